"""The NaN/inf scan of a write, read from the device in batches rather than once per write.

A write that brings NaN or inf into finite values warns, naming the value
(`streamscope.values.check_write`). The scan is one reduction of the written
tensor and one of the model's own value there, both left on the device: a
trace that writes at every step of a generation would otherwise wait for the
device at every write. The written tensors' sums are read together, with one
wait, when an invoke's code ends (`warn_pending`), or sooner once the writes
they hold reach `HOLD_BYTES`; the model's own sums are read only for a write
whose sum is not finite. The writes a visit of vLLM's batch lands together
(`streamscope.vllm.write_batch`) are scanned together, row by row, and their
counts copied to the host without a wait (`scan_rows`): they are read once the
device has made them. On the host, where reading a number waits for nothing,
scans are read at the write (`READ_ON_THE_HOST`); the warnings are given when
the invoke's code ends either way. A warning points at the user's line on the stack when the
write is made (an edit that goes back to the model from inside the engine,
with no frame of the user's on the stack, points at streamscope's own).
"""

from __future__ import annotations

import math
import sys
import sysconfig
import warnings
from pathlib import Path
from types import FrameType
from typing import Any, Callable, NamedTuple, Optional

import torch

#: How much written data the unread scans may keep alive (each keeps its tensor, to count its NaN or inf entries
#: should its sum not be finite) before they are read: a bound on the memory a long trace's writes hold.
HOLD_BYTES = 64 << 20
#: How many unread scans there may be before they are read, whatever their size. The scans of writes landed
#: together are then read where their counts have reached the host, and waited for only past four times as many.
HOLD_COUNT = 4096
#: Called before the scans are read: each makes the writes it holds back (`streamscope.vllm.write_batch`), so
#: their scans are started and read with the others.
BEFORE_READ: list[Callable[[], None]] = []
#: Whether a scan of host tensors is read at the write, where reading a number waits for nothing (the tests turn
#: it off to run the deferred path, a device's, on the host).
READ_ON_THE_HOST = True


class Line(NamedTuple):
    """Where a warning points: the user's file, line and module."""

    filename: str
    lineno: int
    module: Optional[str]


class _Scan(NamedTuple):
    name: str
    total: torch.Tensor  # the written tensor's sum, float32, on its device
    # The sum of the model's own value there, on its device (a host tensor may be written into a device's value,
    # say), or None when there is none to compare.
    base: Optional[torch.Tensor]
    value: torch.Tensor
    version: int  # value's version counter at the write: an in-place change since makes its count unknown
    line: Line


_new = tuple.__new__  # makes a NamedTuple in C, not through its Python __new__ (a scan makes two)

_SCANS: list[_Scan] = []
_HELD = 0  # the bytes of the written tensors that the unread scans keep
#: Warnings whose scans are read, due at the end of the invoke: (message, line).
_DUE: list[tuple[str, Line]] = []


def scan_write(name: str, value: torch.Tensor, current: Optional[torch.Tensor]) -> None:
    """Start the NaN/inf scan of `value`, written as `name` over `current` (the model's own value, if any)."""
    global _HELD
    # A trace's steer writes at every step, and every call and attribute look-up here counts: the sums, the
    # version and the record are made inline.
    if current is not None and current.shape != value.shape:
        current = None  # nothing to compare
    if READ_ON_THE_HOST and value.is_cpu:
        # Reading a host number waits for nothing: read it now, and the model's own sum only where it matters.
        if not math.isfinite(_sum(value).item()) and (current is None or math.isfinite(_sum(current).item())):
            _queue(name, value, _version(value), user_line())
        return
    # Two sums rather than one fused op: `torch._foreach_norm`, the one that reduces both tensors in a call, fills
    # two buffers with zeros on CUDA before its two kernels (four launches for these two), and on the host it is
    # slower than the two sums.
    total = value.sum(dtype=torch.float32) if value.element_size() < 4 else value.sum()
    base = None
    if current is not None:
        base = current.sum(dtype=torch.float32) if current.element_size() < 4 else current.sum()
    try:
        version = value._version
    except RuntimeError:  # an inference tensor keeps no version counter
        version = -1
    _SCANS.append(_new(_Scan, (name, total, base, value, version, user_line())))
    _HELD += value.nbytes
    if _HELD > HOLD_BYTES or len(_SCANS) > HOLD_COUNT:
        read_scans()


