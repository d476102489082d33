"""What a bulk run asks for: the values to harvest, the steers to apply, the positions, checked before anything runs.

A bulk request names values the way a trace does (``"layer_output"``,
``"self_attn.attention_output"``) and blocks by index. Each name is resolved
here, once, on the engine's own envoy tree, to a `Site`: the module whose call
holds the value and the served value's descriptor, so the bulk path reads and
writes exactly what the trace's envoys read and write (the fused halves'
sum on vLLM, Granite's multiplier, a parallel block's relocated stream).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch

from .. import nnsight_seam as seam
from ..blocks import BOUNDARIES, CONTRIBUTIONS, SHORT_CONTRIBUTIONS
from ..blocks.head_results import HEAD_RESULTS, STEER_REFUSAL
from ..blocks.sublayers import NEURONS
from ..errors import Unavailable
from ..families.spec import ROOT_STREAMS
from .operations import DIRECTIONAL, MODES, ClampFeature, Operation, check_clamp, prepare
from .conditions import COMPUTE_ORDER, Condition, check_condition
from .dose import DoseWarning, SteerError, check_dose, dose_field, edit_size  # noqa: F401  (spec's names, as before)
from ..values import ComputedValue, Host, StreamValue, resolve

#: Values of the model's root: one per model, not per block.
ROOT_VALUES = ROOT_STREAMS
#: Short spellings of the contributions: the mixer a block has, its MLP.
SHORT = SHORT_CONTRIBUTIONS
#: Each head's result after the output projection, ``[heads, hidden_size]`` a row (`streamscope.blocks.head_results`).
HEAD_RESULTS_VALUE = f"self_attn.{HEAD_RESULTS}"

Positions = Union[str, slice, Sequence[int], Sequence[Sequence[int]]]
"""``"last"``, ``"all"``, ``"all_but_first"``, a slice of the prompt, one list of indices for every prompt, or one
list per prompt."""

#: A steer's default positions: every prompt position but the first. The first token of a prompt is an attention
#: sink in most trained models (its stream's norm can be a hundred times the others': about 24,000 on
#: SmolLM2-135M), so a clamp, ablation or set there changes the run in ways that have nothing to do with the
#: direction. ``positions="all"`` edits it too.
SKIP_FIRST = "all_but_first"
#: The positions rules a string may name.
RULES = ("all", SKIP_FIRST, "last", "none")
#: A steer's default dose limit: the edit's size over the stream's own norm at the steered value and block
#: (`check_dose`). Steering is usually done at doses up to about 10-20; past this the stream is the vector.
MAX_DOSE = 100.0
#: What a steer's dose past its limit does (`Steer.on_dose`); the first is the default.
DOSE_ACTIONS = ("refuse", "clamp", "warn")
#: The text on which streamscope measures a value's stream norm for the dose check (`stream_norms`).
CALIBRATION_TEXT = ("The old lighthouse keeper walked along the shore at dawn, counting the boats that had come "
                    "back in the night, and wrote their names in a small blue book.")
#: Which of a steer's numbers each mode uses (the others must be left out), and their defaults.
MODE_USES: dict[str, dict[str, Any]] = {
    "add": {"scale": 1.0}, "set": {"scale": 1.0}, "ablate": {"scale": 1.0},
    "clamp": {"projection": 0.0}, "sae_clamp": {"projection": 0.0},
}
#: What each number means in each mode that uses it, for the refusal of one given to a mode that does not.
_MEANING = {"scale": "the multiple of the vector that add and set apply, or the fraction ablate removes",
            "projection": "the projection that clamp (and sae_clamp, the feature's value) sets"}


def value_names() -> tuple[str, ...]:
    """Every name a bulk request accepts."""
    return (*BOUNDARIES, *CONTRIBUTIONS, *SHORT, *(f"mlp.{name}" for name in NEURONS), HEAD_RESULTS_VALUE,
            *ROOT_VALUES)


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
        if not isinstance(self.generated, bool):
            raise SteerError(f"{name}: generated={self.generated!r} must be True or False.", "generated")
        if not isinstance(self.norm_match, bool):
            raise SteerError(f"{name}: norm_match={self.norm_match!r} must be True or False.", "norm_match")
        if not isinstance(self.from_step, int) or isinstance(self.from_step, bool) or self.from_step < 0:
            raise SteerError(f"{name}: from_step={self.from_step!r} must be an int >= 0 "
                             f"(0: every generated token; k: from the k-th on).", "from_step")
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
        if self.max_dose is not None and (isinstance(self.max_dose, bool) or not isinstance(self.max_dose, (int, float))
                                          or not self.max_dose > 0 or not math.isfinite(self.max_dose)):
            raise SteerError(f"{name}: max_dose={self.max_dose!r} must be a positive finite number, or None for "
                             f"no dose limit.", "max_dose")
        if self.on_dose not in DOSE_ACTIONS:
            raise SteerError(f"{name}: on_dose={self.on_dose!r}: use one of {', '.join(map(repr, DOSE_ACTIONS))} "
                             f"(what a dose past max_dose does).", "on_dose")
        if self.condition is not None:
            if isinstance(self.condition, dict):
                self.condition = Condition.from_dict(self.condition)
            if not isinstance(self.condition, Condition):
                raise SteerError(f"{name}: condition takes a streamscope.Condition (or its to_dict()), not a "
                                 f"{type(self.condition).__name__}.", "condition")
            self.condition.validate()
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
        if vector.numel() and not bool(torch.isfinite(vector).all()):
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
        data = {name: getattr(self, name) for name in ("value", "layer", "scale", "mode", "generated",
                                                       "projection", "norm_match", "from_step", "origin", "feature",
                                                       "max_dose", "on_dose")}
        data["condition"] = None if self.condition is None else self.condition.to_dict()
        positions: Any = self.positions
        if isinstance(positions, slice):
            positions = {"slice": [positions.start, positions.stop, positions.step]}
        data.update(vector=[float(number) for number in self.vector.detach().float().cpu().tolist()],
                    positions=positions, prompts=None if self.prompts is None else list(self.prompts))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Steer":
        """A steer from `to_dict`'s data; unknown keys are refused, naming the ones there are.

        A null number (scale, projection, feature) is a field left out: its mode's default, where the mode uses it.
        """
        known = {"value", "layer", "vector", "scale", "positions", "mode", "generated", "prompts", "projection",
                 "norm_match", "from_step", "origin", "feature", "max_dose", "on_dose", "condition"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SteerError(f"a steer has no {', '.join(unknown)}: its fields are {', '.join(sorted(known))}.")
        fields = {key: item for key, item in data.items()
                  if not (item is None and key in ("scale", "projection", "feature", "condition"))}
        for required in ("value", "vector"):
            if required not in fields:
                raise SteerError(f"a steer needs {required!r}: its fields are {', '.join(sorted(known))}.")
        positions = fields.get("positions", SKIP_FIRST)
        if isinstance(positions, dict) and "slice" in positions:
            fields["positions"] = slice(*positions["slice"])
        try:
            fields["vector"] = torch.tensor(fields["vector"], dtype=torch.float32)
        except (TypeError, ValueError) as error:
            raise SteerError(f"a steer's vector is a list of numbers: {error}") from None
        fields.setdefault("layer", None)
        return cls(**fields)

    def __repr__(self) -> str:
        from ..workflows.display import shape

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
        return (self.vector.detach().to(device=device, dtype=torch.float32) * scale).to(dtype)

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


def host_and_name(model: Any, value: str, layer: Optional[int]) -> tuple[Any, str]:
    """The envoy that serves `value` at block `layer` of `model`, and the value's name on it."""
    if value in ROOT_VALUES:
        if layer is not None:
            raise ValueError(f"{value} is a root value (one per model, not per block): pass layer=None for it.")
        return model, value
    if value == HEAD_RESULTS:
        raise ValueError(f"{value!r} is an attention's value: name it {HEAD_RESULTS_VALUE!r}.")
    if value not in value_names():
        raise ValueError(
            f"unknown value {value!r} for a bulk request: choose one of {', '.join(value_names())}."
        )
    if layer is None:
        raise ValueError(f"{value} is a block's value: name the block with layer=<index>.")
    block = model.layers[layer]
    if value in BOUNDARIES:
        return block, value
    if value in SHORT:
        hosts = [role for role in SHORT[value] if block.__dict__.get(role) is not None]
        if not hosts:
            raise Unavailable(value, block.where(), f"no {' or '.join(SHORT[value])} module on this block")
        return block.__dict__[hosts[0]], value
    role, name = value.split(".")
    return resolve(block, role), name


