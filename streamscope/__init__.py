"""streamscope: one named map of every decoder-only language model's internals, on transformers and vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import Unavailable
from .support import BlockSupport, ModelSupport
from .cache import Cache
from .logit_lens import Lens, lens
from .patching import Patching, patch

__all__ = ["load", "Unavailable", "BlockSupport", "ModelSupport", "Cache", "Lens", "lens", "Patching", "patch"]

ENGINES = ("transformers", "vllm")


def load(path: str | Path, engine: str = "transformers", **kwargs: Any) -> Any:
    """Load a decoder-only model under streamscope's names.

    Args:
        path: A checkpoint folder (or a hub repository where the hub is reachable).
        engine: ``"transformers"`` or ``"vllm"``.
        **kwargs: Passed to the engine (``dtype``, ``device_map``; vLLM's
            engine arguments).
    """
    if engine == "transformers":
        from .transformers import load as load_transformers

        return load_transformers(path, **kwargs)
    if engine == "vllm":
        from .vllm import load as load_vllm

        return load_vllm(path, **kwargs)
    raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
