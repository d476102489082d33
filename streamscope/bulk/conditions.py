"""Conditional steering (CAST-style): a steer that edits only where a probe on the stream says so.

Lee et al. (2024, "Programming Refusal with Conditional Activation
Steering") add a behavior vector only where the hidden state's similarity to a
*condition vector* passes a threshold, compared one way or the other (the
rule and its complement). Here that is a `Condition` attached to a
`streamscope.Steer`: the steer's edit is applied to a row (or a whole
request) only where the condition passes, decided on the engine at every step
of the run, prefill and decode, with no copy to the host.

What is compared, with ``c`` the condition's vector, ``u = c / |c|`` its unit
direction, and ``h`` the condition value's row (float32):

* ``measure="projection"`` (the default): ``h . u``, the stream's length along
  the direction;
* ``measure="cosine"``: ``h . u / |h|``, the cosine of ``h`` and ``c``
  (CAST's similarity of ``h`` and its projection on ``c`` is this cosine's
  absolute value: ask for ``< -t`` or ``> t`` as fits the direction's sign).

``compare="greater"`` passes where the measure is strictly greater than
`threshold`, ``compare="less"`` where it is strictly less.

Which rows the decision covers (`scope`):

* ``"row"``: each row decides for itself. Row ``r`` of a request (one token:
  a prompt position or a generated token) is edited at the steer's site where
  the steer selects it (its positions, `generated`, `from_step`, prompts) and
  the measure of the condition value at the *same token, in the same forward
  pass* passes.
* ``"request"``: one decision per request, CAST's: the measure of the mean of
  the condition value over the request's prompt positions after the first
  (position 0 alone for a one-token prompt), made during the forward pass that
  runs the prompt and kept for every generated token after it. Where it
  passes, the steer edits every row it selects, prompt and generated; where it
  does not, none. The whole prompt must run in one step: a vLLM engine or
  server that may run a prompt in pieces (chunked prefill) refuses a
  request-scoped condition before anything runs, and its requests are kept
  out of the prefix cache.

The condition is read where the model computes its value, before any steer at
that same value and block edits it (after the edits of steers at earlier
points of the model): a condition at the steer's own site sees the unsteered
row. Its site must come no later in the forward pass than the steer's: an
earlier block, a value computed earlier in the same block
(`COMPUTE_ORDER`), the same value and block, or the
token embeddings. A row the condition does not pass is left exactly as it was
(the steer's edit is computed, then the old row kept where the condition
fails), so a request whose rows never pass runs bit for bit as the unsteered
run, and other requests of a step are never read by its condition.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional

import torch

from ..families.spec import ROOT_STREAMS
from .operations import on_device

#: A block's values in the order a sequential block computes them, for applying steers in a trace.
COMPUTE_ORDER = ("layer_input", "attention_norm_output", "self_attn.attention_output", "linear_attn.attention_output",
                 "attention_output", "layer_mid", "mlp_norm_output", "mlp_input", "mlp.mlp_output", "mlp_output",
                 "layer_output")
#: How a condition's measure is compared with its threshold.
COMPARES = ("greater", "less")
#: What a condition measures of a row.
MEASURES = ("projection", "cosine")
#: Which rows one decision covers.
SCOPES = ("row", "request")


class ConditionError(ValueError):
    """A condition that cannot run: a bad field or a site after the steer's. `field` names the condition's field."""

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.field))


@dataclass
class Condition:
    """When a steer applies: where the projection (or cosine) of a value on `vector` passes `threshold`.

    See `streamscope.bulk.conditions` for the exact semantics.

    Args:
        value: The value the condition reads (a block's value such as
            ``"layer_output"``, or ``"token_embeddings"``), as `Steer` names values.
        layer: Its block (negative counts from the end); None for a root value.
            No later in the forward pass than the steer's site.
        vector: ``[hidden_size]``: the condition direction (any non-zero length: its unit vector is used).
        threshold: The number the measure is compared with.
        compare: ``"greater"`` (passes where measure > threshold) or ``"less"`` (measure < threshold).
        measure: ``"projection"`` (``h . u``) or ``"cosine"`` (``h . u / |h|``).
        scope: ``"row"`` (each token decides for itself) or ``"request"`` (the
            prompt's mean stream decides once for the whole request).
    """

    value: str
    layer: Optional[int]
    vector: torch.Tensor
    threshold: float
    compare: str = "greater"
    measure: str = "projection"
    scope: str = "row"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse a field that cannot work (`ConditionError`, naming the field and the fix)."""
        name = f"Condition({self.value!r}, layer={self.layer})"
        if not isinstance(self.value, str):
            raise ConditionError(f"{name}: value names the value read, a string such as 'layer_output'.", "value")
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)):
            raise ConditionError(f"{name}: layer is a block index (an int), or None for a root value.", "layer")
        threshold = self.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ConditionError(f"{name}: threshold={threshold!r} must be a finite number.", "threshold")
        for field_name, allowed in (("compare", COMPARES), ("measure", MEASURES), ("scope", SCOPES)):
            if getattr(self, field_name) not in allowed:
                raise ConditionError(f"{name}: {field_name}={getattr(self, field_name)!r}: use one of "
                                     f"{', '.join(map(repr, allowed))}.", field_name)
        vector = self.vector
        if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or not vector.is_floating_point():
            raise ConditionError(f"{name}: vector must be one floating-point [hidden_size] tensor.", "vector")
        if vector.numel() and not bool(torch.isfinite(vector).all()):
            raise ConditionError(f"{name}: the vector holds NaN or inf: give a finite direction.", "vector")
        if vector.numel() and not bool(vector.norm() > 0):
            raise ConditionError(f"{name}: the vector is all zeros, so it has no direction to project on.", "vector")

    def to_dict(self) -> dict[str, Any]:
        """The condition as JSON-ready data (the vector as a list of floats); `from_dict` reads it back."""
        data = {item.name: getattr(self, item.name) for item in fields(self)}
        data.update(threshold=float(self.threshold),
                    vector=[float(item) for item in self.vector.detach().float().cpu().tolist()])
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Condition":
        """A condition from `to_dict`'s data; unknown or missing keys are refused, naming the fields."""
        known = tuple(item.name for item in fields(cls))  # held to the request schema's (`bulk.schema.ConditionJSON`)
        if not isinstance(data, dict):
            raise ConditionError(f"a condition is an object with the fields {', '.join(known)}.")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConditionError(f"a condition has no {', '.join(unknown)}: its fields are {', '.join(known)}.",
                                 unknown[0])
        for required in (item.name for item in fields(cls) if item.default is MISSING and item.name != "layer"):
            if required not in data:
                raise ConditionError(f"a condition needs {required!r}: its fields are {', '.join(known)}.", required)
        given = dict(data)
        if not isinstance(given["vector"], torch.Tensor):
            try:
                given["vector"] = torch.tensor(given["vector"], dtype=torch.float32)
            except (TypeError, ValueError) as error:
                raise ConditionError(f"a condition's vector is a list of numbers: {error}", "vector") from None
        given.setdefault("layer", None)  # a root value's condition
        return cls(**given)

    def described(self) -> str:
        where = self.value if self.layer is None else f"layers[{self.layer}].{self.value}"
        sign = ">" if self.compare == "greater" else "<"
        return f"{self.measure} of {where} on the condition vector {sign} {self.threshold:g} ({self.scope} scope)"