class _RowScans(NamedTuple):
    """The scans of writes landed together (`scan_rows`), one record for them all."""

    # [2, rows] int64, in row order: each written row's count of finite entries, then the same of the model's
    # own row under it. On the host, or being copied there.
    counts: torch.Tensor
    width: int  # the entries of a row
    # (name, rows, line) in row order; a write with no name is not scanned, its rows kept only to line the
    # others up.
    writes: list[tuple[Optional[str], int, Optional[Line]]]
    copied: Any  # the device's event recorded after the copy of `counts` to the host, or None (nothing to wait for)


_ROW_SCANS: list[_RowScans] = []
_ROW_WRITES = 0  # the writes the unread row scans hold


def scan_rows(writes: list[tuple[Optional[str], int, Optional[Line]]], value: torch.Tensor,
              own: torch.Tensor) -> None:
    """Start the NaN/inf scans of writes landed together.

    `writes` are ``(name, rows, line)`` in row order, their rows together
    making up `value` (``[rows, width]``, the values written, counted now:
    a later change to them changes no warning) and `own` (the same rows of
    the model's own values they were written over). A write warns, as
    `scan_write` says, where its rows hold NaN or inf and the model's did
    not; a write whose name is None is not scanned.

    The counts are made on the device (a few kernels for every write of the
    landing) and copied to the host without waiting: on a CUDA device an
    event says when they are there, and they are read once it has passed (at
    the latest when an invoke's code ends), so a trace that writes at every
    step never waits for the device to scan, nor keeps what it wrote.
    """
    global _ROW_WRITES
    if READ_ON_THE_HOST and value.is_cpu:
        if bool(value.isfinite().all()):
            return
        counts = _row_counts(value, own)
        _warn_rows(_RowScans(counts, value.shape[-1], writes, None), counts.tolist())
        return
    counts, copied = _row_counts(value, own), None
    if counts.is_cuda:
        # Into pinned memory, in the order of the device's work; the event passes once it is done.
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        counts, copied = host, torch.cuda.Event()
        copied.record()
    _ROW_SCANS.append(_RowScans(counts, value.shape[-1], writes, copied))
    _ROW_WRITES += len(writes)
    if len(_SCANS) + _ROW_WRITES > HOLD_COUNT:
        _read_row_scans(wait=len(_SCANS) + _ROW_WRITES > 4 * HOLD_COUNT)  # waits only when far behind


