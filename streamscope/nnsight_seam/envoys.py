"""nnsight's envoys: the module an envoy wraps, its children, the swap of that module, and the forward nnsight
instruments so that a call inside it is a location (``.source``).

Read, not patched:

* ``Envoy._module`` and ``Envoy._child_map`` (`module_of`, `children`): an envoy's ``torch.nn.Module`` and child
  envoys. Upstream: public ``envoy.module`` and ``envoy.children()``.
* a module's ``__nnsight__`` state and nnsight's source reader (``module_body``, ``decorator_chain``,
  ``compiled``, ``install_source``; `kernel_call_names`, `runs_class_forward`, `ensure_source`): which calls a
  forward makes, read without instrumenting it, and the instrumentation done once. Upstream: a public
  ``envoy.source_names()`` that reads without installing.
* the function under nnsight's trace-or-call wrapper of ``generate`` (``__wrapped__``; `unwrapped_generate`):
  streamscope decides itself whether a ``generate`` traces. Upstream: a documented plain ``generate``.

Overridden or undone:

* ``Envoy._update`` (`RebindingEnvoy`): the one override of nnsight's hook for a module swapped under an envoy
  (a dispatch replaces the meta model's modules). Upstream: a public ``on_module_bound`` callback.
* the controller forward nnsight installs on every module (`uninstrumented`): removed again where an envoy tree
  serves plain torch hooks only (a server's worker without traces). Upstream: an envoy tree built without
  instrumenting modules.
"""

from __future__ import annotations

from typing import Any, Callable

import nnsight
from nnsight.intervention.source import (STATE, SourceNotAvailable, compiled, decorator_chain, install_source,
                                         module_body)

__all__ = ["module_of", "children", "RebindingEnvoy", "kernel_call_names", "runs_class_forward", "ensure_source",
           "unwrapped_generate", "uninstrumented"]


# Envoys: the module an envoy wraps, its children, and being told when nnsight gives it another module.

def module_of(envoy: Any) -> Any:
    """The ``torch.nn.Module`` that `envoy` wraps (nnsight keeps it as the envoy's ``_module``)."""
    return envoy._module


def children(envoy: Any) -> dict[str, Any]:
    """`envoy`'s child envoys by their attribute names, in the module's order (nnsight's ``_child_map``)."""
    return dict(envoy._child_map)


class RebindingEnvoy(nnsight.Envoy):
    """An envoy told when nnsight swaps the module under it (a dispatch replaces the meta model's modules).

    Subclasses override `module_bound`; nnsight's hook for the swap is its
    private ``_update``, overridden here only.
    """

    def _update(self, module: Any) -> None:
        super()._update(module)
        self.module_bound(module)

    def module_bound(self, module: Any) -> None:
        """Called with the new module after nnsight has put it under this envoy."""


# Source instrumentation: a call inside a module's forward as a location.

def kernel_call_names(module: Any) -> Any:
    """The names nnsight's ``.source`` gives the calls in `module`'s forward; () where it cannot read it.

    Read from the original forward (before nnsight wrapped it, where it has),
    through its decorators, without instrumenting anything: streamscope asks
    whether the attention kernel call is there before serving the values at it.
    """
    state = module.__dict__.get("__nnsight__")
    forward = state.original if state is not None else module_body(module)
    try:
        return compiled(decorator_chain(forward)[0]).names
    except (SourceNotAvailable, TypeError, OSError, AttributeError):
        return ()


def runs_class_forward(module: Any) -> bool:
    """Whether `module` runs its class's own forward: False where something rewrote it on the instance (vLLM's
    Transformers backend fusing an attention's q/k/v projections compiles a new forward from the class's source,
    which ``.source`` cannot instrument: it would read the class's source and run that instead)."""
    state = module.__dict__.get("__nnsight__")
    forward = state.original if state is not None else module_body(module)
    return getattr(forward, "__code__", None) is getattr(type(module).forward, "__code__", None)


def ensure_source(envoy: Any) -> None:
    """Instrument `envoy`'s module forward (once), so each call in it is a location (``path.source.<call>``)."""
    state = module_of(envoy).__dict__.get("__nnsight__")
    if state is None or not state.sourced:
        install_source(envoy)


# The engines' model classes.

def unwrapped_generate(model: Any, base: type) -> Callable:
    """`base`'s ``generate`` without nnsight's trace-or-call wrapper, bound to `model`.

    streamscope's ``generate`` makes the trace-or-call decision itself (it
    adds bulk sampling), so it calls the function nnsight's wrapper wraps.
    """
    return getattr(base, "generate").__wrapped__.__get__(model, type(model))

def uninstrumented(module: Any, build: Callable[[Any], Any]) -> Any:
    """`build(module)` (an envoy tree over it), with `module`'s forwards left as they were before.

    Building an envoy installs nnsight's controller as every submodule's
    ``forward`` (the handoff to a trace, a Python call per module call, kept
    for the process). A tree used only to find modules and read or write
    their tensors from plain torch hooks (a server's worker without traces)
    needs none of it: each module's instance ``forward`` is put back (or
    removed, where it had none) and nnsight's per-module state dropped, so
    the model runs as vLLM built it.
    """
    before = {id(item): item.__dict__.get("forward") for item in module.modules()}
    built = build(module)
    for item in module.modules():
        if item.__dict__.pop(STATE, None) is None:
            continue
        forward = before.get(id(item))
        if forward is None:
            item.__dict__.pop("forward", None)
        else:
            item.__dict__["forward"] = forward
    return built
