"""streamscope: one named map of every decoder-only language model's internals, on transformers and vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checks import check_load
from .errors import Unavailable, UnsupportedCheckpoint
from .support import BlockSupport, ModelSupport

__all__ = ["load", "Unavailable", "UnsupportedCheckpoint", "BlockSupport", "ModelSupport", "Steer", "Harvest",
           "Generation", "load_harvest", "iter_harvest", "Cache", "Lens", "lens", "Patching", "patch", "Client"]

ENGINES = ("transformers", "vllm")
_BULK = ("Steer", "Harvest", "Generation", "load_harvest", "iter_harvest")
#: The workflows' names, loaded on first use like the bulk path's: {name: module}.
_WORKFLOWS = {"Client": "serve.client", "Cache": "cache", "Lens": "logit_lens", "lens": "logit_lens", "Patching": "patching", "patch": "patching"}


def __getattr__(name: str) -> Any:
    # The bulk path's names load with it (torch, nnsight), not with `import streamscope`.
    if name in _BULK:
        from . import bulk

        return getattr(bulk, name)
    if name in _WORKFLOWS:
        import importlib

        return getattr(importlib.import_module(f".{_WORKFLOWS[name]}", __name__), name)
    raise AttributeError(f"module 'streamscope' has no attribute {name!r}")


def load(path: str | Path, engine: str = "transformers", **kwargs: Any) -> Any:
    """Load a decoder-only model under streamscope's names.

    Args:
        path: A checkpoint folder; ``"smollm2"`` (SmolLM2-135M-Instruct, fetched and converted once, as the
            command line takes it); a ``.gguf`` file (converted once to a float32 checkpoint); or a hub
            repository id, fetched as transformers and vLLM fetch it (where the hub cannot be reached,
            this fails at once saying what to do).
        engine: ``"transformers"`` or ``"vllm"``.
        **kwargs: Passed to the engine (``dtype``, ``device_map``; vLLM's
            engine arguments).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if isinstance(path, (str, Path)):
        from .models import resolve

        path = resolve(path)
    check_load(path, kwargs)
    if engine == "transformers":
        from .transformers import load as load_transformers

        return load_transformers(path, **kwargs)
    if engine == "vllm":
        from .vllm import load as load_vllm

        return load_vllm(path, **kwargs)
    raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
