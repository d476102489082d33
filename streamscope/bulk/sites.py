"""Where a bulk request's value is served: its name resolved once, on the engine's own envoy tree, to a `Site`.

A bulk request names values the way a trace does (``"layer_output"``,
``"self_attn.attention_output"``) and blocks by index. `locate` resolves each
to a `Site`: the module whose call holds the value and the served value's
descriptor, so the bulk path reads and writes exactly what the trace's envoys
read and write (the fused halves' sum on vLLM, Granite's multiplier, a
parallel block's relocated stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch

from .. import nnsight_seam as seam
from ..blocks import BOUNDARIES, CONTRIBUTIONS, SHORT_CONTRIBUTIONS
from ..blocks.head_results import HEAD_RESULTS
from ..blocks.sublayers import NEURONS
from ..errors import Unavailable
from ..families.spec import ROOT_STREAMS
from ..values import ComputedValue, Host, StreamValue, resolve

#: Values of the model's root: one per model, not per block.
ROOT_VALUES = ROOT_STREAMS
#: Short spellings of the contributions: the mixer a block has, its MLP.
SHORT = SHORT_CONTRIBUTIONS
#: Each head's result after the output projection, ``[heads, hidden_size]`` a row (`streamscope.blocks.head_results`).
HEAD_RESULTS_VALUE = f"self_attn.{HEAD_RESULTS}"


def value_names() -> tuple[str, ...]:
    """Every name a bulk request accepts."""
    return (*BOUNDARIES, *CONTRIBUTIONS, *SHORT, *(f"mlp.{name}" for name in NEURONS), HEAD_RESULTS_VALUE,
            *ROOT_VALUES)


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
        # A slice is a view of the whole batch's copy: keep only its rows (a tensor of their own, which a harvest's
        # copy to the host may still read while the engine runs on: `streamscope.bulk.apply.Applier.store`).
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


def row_width(value: str) -> str:
    """How wide a harvested row of `value` is, in words."""
    if value.split(".")[-1] in NEURONS:
        return "intermediate_size wide"
    if value == HEAD_RESULTS_VALUE:
        return "[heads, hidden_size] a row"
    return "hidden_size wide"


__all__ = ["HEAD_RESULTS_VALUE", "ROOT_VALUES", "SHORT", "Site", "block_index", "host_and_name", "layer_list",
           "locate", "row_width", "value_names"]