def block_index(model: Any, layer: int, what: str) -> int:
    """`layer` as a non-negative block index, or a clear error naming the range."""
    count = len(model.layers)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"{what}: a block index is an int, not a {type(layer).__name__}.")
    if not -count <= layer < count:
        raise IndexError(f"{what}: block {layer} is out of range: the model has {count} blocks (0-{count - 1}).")
    return layer % count


@dataclass
class Site:
    """A served value on one block (or the root), where its module's call holds it.

    `read`/`edit` use the value's own descriptor on its own envoy, so a bulk
    read is the trace's read: the same arithmetic, bit for bit.
    """

    value: str
    layer: Optional[int]
    host: Host
    descriptor: StreamValue
    module: torch.nn.Module
    where: str
    location: str  # nnsight's name for the call's point: what a tapped vLLM engine's replay serves
    #: What a value computed from its call (head_results) keeps for the run: its columns of the projection.
    held: Optional[torch.Tensor] = None

    @property
    def key(self) -> tuple[int, str]:
        """Which module call holds it: sites on the same call share one hook."""
        return id(self.module), self.where

    def prepare(self, device: Any) -> None:
        """Read what the value needs of the model once, before the run's hooks are installed (head_results: this
        rank's columns of the output projection, on `device`)."""
        columns = getattr(self.descriptor, "columns", None)
        if columns is not None and self.held is None:
            self.held = columns(self.host).to(device)

    def user(self, raw: Any) -> torch.Tensor:
        """The whole batch's value, in the user's layout, as a private tensor."""
        return self.descriptor._read(self.host, raw)

    def read_rows(self, raw: Any, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened batch, ``[rows, width]``: the trace's read, at those rows only (head_results:
        each row's ``[heads, hidden]`` flattened; `HarvestSpec.shapes` gives it back its shape)."""
        if self.held is not None:
            return self.descriptor.read_rows(self.host, raw, rows, self.held)  # type: ignore[attr-defined]
        stream_rows = getattr(self.descriptor, "stream_rows", None)
        if stream_rows is not None:  # a stream in two halves (vLLM's fused blocks): summed at those rows only
            picked = stream_rows(raw, rows)
            if picked is not None:
                return picked
        view = self.user(raw)
        picked = view.reshape(-1, view.shape[-1])[rows]
        # A slice is a view of the whole batch's copy: keep only its rows.
        return picked.clone() if isinstance(rows, slice) else picked

    def row_editor(self, operation: Any, graphs: Any = None) -> Callable[[Any, torch.Tensor], None]:
        """``edit(raw, rows)``: `edit_rows` for one steer's `operation`, its route chosen once for a run.

        A value held in two halves (vLLM's fused blocks) answers with its own
        editor (`streamscope.vllm.blocks.Summed.row_editor`, which replays its
        edit at a tap from `graphs` where given); any other with `edit_rows`
        itself.
        """
        make = getattr(self.descriptor, "row_editor", None) if self.descriptor.factor is None else None
        if make is not None:
            def whole_batch(raw: Any, rows: torch.Tensor) -> None:
                self._write_rows(raw, rows, operation, None)
            return cast(Callable[[Any, torch.Tensor], None], make(operation, whole_batch, graphs))

        def edit(raw: Any, rows: torch.Tensor) -> None:
            self.edit_rows(raw, rows, operation)
        return edit

    def edit_rows(self, raw: Any, rows: torch.Tensor, operation: Any, mode: Optional[str] = None) -> None:
        """Apply `operation` to rows of the flattened batch, written back as a trace's edit is.

        `operation` is an `Operation` (or any callable of the rows); with
        `mode` (``"add"`` or ``"set"``) it is instead the vector(s) to add or
        set, ``[hidden]`` or one per row.
        """
        if self.descriptor.factor is None:
            # A value held in two halves (vLLM's fused blocks) takes the edit at the edited rows only.
            edits = getattr(self.descriptor, "edit_rows", None)
            if edits is not None and edits(raw, rows, operation, mode):
                return
        self._write_rows(raw, rows, operation, mode)

    def _write_rows(self, raw: Any, rows: torch.Tensor, operation: Any, mode: Optional[str]) -> None:
        """`edit_rows` on the whole batch's copy in the user's layout, written back as a trace's edit is."""
        view = self.user(raw)
        flat = view.reshape(-1, view.shape[-1])
        if mode is not None:
            if mode == "add":
                flat[rows] += operation
            else:
                flat[rows] = operation
        elif operation.adds_only:
            flat[rows] += operation.delta
        else:
            flat[rows] = operation(flat[rows])
        descriptor = self.descriptor
        if descriptor.factor is None:
            # The other rows go back as they were read (a copy of themselves, or a zero change
            # to a fused block's hidden half), so other requests are untouched, bit for bit.
            descriptor.write(self.host, raw, view)
            return
        # A scaled value ((x * f) / f need not be x): write the edited rows only.
        live = descriptor.live(self.host, raw)
        engine = live.view(-1, live.shape[-1])
        with torch.no_grad():
            engine[rows] = (flat[rows] / descriptor.factor(self.host)).to(live.dtype)


def locate(model: Any, value: str, layer: Optional[int]) -> Site:
    """The `Site` of `value` at block `layer` on `model`'s envoy tree; a clear error where it is not served."""
    if layer is not None:
        layer = block_index(model, layer, value)
    host, name = host_and_name(model, value, layer)
    descriptor = getattr(type(host), name, None)
    if not isinstance(descriptor, StreamValue) or isinstance(descriptor, ComputedValue):
        raise ValueError(f"{host.where()}.{name} is not a value a bulk request can read or write.")
    bulk_site = getattr(descriptor, "bulk_site", None)
    if bulk_site is not None:  # a value computed from another point of a call (head_results: the projection's input)
        target, where, location = bulk_site(host)
        return Site(value, layer, host, descriptor, seam.module_of(target), where, location)
    target = descriptor.located(host)  # raises Unavailable with the family's reason
    where = descriptor.site(host)[1]
    return Site(value, layer, host, descriptor, seam.module_of(target), where, descriptor.location(host))


def layer_list(model: Any, layers: Any) -> list[int]:
    """`layers` (None for every block, an int, a range, a list) as a list of block indices."""
    if layers is None:
        return list(range(len(model.layers)))
    if isinstance(layers, int):
        layers = [layers]
    return [block_index(model, layer, "layers") for layer in layers]


def prompt_positions(positions: Positions, length: int, prompt: int) -> list[int]:
    """The positions of a `length`-token prompt that `positions` selects, in order; a clear error if out of range."""
    if isinstance(positions, str):
        if positions == "last":
            return [length - 1]
        if positions == "all":
            return list(range(length))
        if positions == SKIP_FIRST:
            return list(range(1, length))
        if positions == "none":
            return []
        raise ValueError(f"positions={positions!r}: use 'last', 'all', 'all_but_first', 'none', a slice, or a list "
                         f"of indices.")
    if isinstance(positions, slice):
        return list(range(length))[positions]
    if isinstance(positions, int):
        positions = [positions]
    chosen = []
    for index in positions:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"positions: an index is an int, not a {type(index).__name__}.")
        if not -length <= index < length:
            raise IndexError(f"positions: index {index} is out of range for prompt {prompt}, "
                             f"which has {length} tokens.")
        chosen.append(index % length)
    return chosen


