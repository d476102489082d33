"""Everything streamscope takes from nnsight beyond its public API, in one place, checked against one version.

streamscope serves its values through nnsight's interleaving machinery at a
depth nnsight does not promise to keep: the ``Mediator`` that runs each
invoke's code of a trace (nnsight's word; vLLM's "workers" are its processes), its pending write-back, the ``eproperty`` callbacks, the
source-instrumented forward, the vLLM workers. nnsight moves these between
releases, so every use of them lives here, written against one release
(`SUPPORTED`), which is checked when this module is imported.

What counts as nnsight's public API (used directly by the rest of streamscope):
the names the top-level ``nnsight`` package exports in ``__all__``
(``nnsight.Envoy``, ``nnsight.TransformersModel``, ``nnsight.LanguageModel``,
``nnsight.NNsight``, ``nnsight.save``, ...) and ``nnsight.modeling.vllm.VLLM``
(the one name that package exports, and the vLLM entry nnsight documents),
together with what their documentation shows a user doing: ``model.trace``,
``model.generate``, an envoy's ``.path``, ``.output``, ``.input``, ``.source``,
the ``rename=`` and ``envoys=`` arguments. Everything reached by another
module path (``nnsight.intervention.*``, ``nnsight.tracing.*``,
``nnsight.modeling.vllm.<submodule>``) or by a private name is internal, and
only this module touches it. `tests/test_nnsight_seam.py` fails when another
module imports an internal path, or reaches a private name nnsight's classes
define (``envoy._module``: `module_of` here instead).

Two kinds of contact stay outside this module, each covered by the version
check all the same:

* the methods streamscope's engine model classes override on nnsight's
  (``_batch`` on transformers; ``_call``, ``_collect``, ``_resolve_taps`` on
  vLLM), each calling its parent's: nnsight calls them, and a subclass's
  override cannot live elsewhere (the seam test allows these, in those two
  modules only). Envoys and values override nnsight through this module
  (`RebindingEnvoy`, `LocatedProperty`).
* streamscope's own notes kept on a mediator (``streamscope_wanted``,
  ``streamscope_read``, ``streamscope_retired``, the vLLM attention history):
  attributes nnsight never reads, kept where each invoke's state lives.

The vLLM pieces (`NNsightGPUWorker`, `NNsightGPUModelRunner`,
`ParallelEnvoy`, `parallel_envoys`, `VLLMClient`) import vLLM, so they load on
first use (module ``__getattr__``), not with this module.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time
import warnings
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import nnsight
from greenlet import getcurrent

#: The nnsight release this module was written and tested against (no other release was available to
#: compare, so patch releases are not assumed to match: internals move even there).
SUPPORTED = "0.8.1"
#: Set to 1 to run on another nnsight release anyway, with a warning instead of the ImportError.
ALLOW_ENV = "STREAMSCOPE_ALLOW_NNSIGHT"


def check_version(installed: Optional[str] = None) -> None:
    """Raise ImportError unless nnsight `installed` (by default the one imported) is `SUPPORTED`.

    With ``STREAMSCOPE_ALLOW_NNSIGHT=1`` in the environment the mismatch is a
    RuntimeWarning instead, for whoever wants to try another release.
    """
    installed = nnsight.__version__ if installed is None else installed
    if installed == SUPPORTED:
        return
    message = (f"streamscope needs nnsight {SUPPORTED}, but nnsight {installed} is installed: streamscope "
               f"drives nnsight internals (its trace workers, write-backs and vLLM workers) that differ "
               f"between releases. Install the supported one: `pip install nnsight=={SUPPORTED}` "
               f"(or set {ALLOW_ENV}=1 to try this one anyway, at your own risk).")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise ImportError(message)


check_version()

# Imported after the check: on another release these paths may not exist at all. Re-exported as they are:
# * eproperty: the descriptor nnsight's envoys serve ``.output``/``.input`` with; every streamscope value
#   subclasses it, so a read waits for the model like nnsight's own and books a write-back.
# * Mediator: nnsight's runner of one invoke's code of a trace (not a vLLM worker process), on a greenlet
#   beside the model; used in annotations, and its instance ``__dict__`` keeps streamscope's notes per invoke.
# * OutOfOrderError: what nnsight raises for a value asked for after the model passed it; streamscope raises it
#   too (an edit made after the trace moved on), so one except clause catches both.
# * WithBlockNotFoundError: what a tracer's ``capture()`` raises when it was not called as a ``with``
#   statement; ``generate`` then runs plainly instead of tracing.
from nnsight.intervention import backward as _backward  # noqa: E402
from nnsight.intervention import interleaver as _interleaver  # noqa: E402
from nnsight.intervention.batching import Batcher as _Batcher  # noqa: E402
from nnsight.intervention.eproperty import WriteBack as _WriteBack  # noqa: E402
from nnsight.intervention.eproperty import eproperty  # noqa: E402
from nnsight.intervention.interleaver import Mediator  # noqa: E402
from nnsight.intervention.interleaver import OutOfOrderError  # noqa: E402
from nnsight.intervention.source import (SourceNotAvailable, compiled, decorator_chain,  # noqa: E402
                                         install_source, module_body)
from nnsight.tracing.tracer import WithBlockNotFoundError, _saves  # noqa: E402

__all__ = [
    "SUPPORTED", "ALLOW_ENV", "check_version", "eproperty", "LocatedProperty", "Mediator", "OutOfOrderError",
    "WithBlockNotFoundError", "codes_use_attributes", "trace_mediators", "module_of", "children", "RebindingEnvoy", "wrap_replay",
    "wrap_update_states", "uninstrumented",
    "set_callbacks", "read_located", "location", "call_location", "running_mediator", "mediator_at", "step_of",
    "read_at", "skip_at",
    "is_saved", "invoke_rows", "with_invoke_rows", "PendingWriteBack", "pending_write_back", "held_view",
    "redirect_write_back",
    "filter_write_backs", "rename_out_of_order", "around_mediator_run", "serve_gradients", "batch_whole",
    "around_visits", "narrow_spans_directly", "record_saves_cheaply", "running_token_span", "kernel_call_names",
    "ensure_source",
    "unwrapped_generate", "running_taps", "interleaving", "take_request_error", "collect_requests",
    "EachPrompt", "invoke_per_prompt_tracer", "set_client_worker",
    "HandedSaves", "hand_saves_over", "handing_over", "saves_transport", "SAVES_TRANSPORT_ENV", "transport_counts",
    "PACKED_SAVES", "pack_saves_in_this_process", "received_counts",
    "bundle_interventions", "bundle_counts", "take_bundle", "HERE",
    # Loaded on first use by the module's __getattr__ (vLLM is not imported with streamscope).
    "NNsightGPUWorker", "NNsightGPUModelRunner", "ParallelEnvoy", "parallel_envoys", "VLLMClient",  # noqa: F822
    "InvokePerPromptTracer",  # noqa: F822
]


# eproperty: the base of every streamscope value.

class LocatedProperty(eproperty):
    """An eproperty that says where its value is through a public `location(obj)`.

    nnsight asks an eproperty for its location through the private
    ``_location``; this is the one override of it.
    """

    def _location(self, obj: Any) -> str:
        return self.location(obj)

    def location(self, obj: Any) -> str:
        """The nnsight location (``"{path}.{key}"``) that holds the value on `obj`."""
        return super()._location(obj)


def read_located(value: eproperty, host: Any, location: str, mediator: Mediator) -> Any:
    """What reading `value` on `host` returns (nnsight's ``eproperty.__get__``), its `location` and the running
    `mediator` already in hand.

    nnsight's read asks the eproperty for its location and the greenlet for
    its mediator again, and parks through ``Mediator.value``, which asks for
    the mediator once more; a value read at every step of every invoke pays
    that each time. This is the same read with what the caller knows: answered
    with the pending write-back's view while it is this read's (same value,
    location and occurrence), else the mediator writes back what it holds
    (``flush``) and parks until the model serves `location`, and the
    preprocess's result becomes the pending write-back.
    """
    occurrence = mediator.wanted(location)
    if value._transform is not None:
        waiting = mediator.transform
        if waiting is not None and waiting.key == (value, location, occurrence):
            return waiting.view
    mediator.flush()
    raw = getcurrent().parent.switch(_interleaver.Pending(_interleaver.Event.VALUE, location, occurrence))
    result = value._preprocess(host, raw) if value._preprocess is not None else raw
    if value._transform is not None:
        mediator.transform = _WriteBack(partial(value._transform, host, result, raw), result, value, location,
                                        occurrence)
    return result


def set_callbacks(value: eproperty, read: Callable, write_back: Callable, assign: Callable) -> None:
    """Give an eproperty its three callbacks.

    nnsight calls ``read(host, raw)`` on a read (``preprocess``: the user gets
    its result), ``write_back(host, view, raw)`` when the worker moves on after
    that read (``transform``: what goes back into the model), and
    ``assign(host, value)`` on an assignment (``postprocess``). streamscope's
    values are the methods of one class, set per instance rather than through
    nnsight's decorators, so a subclass overrides them as methods.
    """
    value._preprocess = read
    value._transform = write_back
    value._postprocess = assign


# The worker of a trace and what it asks of the model.

def running_mediator() -> Optional[Mediator]:
    """The mediator of the trace whose code runs now, or None outside a trace.

    nnsight runs a trace's code on a greenlet that holds a weak reference to
    its mediator; streamscope asks for it to refuse a read outside a trace with
    its own message, and to keep its notes of what was read (the mediator's
    ``__dict__``).
    """
    mediator = getattr(getcurrent(), "mediator", None)
    return None if mediator is None else mediator()


def running_taps() -> frozenset[str]:
    """The locations the running mediator's engine serves when it replays CUDA graphs (nnsight's tapped
    interleaver); empty outside a trace and on an eager engine, which serves every location."""
    mediator = running_mediator()
    interleaver = getattr(mediator, "interleaver", None) if mediator is not None else None
    return getattr(interleaver, "taps", None) or frozenset()


def location(path: str, where: str) -> str:
    """nnsight's name for a point of a module's call: ``where`` is ``input``, ``output`` or ``skip`` (the gate
    that replaces the call); `path` is the envoy's ``.path``."""
    return f"{path}.{where}"


