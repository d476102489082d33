"""streamscope: one named map of every decoder-only language model's internals, on transformers and vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .input_checks import check_load
from .engine import MODULES, engine_module
from .errors import Unavailable, UnsupportedCheckpoint
from .support import BlockSupport, ModelSupport

__all__ = ["load", "Unavailable", "UnsupportedCheckpoint", "BlockSupport", "ModelSupport", "Steer", "Condition",
           "DoseWarning", "apply_steers",
           "Harvest", "Generation", "load_harvest", "iter_harvest", "Cache", "Lens", "lens", "Patching", "patch",
           "Client", "plot", "views", "directions", "sae"]

#: The engines `load` takes, by name.
ENGINES = tuple(MODULES)
_BULK = ("Steer", "Condition", "DoseWarning", "apply_steers", "Harvest", "Generation", "load_harvest", "iter_harvest")
#: The workflows' names, loaded on first use like the bulk path's: {name: module}.
_WORKFLOWS = {"Client": "serve.client", "Cache": "workflows.cache", "Lens": "workflows.logit_lens",
              "lens": "workflows.logit_lens", "Patching": "workflows.patching", "patch": "workflows.patching"}
#: Workflow modules reached as attributes of the package, as they were before they moved to `workflows/`.
_MODULES = {"plot": "workflows.plot", "cache": "workflows.cache", "logit_lens": "workflows.logit_lens",
            "patching": "workflows.patching", "check": "workflows.check", "directions": "directions", "sae": "sae",
            "views": "workflows.views"}


class _MovedModules:
    """`import streamscope.plot` (and the other workflows' paths from before they moved to `workflows/`) imports
    the module where it lives now; both names then hold the same module object."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in _MODULES or _MODULES[name] == name:
            return None
        import importlib.util

        return importlib.util.spec_from_loader(fullname, _MovedModules())  # type: ignore[arg-type]

    @staticmethod
    def create_module(spec: Any) -> Any:
        import importlib

        return importlib.import_module(f"{__name__}.{_MODULES[spec.name.partition('.')[2]]}")

    @staticmethod
    def exec_module(module: Any) -> None:
        """The module ran when it was imported under its own name."""


import sys as _sys  # noqa: E402

if not any(isinstance(finder, _MovedModules) for finder in _sys.meta_path):
    _sys.meta_path.append(_MovedModules())


def __getattr__(name: str) -> Any:
    # The bulk path's names load with it (torch, nnsight), not with `import streamscope`.
    if name in _BULK:
        from . import bulk

        return getattr(bulk, name)
    if name in _WORKFLOWS:
        import importlib

        return getattr(importlib.import_module(f".{_WORKFLOWS[name]}", __name__), name)
    if name in _MODULES:
        import importlib

        return importlib.import_module(f".{_MODULES[name]}", __name__)
    raise AttributeError(f"module 'streamscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily loaded names too: dir(), help(streamscope) and tab completion list them.
    return sorted(set(globals()) | set(__all__))


def load(path: str | Path, engine: str = "transformers", **kwargs: Any) -> Any:
    """Load a decoder-only model under streamscope's names.

    Args:
        path: A checkpoint folder; ``"smollm2"`` (SmolLM2-135M-Instruct, fetched and converted once, as the
            command line takes it); a ``.gguf`` file (converted once to a float32 checkpoint); or a hub
            repository id, fetched as transformers and vLLM fetch it (where the hub cannot be reached,
            this fails at once saying what to do).
        engine: ``"transformers"`` or ``"vllm"``.
        **kwargs: Passed to the engine (``dtype``, ``device_map``; vLLM's
            engine arguments). A vLLM engine starts quietly (vLLM's warnings only); ``verbose=True`` prints
            vLLM's log (`streamscope.vllm.model.load`).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if isinstance(path, (str, Path)):
        from .models import resolve

        path = resolve(path)
    check_load(path, kwargs)
    return engine_module(engine).load(path, **kwargs)