def per_prompt_positions(positions: Positions, lengths: Sequence[int]) -> list[list[int]]:
    """Each prompt's positions: per-prompt lists (one list per prompt) or one rule for all of them."""
    nested = (isinstance(positions, (list, tuple)) and len(positions) > 0
              and all(isinstance(item, (list, tuple, range)) for item in positions))
    if nested:
        positions = cast(Sequence[Sequence[int]], positions)
        if len(positions) != len(lengths):
            raise ValueError(f"positions has {len(positions)} lists for {len(lengths)} prompts: "
                             f"give one list per prompt, or one rule for every prompt.")
        return [prompt_positions(list(chosen), length, prompt)
                for prompt, (chosen, length) in enumerate(zip(positions, lengths))]
    return [prompt_positions(positions, length, prompt) for prompt, length in enumerate(lengths)]


def check_rule(positions: Any, name: str) -> None:
    """Refuse a steer's positions that are no rule (`Positions`, one rule for every prompt), naming the fix."""
    if isinstance(positions, str):
        if positions not in RULES:
            raise SteerError(f"{name}: positions={positions!r} is not a rule: use {', '.join(map(repr, RULES))}, a "
                             f"slice, or a list of indices (negative from the prompt's end).", "positions")
        return
    if isinstance(positions, slice):
        parts = (positions.start, positions.stop, positions.step)
        if not all(part is None or (isinstance(part, int) and not isinstance(part, bool)) for part in parts):
            raise SteerError(f"{name}: positions={positions!r}: a slice's bounds are ints or None.", "positions")
        if positions.step == 0:
            raise SteerError(f"{name}: positions={positions!r}: a slice's step cannot be 0.", "positions")
        return
    if isinstance(positions, int) and not isinstance(positions, bool):
        return
    if isinstance(positions, (list, tuple, range)):
        if any(isinstance(item, (list, tuple, range)) for item in positions):
            raise SteerError(f"{name}: a steer takes one positions rule for every prompt it steers, not one list "
                             f"per prompt: give one steer per prompt (prompts=[i]) with its own positions.",
                             "positions")
        if all(isinstance(item, int) and not isinstance(item, bool) for item in positions):
            return
    raise SteerError(f"{name}: positions={positions!r} is not a rule: use {', '.join(map(repr, RULES))}, a slice, "
                     f"or a list of int indices (negative from the prompt's end).", "positions")


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