def call_location(path: str, call: str, where: str) -> str:
    """nnsight's name for the `where` (``input``/``output``) of the call named `call` inside a module's forward
    (after `ensure_source`); `path` is the module envoy's ``.path``."""
    return f"{path}.source.{call}.{where}"


def mediator_at(location: str) -> Mediator:
    """The running mediator (nnsight's ``Mediator.current``); ValueError naming `location` outside a trace."""
    return Mediator.current(location)


def step_of(mediator: Mediator, location: str) -> int:
    """How many times the model has reached `location` since `mediator` started (a vLLM request's decode step)."""
    return mediator.occurrence(location)


def read_at(location: str) -> Any:
    """The value the model produces at `location` (``path.input`` / ``path.output``), waited for by the mediator.

    nnsight's ``Mediator.value``: used where a value is read raw, to write it
    (an assignment), or to wait for a block's input before skipping it.
    """
    return Mediator.value(location)


def skip_at(location: str, value: Any) -> None:
    """Skip the module call gated at `location` (``path.skip``), returning `value` in its stead (``Mediator.skip``)."""
    Mediator.skip(location, value)


def is_saved(value: Any) -> bool:
    """Whether `value` was marked with ``.save()`` in the running trace (nnsight keeps their ids).

    A saved read must keep what it read, so a second read of the same value
    (to edit it) gets a copy of its own.
    """
    return id(value) in _saves()


# An invoke's rows of a batched trace, for a value nnsight cannot narrow itself.

def _invoke_batch() -> Optional[tuple[Any, Any]]:
    """The running mediator's batcher and its ``[start, size]`` rows in the run's batch; None where no batched run
    narrows anything for it (outside a trace, or a run that does not batch)."""
    mediator = running_mediator()
    if mediator is None or mediator.interleaver is None or mediator.interleaver.batcher is None:
        return None
    return mediator.interleaver.batcher, mediator.batch_group


def invoke_rows(batch_leading: Any) -> Any:
    """`batch_leading` (``[batch, ...]``) narrowed to the running invoke's rows, as nnsight narrows what it serves.

    nnsight's batcher serves each invoke of a batched trace its own rows of a
    value by its leading dimension, where that dimension is the batch (it
    equals the run's total rows). A tensor the model holds in another layout,
    such as a block's tokens flattened to ``[batch * seq, hidden]``, leads
    with no such dimension and reaches every invoke whole. Viewed batch-leading
    (``[batch, seq, hidden]``) it is narrowed here by the batcher's own rule:
    the result is a view of this invoke's rows, and `batch_leading` itself
    outside a trace, for a lone invoke, for an invoke without rows (it sees
    the whole batch) and where the leading dimension is not the batch.
    """
    batch = _invoke_batch()
    return batch_leading if batch is None else batch[0].narrow(batch_leading, batch[1])


def with_invoke_rows(batch_leading: Any, rows: Any) -> Any:
    """`batch_leading` with the running invoke's rows replaced by `rows`, as a new tensor: the inverse of
    `invoke_rows`, spliced the way nnsight's batcher splices an invoke's edit; `rows` itself wherever
    `invoke_rows` narrows nothing."""
    batch = _invoke_batch()
    return rows if batch is None else batch[0].widen(batch_leading, batch[1], rows)


# The pending write-back: a read's copy that nnsight swaps back into the model when the worker moves on.

class PendingWriteBack(NamedTuple):
    """A worker's pending write-back: the eproperty read, the envoy it was read on, the copy handed out."""

    value: Any
    host: Any
    view: Any


def pending_write_back(mediator: Mediator) -> Optional[PendingWriteBack]:
    """The write-back `mediator` has pending (nnsight's ``Mediator.transform``), or None."""
    waiting = mediator.transform
    if waiting is None:
        return None
    return PendingWriteBack(waiting.eproperty, waiting.fn.args[0], waiting.view)


def held_view(mediator: Mediator, value: eproperty, location: str) -> Any:
    """The copy `value`'s read at `location` handed out and not yet written back, or None.

    nnsight keys a pending write-back on (eproperty, location, occurrence):
    it is this read's only while the mediator still wants that occurrence.
    """
    waiting = mediator.transform
    if waiting is not None and waiting.key == (value, location, mediator.wanted(location)):
        return waiting.view
    return None


