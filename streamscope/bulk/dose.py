"""The dose guard: how large a steer's edit is against the stream it edits, and what a dose past the limit does.

A steer's dose is its edit's size over ``||h||``, the steered value's mean row
norm at its block (`streamscope.bulk.spec.stream_norms`, `model.norms`). Past
`Steer.max_dose` the steer's `Steer.on_dose` decides: ``"refuse"`` (the
default, a `SteerError`), ``"clamp"`` (run at the limit) or ``"warn"`` (run as
given); an edit that would overflow is refused whatever it says.

A vector may carry the stream norm it was made against (``origin["stream_norm"]``
of its steer, `carried_entry`: a `streamscope.directions.Direction` records it
from the prompts it was fit on; a server keeps it beside a stored vector).
Where a steer's vector carries a norm at the steer's own value and block, the
dose check takes it (and measures nothing there for it), whatever else the
model or server has measured, so the check never depends on what ran before;
its message says which norm it used.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

Steer = Any  # a `streamscope.bulk.spec.Steer` (not imported: spec imports this module)
Site = tuple[str, Optional[int]]  # a value and its block (None at the root)


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
    checked for overflow at its clamped size. A clamped or warned dose is said
    by a `DoseWarning`.
    """
    allowed, message = judge_dose(steer, norm, dtype, where, how)
    if message is not None:
        warnings.warn(message, DoseWarning, stacklevel=2)
    return allowed


def judge_dose(steer: "Steer", norm: Optional[float], dtype: torch.dtype, where: str,
               how: str) -> tuple["Steer", Optional[str]]:
    """`check_dose` without the warning: the steer to run and what its `DoseWarning` would say (None where the dose
    is within the limit). The server sends the message to its caller instead of warning in its own process."""
    if steer.on_dose == "clamp":
        steer, message = _dose_limit(steer, norm, where, how)
        _check_overflow(steer, norm, dtype, where, how)
        return steer, message
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


def _dose_limit(steer: "Steer", norm: Optional[float], where: str, how: str) -> tuple["Steer", Optional[str]]:
    """`steer`, refused, warned about or clamped (`Steer.on_dose`) where its dose passes `Steer.max_dose`, and
    the warning's message."""
    if norm is None or steer.max_dose is None:
        return steer, None

    name = steer.described()
    size, formula = edit_size(steer, norm)
    dose = size / norm if norm > 0 else math.inf
    if not dose > steer.max_dose:
        return steer, None
    measured = f"||h|| = {norm:.4g} at {where} ({how})"
    stated = (f"dose {dose:.4g} = edit / ||h||, with the edit {formula} = {size:.4g} and {measured}; the limit is "
              f"max_dose={steer.max_dose:g}")
    if steer.on_dose == "refuse":
        raise SteerError(f"{name}: {stated}. Steering doses are usually up to 10-20: use a smaller scale (or "
                         f"projection), pass on_dose='clamp' to run it at the limit, or max_dose=None (or a larger "
                         f"one) to run it anyway.", dose_field(steer))
    if steer.on_dose == "warn":
        return steer, f"{name}: {stated}; it runs as given (on_dose='warn')."
    number = dose_field(steer)
    if not math.isfinite(dose):
        raise SteerError(f"{name}: {stated}: a stream of norm 0 leaves no dose to clamp to. Steer another value or "
                         f"block.", number)
    clamped = float(getattr(steer, number)) * (steer.max_dose / dose)
    message = (f"{name}: {stated}; clamped to the limit: {number} {getattr(steer, number):g} -> {clamped:.6g} "
               f"(x max_dose / dose, on_dose='clamp').")
    return (replace(steer, projection=clamped) if number == "projection" else replace(steer, scale=clamped)), message


# ---------------------------------------------------------------- a norm carried with the vector

#: The key of `Steer.origin` under which a steer carries the stream norm its vector was made against.
CARRIED = "stream_norm"
#: How the dose check says it measured ``||h||`` itself (`streamscope.bulk.spec.stream_norms`).
MEASURED = "measured by streamscope on its calibration text, positions after the first"