#: Each model's measured stream norms, ``(value, block) -> ||h||``, kept while the model lives.
_NORMS: dict[int, tuple[Any, dict[tuple[str, Optional[int]], float]]] = {}


def stream_norms(model: Any, sites: Sequence[tuple[str, Optional[int]]]) -> dict[tuple[str, Optional[int]], float]:
    """``||h||`` of each ``(value, block)`` in `sites`: the value's mean row norm over `CALIBRATION_TEXT`'s
    positions after the first (the sink), measured by a harvest on `model` once and kept for the model's life."""
    entry = _NORMS.get(id(model))
    if entry is None or entry[0]() is not model:
        try:
            reference: Any = weakref.ref(model)
        except TypeError:
            reference = lambda: model  # noqa: E731  (kept while the process lives)
        entry = _NORMS[id(model)] = (reference, {})
    known = entry[1]
    missing: dict[str, list[Optional[int]]] = {}
    for value, layer in sites:
        if (value, layer) not in known:
            missing.setdefault(value, [])
            if layer not in missing[value]:
                missing[value].append(layer)
    for value, layers in missing.items():
        blocks = [layer for layer in layers if layer is not None]
        harvest = model.harvest([CALIBRATION_TEXT], value, layers=blocks or None, positions="all", progress=False)
        rows = harvest[value][0].float()  # [blocks, positions, hidden]; [positions, hidden] at the root
        rows = rows.unsqueeze(0) if rows.dim() == 2 else rows
        norms = (rows[:, 1:] if rows.shape[1] > 1 else rows).norm(dim=-1).mean(-1)
        if value in ROOT_VALUES:
            known[(value, None)] = float(norms[0])
        else:
            for index, layer in enumerate(blocks):
                known[(value, layer)] = float(norms[index])
    return {site: known[site] for site in sites}


