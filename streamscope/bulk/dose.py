"""The dose guard: how large a steer's edit is against the stream it edits, and what a dose past the limit does.

A steer's dose is its edit's size over ``||h||``, the steered value's mean row
norm at its block (`streamscope.bulk.spec.stream_norms`, `model.norms`). Past
`Steer.max_dose` the steer's `Steer.on_dose` decides: ``"refuse"`` (the
default, a `SteerError`), ``"clamp"`` (run at the limit) or ``"warn"`` (run as
given); an edit that would overflow is refused whatever it says.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

Steer = Any  # a `streamscope.bulk.spec.Steer` (not imported: spec imports this module)


class SteerError(ValueError, TypeError, IndexError):
    """A steer that cannot run: a bad field, a field its mode does not use, positions that do not fit a prompt,
    or an edit too large for the stream. A ValueError (also a TypeError and an IndexError, the types these
    refusals had before they shared one), raised before anything runs, on both engines and in a trace.

    `field` names the steer's field at fault (``"scale"``, ``"positions"``, ...), None where it is the whole steer:
    the server answers its 400 with it.
    """

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> Any:  # from a worker in another process, with its field
        return (type(self), (str(self), self.field))


def edit_size(steer: "Steer", norm: float) -> tuple[float, str]:
    """How large the steer's edit of a row is, given the stream's norm `norm` there, and the formula in words."""
    length = float(steer.vector.detach().float().norm())
    if steer.mode in ("add", "set"):
        return abs(float(steer.scale or 0.0)) * length, f"|scale| * |v| = {abs(float(steer.scale or 0.0)):g} * {length:.4g}"
    if steer.mode == "ablate":
        return abs(float(steer.scale or 0.0)) * norm, f"|scale| * ||h||, {abs(float(steer.scale or 0.0)):g} * {norm:.4g},"
    if steer.mode == "clamp":
        return abs(float(steer.projection or 0.0)), f"|projection| = {abs(float(steer.projection or 0.0)):g}"
    return (abs(float(steer.projection or 0.0)) * length,
            f"|projection| * |W_dec[feature]| = {abs(float(steer.projection or 0.0)):g} * {length:.4g}")


def dose_field(steer: "Steer") -> str:
    """The field that sets the size of `steer`'s edit: projection for a clamp, scale otherwise."""
    return "projection" if steer.mode in ("clamp", "sae_clamp") else "scale"


class DoseWarning(UserWarning):
    """A steer's dose passed its `Steer.max_dose` and it ran anyway: clamped to the limit, or as given."""


def check_dose(steer: "Steer", norm: Optional[float], dtype: torch.dtype, where: str, how: str) -> "Steer":
    """The steer to run: `steer` itself, or (``on_dose="clamp"``) a copy whose dose is its `Steer.max_dose`;
    `SteerError` where the edit overflows, or its dose ``edit / ||h||`` passes the limit and it refuses.

    `norm` is ``||h||``, the value's mean row norm at the steered block
    (None where it was not measured: only the overflow is checked); `where`
    names the value, `how` says how the norm was measured. The overflow
    bound is arithmetic: ``scale * v`` must be finite in the engine's
    `dtype`, and the edited row's squared norm, ``(||h|| + edit)^2``, finite
    in float32, where the norms that follow square it. A clamped steer is
    checked for overflow at its clamped size.
    """
    if steer.on_dose == "clamp":
        steer = _dose_limit(steer, norm, where, how)
        _check_overflow(steer, norm, dtype, where, how)
        return steer
    _check_overflow(steer, norm, dtype, where, how)
    return _dose_limit(steer, norm, where, how)


def _check_overflow(steer: "Steer", norm: Optional[float], dtype: torch.dtype, where: str, how: str) -> None:
    name = steer.described()
    size, formula = edit_size(steer, norm or 0.0)
    measured = f"||h|| = {norm:.4g} at {where} ({how})" if norm is not None else f"at {where}"
    multiple = steer.scale if steer.mode in ("add", "set") and steer.scale is not None else 1.0
    scaled = steer.vector.detach().float() * float(multiple)
    if not bool(torch.isfinite(scaled).all()) or \
            float(scaled.abs().max()) > torch.finfo(dtype).max or not math.isfinite(size):
        raise SteerError(f"{name}: scale * vector is not finite in {dtype} (the edit {formula}, {measured}): every "
                         f"steered row would be inf or NaN. Use a smaller scale.", dose_field(steer))
    square = (size + (norm or 0.0)) ** 2
    if not square < torch.finfo(torch.float32).max:
        raise SteerError(f"{name}: the edit {formula} = {size:.4g} overflows the next norm, which squares the row in "
                         f"float32 ({measured}). Use an edit a few times ||h|| at most.", dose_field(steer))


def _dose_limit(steer: "Steer", norm: Optional[float], where: str, how: str) -> "Steer":
    """`steer`, refused, warned about or clamped (`Steer.on_dose`) where its dose passes `Steer.max_dose`."""
    if norm is None or steer.max_dose is None:
        return steer
    import warnings
    from dataclasses import replace

    name = steer.described()
    size, formula = edit_size(steer, norm)
    dose = size / norm if norm > 0 else math.inf
    if not dose > steer.max_dose:
        return steer
    measured = f"||h|| = {norm:.4g} at {where} ({how})"
    stated = (f"dose {dose:.4g} = edit / ||h||, with the edit {formula} = {size:.4g} and {measured}; the limit is "
              f"max_dose={steer.max_dose:g}")
    if steer.on_dose == "refuse":
        raise SteerError(f"{name}: {stated}. Steering doses are usually up to 10-20: use a smaller scale (or "
                         f"projection), pass on_dose='clamp' to run it at the limit, or max_dose=None (or a larger "
                         f"one) to run it anyway.", dose_field(steer))
    if steer.on_dose == "warn":
        warnings.warn(f"{name}: {stated}; it runs as given (on_dose='warn').", DoseWarning, stacklevel=3)
        return steer
    number = dose_field(steer)
    if not math.isfinite(dose):
        raise SteerError(f"{name}: {stated}: a stream of norm 0 leaves no dose to clamp to. Steer another value or "
                         f"block.", number)
    clamped = float(getattr(steer, number)) * (steer.max_dose / dose)
    warnings.warn(f"{name}: {stated}; clamped to the limit: {number} {getattr(steer, number):g} -> {clamped:.6g} "
                  f"(x max_dose / dose, on_dose='clamp').", DoseWarning, stacklevel=3)
    return replace(steer, projection=clamped) if number == "projection" else replace(steer, scale=clamped)


__all__ = ["DoseWarning", "SteerError", "check_dose", "dose_field", "edit_size"]
