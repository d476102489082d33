"""A trace's invokes as nnsight runs them: the mediator, its pending write-back, the eproperty callbacks, an
invoke's rows of a batch, and the process-wide patches streamscope puts on the mediator, the interleaver and the
batcher.

Read, not patched (nnsight's own objects, reached at attributes nnsight does not document):

* the eproperty callbacks (``_preprocess``, ``_transform``, ``_postprocess``; `set_callbacks`) and its location
  (``_location``, overridden once by `LocatedProperty`). streamscope's values are instances of one class each,
  their callbacks its methods, so they are set per instance. Upstream: nnsight's decorators (``@eproperty()``,
  ``.transform``, ``.postprocess``) applied at class definition, or an eproperty that calls overridable methods
  of its own class, and a public ``location(obj)``.
* the running mediator (the greenlet's ``mediator``), its pending write-back (``Mediator.transform``, a
  ``WriteBack``: read by `pending_write_back` and `held_view`, pointed at another view by `redirect_write_back`)
  and the wait for a location (``Mediator.value``/``skip``/``current``/``occurrence``; `read_located` parks the
  greenlet as ``eproperty.__get__`` does, without asking again what the caller knows). Upstream: a public
  ``Mediator.current()`` and a documented write-back record a value may replace.

Patched, each once per process (idempotent, each patch marked on the function it installs):

* ``Mediator.flush`` (`filter_write_backs`): a read's write-back reaches the model only where streamscope says
  so, and one written in place is not spliced into a new batch tensor (a block's saved residual would miss the
  edit). Upstream: an eproperty ``transform`` that may answer "unchanged" (no swap), and a batcher that keeps an
  in-place edit's tensor.
* ``interleaver.dangling_unwind`` (`rename_out_of_order`): the out-of-order error names the value in
  streamscope's words, not nnsight's raw location. Upstream: a hook that describes a location for errors.
* ``Mediator._run`` (`around_mediator_run`): streamscope's checks when an invoke's code ends, and its wording of
  a RuntimeError raised in it. Upstream: a mediator lifecycle callback (on end, on error).
* ``Interleaver._reindex_parked``, ``Interleaver.__exit__``, ``Batcher.narrow``/``widen``/``gather_skip``
  (`around_visits`): streamscope learns when a module's visit has served its invokes and before an invoke is
  served its rows, so edits held back during a visit (vLLM's fused halves) land before anything reads them.
  Upstream: a ``Batcher`` subclass given as the model class's batcher (``_batcher_class``) for the batcher's
  part, one per engine (nnsight's vLLM batcher is a subclass of its own), and a visit-end callback on the
  interleaver for the rest.
"""

from __future__ import annotations

import dis
import types
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

from greenlet import getcurrent
from nnsight.intervention import interleaver as _interleaver
from nnsight.intervention.batching import Batcher as _Batcher
from nnsight.intervention.eproperty import WriteBack as _WriteBack
from nnsight.intervention.eproperty import eproperty
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.tracing.tracer import WithBlockNotFoundError, _saves

# Re-exported as they are:
# * eproperty: the descriptor nnsight's envoys serve ``.output``/``.input`` with; every streamscope value
#   subclasses it, so a read waits for the model like nnsight's own and books a write-back.
# * Mediator: nnsight's runner of one invoke's code of a trace (not a vLLM worker process), on a greenlet
#   beside the model; used in annotations, and its instance ``__dict__`` keeps streamscope's notes per invoke.
# * OutOfOrderError: what nnsight raises for a value asked for after the model passed it; streamscope raises it
#   too (an edit made after the trace moved on), so one except clause catches both.
# * WithBlockNotFoundError: what a tracer's ``capture()`` raises when it was not called as a ``with``
#   statement; ``generate`` then runs plainly instead of tracing.
__all__ = [
    "eproperty", "LocatedProperty", "Mediator", "OutOfOrderError", "WithBlockNotFoundError", "set_callbacks",
    "read_located", "location", "call_location", "running_mediator", "running_taps", "mediator_at", "step_of",
    "read_at", "skip_at", "is_saved", "invoke_rows", "with_invoke_rows", "PendingWriteBack", "pending_write_back",
    "held_view", "redirect_write_back", "filter_write_backs", "rename_out_of_order", "around_mediator_run",
    "batch_whole", "codes_use_attributes", "trace_mediators", "around_visits", "interleaving",
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



def codes_use_attributes(mediators: list, names: frozenset[str]) -> list[str]:
    """Which of the attribute `names` the code of `mediators` (a trace's invokes) reads, writes or calls, at any
    depth (its comprehensions, lambdas and nested functions too); found in the compiled code, before it runs."""
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


def interleaving(model: Any) -> bool:
    """Whether `model` is inside a run of its own (a ``generate`` called within a trace)."""
    return model.interleaver.interleaving