def measured_norms(model: Any) -> dict[tuple[str, Optional[int]], float]:
    """The stream norms `stream_norms` has measured on `model` so far, ``(value, block) -> ||h||`` (a copy; nothing
    is measured here)."""
    entry = _NORMS.get(id(model))
    return dict(entry[1]) if entry is not None and entry[0]() is model else {}


def check_doses(model: Any, steers: Sequence[Steer], dtype: torch.dtype) -> list[Steer]:
    """`check_dose` for each steer of a bulk run before it runs, ``||h||`` measured once per model, value and block
    (`stream_norms`), or carried by the steer's vector where none is measured there
    (`streamscope.bulk.dose.check_bulk_doses`), so that a refusal states it: the steers to run, in order (a clamped
    one replaced)."""
    from .dose import check_bulk_doses

    return check_bulk_doses(model, steers, dtype, lambda sites: stream_norms(model, sites),
                            lambda: measured_norms(model))


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


def row_width(value: str) -> str:
    """How wide a harvested row of `value` is, in words."""
    if value.split(".")[-1] in NEURONS:
        return "intermediate_size wide"
    if value == HEAD_RESULTS_VALUE:
        return "[heads, hidden_size] a row"
    return "hidden_size wide"


@dataclass
class HarvestSpec:
    """A harvest: which values, at which blocks, at which positions of each prompt."""

    values: list[str]
    layers: list[int]
    positions: list[list[int]] = field(default_factory=list)
    #: What each harvested row becomes before it is stored (an SAE's features: `streamscope.sae.FeatureReadout`).
    readout: Optional[Any] = None
    #: A value whose row is not one vector: its row's shape (head_results: ``(heads, hidden_size)``), which the
    #: run stores flattened and `streamscope.bulk.results.assemble` gives back.
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: How each prompt's positions are reduced where they are read (`streamscope.bulk.moments.reduce_positions`):
    #: ``"last"``, ``"mean"``, or None (every position kept).
    reduce: Optional[str] = None

    def sites(self, model: Any) -> list[Site]:
        """Every (value, block) `Site`, root values once."""
        return [locate(model, value, None) if value in ROOT_VALUES else locate(model, value, layer)
                for value in self.values for layer in ([None] if value in ROOT_VALUES else self.layers)]


