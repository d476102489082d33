"""The ``.grad`` nnsight serves inside ``with loss.backward():``, reaching the model tensor a value was read from.

Patched, once per process (idempotent):

* ``nnsight.intervention.backward._grad_property`` (`serve_gradients`): nnsight serves ``t.grad`` by hooking
  ``t`` itself, and a streamscope read hands out a private copy that nothing downstream uses, so that hook would
  never fire. The property built here hooks the model's tensor the copy was read from (found by
  `streamscope.gradients`), serves the copy's part of its gradient in the copy's layout and takes an edit back.
  Upstream: a hook on nnsight's grad property for tensors it did not create (a ``grad_of(tensor)`` redirect an
  eproperty could register with its ``preprocess``), or a ``.grad`` eproperty on envoys' values.
"""

from __future__ import annotations

from typing import Any, Callable

from nnsight.intervention import backward as _backward
from nnsight.intervention.interleaver import Mediator

__all__ = ["serve_gradients"]


def serve_gradients(served_from: Callable[[Any], Any], named: Callable[[Mediator, str, Any], None]) -> None:
    """Let ``.grad`` inside nnsight's ``with loss.backward():`` block reach the model's tensor a copy was read from.

    nnsight serves ``t.grad`` by hooking `t` itself. streamscope hands out a
    private copy of the model's tensor, which nothing downstream of it uses, so
    that hook would never fire. ``served_from(t)`` says where a copy's
    gradient is: None for a tensor that is not one (nnsight's own ``.grad``),
    else an object with ``target()`` (the tensor in the graph to hook; it
    raises, with the reason, where there is none), ``served(grad)`` (the
    copy's gradient, a private tensor in the copy's layout, given the
    target's) and ``returned(grad, edited)`` (the target's gradient with the
    copy's part replaced by `edited`). ``named(mediator, location, source)``
    records which value a ``.grad`` location belongs to, for the message when
    its gradient never comes.

    Copies of one target (a block's output and the next block's input) share
    one hook, served in the order they were asked for: a gradient edited for
    one reaches the next. A read that edits nothing hands autograd its own
    gradient back, so the backward is unchanged by it.
    """
    build = _backward._grad_property
    if getattr(build, "streamscope_gradients", False):
        return

    def grad_property(interleaver: Any, seen: set, hooks: list) -> property:
        plain = build(interleaver, seen, hooks)
        waiting: dict[int, list] = {}  # per target tensor: the (location, source) pairs its hook serves

        def wrap(tensor: Any, source: Any) -> str:
            location = f"{id(tensor)}.grad"
            if id(tensor) in seen:
                return location
            target = source.target()
            seen.add(id(tensor))
            named(Mediator.current(location), location, source)
            entries = waiting.get(id(target))
            if entries is not None:  # asked for while the target's hook serves an earlier copy: served next
                entries.append((location, source))
                return location
            entries = waiting[id(target)] = [(location, source)]

            def hook(grad: Any) -> Any:
                try:
                    index = 0
                    while index < len(entries):
                        asked, asked_source = entries[index]
                        copy = asked_source.served(grad)
                        version = copy._version
                        answer = interleaver.handle(asked, copy)
                        if answer is not copy or copy._version != version:  # assigned, or edited in place
                            grad = asked_source.returned(grad, answer)
                        index += 1
                    return grad
                finally:
                    handle.remove()
                    waiting.pop(id(target), None)

            handle = target.register_hook(hook)
            hooks.append(handle)
            return location

        def getter(tensor: Any) -> Any:
            source = served_from(tensor)
            if source is None:
                return plain.fget(tensor)
            return Mediator.value(wrap(tensor, source))

        def setter(tensor: Any, value: Any) -> None:
            source = served_from(tensor)
            if source is None:
                return plain.fset(tensor, value)
            Mediator.swap(wrap(tensor, source), value)

        return property(getter, setter)

    setattr(grad_property, "streamscope_gradients", True)  # marks the patch as applied (a function attribute)
    _backward._grad_property = grad_property
