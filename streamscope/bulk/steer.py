"""A steer: one value of one block edited at chosen positions (add, set, ablate, clamp), and its checks.

The `Steer` record is checked when built (every field that needs no model)
and again against a model before it runs (`check_steer`: its vector, site,
prompts and positions); it runs in a trace (`Steer.apply`, `apply_steers`)
and on the bulk path, whose engines apply `Steer.operation` at the steer's
`Site`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, cast

import torch

from ..blocks.head_results import HEAD_RESULTS, STEER_REFUSAL
from ..blocks.sublayers import NEURONS
from ..display import shape
from .conditions import COMPUTE_ORDER, Condition, check_condition
from .dose import SteerError, check_dose
from .operations import DIRECTIONAL, MODES, ClampFeature, Operation, check_clamp, on_device, per_tensor, prepare
from .positions import SKIP_FIRST, Positions, check_rule, prompt_positions
from .schema import (DOSE_ACTIONS, MAX_DOSE, NULL_IS_LEFT_OUT, STEER_FIELDS, STEER_REQUIRED, SteerJSON,
                     positions_from_json, rule_json, validate_field)
from .sites import HEAD_RESULTS_VALUE, Site, block_index, host_and_name, locate

#: Which of a steer's numbers each mode uses (the others must be left out), and their defaults.
MODE_USES: dict[str, dict[str, Any]] = {
    "add": {"scale": 1.0}, "set": {"scale": 1.0}, "ablate": {"scale": 1.0},
    "clamp": {"projection": 0.0}, "sae_clamp": {"projection": 0.0},
}
#: What each number means in each mode that uses it, for the refusal of one given to a mode that does not.
_MEANING = {"scale": "the multiple of the vector that add and set apply, or the fraction ablate removes",
            "projection": "the projection that clamp (and sae_clamp, the feature's value) sets"}
#: The fields a steer's data (`Steer.to_dict`) leaves out: an ``sae_clamp`` steer's SAE is weights, not data.
_NOT_DATA = ("sae",)


#: Whether a vector is finite, remembered while it holds the same numbers: a server checks a stored vector each time
#: a request steers by its name, three times a request.
_all_finite = per_tensor(lambda vector: bool(torch.isfinite(vector).all()))


@dataclass
class Steer:
    """Edit one value of one block at chosen positions: add, set, ablate or clamp a direction.

    A plain record (every field a number, a string, a list or the vector), so
    a steer travels to a worker or as JSON unchanged. The same steer runs on
    the bulk path (``model.generate(steer=[...])``, ``model.harvest``) and in
    a trace (`apply`). What each mode does to a row ``x`` (with ``v`` the
    vector and ``d = v / |v|``) is in `streamscope.bulk.operations`.

    Every field is checked when the steer is built (`SteerError`, a
    ValueError, naming the field and the fix); the vector's width, the block
    and the positions against each prompt when it runs, before the engine
    sees it.

    **The first prompt token is skipped unless `positions` says otherwise.**
    The default, ``positions="all_but_first"``, edits every prompt position
    but position 0, in every mode: in trained models that token is an
    attention sink whose stream is far larger than the others' (norm about
    24,000, projection about -2,000 on SmolLM2-135M), and an edit there
    (a clamp, an ablation, a set) changes the run through the sink rather
    than through the direction. ``positions="all"`` edits it too; indices or
    a slice edit exactly what they name.

    Args:
        value: A block's value (``"layer_output"``, ``"mlp.mlp_output"``, ...)
            or a root value (``"token_embeddings"``), as `model.harvest` names them.
        layer: The block's index (negative counts from the end); None for a root value.
        vector: ``[hidden_size]``: the vector to add (or set), or the direction
            to ablate or clamp (any length: its unit vector is used).
        scale: ``add``/``set``: the vector is multiplied by it once, before the
            run. ``ablate``: the fraction of the component removed (1: all of it).
            Default 1 for those modes; clamp and sae_clamp refuse it.
        positions: Which prompt positions: ``"all_but_first"`` (the default:
            every one but the first token, see above), ``"all"``, ``"last"``,
            ``"none"`` (generated tokens only), a slice, or indices (negative
            from the prompt's end).
        mode: ``"add"`` (``x + scale * v``), ``"set"`` (``scale * v``),
            ``"ablate"`` (``x - scale * (x . d) d``), ``"clamp"``
            (``x + (projection - x . d) d``), or ``"sae_clamp"``: SAE
            feature `feature` clamped to `projection` with the SAE's error
            term kept (`streamscope.sae.SAE.clamp` builds it).
        generated: Whether generated tokens are steered too.
        prompts: The indices of the prompts this steer applies to; None for all.
        projection: ``clamp``: the projection on ``d`` that every edited row
            gets (default 0); ``sae_clamp``: the feature's value. The other modes refuse it.
        norm_match: After the edit, rescale each edited row to the norm it had
            before (not with ``sae_clamp``).
        from_step: The first generated token steered (0: every one; ``k``: from
            the ``k``-th generated token on), where `generated` is true.
        origin: The shape of the model the vector was made on (``model_type``,
            ``hidden_size``, ``num_layers``, ``vocab_size``; a `Direction`'s
            steer sets it): a run on a model of another shape is refused. Its
            ``"stream_norm"`` (``{"value", "layer", "norm"}``, a `Direction`'s
            steer sets it) is the norm the vector was made against, which the
            dose check uses over any norm the model measured.
        sae, feature: ``sae_clamp``'s SAE (`streamscope.sae.SAE`) and feature index.
        max_dose: The largest dose allowed, ``|edit| / ||h||``: the edit's size
            (``|scale| * |v|`` for add and set, ``|scale| * ||h||`` for ablate,
            ``|projection|`` for clamp, ``|projection| * |v|`` for sae_clamp) over
            ``||h||``, the value's mean row norm at that block, measured by
            streamscope on a short calibration text (`stream_norms`, once per
            model, value and block; `model.norms()` gives them per block).
            Default `MAX_DOSE` (100); None lifts the
            limit. An edit that would overflow (``scale * v`` not finite in the
            engine's dtype, or the edited row's squared norm not finite in
            float32) is refused whatever this says.
        on_dose: What a dose past `max_dose` does: ``"refuse"`` (the default:
            `SteerError` before anything runs), ``"clamp"`` (the edit is made
            smaller to the limit: `scale`, or `projection` for clamp and
            sae_clamp, is multiplied by ``max_dose / dose``, so the dose is
            exactly `max_dose`, and a `DoseWarning` names the dose, the limit
            and the number used) or ``"warn"`` (a `DoseWarning` naming the
            dose and the limit, and the steer runs as given).
        condition: A `streamscope.Condition`: the steer edits only the rows (or
            requests) where the condition's projection passes its threshold,
            decided on the engine at every step (`streamscope.bulk.conditions`).
            On the bulk path and the server; a trace refuses it.

    A field left out takes its mode's default; a field the mode does not use
    is refused rather than ignored (``Steer(..., mode="clamp", scale=5)``
    would clamp to 0). Once built, the fields a mode does not use are None.
    """

    value: str
    layer: Optional[int]
    vector: torch.Tensor
    scale: Optional[float] = None
    positions: Positions = SKIP_FIRST
    mode: str = "add"
    generated: bool = True
    prompts: Optional[Sequence[int]] = None
    projection: Optional[float] = None
    norm_match: bool = False
    from_step: int = 0
    origin: Optional[dict] = None
    sae: Optional[Any] = None
    feature: Optional[int] = None
    max_dose: Optional[float] = MAX_DOSE
    on_dose: str = "refuse"
    condition: Optional[Any] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field that needs no model, and fill in the mode's defaults for the numbers left out.

        Raises `SteerError` naming the field, the mode and the fix. Runs when
        the steer is built and again before it runs (a field may have been
        changed in between).
        """
        name = self.described()
        self._check_mode(name)
        self._check_reach(name)
        self._check_dose_and_condition(name)
        self._check_vector_field(name)

    def _check_mode(self, name: str) -> None:
        """The mode, the numbers it uses (filled with its defaults where left out) and the SAE fields."""
        if self.mode not in MODES:
            raise SteerError(f"{name}: mode {self.mode!r} is not a steer operation: use one of "
                             f"{', '.join(repr(mode) for mode in MODES)}.", "mode")
        uses = MODE_USES[self.mode]
        for number in ("scale", "projection"):
            given = getattr(self, number)
            if number not in uses:
                if given is not None:
                    users = [mode for mode, used in MODE_USES.items() if number in used]
                    fix = ("pass projection=... to set the projection" if number == "scale"
                           else "pass scale=... to scale the edit")
                    raise SteerError(f"{name}: mode {self.mode!r} does not use {number} ({number} is "
                                     f"{_MEANING[number]}; modes {', '.join(users)}): leave {number} out and "
                                     f"{fix}, or choose a mode that uses it.", number)
                continue
            if given is None:
                setattr(self, number, uses[number])
                continue
            if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isfinite(given):
                raise SteerError(f"{name}: {number}={given!r} must be a finite number.", number)
        if self.mode != "sae_clamp":
            for field_name in ("sae", "feature"):
                if getattr(self, field_name) is not None:
                    raise SteerError(f"{name}: {field_name} is for mode 'sae_clamp' (an SAE's feature clamped in "
                                     f"the loop): leave it out, or build the clamp with sae.clamp(feature, value).",
                                     field_name)
        elif self.norm_match:
            raise SteerError(f"{name}: mode 'sae_clamp' keeps the SAE's error term and does not norm-match: "
                             f"leave norm_match out.", "norm_match")

    def _check_declared(self, name: str, field_name: str) -> None:
        """Refuse a field whose value its declaration (`streamscope.bulk.schema.SteerJSON`: its type and range)
        does not take, naming the field and what it takes."""
        given = getattr(self, field_name)
        wrong = validate_field(SteerJSON, field_name, given)
        if wrong is not None:
            raise SteerError(f"{name}: {field_name}={given!r}: {wrong}", field_name)

    def _check_reach(self, name: str) -> None:
        """What the steer reaches: generated tokens, the first one steered, the positions and the prompts."""
        for field_name in ("generated", "norm_match", "from_step"):
            self._check_declared(name, field_name)
        if self.from_step and not self.generated:
            raise SteerError(f"{name}: from_step={self.from_step} picks the first generated token steered, and "
                             f"generated=False steers none: leave from_step out, or set generated=True.", "from_step")
        check_rule(self.positions, name)
        if self.positions == "none" and not self.generated:
            raise SteerError(f"{name}: positions='none' with generated=False edits nothing: steer some prompt "
                             f"positions, or generated tokens.", "positions")
        if self.prompts is not None:
            if isinstance(self.prompts, (str, bytes)) or not isinstance(self.prompts, (list, tuple, range)) or \
                    not all(isinstance(index, int) and not isinstance(index, bool) for index in self.prompts):
                raise SteerError(f"{name}: prompts={self.prompts!r} must be a list of prompt indices, or None "
                                 f"for every prompt.", "prompts")

    def _check_dose_and_condition(self, name: str) -> None:
        """The dose limit, what a dose past it does, and the condition (a dict becomes a `Condition`)."""
        for field_name in ("max_dose", "on_dose"):
            self._check_declared(name, field_name)
        if self.condition is not None:
            if isinstance(self.condition, dict):
                self.condition = Condition.from_dict(self.condition)
            if not isinstance(self.condition, Condition):
                raise SteerError(f"{name}: condition takes a streamscope.Condition (or its to_dict()), not a "
                                 f"{type(self.condition).__name__}.", "condition")
            self.condition.validate()

    def _check_vector_field(self, name: str) -> None:
        """The vector: one finite floating-point tensor (its width is checked against a model by `check_vector`)."""
        vector = self.vector
        if not isinstance(vector, torch.Tensor) and hasattr(vector, "steer") and hasattr(vector, "unit"):
            raise SteerError(f"{name} was given a Direction as its vector: build the steer with "
                             f"direction.steer(mode=..., scale=...), which also checks the model it was made on.",
                             "vector")
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1:
            shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
            raise SteerError(f"{name} has a vector of shape {shape}: it must be one [hidden_size] tensor.", "vector")
        if vector.dtype == torch.bool or vector.is_complex() or not vector.is_floating_point():
            raise SteerError(f"{name} has a {vector.dtype} vector: give a floating-point tensor (vector.float()).",
                             "vector")
        if vector.numel() and not _all_finite(vector):
            raise SteerError(f"{name} has NaN or inf in its vector: every steered row would become NaN. "
                             f"Give a finite vector (torch.nan_to_num, or rebuild the direction).", "vector")

    def described(self) -> str:
        """The steer in a few words, for its error messages."""
        return f"Steer({self.value!r}, layer={self.layer}, mode={self.mode!r})"

    def to_dict(self) -> dict[str, Any]:
        """The steer as JSON-ready data (the vector as a list of floats); `from_dict` reads it back.

        An ``sae_clamp`` steer holds its SAE, which is weights, not data: it is refused here.
        """
        if self.sae is not None:
            raise ValueError("an sae_clamp steer holds its SAE's weights: send the SAE by name, not as data.")
        data = {name: getattr(self, name) for name in STEER_FIELDS if name not in _NOT_DATA}
        data.update(condition=None if self.condition is None else self.condition.to_dict(),
                    vector=[float(number) for number in self.vector.detach().float().cpu().tolist()],
                    positions=self.positions if isinstance(self.positions, str) else rule_json(self.positions),
                    prompts=None if self.prompts is None else list(self.prompts))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Steer":
        """A steer from `to_dict`'s data; unknown keys are refused, naming the ones there are.

        A null number (scale, projection, feature) is a field left out: its mode's default, where the mode uses it.
        """
        known = set(STEER_FIELDS) - set(_NOT_DATA)
        unknown = sorted(set(data) - known)
        if unknown:
            raise SteerError(f"a steer has no {', '.join(unknown)}: its fields are {', '.join(sorted(known))}.")
        fields = {key: item for key, item in data.items() if item is not None or key not in NULL_IS_LEFT_OUT}
        for required in STEER_REQUIRED:
            if required not in fields:
                raise SteerError(f"a steer needs {required!r}: its fields are {', '.join(sorted(known))}.")
        positions = fields.get("positions", SKIP_FIRST)
        if isinstance(positions, dict):
            try:
                fields["positions"] = positions_from_json(positions)
            except ValueError as error:
                raise SteerError(f"a steer's positions: {error}", "positions") from None
        try:
            fields["vector"] = torch.tensor(fields["vector"], dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise SteerError(f"a steer's vector is a list of numbers: {error}") from None
        fields.setdefault("layer", None)
        return cls(**fields)

    def __repr__(self) -> str:
        where = f"layers[{self.layer}].{self.value}" if self.layer is not None else self.value
        prompts = "" if self.prompts is None else f", prompts {list(self.prompts)}"
        amount = f" x {self.scale:g}" if self.scale is not None else f" to {self.projection:g}"
        condition = "" if self.condition is None else f", where the {self.condition.described()}"
        dose = "" if self.on_dose == "refuse" else f", on_dose={self.on_dose!r}"
        return (f"Steer({self.mode} {shape(self.vector)}{amount} at {where}, positions "
                f"{self.positions!r}{', prompt only' if not self.generated else ''}{prompts}{dose}{condition})")

    def delta(self, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """The vector the run adds (or sets): ``scale * vector`` in the engine's dtype, on its device."""
        scale = 1.0 if self.scale is None else self.scale
        return (on_device(self.vector, device) * scale).to(dtype)

    def operation(self, dtype: torch.dtype, device: Any) -> Operation:
        """What the steer does to the rows it edits, with its vectors in `dtype` on `device`."""
        if self.mode == "sae_clamp":
            return cast(Operation, ClampFeature(cast(Any, self.sae), cast(int, self.feature), self.projection or 0.0,
                                                dtype, device))
        return prepare(self.mode, self.vector, 1.0 if self.scale is None else self.scale, self.projection or 0.0,
                       self.norm_match, dtype, device)

    def steers_generated(self, step: int) -> bool:
        """Whether the `step`-th generated token (0 for the first) is edited."""
        return bool(self.generated) and step >= self.from_step

    def apply(self, model: Any, step: int = 0) -> None:
        """Apply the steer inside a trace, at one step of it (one invoke's value, ``[1, tokens, hidden]``).

        `step` 0 is the prompt: its `positions` are edited. Step ``k >= 1``
        is a decode step, whose one row is the ``(k - 1)``-th generated
        token: edited where `generated` holds from `from_step` on. So a
        trace steers as ``model.generate(steer=[...])`` does with::

            for step in tracer.iter[:]:
                steer.apply(model, step)

        The edit goes through the value's write checks (shape, dtype, NaN).
        Its dose is checked against the stream it edits, measured here on the
        rows of this step (after the first prompt position): a trace has the
        stream in hand.
        """
        self.validate()
        if self.condition is not None:
            raise SteerError(f"{self.described()}: a conditional steer is decided on the engine by the bulk path: "
                             f"run it with model.generate(prompts, steer=[...]) (or model.harvest(..., steer=...)), "
                             f"or test the condition in the trace yourself.", "condition")
        check_vector(self, model.hidden_size)
        check_origin(self, model)
        if self.mode == "sae_clamp":
            check_clamp(self, model)
        host, name = host_and_name(model, self.value, None if self.layer is None
                                   else block_index(model, self.layer, self.value))
        current = getattr(host, name)
        if step == 0:
            rows = steer_positions(self, current.shape[1], 0)
        else:
            rows = list(range(current.shape[1])) if self.steers_generated(step - 1) else []
        if not rows:
            return
        measured = current[0, 1:] if step == 0 and current.shape[1] > 1 else current[0]
        norm = float(measured.detach().float().norm(dim=-1).mean())
        allowed = check_dose(self, norm, current.dtype, f"{host.where()}.{name}", "measured on this step's rows")
        operation = allowed.operation(current.dtype, current.device)
        if rows == list(range(current.shape[1])):
            current[:, :] = operation(current[:, :])
        else:
            current[:, rows] = operation(current[:, rows])


def apply_steers(model: Any, steers: Sequence[Steer], step: int = 0) -> None:
    """Apply several steers inside a trace at one step, in the order the model computes their values.

    A trace reads values in the model's order; this sorts the steers by block
    and by value (a root's token embeddings first, its final norm last) and
    applies each (`Steer.apply`). Steers at the same value apply in the
    order given, as on the bulk path.
    """
    def order(steer: Steer) -> tuple[int, int]:
        if steer.value == "token_embeddings":
            return (-1, 0)
        if steer.value == "final_norm_output":
            return (len(model.layers), 0)
        layer = block_index(model, steer.layer, steer.value) if steer.layer is not None else 0
        rank = COMPUTE_ORDER.index(steer.value) if steer.value in COMPUTE_ORDER else len(COMPUTE_ORDER)
        return (layer, rank)

    for steer in sorted(steers, key=order):
        steer.apply(model, step)


def steer_positions(steer: Steer, length: int, prompt: int) -> list[int]:
    """The prompt positions `steer` edits in prompt `prompt` of `length` tokens; `SteerError` where they do not fit."""
    try:
        return prompt_positions(steer.positions, length, prompt)
    except (ValueError, TypeError, IndexError) as error:
        raise SteerError(f"{steer.described()}: {str(error).removeprefix('positions: ')} Give positions that fit "
                         f"the prompt (negative indices count from its end).", "positions") from None


def check_vector(steer: Steer, width: int) -> None:
    """Refuse a steer whose vector, mode or settings cannot run, naming the steer and the fix (`SteerError`)."""
    steer.validate()
    name = steer.described()
    vector = steer.vector
    if tuple(vector.shape) != (width,):
        raise SteerError(f"{name} has a vector of shape {tuple(vector.shape)}: it must be [hidden_size] = ({width},).",
                         "vector")
    if steer.mode in DIRECTIONAL and not bool(vector.norm() > 0):
        raise SteerError(f"{name}: the vector is all zeros, so it has no direction to {steer.mode} along. "
                         f"Give the direction's vector.", "vector")


def check_origin(steer: Steer, model: Any) -> None:
    """Refuse a steer whose vector was made on a model of another shape (`Steer.origin`), with the fix."""
    if not steer.origin:
        return
    here = {"model_type": model.config.model_type, "hidden_size": model.hidden_size,
            "num_layers": model.num_layers, "vocab_size": model.vocab_size}
    different = [f"{key} {steer.origin[key]!r} there, {here[key]!r} here" for key in here
                 if key in steer.origin and steer.origin[key] != here[key]]
    if different:
        raise SteerError(f"Steer({steer.value!r}, layer={steer.layer}): its vector was made on another model "
                         f"({'; '.join(different)}). Find the direction on this model "
                         f"(streamscope.directions.find), or steer the model it was made on.")


def check_steer(model: Any, steer: Steer, prompts: int, lengths: Optional[Sequence[int]] = None) -> Site:
    """The steer's `Site`, after checking its fields, vector, site, prompts and (given each prompt's token count,
    `lengths`) its positions on every prompt it steers; a refusal is a `SteerError` naming the steer and the fix
    (`Unavailable` where the family does not serve the value)."""
    if not isinstance(steer, Steer):
        raise SteerError(f"steer takes streamscope.Steer objects, not a {type(steer).__name__}.")
    steer.validate()
    if steer.value in (HEAD_RESULTS, HEAD_RESULTS_VALUE):
        raise SteerError(STEER_REFUSAL.format(name=HEAD_RESULTS_VALUE))
    try:
        site = locate(model, steer.value, steer.layer)
    except SteerError:
        raise
    except (ValueError, TypeError, IndexError) as error:
        raise SteerError(f"{steer.described()}: {error}") from None
    if steer.value.split(".")[-1] in NEURONS:
        raise SteerError(f"Steer({steer.value!r}): a steer's vector is hidden_size wide, the neurons "
                         f"intermediate_size: edit them in a trace (model.layers[{steer.layer}].{steer.value}"
                         f"[:, -1] += vector), or steer mlp_output with the vector they write (vector @ W_out).")
    check_vector(steer, model.hidden_size)
    check_origin(steer, model)
    if steer.mode == "sae_clamp":
        try:
            check_clamp(steer, model)
        except (ValueError, TypeError, IndexError) as error:
            raise SteerError(str(error)) from None
    if steer.condition is not None:
        try:
            check_condition(model, steer)
            locate(model, steer.condition.value, steer.condition.layer)
        except (ValueError, TypeError, IndexError) as error:
            raise SteerError(f"{steer.described()}: condition: {error}", "condition") from None
    if steer.prompts is not None:
        for index in steer.prompts:
            if not 0 <= index < prompts:
                raise SteerError(f"{steer.described()}: prompts has {index}, out of range for {prompts} prompts "
                                 f"(0-{prompts - 1}).", "prompts")
    if lengths is not None:
        for index in range(len(lengths)) if steer.prompts is None else steer.prompts:
            steer_positions(steer, lengths[index], index)
    return site


def condition_sites(model: Any, steers: Sequence[Steer]) -> list[Site]:
    """The `Site` each conditional steer of `steers` reads its condition at (an engine's tap check)."""
    return [locate(model, steer.condition.value, steer.condition.layer) for steer in steers
            if steer.condition is not None]


__all__ = ["DOSE_ACTIONS", "MAX_DOSE", "MODE_USES", "Steer", "apply_steers", "check_origin", "check_steer",
           "check_vector", "condition_sites", "steer_positions"]