def harvest_spec(model: Any, values: Any, layers: Any, positions: Positions, lengths: Sequence[int]) -> HarvestSpec:
    """Check a harvest's values, blocks and positions on `model`, before anything runs."""
    if isinstance(values, str):
        values = [values]
    values = list(values)
    if not values:
        raise ValueError("harvest needs at least one value name.")
    spec = HarvestSpec(values, layer_list(model, layers), per_prompt_positions(positions, lengths))
    spec.sites(model)  # every site resolves, or the error says which does not
    if HEAD_RESULTS_VALUE in values:
        spec.shapes[HEAD_RESULTS_VALUE] = (model.num_heads, model.hidden_size)
    # Each prompt's rows are kept in one [sites, positions, width] buffer, filled as the steps run.
    widths: dict[str, list[str]] = {}
    for value in values:
        widths.setdefault(row_width(value), []).append(value)
    if len(widths) > 1:
        described = "; ".join(f"{', '.join(names)} {width}" for width, names in widths.items())
        raise ValueError(f"one harvest's values share one width, and these differ ({described}): harvest the values "
                         f"of each width in a harvest of their own.")
    return spec


__all__ = ["Steer", "SteerError", "apply_steers", "Site", "HarvestSpec", "harvest_spec", "check_steer", "locate", "value_names"]


def generation_harvest(model: Any, harvest: Any, lengths: Sequence[int]) -> Optional[HarvestSpec]:
    """The harvest a generation reads along (``harvest={"values": ..., "layers": ..., "positions": ...}``), or None."""
    if harvest is None:
        return None
    options = dict(harvest)
    spec = harvest_spec(model, options.pop("values"), options.pop("layers", None),
                        options.pop("positions", "last"), lengths)
    if options:
        raise TypeError(f"harvest= takes values, layers and positions; not {', '.join(options)}.")
    return spec


def plain_generation(inputs: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    """`model.generate(...)` called outside a ``with`` block, as the bulk path's (prompts, settings).

    One prompt (a string) is a list of one; transformers' spellings are taken too: ``max_new_tokens`` is
    ``max_tokens``, ``do_sample=False`` greedy (``temperature=0``), ``do_sample=True`` sampling at temperature 1
    unless one is given.
    """
    if len(inputs) != 1:
        raise TypeError(f"model.generate takes the prompts as one argument (a string or a list); got {len(inputs)}")
    prompts = inputs[0]
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    settings = dict(kwargs)
    if "max_new_tokens" in settings:
        if "max_tokens" in settings:
            raise TypeError("give max_tokens or max_new_tokens, not both")
        settings["max_tokens"] = settings.pop("max_new_tokens")
    if "do_sample" in settings:
        sample = settings.pop("do_sample")
        if not sample:
            if settings.get("temperature", 0.0) != 0.0:
                raise ValueError("do_sample=False is greedy: leave temperature out, or sample with do_sample=True")
            settings["temperature"] = 0.0
        else:
            settings.setdefault("temperature", 1.0)
    return prompts, settings


def token_ids(model: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Each prompt's token ids: a string is tokenized as a trace tokenizes it; a list of ids is taken as is."""
    if isinstance(prompts, str):
        raise TypeError("bulk runs take a list of prompts; wrap a single prompt in a list.")
    ids = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids.append(list(model.tokenizer(prompt)["input_ids"]))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(token, int) for token in prompt):
            ids.append(list(prompt))
        else:
            raise TypeError(f"prompt {index} is a {type(prompt).__name__}: give a string or a list of token ids.")
        if not ids[-1]:
            raise ValueError(f"prompt {index} has no tokens.")
    return ids
