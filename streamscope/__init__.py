"""streamscope: one named map of every decoder-only language model's internals, on transformers and vLLM."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .engine_registry import MODULES
from .errors import Unavailable, UnsupportedCheckpoint
from .support import BlockSupport, ModelSupport

if TYPE_CHECKING:  # what type checkers and documentation tools read; at run time these load on first use (below)
    from . import directions, sae
    from .bulk import Condition, DoseWarning, Generation, Harvest, Steer, apply_steers, iter_harvest, load_harvest
    from .loading import load
    from .serve.client import Client
    from .workflows import plot, views
    from .workflows.cache import Cache
    from .workflows.logit_lens import Lens, lens
    from .workflows.patching import Patching, patch

__all__ = ["load", "Unavailable", "UnsupportedCheckpoint", "BlockSupport", "ModelSupport", "Steer", "Condition",
           "DoseWarning", "apply_steers",
           "Harvest", "Generation", "load_harvest", "iter_harvest", "Cache", "Lens", "lens", "Patching", "patch",
           "Client", "plot", "views", "directions", "sae"]

#: The engines `load` takes, by name.
ENGINES = tuple(MODULES)
#: The names loaded on first use, with the module that defines each: `import streamscope` loads none of torch,
#: nnsight, transformers or an engine; `streamscope.load` and the bulk path's names bring them.
_LAZY = {"load": "loading", "Client": "serve.client", "Cache": "workflows.cache", "Lens": "workflows.logit_lens",
         "lens": "workflows.logit_lens", "Patching": "workflows.patching", "patch": "workflows.patching",
         **{name: "bulk" for name in ("Steer", "Condition", "DoseWarning", "apply_steers", "Harvest", "Generation",
                                      "load_harvest", "iter_harvest")}}
#: The modules reached as attributes of the package, loaded on first use: {attribute: module}.
_MODULES = {"plot": "workflows.plot", "views": "workflows.views", "directions": "directions", "sae": "sae",
            "tl": "tl"}


def __getattr__(name: str) -> Any:
    # PEP 562: a lazy attribute is imported by its module's name on first use, and kept by its module after.
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _MODULES:
        return importlib.import_module(f".{_MODULES[name]}", __name__)
    raise AttributeError(f"module 'streamscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily loaded names too: dir(), help(streamscope) and tab completion list them.
    return sorted(set(globals()) | set(__all__))