def carried_entry(value: str, layer: Optional[int], norm: float) -> dict[str, Any]:
    """A carried stream norm as data: ``{"value", "layer", "norm"}``, ``||h||`` of `value` at block `layer` as
    `model.norms` measures it (a `Direction`'s steer puts it in ``origin["stream_norm"]``; a stored vector on a
    server keeps it beside the vector)."""
    return {"value": value, "layer": layer, "norm": float(norm)}


def check_carried(entry: Any, where: str) -> dict[str, Any]:
    """`entry` if it is a carried norm's data (`carried_entry`), else a `SteerError` naming what is wrong."""
    fields = {"value", "layer", "norm"}
    if not isinstance(entry, dict) or set(entry) != fields:
        raise SteerError(f"{where}: a carried stream norm is {{'value': str, 'layer': int or None, 'norm': number}} "
                         f"(what model.norms measured where the vector was made), not {entry!r}.", "origin")
    norm, layer = entry["norm"], entry["layer"]
    if not isinstance(entry["value"], str) or (layer is not None and (isinstance(layer, bool)
                                                                      or not isinstance(layer, int))):
        raise SteerError(f"{where}: a carried stream norm names its value (a string) and block (an int, or None "
                         f"at the root), not {entry['value']!r} and {layer!r}.", "origin")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 < norm < math.inf:
        raise SteerError(f"{where}: a carried stream norm is a positive finite number, not {norm!r}: measure it "
                         f"with model.norms(prompts), or leave it out.", "origin")
    return entry


def carried_norm(steer: "Steer", layer: Optional[int], blocks: int) -> Optional[float]:
    """The stream norm `steer`'s vector carries (``origin["stream_norm"]``) where it names the steer's own value
    and block (`layer`, counted from the start of `blocks`); None where it carries none for them."""
    entry = (steer.origin or {}).get(CARRIED) if isinstance(steer.origin, dict) else None
    if entry is None:
        return None
    entry = check_carried(entry, steer.described())
    there = entry["layer"] % blocks if isinstance(entry["layer"], int) and -blocks <= entry["layer"] < blocks \
        else entry["layer"]
    return float(entry["norm"]) if (entry["value"], there) == (steer.value, layer) else None


def carried_how(source: str) -> str:
    """How the dose check says it took a carried norm: `source` carried it, and the model had none measured."""
    return (f"carried by {source}, as model.norms measured it on the prompts the vector was made from; a "
            f"vector's own norm comes before any the model measured")


def check_bulk_doses(model: Any, steers: Sequence["Steer"], dtype: torch.dtype,
                     measure: Callable[[list[Site]], Any], measured: Callable[[], dict[Site, float]]) -> list["Steer"]:
    """`check_dose` for each steer of a bulk run: ``||h||`` measured by streamscope once per model, value and block
    (`measure` measures sites, `streamscope.bulk.spec.stream_norms`; `measured` gives those measured so far),
    except for a steer whose vector carries its own norm there (``origin["stream_norm"]``): that one is its
    check's, whatever else was measured, so a steer's check never depends on what ran before. The steers to run."""
    blocks = len(model.layers)
    sites = [(steer.value, None if steer.layer is None else steer.layer % blocks) for steer in steers]
    carried = [carried_norm(steer, site[1], blocks) for steer, site in zip(steers, sites)]
    wanted = [site for site, norm in zip(sites, carried) if norm is None]
    if wanted:
        measure(wanted)
    known = measured()
    allowed = []
    for steer, site, norm in zip(steers, sites, carried):
        where = steer.value if site[1] is None else f"layers[{site[1]}].{steer.value}"
        if norm is not None:
            allowed.append(check_dose(steer, norm, dtype, where, carried_how("the steer's vector (origin)")))
        else:
            allowed.append(check_dose(steer, known[site], dtype, where, MEASURED))
    return allowed


__all__ = ["DoseWarning", "SteerError", "check_dose", "judge_dose", "dose_field", "edit_size", "carried_entry",
           "check_carried", "carried_norm", "check_bulk_doses", "CARRIED", "MEASURED"]
