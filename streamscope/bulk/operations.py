"""What a steer does to the rows it edits: add, set, ablate, clamp, each optionally norm-matched.

Every operation takes rows of one value, ``[rows, hidden_size]``, and
returns their new contents, the same arithmetic in a trace (`Steer.apply`)
and on the bulk path (`streamscope.bulk.apply`). With ``v`` the steer's
vector, ``d = v / |v|`` its unit direction and ``x`` a row:

* ``add``: ``x + scale * v``;
* ``set``: ``scale * v``, whatever ``x`` was;
* ``ablate``: ``x - scale * (x . d) d``: the component along ``d`` removed
  (``scale=1``, directional ablation), partly removed (``0 < scale < 1``) or
  reflected (``scale=2``);
* ``clamp``: ``x + (projection - x . d) d``: the projection on ``d`` set to
  ``projection``, the rest of ``x`` kept.

``norm_match=True`` then rescales each edited row to the norm it had before
the edit, so the steer turns the stream without making it longer or
shorter.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch

Found = TypeVar("Found")

#: Every steer operation, by its ``mode`` name.
MODES = ("add", "set", "ablate", "clamp", "sae_clamp")  # sae_clamp: streamscope.sae.ClampFeature
#: The operations that use the vector as a direction (its unit vector), not as an amount.
DIRECTIONAL = ("ablate", "clamp")


@dataclass
class Operation:
    """A steer's operation with its vectors ready on the engine's device, in the engine's dtype.

    `delta` is ``scale * vector`` (add, set); `unit` the unit direction
    (ablate, clamp).
    """

    mode: str
    delta: torch.Tensor
    unit: torch.Tensor
    scale: float
    projection: float
    norm_match: bool
    #: Whether the edit's change is a multiple of the unit direction per row (an ablate or a clamp without a norm
    #: match), which `add_change` adds in place. Set once, read by every hook call.
    along_direction: bool = field(init=False)

    def __post_init__(self) -> None:
        self.along_direction = self.mode in DIRECTIONAL and not self.norm_match

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """The edited rows, ``[..., hidden_size]``, a new tensor (`rows` is not changed)."""
        if self.mode == "add":
            edited = rows + self.delta
        elif self.mode == "set":
            edited = self.delta.expand_as(rows).clone()
        else:
            along = rows @ self.unit  # [...]: each row's projection on the direction
            if self.mode == "ablate":
                edited = rows - (self.scale * along).unsqueeze(-1) * self.unit
            else:
                edited = rows + (self.projection - along).unsqueeze(-1) * self.unit
        if self.norm_match:
            before = rows.norm(dim=-1, keepdim=True)
            after = edited.norm(dim=-1, keepdim=True)
            # A row the edit left at zero stays zero: there is no direction to give the old norm to.
            edited = edited * torch.where(after > 0, before / after.clamp_min(torch.finfo(after.dtype).tiny),
                                          torch.zeros_like(after))
        return edited

    def add_change(self, target: torch.Tensor, stream: torch.Tensor, other: Optional[torch.Tensor] = None) -> bool:
        """Add the edit's change of the rows ``x = stream (+ other)`` to `target` (rows of the same shape) in place,
        where the operation is a direction's ablate or clamp without a norm match; False, doing nothing, otherwise.

        ``target += -scale (x . d) d`` (ablate) or ``(projection - x . d) d``
        (clamp): the same change as ``self(x) - x``, rounded once. A stream in
        two halves (`other`: vLLM's hidden and residual) is never summed: its
        projection is ``stream . d + other . d``. Three kernels for an
        ablation (the projection, its second half, the rank-one update), one
        more for a clamp; nothing of the rows' size is gathered, copied or
        allocated (only the projections, ``[n]``).
        """
        if not self.along_direction:
            return False
        along = torch.mv(stream, self.unit)  # [n]: each row's projection on the direction
        if other is not None:
            along.addmv_(other, self.unit)
        if self.mode == "ablate":
            target.addr_(along, self.unit, alpha=-self.scale)
        else:
            target.addr_(self.projection - along, self.unit)
        return True

    def add_change_at(self, target: torch.Tensor, index: torch.Tensor, stream: torch.Tensor,
                      other: Optional[torch.Tensor] = None) -> bool:
        """`add_change` for rows `index` of `target` (a tensor of row indices; `stream` and `other` are those rows):
        the change goes in with one ``index_add_``."""
        if not self.along_direction:
            return False
        along = torch.mv(stream, self.unit)
        if other is not None:
            along.addmv_(other, self.unit)
        if self.mode == "ablate":
            target.index_add_(0, index, torch.outer(along, self.unit), alpha=-self.scale)
        else:
            target.index_add_(0, index, torch.outer(self.projection - along, self.unit))
        return True

    @property
    def adds_only(self) -> bool:
        """Whether the operation is a plain addition, which the bulk path applies in place."""
        return self.mode == "add" and not self.norm_match


def per_tensor(compute: Callable[[torch.Tensor], Found], size: int = 1024) -> Callable[[torch.Tensor], Found]:
    """`compute`, remembered for each tensor while it holds the same numbers (a server's stored vector is checked
    and encoded once, not for each request that names it): a tensor is known by its identity, checked by a weak
    reference (a new tensor at a dead one's address is computed anew) and by its version, which any write in
    place moves. An inference tensor keeps no version, so a write to it would go unseen: computed each time."""
    found: dict[int, tuple[Any, int, Found]] = {}

    def remembered(tensor: torch.Tensor) -> Found:
        if tensor.is_inference():
            return compute(tensor)
        entry = found.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        value = compute(tensor)
        if len(found) >= size:
            found.clear()
        found[id(tensor)] = (weakref.ref(tensor), tensor._version, value)
        return value
    return remembered


def on_device(vector: torch.Tensor, device: Any) -> torch.Tensor:
    """`vector` in float32 on `device`, its copy queued without waiting for the device.

    A blocking copy from host memory waits for every kernel already queued
    (on a busy engine, the step in flight), so each request that brought a
    vector would stall the engine's host side for a step. The copy is queued
    on the current stream, ahead of the kernels that read it; CUDA stages a
    pageable source before the call returns, so the source may change after.
    """
    return vector.detach().to(device=device, dtype=torch.float32, non_blocking=True)


def prepare(mode: str, vector: torch.Tensor, scale: float, projection: float, norm_match: bool,
            dtype: torch.dtype, device: Any) -> Operation:
    """The `Operation` for these settings, its vectors rounded once to `dtype` on `device`."""
    exact = on_device(vector, device)
    delta = (exact * scale).to(dtype)
    unit = (exact / exact.norm()).to(dtype) if mode in DIRECTIONAL else delta
    return Operation(mode, delta, unit, float(scale), float(projection), bool(norm_match))


class ClampFeature:
    """The `sae_clamp` operation, ready on the engine: rows ``[n, d_in]`` -> rows with one feature clamped."""

    adds_only = False

    def __init__(self, sae: Any, feature: int, value: float, dtype: torch.dtype, device: Any) -> None:
        # The encoder runs in float32 whatever the engine's dtype: a feature's value decides what is added.
        self.sae = sae.placed(device)
        self.feature, self.value, self.dtype = feature, float(value), dtype
        self.direction = self.sae.W_dec[feature]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        current = self.sae.encode(rows.float())[..., self.feature]
        return (rows.float() + (self.value - current).unsqueeze(-1) * self.direction).to(rows.dtype)


def check_clamp(steer: Any, model: Any) -> None:
    """Refuse an ``sae_clamp`` steer whose SAE or feature does not fit the steer's site or the model."""
    sae = steer.sae
    if not (hasattr(sae, "encode") and hasattr(sae, "W_dec") and hasattr(sae, "check")):
        raise TypeError(f"Steer mode 'sae_clamp' needs sae= a streamscope.sae.SAE (build it with sae.clamp(...)), "
                        f"not {type(sae).__name__}.")
    sae.check(model)
    layer = None if steer.layer is None else steer.layer % model.num_layers
    if (sae.value, sae.layer) != (steer.value, layer):
        raise ValueError(f"{sae!r} reads {sae.value} at block {sae.layer}, and the steer edits {steer.value} at block "
                         f"{steer.layer}: an SAE's features mean something at its own site only. Use sae.clamp(...).")
    sae._check_feature(steer.feature if isinstance(steer.feature, int) else -1)