def redirect_write_back(mediator: Mediator, value: eproperty, host: Any, view: Any) -> None:
    """Make `view` what `mediator`'s pending write-back sends to the model (and what later reads answer with).

    The pending write-back's function is ``value``'s transform bound to
    ``(host, view, raw)``; the raw call the model made stays, the view changes.
    """
    waiting = mediator.transform
    raw = waiting.fn.args[2]
    mediator.transform = waiting._replace(view=view, fn=partial(value._transform, host, view, raw))


# Process-wide changes to nnsight's mediator, made once (each is idempotent).

def filter_write_backs(served: type, send: Callable[[PendingWriteBack], bool],
                       after: Callable[[Mediator, PendingWriteBack], None]) -> None:
    """Let streamscope decide whether a pending write-back of one of its values reaches the model.

    nnsight's ``Mediator.flush`` swaps a pending write-back into the model
    whenever the mediator moves on, edited or not: one round trip between the
    mediator and the model per read. For an eproperty of type `served`,
    ``send(pending)`` decides; one it declines is dropped. ``after(mediator,
    pending)`` then runs either way. Other write-backs flush as nnsight does.

    A sent write-back that wrote into the model's own tensor in place (it
    hands back the call's value itself) is not swapped: nnsight narrows a
    batch to a view, so the edit is already in the batch, and the swap would
    splice the rows into a new batch tensor (``torch.cat``). A block that
    kept the old one (a residual saved before the call) would then miss this
    and every later invoke's edit of that call.
    """
    flush = Mediator.flush
    if getattr(flush, "streamscope_filter", False):
        return

    def filtered_flush(mediator: Mediator) -> None:
        waiting = mediator.transform
        if waiting is None or not isinstance(waiting.eproperty, served):
            return flush(mediator)
        pending = PendingWriteBack(waiting.eproperty, waiting.fn.args[0], waiting.view)
        if not send(pending):
            mediator.transform = None
        else:
            raw = waiting.fn.args[2]
            result = waiting.fn()
            if result is raw:
                mediator.transform = None  # written in place: nothing to swap
            else:
                mediator.transform = waiting._replace(fn=lambda: result)
                flush(mediator)
        after(mediator, pending)

    setattr(filtered_flush, "streamscope_filter", True)  # marks the patch as applied (a function attribute)
    Mediator.flush = filtered_flush


def rename_out_of_order(message: Callable[[Mediator, str], Optional[str]]) -> None:
    """Let streamscope word nnsight's out-of-order error in its own names.

    When a run ends with a mediator still waiting for a location the model has
    passed, nnsight's ``dangling_unwind`` builds an OutOfOrderError naming the
    raw location. ``message(mediator, location)`` may return streamscope's
    message for it (None keeps nnsight's).
    """
    unwind = _interleaver.dangling_unwind
    if getattr(unwind, "streamscope_names", False):
        return

    def named_unwind(mediator: Mediator) -> tuple[BaseException, Optional[str]]:
        error, expected = unwind(mediator)
        pending = mediator.pending
        if not isinstance(error, OutOfOrderError) or expected is not None or pending is None:
            return error, expected
        text = message(mediator, pending.provider)
        return (error, expected) if text is None else (OutOfOrderError(text), None)

    setattr(named_unwind, "streamscope_names", True)  # marks the patch as applied (a function attribute)
    _interleaver.dangling_unwind = named_unwind


def around_mediator_run(after: Callable[[Mediator], None],
                        explain: Callable[[Mediator, RuntimeError], None],
                        ended: Callable[[bool], None]) -> None:
    """Run streamscope's checks when a mediator's code ends, and let it explain a RuntimeError raised in it.

    nnsight's ``Mediator._run`` runs one invoke's code. ``after(mediator)`` runs
    when it returns (it may raise); ``explain(mediator, error)`` sees a
    RuntimeError the code raised (it may reword ``error.args``) before it
    propagates; ``ended(raised)`` runs last either way, told whether the code
    (or ``after``) raised.
    """
    run = Mediator._run
    if getattr(run, "streamscope_checks", False):
        return

    def checked_run(mediator: Mediator) -> None:
        raised = True
        try:
            run(mediator)
            after(mediator)
            raised = False
        except RuntimeError as error:
            explain(mediator, error)
            raise
        finally:
            ended(raised)

    setattr(checked_run, "streamscope_checks", True)  # marks the patch as applied (a function attribute)
    Mediator._run = checked_run


def batch_whole(tensor: Any) -> Any:
    """The tensor the model computed, of which nnsight served `tensor` as one invoke's rows of a batched trace;
    `tensor` itself where nnsight narrowed nothing.

    nnsight's batcher hands each invoke a view of its rows and marks it
    (``_nnsight_batch``); the model ran on the whole batch, so that view is in
    no autograd graph and only the tensor it was cut from (its ``_base``) is.
    """
    if getattr(tensor, "_nnsight_batch", False) and tensor._base is not None:
        return tensor._base
    return tensor


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


