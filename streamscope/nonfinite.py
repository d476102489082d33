"""The NaN/inf scan of a write, read from the device in batches rather than once per write.

A write that brings NaN or inf into finite values warns, naming the value
(`streamscope.values.check_write`). The scan is one reduction of the written
tensor and one of the model's own value there, both left on the device: a
trace that writes at every step of a generation would otherwise wait for the
device at every write. The sums are read together, with one wait, when an
invoke's code ends (`warn_pending`), or sooner once the writes they hold
reach `HOLD_BYTES`. On the host, where reading a number waits for nothing,
they are read at the write (`READ_ON_THE_HOST`); the warnings are given when the
invoke's code ends either way. A warning points at the user's line on the stack when the
write is made (an edit that goes back to the model from inside the engine,
with no frame of the user's on the stack, points at streamscope's own).
"""

from __future__ import annotations

import math
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

#: How much written data the unread scans may keep alive (each keeps its tensor, to count its NaN or inf entries
#: should its sum not be finite) before they are read: a bound on the memory a long trace's writes hold.
HOLD_BYTES = 64 << 20
#: How many unread scans there may be before they are read, whatever their size.
HOLD_COUNT = 4096
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
    base: Optional[torch.Tensor]  # the sum of the model's own value there, or None when there is none to compare
    value: torch.Tensor
    version: int  # value's version counter at the write: an in-place change since makes its count unknown
    line: Line


_SCANS: list[_Scan] = []
_HELD = [0]
#: Warnings whose scans are read, due at the end of the invoke: (message, line).
_DUE: list[tuple[str, Line]] = []


def scan_write(name: str, value: torch.Tensor, current: Optional[torch.Tensor]) -> None:
    """Start the NaN/inf scan of `value`, written as `name` over `current` (the model's own value, if any)."""
    # (inline rather than `_sum`: a trace's steer writes at every step, and every call there counts)
    total = value.sum(dtype=torch.float32) if value.element_size() < 4 else value.sum()
    compared = current is not None and current.shape == value.shape
    if READ_ON_THE_HOST and total.is_cpu:
        # Reading a host number waits for nothing: read it now, and the model's own sum only where it matters.
        if not math.isfinite(total.item()) and (not compared or math.isfinite(_sum(current).item())):
            _queue(name, value, _version(value), user_line())
        return
    base = _sum(current) if compared else None
    if base is not None and base.device != total.device:  # a host tensor written into a device's value, say
        base = base.to(total.device)
    _SCANS.append(_Scan(name, total, base, value, _version(value), user_line()))
    _HELD[0] += value.numel() * value.element_size()
    if _HELD[0] > HOLD_BYTES or len(_SCANS) > HOLD_COUNT:
        read_scans()


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
    """Read every started scan (one wait per device) and queue a warning for each write that brought NaN or inf."""
    scans = _SCANS[:]
    del _SCANS[:len(scans)]
    _HELD[0] = 0
    by_device: dict[torch.device, list[_Scan]] = {}
    for scan in scans:
        by_device.setdefault(scan.total.device, []).append(scan)
    for group in by_device.values():
        sums = [sum_ for scan in group for sum_ in (scan.total, scan.total if scan.base is None else scan.base)]
        finite = torch.stack(sums).isfinite().tolist()
        for index, scan in enumerate(group):
            written, model_own = finite[2 * index], finite[2 * index + 1]
            # Where the model's own value held NaN or inf already, the write is not what poisons the run.
            if not written and (model_own or scan.base is None):
                _queue(scan.name, scan.value, scan.version, scan.line)


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
        try:
            # No registry: "default" shows the warning every time (a registry keeps only the first of a line).
            warnings.warn_explicit(message, RuntimeWarning, line.filename, line.lineno,
                                   **({"module": line.module} if line.module else {}), registry=None)
        except Warning:
            if raising:
                raise


def pending() -> int:
    """How many scans are started and not read yet (for tests)."""
    return len(_SCANS)


# The user's line: the innermost frame outside streamscope, nnsight, torch, vLLM and the standard library.

_PACKAGE = str(Path(__file__).parent)
_LIBRARIES = ("<", _PACKAGE, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"])
#: Whether a code object is a library's (a trace body nnsight compiled, "<...>", has no file to show a line of).
_IS_LIBRARY: dict[Any, bool] = {}


def user_line(skip: int = 1) -> Line:
    """The user's line that called into streamscope, `skip` frames above the caller (the caller's own if none)."""
    caller = sys._getframe(skip + 1)
    frame: Any = caller
    while frame is not None:
        code = frame.f_code
        library = _IS_LIBRARY.get(code)
        if library is None:
            if len(_IS_LIBRARY) > 4096:  # every trace compiles a body of its own: forget them now and then
                _IS_LIBRARY.clear()
            library = _IS_LIBRARY[code] = code.co_filename.startswith(_LIBRARIES)
        if not library:
            break
        frame = frame.f_back
    frame = frame or caller
    return Line(frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__"))