def check_condition(model: Any, steer: Any) -> None:
    """Refuse a steer's condition whose width does not fit `model` or which is read after the steer's value
    (`ConditionError` naming the fix); `streamscope.bulk.steer.check_steer` then finds its site."""
    condition: Condition = steer.condition
    if not isinstance(condition, Condition):
        raise ConditionError(f"condition takes a streamscope.Condition, not a {type(condition).__name__}.",
                             "condition")
    condition.validate()
    if tuple(condition.vector.shape) != (model.hidden_size,):
        raise ConditionError(f"{condition.described()}: the vector has shape {tuple(condition.vector.shape)}: it must "
                             f"be [hidden_size] = ({model.hidden_size},).", "vector")
    count = len(model.layers)
    if condition.layer is not None and not -count <= condition.layer < count:
        raise ConditionError(f"{condition.described()}: block {condition.layer} is out of range: the model has "
                             f"{count} blocks (0-{count - 1}).", "layer")

    def place(value: str, layer: Optional[int]) -> tuple[int, int]:
        if value == "token_embeddings":
            return (-1, 0)
        if value in ROOT_STREAMS:
            return (count, 0)
        index = layer % count if layer is not None else 0
        return (index, COMPUTE_ORDER.index(value) if value in COMPUTE_ORDER else len(COMPUTE_ORDER))

    own = place(condition.value, condition.layer)
    steered = place(steer.value, steer.layer)
    same = own == steered and condition.value == steer.value
    unordered = own[0] == steered[0] and len(COMPUTE_ORDER) in (own[1], steered[1])
    if not same and (own > steered or unordered):
        raise ConditionError(
            f"it reads {condition.value} at block {condition.layer}, which the model "
            f"computes after the steered value (or in no fixed order with it), so the decision would come too late "
            f"for the edit. Read the condition at an earlier block (or an earlier value of the same block, or the "
            f"steered value itself).", "layer")