def codes_use_attributes(mediators: list, names: frozenset[str]) -> list[str]:
    """Which of the attribute `names` the code of `mediators` (a trace's invokes) reads, writes or calls, at any
    depth (its comprehensions, lambdas and nested functions too); found in the compiled code, before it runs."""
    import dis
    import types

    found: list[str] = []
    codes = [mediator.code for mediator in mediators if getattr(mediator, "code", None) is not None]
    while codes:
        code = codes.pop()
        for instruction in dis.get_instructions(code):
            if (instruction.opname in ("LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "LOAD_METHOD")
                    and instruction.argval in names and instruction.argval not in found):
                found.append(instruction.argval)
        codes += [constant for constant in code.co_consts if isinstance(constant, types.CodeType)]
    return found


def trace_mediators(model: Any) -> list:
    """The mediators (one per invoke) of the trace `model` is about to run."""
    interleaver = getattr(model, "interleaver", None)
    return list(getattr(interleaver, "mediators", None) or [])


def around_visits(visited: Callable[[], None], serving: Callable[[Any], None], ended: Callable[[bool], None]) -> None:
    """Tell streamscope when a module's visit has served its workers, before a worker is served its rows, and
    when a run ends, so edits held back during a visit land before anything could see them missing.

    nnsight's ``Interleaver.handle`` serves, in turn, every worker parked on
    a visit of a location, then re-indexes the parked workers
    (``_reindex_parked``) before caches observe the value and the model goes
    on: ``visited()`` runs there (and wherever else the parked set is
    re-indexed, as at the start of a run). ``serving(group)`` runs before the
    run's batcher narrows a value to a worker's rows (``group``, ``[start,
    size]``, or None for every row), and ``visited()`` before it splices a
    worker's swap or skip into the batch (a new tensor made from the old one's
    rows). ``ended(failed)`` runs when the interleaver closes, told whether an
    exception is leaving it.
    """
    interleaver = _interleaver.Interleaver
    if getattr(interleaver._reindex_parked, "streamscope_visits", False):
        return
    parked, close = interleaver._reindex_parked, interleaver.__exit__
    narrow, widen, gather_skip = _Batcher.narrow, _Batcher.widen, _Batcher.gather_skip

    def reindex_parked(self: Any) -> None:
        visited()
        parked(self)

    def closing(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        ended(exc_type is not None)
        return close(self, exc_type, exc_value, traceback)

    def narrowing(self: Any, value: Any, group: Any) -> Any:
        serving(group)
        return narrow(self, value, group)

    _SERVING.append(serving)

    def widening(self: Any, full: Any, group: Any, edited: Any) -> Any:
        visited()
        return widen(self, full, group, edited)

    def gathering(self: Any, running: Any, group: Any, replacement: Any) -> Any:
        visited()
        return gather_skip(self, running, group, replacement)

    setattr(reindex_parked, "streamscope_visits", True)  # marks the patch as applied (a function attribute)
    interleaver._reindex_parked, interleaver.__exit__ = reindex_parked, closing
    _Batcher.narrow, _Batcher.widen, _Batcher.gather_skip = narrowing, widening, gathering


#: What runs before a batcher narrows a value to a worker's rows (`around_visits`' ``serving``).
_SERVING: list[Callable[[Any], None]] = []


def narrow_spans_directly() -> None:
    """Narrow a tensor, or a plain tuple of tensors, to a worker's token span on vLLM's flat token axis
    without nnsight's walk of the value.

    nnsight's vLLM batcher serves each worker parked on a visit its span of
    the step's tokens by walking the value generically (``util.apply``: a
    recursive call and a closure per tensor). A trace with an invoke per
    prompt has every value it reads narrowed so, once per invoke and step;
    the values a block hands on are a tensor or a pair. Those are narrowed
    here directly, each tensor by the batcher's own rule (``_token_dim``:
    tokens on dim 0, on dim 1 behind a leading 1, else not batched): the same
    views. Anything else (another container, a clone of each read) takes
    nnsight's path.
    """
    import torch

    batcher: Any = _vllm_batcher()
    general = batcher.narrow
    if getattr(general, "streamscope_direct", False):
        return
    tensor_type = torch.Tensor

    def span(self: Any, tensor: Any, start: int, size: int) -> Any:
        total, shape = self.total, tensor.shape
        if shape[0] == total:
            return tensor.narrow(0, start, size)
        if len(shape) >= 2 and shape[0] == 1 and shape[1] == total:
            return tensor.narrow(1, start, size)
        return tensor

    def direct(self: Any, value: Any, group: Any) -> Any:
        if group is None or self.clone_reads:
            return general(self, value, group)
        if type(value) is tuple and len(value) == 2:
            first, second = value
            if isinstance(first, tensor_type) and isinstance(second, tensor_type):
                for serving in _SERVING:
                    serving(group)
                start, size = group
                return (span(self, first, start, size), span(self, second, start, size))
        elif isinstance(value, tensor_type):
            for serving in _SERVING:
                serving(group)
            return span(self, value, group[0], group[1])
        return general(self, value, group)

    setattr(direct, "streamscope_direct", True)  # marks the patch as applied (a function attribute)
    batcher.narrow = direct


def record_saves_cheaply() -> None:
    """Skip nnsight's per-step walk of a vLLM worker's names when the trace has saved nothing.

    At every step nnsight notes, on each scheduled worker, which of its names
    hold a saved value (``Requests.record``: each name's value looked up in the
    thread's set of saved ids), so the collect knows them. With nothing saved
    in the thread the answer is the names saved before the worker was sent
    (``presaved``), and that is what is noted, without the walk; an error to
    capture, or any save at all, takes nnsight's path.
    """
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import Requests

    general = Requests.record
    if getattr(general, "streamscope_cheap", False):
        return

    def record(self: Any, mediator: Any) -> None:
        if _saves() or mediator.exception is not None:
            return general(self, mediator)
        mediator.nnsight_saved = set(mediator.presaved)

    setattr(record, "streamscope_cheap", True)  # marks the patch as applied (a function attribute)
    Requests.record = record


def running_token_span() -> Optional[tuple[int, int]]:
    """The running invoke's span of vLLM's flat token axis, ``(start, size)``, while nnsight's vLLM batcher
    serves it in a visit of a module; None outside one (or for an invoke with no rows of its own)."""
    mediator = running_mediator()
    if mediator is None:
        return None
    group, interleaver = mediator.batch_group, mediator.interleaver
    if group is None or interleaver is None or not interleaver.interleaving:
        return None
    return (group[0], group[1]) if type(interleaver.batcher) is _vllm_batcher() else None


@functools.cache
def _vllm_batcher() -> type:
    from nnsight.modeling.vllm.batching import VLLMBatcher  # imports vLLM: loaded by the engine that asks

    return VLLMBatcher


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


def wrap_replay(interleaver: Any, around: Callable[[Callable, str, Any], Any]) -> bool:
    """Run `around(original, location, tensors)` at every replayed tap of nnsight's tapped vLLM interleaver.

    nnsight calls the interleaver's ``replay(location, tensors)`` at each tap
    of a replayed CUDA graph (looked up at each replay, so wrapping it on the
    instance reaches graphs recorded before). Returns False, wrapping nothing,
    where the interleaver has no taps (an eager engine).
    """
    if not getattr(interleaver, "taps", None):
        return False
    original = interleaver.replay
    interleaver.replay = partial(around, original)
    return True


def wrap_update_states(runner: Any, after: Callable[[Any], None]) -> None:
    """Call `after(scheduler_output)` each step once vLLM's model runner has taken the step's schedule in.

    The runner's ``_update_states`` is where it does; it is wrapped on the
    instance, as ``execute_model`` calls it through ``self`` whatever the
    runner's class (nnsight's, or streamscope's CPU one).
    """
    original = runner._update_states

    def update_states(scheduler_output: Any) -> Any:
        result = original(scheduler_output)
        after(scheduler_output)
        return result

    runner._update_states = update_states


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
    from nnsight.intervention.source import STATE

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


def interleaving(model: Any) -> bool:
    """Whether `model` is inside a run of its own (a ``generate`` called within a trace)."""
    return model.interleaver.interleaving


def take_request_error(output: Any) -> Optional[dict]:
    """The error record a vLLM request's output carries back from the worker (type, message, traceback), or None.

    It is taken off the output, so nnsight's collection does not raise it as
    a RuntimeError: streamscope raises it with its own type. A control-flow
    record (nnsight's own early stop) is left in place.
    """
    error = getattr(output, "nnsight_error", None)
    if not error or error.get("is_control_flow"):
        return None
    output.nnsight_error = None
    return error


def collect_requests(mediators: list, outputs: list) -> None:
    """nnsight's client-side collection of a vLLM trace's request outputs into its invokes' saved values."""
    __getattr__("VLLMClient")._collect(mediators, outputs)


class EachPrompt(tuple):
    """Several prompts (each text, or token ids without padding) as one vLLM trace input: under
    `invoke_per_prompt_tracer`'s tracer the trace runs its body once per prompt, an invoke (a request) each."""


def invoke_per_prompt_tracer() -> type:
    """nnsight's vLLM tracer class, extended for a trace whose one input is an `EachPrompt`: its body runs once
    per prompt, each as an invoke of its own (one vLLM request), exactly as one ``with tracer.invoke(prompt):``
    block per prompt with the same body would run. Any other input is nnsight's. Pass it as ``tracer_cls=`` to
    ``VLLM.trace``.

    nnsight builds a trace given its input directly as one invoke (one ``Mediator`` over the body, with the
    input added to the trace's batcher); here there is one such ``Mediator`` per prompt instead, each with its
    own copy of the caller's locals, the trace's keywords (the sampling settings) going with every request.
    The class is this module's ``InvokePerPromptTracer``, built on first use (it imports vLLM): a body that
    names its tracer ships the tracer to the worker, and nnsight's pickler sends a class it cannot import by
    name as source, which it then writes over the class's own methods.
    """
    return __getattr__("InvokePerPromptTracer")


def _build_invoke_per_prompt_tracer() -> type:
    import importlib

    base = importlib.import_module("nnsight.modeling.vllm.tracer").VLLMTracer

    class InvokePerPromptTracer(base):  # type: ignore[valid-type, misc]
        def prepare(self, code: Any) -> tuple:
            if len(self.args) != 1 or not isinstance(self.args[0], EachPrompt):
                return super().prepare(code)
            frame = self.info.frame
            interleaver = self.envoy.interleaver
            self.batcher = self.envoy._batcher_class(self.envoy, self.kwargs)
            for prompt in self.args[0]:
                mediator = Mediator(code, frame.f_globals, dict(frame.f_locals), node=self.node)
                mediator.batch_group = self.batcher.add(prompt, **self.kwargs)
                interleaver.mediators.append(mediator)
            args, kwargs = self.batcher.assemble(self.fn)
            return list(interleaver.mediators), args, kwargs

    InvokePerPromptTracer.__module__ = __name__
    InvokePerPromptTracer.__qualname__ = "InvokePerPromptTracer"
    return InvokePerPromptTracer


def set_client_worker(model_or_class: Any, worker_cls: str) -> None:
    """Make nnsight's vLLM client start engines with `worker_cls` (a dotted path vLLM imports in the worker).

    nnsight passes ``worker_cls=self._WORKER_CLS`` to ``vllm.LLM`` and forwards
    the caller's keywords too, so the attribute is the only place to say it.
    """
    if isinstance(model_or_class, type):
        setattr(model_or_class, "_WORKER_CLS", worker_cls)
    else:
        object.__setattr__(model_or_class, "_WORKER_CLS", worker_cls)


# A vLLM trace's saves on their way home: handed over as tensors where the engine shares the caller's process.

#: ``pickle`` makes every vLLM trace send its saves pickled, as nnsight does, even with the engine in this process.
SAVES_TRANSPORT_ENV = "STREAMSCOPE_SAVES_TRANSPORT"
_TRANSPORTS = ("auto", "pickle")
#: The process whose vLLM client takes saves handed over (set by `hand_saves_over`; a forked child differs).
_CLIENT_PID: list[int] = []
#: Set while a streamscope worker answers a collect (`handing_over`): another engine's worker (raw nnsight's, in
#: the same process) keeps nnsight's pickled answer.
_HANDING: list[bool] = []
#: Collects answered each way, per process (`transport_counts`): counted where the worker runs.
_COUNTS: dict[str, float] = {"handed": 0, "pickled": 0, "tensors_handed": 0, "packed": 0, "tensors_packed": 0,
                              "bytes_packed": 0, "seconds_pickling": 0.0, "seconds_packing": 0.0}
#: Collects read each way by this process's vLLM clients (`received_counts`): counted where the caller runs.
_RECEIVED: dict[str, float] = {"handed": 0, "packed": 0, "pickled": 0, "seconds_handed": 0.0, "seconds_packed": 0.0,
                               "seconds_pickled": 0.0}


def _compact_reduce(value: Any) -> Any:
    """A save's pickler's `reducer_override`: a plain tensor that views part of a larger storage is pickled as its
    clone, by nnsight's compact rule; anything else as pickle does (``NotImplemented``)."""
    import pickle

    import torch

    if isinstance(value, torch.Tensor) and _plain(value) and (
            value.untyped_storage().nbytes() > value.numel() * value.element_size()):
        return value.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return NotImplemented


class HandedSaves:
    """One collect's saves, from a vLLM worker to the client in the same process, with no tensor pickled.

    nnsight's worker pickles what a trace saved (``dumps_compact``) and its
    engine unpickles it, even where both are one process: a trace that saves
    every block's activations copies them to host bytes and back. Here the
    structure around the tensors (dicts, lists, the user's own objects, an
    error's record) is still pickled, so the caller gets the same new objects
    and the same identities the pickled path gives; every plain tensor travels
    beside it as a device-side copy taken by nnsight's own rule: a tensor that
    views part of a larger storage (a read narrowed out of the step's batch)
    comes home as a copy of itself (``clone``), any other with a copy of its
    whole storage at the same offset and strides, which is what unpickling
    rebuilds. The copy is what makes it the caller's: the model's tensors are
    inference tensors that later steps may write over.
    """

    __slots__ = ("structure", "tensors")

    def __init__(self, structure: bytes, tensors: list) -> None:
        self.structure = structure
        self.tensors = tensors


def _owned_copy(tensor: Any) -> Any:
    """`tensor` as unpickling it would rebuild it: values, dtype, device, shape, strides, offset; not an
    inference tensor (the copy is made outside inference mode)."""
    import torch

    with torch.inference_mode(False):
        if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
            return tensor.clone()  # nnsight's compact rule: a view of a larger storage comes home as itself alone
        storage = tensor.untyped_storage().clone()
        copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        copy.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        copy.requires_grad_(tensor.requires_grad)
        return copy


def _plain(tensor: Any) -> bool:
    """Whether `tensor` is a dense tensor over one storage (sparse, quantized and conjugated ones are pickled)."""
    import torch

    return (tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_conj()
            and not tensor.is_neg())


def _pack(collected: Any, compact: Callable[[Any], bytes]) -> Any:
    """`collected` as `HandedSaves` for a client of this process, packed (`_pack_into_buffer`) for a client in
    another; pickled by `compact` (nnsight's) for a worker no streamscope client set up, or where asked."""
    # Read, not checked: the worker must answer whatever the setting (`hand_saves_over` refused a bad one).
    if not _HANDING or os.environ.get(SAVES_TRANSPORT_ENV) == "pickle":
        _COUNTS["pickled"] += 1
        started = time.perf_counter()
        pickled = compact(collected)
        _COUNTS["seconds_pickling"] += time.perf_counter() - started
        return pickled
    if not _CLIENT_PID or _CLIENT_PID[0] != os.getpid():
        started = time.perf_counter()
        packed = _pack_into_buffer(collected)
        _COUNTS["seconds_packing"] += time.perf_counter() - started
        return packed
    import io
    import pickle

    import torch

    tensors: list = []
    index: dict[int, int] = {}

    class StructurePickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Optional[int]:
            if type(value) is not torch.Tensor or not _plain(value):
                return None
            if id(value) not in index:  # one object saved twice stays one object, as pickle's memo keeps it
                index[id(value)] = len(tensors)
                tensors.append(_owned_copy(value))
            return index[id(value)]

        def reducer_override(self, value: Any) -> Any:
            return _compact_reduce(value)

    buffer = io.BytesIO()
    StructurePickler(buffer, pickle.HIGHEST_PROTOCOL).dump(collected)
    _COUNTS["handed"] += 1
    _COUNTS["tensors_handed"] += len(tensors)
    return HandedSaves(buffer.getvalue(), tensors)


def _unpack(payload: Any) -> Any:
    """What a worker's collect answered, as nnsight's engine reads it (a pickled payload is unpickled)."""
    import io
    import pickle

    if _is_packed(payload):
        return _unpack_buffer(payload)
    if not isinstance(payload, HandedSaves):
        return pickle.loads(payload)
    tensors = payload.tensors

    class StructureUnpickler(pickle.Unpickler):
        def persistent_load(self, key: Any) -> Any:
            return tensors[key]

    return StructureUnpickler(io.BytesIO(payload.structure)).load()


class _HandoverPickle:
    """The ``pickle`` nnsight's vLLM engine module calls: ``loads`` also takes `HandedSaves`; the rest is pickle's."""

    def __init__(self) -> None:
        import pickle

        self._pickle = pickle

    def loads(self, payload: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if isinstance(payload, HandedSaves) or _is_packed(payload):
            kind = "handed" if isinstance(payload, HandedSaves) else "packed"
            loaded = _unpack(payload)
        else:
            kind = "pickled"
            loaded = self._pickle.loads(payload, *args, **kwargs)
        _RECEIVED[kind] += 1
        _RECEIVED[f"seconds_{kind}"] += time.perf_counter() - started
        return loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pickle, name)


def _transport() -> str:
    chosen = os.environ.get(SAVES_TRANSPORT_ENV, "auto")
    if chosen not in _TRANSPORTS:
        raise ValueError(f"{SAVES_TRANSPORT_ENV}={chosen!r}: use one of {_TRANSPORTS} ('auto' hands a vLLM "
                         f"trace's saves over as tensors where the engine runs in this process; 'pickle' always "
                         f"pickles them, as nnsight does).")
    return chosen


def hand_saves_over() -> None:
    """Let vLLM traces of this process take their saves as tensors from a worker in this process (idempotent).

    Called in the client's process before its engine starts. nnsight's
    worker answers a collect with ``dumps_compact(collected)`` and its engine
    reads each rank's answer with ``pickle.loads`` (``merge_collected``): the
    first now answers with `HandedSaves` where the worker runs in the process
    that called this (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with one rank), and
    packs them into one buffer anywhere else (an engine process, a forked
    rank: its pid differs; `pack_saves_in_this_process`); the second reads
    any of the three. ``STREAMSCOPE_SAVES_TRANSPORT=pickle`` keeps the pickled
    path everywhere.
    """
    import importlib

    _transport()  # a bad setting is refused before an engine starts
    _CLIENT_PID[:] = [os.getpid()]
    pack_saves_in_this_process()
    engine = importlib.import_module("nnsight.modeling.vllm.engines.engine")
    if not isinstance(engine.pickle, _HandoverPickle):
        setattr(engine, "pickle", _HandoverPickle())  # the pickle nnsight's engine reads a collect with


@contextlib.contextmanager
def handing_over() -> Any:
    """Within the block (a streamscope worker's ``collect_nnsight``), a collect may answer with `HandedSaves`."""
    _HANDING.append(True)
    try:
        yield
    finally:
        _HANDING.pop()


@contextlib.contextmanager
def saves_transport(name: str) -> Any:
    """Within the block, vLLM traces of this process send their saves by `name` (``"auto"`` or ``"pickle"``)."""
    before = os.environ.get(SAVES_TRANSPORT_ENV)
    os.environ[SAVES_TRANSPORT_ENV] = name
    try:
        _transport()
        yield
    finally:
        if before is None:
            os.environ.pop(SAVES_TRANSPORT_ENV, None)
        else:
            os.environ[SAVES_TRANSPORT_ENV] = before


def transport_counts() -> dict[str, float]:
    """How this process's vLLM workers have answered collects so far: ``handed`` (as `HandedSaves`),
    ``packed`` (one buffer for a client in another process, `PACKED_SAVES`), ``pickled`` (nnsight's pickled
    payload), ``tensors_handed`` / ``tensors_packed`` (tensors carried by those), ``bytes_packed`` (their buffers'
    size). An engine process's worker counts in that process: a streamscope worker answers them through
    ``collective_rpc("streamscope_transport_counts")``."""
    return dict(_COUNTS)


def received_counts() -> dict[str, float]:
    """How this process's vLLM clients have read collects so far (one per rank's answer): ``handed``, ``packed``,
    ``pickled`` (raw nnsight's engines in this process count too), and ``seconds_`` each, reading them."""
    return dict(_RECEIVED)


# A vLLM trace's saves from a worker in another process: one buffer, not one pickle per tensor.

#: The first item of a packed collect (`_pack_into_buffer`).
PACKED_SAVES = "streamscope-packed-saves-1"
#: Where each tensor's bytes start in a packed buffer: aligned, so a slot can be viewed as any dtype on the device.
_SLOT_ALIGN = 64
#: The most bytes of saves packed together on a device before their copy to the host.
_DEVICE_PACK = 256 * 2**20


def pack_saves_in_this_process() -> None:
    """Let a streamscope worker of this process answer collects as `HandedSaves` or packed (idempotent).

    Replaces the name nnsight's worker pickles a collect with
    (``dumps_compact``) by `_pack`, which still pickles unless a streamscope
    worker answers (`handing_over`). Called by `hand_saves_over` in the
    client's process and by a streamscope worker in its own
    (``streamscope_hand_saves_over``).
    """
    import importlib

    runner = importlib.import_module("nnsight.modeling.vllm.model_runners.GPUModelRunner")
    if not getattr(runner.dumps_compact, "streamscope_handover", False):
        compact = runner.dumps_compact
        packing = partial(_pack, compact=compact)
        setattr(packing, "streamscope_handover", True)  # marks the patch as applied
        setattr(runner, "dumps_compact", packing)  # the name nnsight's worker pickles a collect with


def _is_packed(payload: Any) -> bool:
    # After vLLM's msgpack the tuple is a list and the bytearray bytes.
    return isinstance(payload, (list, tuple)) and len(payload) == 3 and payload[0] == PACKED_SAVES


def _pack_into_buffer(collected: Any) -> list:
    """`collected` for a client in another process: ``[PACKED_SAVES, structure, buffer]``.

    ``structure`` is `collected` pickled with every plain tensor replaced by a
    record of what unpickling rebuilds (dtype, device, the size of its
    storage, shape, strides, storage offset, ``requires_grad``) and where its
    storage's bytes sit in ``buffer``, one ``bytearray`` holding every saved
    tensor's. Which bytes is nnsight's compact rule, as in `HandedSaves`: a
    tensor that views part of a larger storage travels as a copy of itself
    (a contiguous one as its own bytes, with its strides, as its clone would
    be; another as its clone), any other with its whole storage. The tensors
    of one device are packed into one device buffer and copied to the host
    once; a CPU tensor's bytes are copied straight in (by ``memcpy``, not a
    torch kernel: no thread pool to wake for a few kilobytes). Pickling
    instead copies and serializes each tensor on its own. Both parts are
    plain ``bytes``-like values, which vLLM's ``collective_rpc`` carries from
    an engine process natively.
    """
    import io
    import pickle

    import torch

    slots: list[tuple[Any, int]] = []  # (the bytes to send: a uint8 view on the tensor's device, buffer offset)
    index: dict[int, tuple] = {}
    kept: list = []  # the tensors indexed by id, alive until packed
    end = 0

    def record(value: Any) -> tuple:
        nonlocal end
        with torch.inference_mode(False):
            size = value.numel() * value.element_size()
            if value.untyped_storage().nbytes() > size and not value.is_contiguous():
                value = value.clone()  # its strides are the clone's, as nnsight's compact rule pickles it
            if value.untyped_storage().nbytes() > size:  # contiguous: its own bytes are its clone's, strides kept
                first, nbytes, offset = value.storage_offset() * value.element_size(), size, 0
            else:
                first, nbytes, offset = 0, value.untyped_storage().nbytes(), value.storage_offset()
            source = torch.empty(0, dtype=torch.uint8, device=value.device).set_(
                value.untyped_storage(), first, (nbytes,), (1,))
        start = end
        end += -(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN
        slots.append((source, start))
        return (len(slots) - 1, str(value.dtype).removeprefix("torch."), str(value.device), start, nbytes,
                tuple(value.shape), value.stride(), offset, value.requires_grad)

    class PackingPickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Optional[tuple]:
            if type(value) is not torch.Tensor or not _plain(value):
                return None
            if id(value) not in index:  # one object saved twice stays one object, as pickle's memo keeps it
                kept.append(value)
                index[id(value)] = record(value)
            return index[id(value)]

        def reducer_override(self, value: Any) -> Any:
            return _compact_reduce(value)

    structure = io.BytesIO()
    PackingPickler(structure, pickle.HIGHEST_PROTOCOL).dump(collected)
    buffer = bytearray(end)
    view = memoryview(buffer)
    on_devices: dict[Any, list] = {}
    for source, start in slots:
        if source.device.type == "cpu":
            view[start:start + source.numel()] = source.numpy()
        elif source.numel():
            on_devices.setdefault(source.device, []).append((source, start))
    for placed in on_devices.values():
        # The device's tensors packed into buffers there of at most _DEVICE_PACK bytes, each copied to the host at
        # once: one copy for a collect's saves up to that size, and no more device memory than that beside them.
        group: list = []
        for slot in placed:
            if group and slot[1] + slot[0].numel() - group[0][1] > _DEVICE_PACK:
                _copy_home(group, buffer)
                group = []
            group.append(slot)
        if group:
            _copy_home(group, buffer)
    _COUNTS["packed"] += 1
    _COUNTS["tensors_packed"] += len(slots)
    _COUNTS["bytes_packed"] += end
    return [PACKED_SAVES, structure.getvalue(), buffer]


def _copy_home(group: list, buffer: bytearray) -> None:
    """Copy `group` (``(source, start)`` slots on one device, in order) into `buffer`: packed into one buffer on
    the device and copied to the host once (a lone slot is copied as it is)."""
    import torch

    low = group[0][1]
    high = group[-1][1] + group[-1][0].numel()
    host = torch.frombuffer(buffer, dtype=torch.uint8, count=high - low, offset=low)
    with torch.inference_mode(False):
        if len(group) == 1:
            host.copy_(group[0][0])
            return
        packed = torch.empty(high - low, dtype=group[0][0].dtype, device=group[0][0].device)
        for source, start in group:
            packed[start - low:start - low + source.numel()].copy_(source)
        host.copy_(packed)


def _unpack_buffer(payload: Any) -> Any:
    """A packed collect (`_pack_into_buffer`) as unpickling nnsight's payload gives it: each tensor its own storage,
    on its device, with its dtype, shape, strides, storage offset and ``requires_grad``."""
    import io
    import pickle
    import warnings

    import numpy
    import torch

    _, structure, buffer = payload
    rebuilt: dict[int, Any] = {}
    staged: dict[str, Any] = {}  # per device: the buffer copied there once
    host = numpy.frombuffer(buffer, dtype=numpy.uint8)

    def storage_for(device: str, start: int, nbytes: int) -> Any:
        if device == "cpu":
            owned = torch.empty(nbytes, dtype=torch.uint8)
            owned.numpy()[:] = host[start:start + nbytes]  # a memcpy, as unpickling's
            return owned.untyped_storage()
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        if device not in staged:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only read, by the copy to the device
                staged[device] = torch.from_numpy(host).to(device)  # one copy of the buffer there, sliced there
        return staged[device][start:start + nbytes].clone().untyped_storage()

    class PackedUnpickler(pickle.Unpickler):
        def persistent_load(self, key: Any) -> Any:
            slot, dtype, device, start, nbytes, shape, stride, offset, requires_grad = key
            if slot not in rebuilt:
                storage = storage_for(device, start, nbytes)
                tensor = torch.empty(0, dtype=getattr(torch, dtype), device=device)
                tensor.set_(storage, offset, shape, stride)
                tensor.requires_grad_(requires_grad)
                rebuilt[slot] = tensor
            return rebuilt[slot]

    with torch.inference_mode(False):
        return PackedUnpickler(io.BytesIO(structure)).load()


# A vLLM trace's interventions on their way to the worker: one pickle per trace, kept here for a worker of this
# process, or sent ahead of the trace's requests to workers elsewhere.

#: The bundles of this process's last traces, by trace id (oldest first): their bytes, the unpickled invokes until
#: every one is taken, which are taken.
_BUNDLES: "collections.OrderedDict[str, dict]" = collections.OrderedDict()
#: How many bundles a worker keeps while some of their invokes have not arrived (an aborted request's never does).
_BUNDLES_KEPT = 16
#: While a streamscope client attaches a trace's invokes: the trace's bundle, built on the first invoke's dumps.
_ATTACHING: list[dict] = []
_BUNDLE_COUNTS = {"bundles": 0, "invokes": 0, "loads": 0, "received": 0}
_MEMBER = "streamscope-bundle"


def _bundled_dumps(mediator: Any, *args: Any, dumps: Callable) -> Any:
    """nnsight's ``dumps(mediator)`` for a request, or, while a streamscope trace attaches its invokes, a reference
    to the trace's bundle (every invoke pickled together, once)."""
    attaching = _ATTACHING[-1] if _ATTACHING else None
    if attaching is None or id(mediator) not in attaching["index"]:
        return dumps(mediator, *args)
    if attaching["trace"] is None:
        import uuid

        trace = uuid.uuid4().hex
        _BUNDLES[trace] = {"bytes": dumps(attaching["mediators"], *args), "loaded": None, "taken": set(),
                           "count": len(attaching["mediators"])}
        attaching["trace"] = trace
        _BUNDLE_COUNTS["bundles"] += 1
        _BUNDLE_COUNTS["invokes"] += len(attaching["mediators"])
    return (_MEMBER, attaching["trace"], attaching["index"][id(mediator)])


def _bundled_loads(payload: Any, *args: Any, loads: Callable, **kwargs: Any) -> Any:
    """nnsight's worker-side ``loads`` of a request's intervention; a bundle reference takes its invoke from the
    trace's bundle, unpickled by the first of its requests to arrive."""
    if not (isinstance(payload, (tuple, list)) and len(payload) == 3 and payload[0] == _MEMBER):
        return loads(payload, *args, **kwargs)
    _, trace, index = payload
    entry = _BUNDLES.get(trace)
    if entry is None:
        raise RuntimeError("this request's intervention was bundled with its trace's others, and the bundle is gone: "
                           f"more than {_BUNDLES_KEPT} traces were attached while its requests waited. Run fewer "
                           "traces at once (or set STREAMSCOPE_BUNDLE_INVOKES=0).")
    _BUNDLE_COUNTS["loads"] += 1 if entry["loaded"] is None or index in entry["taken"] else 0
    if index in entry["taken"]:
        # A second request of the same invoke (one of the n sequences of a request with n > 1): its own copy, as
        # nnsight unpickles one for each.
        return loads(entry["bytes"], *args, **kwargs)[index]
    if entry["loaded"] is None:
        entry["loaded"] = loads(entry["bytes"], *args, **kwargs)
    entry["taken"].add(index)
    mediator = entry["loaded"][index]
    if len(entry["taken"]) == entry["count"]:
        entry["loaded"] = None  # every invoke is its request's now; the bytes stay for a late sibling sequence
    return mediator


#: What `bundle_interventions`'s ``route`` answers for an engine whose one worker runs in this process.
HERE = "here"


def bundle_interventions(client: type, route: Callable[[Any], Any]) -> None:
    """Let `client` (streamscope's vLLM model class) pickle a trace's invokes once, together (idempotent).

    nnsight pickles each invoke of a vLLM trace on its own (``dumps(mediator)``
    into its request's ``extra_args``) and the worker unpickles each: the
    model's whole envoy tree, the trace's globals and every tensor an invoke
    names travel once per invoke, and are rebuilt once per invoke. Here the
    invokes are pickled as one list instead, with one memo, so what they
    share is pickled and rebuilt once and stays shared in the worker, as it
    is in the caller's process (where every invoke of a trace runs against
    the same objects); each request carries a reference to the bundle, which
    the first of them to reach the worker unpickles.

    ``route(model)`` says where the bundle goes: `HERE` (the engine's one
    worker runs in this process, which keeps it), a function that hands it
    to every worker elsewhere before the requests are added (``send(trace,
    payload, count)``, each worker then calling `take_bundle`), or None for
    nnsight's own pickling per invoke. ``STREAMSCOPE_BUNDLE_INVOKES=0`` keeps
    nnsight's way everywhere.
    """
    import importlib

    vllm_client = importlib.import_module("nnsight.modeling.vllm.vllm")
    if not getattr(vllm_client.dumps, "streamscope_bundles", False):
        dumps = partial(_bundled_dumps, dumps=vllm_client.dumps)
        setattr(dumps, "streamscope_bundles", True)
        setattr(vllm_client, "dumps", dumps)  # the name nnsight's client pickles each invoke with
    _take_bundled_loads()
    if "_attach_mediators" in client.__dict__:
        return
    attach = __getattr__("VLLMClient")._attach_mediators

    def attach_bundled(model: Any, params: list, **kwargs: Any) -> list:
        # The invokes nnsight attaches (those with a prompt), in its order.
        mediators = [mediator for mediator in model.interleaver.mediators if mediator.batch_group is not None]
        send = route(model) if len(mediators) > 1 and os.environ.get("STREAMSCOPE_BUNDLE_INVOKES") != "0" else None
        if send is None:
            return attach(model, params, **kwargs)
        attaching: dict[str, Any] = {"mediators": mediators, "index": {id(m): i for i, m in enumerate(mediators)},
                                     "trace": None}
        _ATTACHING.append(attaching)
        try:
            attached = attach(model, params, **kwargs)
        finally:
            _ATTACHING.pop()
            _evict_bundles()
        if send is not HERE and attaching["trace"] is not None:
            entry = _BUNDLES.pop(attaching["trace"])
            send(attaching["trace"], entry["bytes"], entry["count"])
        return attached

    setattr(client, "_attach_mediators", attach_bundled)


def _take_bundled_loads() -> None:
    """Let nnsight's worker of this process take an invoke from its trace's bundle (idempotent)."""
    import importlib

    runner = importlib.import_module("nnsight.modeling.vllm.model_runners.GPUModelRunner")
    if not getattr(runner.loads, "streamscope_bundles", False):
        loads = partial(_bundled_loads, loads=runner.loads)
        setattr(loads, "streamscope_bundles", True)
        setattr(runner, "loads", loads)  # the name nnsight's worker unpickles each request's invoke with


def take_bundle(trace: str, payload: bytes, count: int) -> None:
    """Keep a trace's bundle (`bundle_interventions`), sent ahead of its requests, in this worker's process."""
    _take_bundled_loads()
    _BUNDLES[trace] = {"bytes": payload, "loaded": None, "taken": set(), "count": count}
    _BUNDLE_COUNTS["received"] += 1
    _evict_bundles()


def _evict_bundles() -> None:
    while len(_BUNDLES) > _BUNDLES_KEPT:
        _BUNDLES.popitem(last=False)


def bundle_counts() -> dict[str, int]:
    """This process's bundled traces so far: ``bundles`` pickled, ``invokes`` in them, ``loads`` (unpickled),
    ``received`` (sent here ahead of their requests, by a client in another process)."""
    return dict(_BUNDLE_COUNTS)


_VLLM_NAMES = {
    "NNsightGPUWorker": ("nnsight.modeling.vllm.workers.GPUWorker", "NNsightGPUWorker"),
    "NNsightGPUModelRunner": ("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner"),
    "ParallelEnvoy": ("nnsight.modeling.vllm.envoys", "ParallelEnvoy"),
    "parallel_envoys": ("nnsight.modeling.vllm.envoys", "parallel_envoys"),
    "VLLMClient": ("nnsight.modeling.vllm.vllm", "VLLM"),
}
"""nnsight's vLLM internals, loaded on first use (they import vLLM):

* ``NNsightGPUWorker`` / ``NNsightGPUModelRunner``: the worker and runner that
  run a trace inside the engine; streamscope subclasses them (bulk RPCs, a CPU
  worker for hosts without a GPU).
* ``ParallelEnvoy`` / ``parallel_envoys()``: the envoys that gather tensor-parallel
  shards, which streamscope's ``envoys=`` map starts from.
* ``VLLMClient``: the class behind ``nnsight.modeling.vllm.VLLM``, reached at
  its defining module, where its ``_WORKER_CLS`` and ``_collect`` live.
* ``InvokePerPromptTracer``: streamscope's tracer over nnsight's vLLM tracer
  (`invoke_per_prompt_tracer`), built here so that it pickles by name.
"""


def __getattr__(name: str) -> Any:
    if name == "InvokePerPromptTracer":  # streamscope's, built over nnsight's vLLM tracer on first use
        globals()[name] = _build_invoke_per_prompt_tracer()
        return globals()[name]
    target = _VLLM_NAMES.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value
