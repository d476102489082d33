"""The write-backs of a visit, applied together: one set of kernels for every invoke that edits the stream there.

A trace with an invoke per prompt that edits a block's stream at every step
(a steer written in a trace) pays, per invoke and step, the edit's write-back
(the halves summed, the difference, the add into the hidden half) and its
NaN/inf scan (a sum of the written value and one of the model's): five kernel
launches, each a few microseconds of the host's time on a GPU. nnsight serves
the invokes parked on a visit of a module one after another, each its own span
of vLLM's flat token axis, and the model reads the edits only once the visit
has served them all. So a `streamscope.vllm.blocks.Summed` write-back made
during a visit is queued here (`hold`), and when the visit has served everyone
the queued edits of adjacent spans land as one: the written values
concatenated, the same three elementwise kernels over all their rows (each
entry's arithmetic is the one its own write-back does, so the result is the
same bit for bit), and the scan as one count of finite entries by row, read
later without a wait (`streamscope.nonfinite.scan_rows`). Adjacent spans are
found by their rows' addresses. The module also takes two of nnsight's
per-invoke walks off this path through the seam: the batcher's narrowing of a
block's pair to a span (`nnsight_seam.narrow_spans_directly`) and its per-step
note of a worker's saved names (`nnsight_seam.record_saves_cheaply`).

The queue lands earlier wherever waiting would change what anybody sees:

- before nnsight serves a worker rows an edit is queued for (the same invoke
  reading the value again in the same visit), or every row (a worker with no
  rows of its own);
- before nnsight splices a worker's swap or skip into the batch, which copies
  the rows into a new tensor;
- before the NaN/inf scans are read (an invoke's code ends: its warnings are
  due then);

and it is dropped, not applied, when the run fails before the visit ends: its
views are of buffers a later step reuses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .. import nonfinite
from .. import nnsight_seam as seam


class _Edit(NamedTuple):
    # Where the span's rows of each half begin (their data pointers): a tensor's spans sort in row order by
    # them, and whether one span's rows follow another's is arithmetic on them.
    hidden_at: int
    residual_at: int
    hidden: torch.Tensor  # the span's rows of the hidden half, [rows, hidden_size]
    residual: torch.Tensor  # the same rows of the residual half
    value: torch.Tensor  # the stream written there, [rows, hidden_size], in the halves' dtype
    name: Optional[str]  # the value's name where the write is scanned for NaN/inf, else None
    line: Optional[nonfinite.Line]  # the user's line of the write, where it is scanned


_new = tuple.__new__  # a NamedTuple made in C: a record per invoke and step
_QUEUE: list[_Edit] = []
_STARTS: set[int] = set()  # the spans' starts: whether a worker about to be served has an edit queued


def span(hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> Optional[int]:
    """The first token row of the running invoke's span, where its write-back over these halves may wait for
    the end of the visit; None where it must be made now.

    It may wait on vLLM's flat token axis only: halves of the span's rows
    (``[rows, hidden_size]``, each row contiguous), inside a visit nnsight
    serves with vLLM's batcher.
    """
    if residual is None:
        return None
    token_span = seam.running_token_span()
    if token_span is None:
        return None
    start, size = token_span
    if (hidden.dim() != 2 or hidden.shape[0] != size or residual.shape != hidden.shape
            or hidden.stride(1) != 1 or residual.stride(1) != 1):
        return None
    return start


def hold(start: int, hidden: torch.Tensor, residual: torch.Tensor, value: torch.Tensor,
         name: Optional[str]) -> None:
    """Queue the write-back of `value` (the stream's new rows, ``[rows, hidden_size]``) over the halves of the
    span at `start`, scanned for NaN/inf as `name` unless None; it lands when the visit ends (`land`)."""
    line = nonfinite.user_line() if name is not None else None
    _QUEUE.append(_new(_Edit, (hidden.data_ptr(), residual.data_ptr(), hidden, residual, value, name, line)))
    _STARTS.add(start)


def land() -> None:
    """Apply every queued write-back, the edits of adjacent spans as one."""
    if not _QUEUE:
        return
    edits = sorted(_QUEUE, key=_hidden_at)  # a tensor's spans in row order, together
    _QUEUE.clear()
    _STARTS.clear()
    # Runs of spans whose rows follow one another by address, a row apart as the run's first span's are; each
    # run's layout is checked once, as it lands (`_land_run`).
    first = 0
    last = edits[0]
    hidden_row, residual_row = _row_bytes(last)
    for index in range(1, len(edits)):
        edit = edits[index]
        rows = last.hidden.shape[0]
        if (edit.hidden_at != last.hidden_at + rows * hidden_row
                or edit.residual_at != last.residual_at + rows * residual_row):
            _land_run(edits[first:index])
            first = index
            hidden_row, residual_row = _row_bytes(edit)
        last = edit
    _land_run(edits[first:])


def _hidden_at(edit: _Edit) -> int:
    return edit.hidden_at


def _row_bytes(edit: _Edit) -> tuple[int, int]:
    """How far apart, in bytes, one row of each half is from the next."""
    hidden, residual = edit.hidden, edit.residual
    return hidden.stride(0) * hidden.element_size(), residual.stride(0) * residual.element_size()


def _land_run(run: list[_Edit]) -> None:
    """Apply `run`, spans whose rows follow one another by their addresses, as one where they are the rows of
    one pair of tensors of one layout (the common case: one visit's spans of the step's halves). Spans of
    tensors that sit side by side in memory land tensor by tensor; spans of one layout apart, one by one."""
    if len(run) == 1:
        _apply(run)
    elif _storages(run[0]) != _storages(run[-1]):
        split = next(index for index in range(1, len(run)) if _storages(run[index]) != _storages(run[0]))
        _land_run(run[:split])
        _land_run(run[split:])
    elif _one_layout(run):
        _apply(run)
    else:
        for edit in run:
            _apply([edit])


def _storages(edit: _Edit) -> tuple[int, int]:
    return edit.hidden.untyped_storage().data_ptr(), edit.residual.untyped_storage().data_ptr()


def _one_layout(run: list[_Edit]) -> bool:
    """Whether every span of `run` (its first and last of the same storages, so every one between of them too)
    has the first's strides, width, dtype and device."""
    hidden, residual = run[0].hidden, run[0].residual
    strides, width, dtype, device = (hidden.stride(), residual.stride()), hidden.shape[1], hidden.dtype, hidden.device
    return all((edit.hidden.stride(), edit.residual.stride()) == strides and edit.hidden.shape[1] == width
               and edit.hidden.dtype == dtype and edit.residual.dtype == residual.dtype
               and edit.hidden.device == device for edit in run)


def _apply(run: list[_Edit]) -> None:
    first = run[0]
    if len(run) == 1:
        hidden, residual, value = first.hidden, first.residual, first.value
    else:
        rows = sum(edit.hidden.shape[0] for edit in run)
        shape = (rows, first.hidden.shape[1])
        hidden = first.hidden.as_strided(shape, first.hidden.stride())
        residual = first.residual.as_strided(shape, first.residual.stride())
        value = torch.cat([edit.value for edit in run])
    if any(edit.name is not None for edit in run):
        nonfinite.scan_rows([(edit.name, edit.hidden.shape[0], edit.line) for edit in run], value, hidden)
    # Elementwise as each write-back does it alone: the stream's change added to the hidden half.
    hidden.add_(value - (hidden + residual))


def _serving(group: Any) -> None:
    if _QUEUE and (group is None or group[0] in _STARTS):
        land()


def _ended(failed: bool) -> None:
    if failed:
        _QUEUE.clear()
        _STARTS.clear()
    else:
        land()


seam.around_visits(land, _serving, _ended)
seam.narrow_spans_directly()
seam.record_saves_cheaply()
nonfinite.BEFORE_READ.append(land)