def _row_counts(value: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`scan_rows`' ``[2, rows]`` counts: each row's finite entries in `value`, then in `own`."""
    return torch.stack((value.isfinite().sum(dim=-1), own.isfinite().sum(dim=-1)))


def _warn_rows(scans: _RowScans, counts: list[list[int]]) -> None:
    """Queue the warnings of `scans`' writes that brought NaN or inf, given its counts read to the host."""
    finite, own = counts
    width = scans.width
    row = 0
    for name, rows, line in scans.writes:
        if name is not None and line is not None:  # (a scanned write has both)
            brought = rows * width - sum(finite[row:row + rows])
            # Where the model's own rows held NaN or inf, the write is not the cause.
            if brought and all(count == width for count in own[row:row + rows]):
                _due(name, f"at {brought} of its {rows * width} entries", line)
        row += rows


def _version(value: torch.Tensor) -> int:
    try:
        return value._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return -1


def _sum(tensor: torch.Tensor) -> torch.Tensor:
    # Any NaN or inf makes the sum NaN or inf; a sum of finite numbers is finite unless it overflows, which the
    # entry-by-entry count after it tells apart. float16 and bfloat16 are summed in float32 (their own range is
    # soon exceeded by a sum of activations).
    return tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 else tensor.sum()


def read_scans() -> None:
    """Read every started scan and queue a warning for each write that brought NaN or inf.

    One wait per device; where a write brought NaN or inf, one more, for the
    model's own sums of those writes alone.
    """
    global _HELD
    for start_held_back in BEFORE_READ:
        start_held_back()
    scans = _SCANS[:]
    del _SCANS[:len(scans)]
    _HELD = 0
    _read_row_scans()
    by_device: dict[torch.device, list[_Scan]] = {}
    for scan in scans:
        device = scan.total.device
        if device in by_device:
            by_device[device].append(scan)
        else:
            by_device[device] = [scan]
    for device, group in by_device.items():
        written = torch.stack([scan.total for scan in group]).isfinite().tolist()
        if all(written):
            continue
        poisoned = [scan for scan, finite in zip(group, written) if not finite]
        model_own = torch.stack([scan.total if scan.base is None else scan.base.to(device)
                                 for scan in poisoned]).isfinite().tolist()
        for scan, finite in zip(poisoned, model_own):
            # Where the model's own value held NaN or inf already, the write is not what poisons the run.
            if finite or scan.base is None:
                _queue(scan.name, scan.value, scan.version, scan.line)


def _read_row_scans(wait: bool = True) -> None:
    """Read the row scans whose counts are on the host, and, where `wait`, wait for the rest; warn where a write
    brought NaN or inf. The counts of every row scan read are looked at together, once."""
    global _ROW_WRITES
    ready, kept = [], []
    for record in _ROW_SCANS:
        copied = record.copied
        if copied is not None and not copied.query():
            if not wait:
                kept.append(record)
                continue
            copied.synchronize()
        ready.append(record)
    _ROW_SCANS[:] = kept
    _ROW_WRITES = sum(len(record.writes) for record in kept)
    groups: dict[tuple[int, torch.device], list[_RowScans]] = {}
    for record in ready:
        groups.setdefault((record.width, record.counts.device), []).append(record)
    for (width, _), group in groups.items():
        if bool(torch.cat([record.counts for record in group], dim=1)[0].eq(width).all()):
            continue  # every written entry finite
        for record in group:
            _warn_rows(record, record.counts.tolist())


def _queue(name: str, value: torch.Tensor, version: int, line: Line) -> None:
    """Queue the warning for `value`, written as `name` with NaN or inf; `version`, its version at the write."""
    numel = value.numel()
    if version != -1 and value._version != version:
        where = f"at some of its {numel} entries (the tensor was changed in place since, so how many is unknown)"
    else:
        count = int((~torch.isfinite(value)).sum())
        if not count:
            return  # the sum overflowed; every entry is finite
        where = f"at {count} of its {numel} entries"
    _due(name, where, line)


def _due(name: str, where: str, line: Line) -> None:
    """Queue the warning that `name` was written with NaN or inf `where` ("at 3 of its 8 entries")."""
    _DUE.append((f"{name} is written with NaN or inf {where}, where the model's values were finite: every "
                 f"later position that attends to them (and every value after them) becomes NaN. Write finite "
                 f"numbers unless that is what you mean to study.", line))


def warn_pending(raising: bool = True) -> None:
    """Read every started scan and warn for each write that brought NaN or inf, at the user's line of the write.

    With `raising` False a warning the filters turn into an error is dropped
    (an invoke that is already raising keeps its own error).
    """
    read_scans()
    due = _DUE[:]
    del _DUE[:len(due)]
    for message, line in due:
        module: dict[str, Any] = {"module": line.module} if line.module else {}
        try:
            # No registry: "default" shows the warning every time (a registry keeps only the first of a line).
            warnings.warn_explicit(message, RuntimeWarning, line.filename, line.lineno, **module, registry=None)
        except Warning:
            if raising:
                raise


def pending() -> int:
    """How many scans are started and not read yet (for tests)."""
    return len(_SCANS) + _ROW_WRITES


# The user's line: the innermost frame outside streamscope, nnsight, torch, vLLM and the standard library.

_PACKAGE = str(Path(__file__).parent)
_LIBRARIES = ("<", _PACKAGE, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"])
#: Whether a file is a library's (a trace body nnsight compiled, "<...>", has no file to show a line of). Keyed by
#: the file name, whose hash the string keeps, rather than by the code object, whose hash is made anew from its
#: names and constants at every look-up: a write-back from inside an engine walks through some 60 frames.
_IS_LIBRARY: dict[str, bool] = {}


def user_line(skip: int = 1) -> Line:
    """The user's line that called into streamscope, `skip` frames above the caller (the caller's own if none)."""
    caller = sys._getframe(skip + 1)
    frame: Optional[FrameType] = caller
    known = _IS_LIBRARY
    while frame is not None:
        filename = frame.f_code.co_filename
        try:
            if not known[filename]:
                break
        except KeyError:
            if not _learn(filename):
                break
        frame = frame.f_back
    frame = frame or caller
    return _new(Line, (frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__")))


def _learn(filename: str) -> bool:
    if len(_IS_LIBRARY) > 4096:  # every trace compiles a body of its own: forget them now and then
        _IS_LIBRARY.clear()
    library = _IS_LIBRARY[filename] = filename.startswith(_LIBRARIES)
    return library