class Gate:
    """A steer's operation gated by its condition, for the bulk path and the server: the edit where it passes.

    One gate serves the requests of one run (the bulk path) or one request (the
    server), each a *slot*. Every step the engine's planner calls `plan` with
    the rows the steer edits and, for a request-scoped condition, the prompt
    rows that decide; the condition's hook calls `decide` with the condition
    value's call; the steer's edit then calls the gate on its rows. All the
    work is tensors on the engine's device: nothing waits for the host.
    """

    adds_only = False
    along_direction = False

    def __init__(self, operation: Any, condition: Condition, slots: int, device: Any) -> None:
        self.operation = operation
        self.condition = condition
        self.unit = on_device(condition.vector, device)
        self.unit = self.unit / self.unit.norm()
        self.threshold = float(condition.threshold)
        self.device = torch.device(device)
        #: Each slot's request decision (request scope), False until its prompt has run.
        self.decided = torch.zeros(slots, dtype=torch.bool, device=device)
        self.rows: Any = None  # the rows the steer edits this step (a slice or a tensor of rows), None: none
        self.row_slots: Optional[torch.Tensor] = None  # request scope: each edited row's slot
        self.deciding: Optional[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.mask: Optional[torch.Tensor] = None  # this step's decision for each edited row, once `decide` ran

    @property
    def delta(self) -> Any:
        return getattr(self.operation, "delta", None)

    def passes(self, rows: torch.Tensor) -> torch.Tensor:
        """Whether each row ``[n, hidden]`` passes the condition, ``[n]`` bool."""
        rows = rows.float()
        along = rows @ self.unit
        if self.condition.measure == "cosine":
            along = along / rows.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
        return along > self.threshold if self.condition.compare == "greater" else along < self.threshold

    def plan(self, rows: Any, row_slots: Optional[list[int]], deciding: Optional[list[tuple[int, int, int]]]) -> None:
        """This step's rows: `rows` the steer edits (its index), each one's slot (request scope), and `deciding`:
        ``(slot, first row, row count)`` of each request whose prompt's deciding rows run in this step."""
        self.rows, self.mask = rows, None
        if self.condition.scope == "row":
            return
        self.row_slots = (None if row_slots is None or rows is None else
                          torch.tensor(row_slots, dtype=torch.long).to(self.device, non_blocking=True))
        if not deciding:
            self.deciding = None
            return
        flat = [row for _, first, count in deciding for row in range(first, first + count)]
        segments = [index for index, (_, _, count) in enumerate(deciding) for _ in range(count)]
        self.deciding = (
            torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(segments, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor([float(count) for _, _, count in deciding], dtype=torch.float32).to(self.device, non_blocking=True),
            torch.tensor([slot for slot, _, _ in deciding], dtype=torch.long).to(self.device, non_blocking=True))

    def decide(self, site: Any, raw: Any) -> None:
        """At the condition value's call: this step's decision for each row the steer edits."""
        if self.condition.scope == "row":
            if self.rows is not None:
                self.mask = self.passes(site.read_rows(raw, self.rows))
            return
        if self.deciding is not None:
            rows, segments, counts, slots = self.deciding
            read = site.read_rows(raw, rows).float()
            sums = torch.zeros(len(counts), read.shape[-1], dtype=torch.float32, device=read.device)
            sums.index_add_(0, segments, read)
            self.decided[slots] = self.passes(sums / counts.unsqueeze(-1))
        if self.rows is not None and self.row_slots is not None:
            self.mask = self.decided[self.row_slots]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """The steer's edit of `rows` where the condition passed, each other row as it was (a new tensor)."""
        mask = self.mask
        if mask is None or mask.shape[0] != rows.reshape(-1, rows.shape[-1]).shape[0]:
            raise RuntimeError(f"the steer's condition ({self.condition.described()}) was not read before the "
                               f"steered value in this step: read the condition at an earlier point of the model.")
        edited = self.operation(rows)
        return torch.where(mask.reshape(*rows.shape[:-1], 1), edited, rows)


def deciding_rows(length: int, first: int, count: int) -> Optional[tuple[int, int]]:
    """The rows of a request's span (its positions ``first .. first + count`` of a `length`-token prompt) that
    decide a request-scoped condition, as ``(offset in the span, rows)``; None where the span decides nothing.

    Raises where the span holds only part of the prompt (chunked prefill): the decision needs the whole prompt.
    """
    if first >= length:
        return None
    if first > 0 or count < length:
        raise RuntimeError("a request-scoped condition decides on the whole prompt, and this prompt ran in pieces "
                           "(chunked prefill or prefix caching): start the engine with enable_chunked_prefill=False "
                           "and enable_prefix_caching=False, or use scope='row'.")
    return (0, 1) if length == 1 else (1, length - 1)


__all__ = ["COMPUTE_ORDER", "Condition", "ConditionError", "Gate", "check_condition", "deciding_rows"]
