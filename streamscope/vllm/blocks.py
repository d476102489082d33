"""How vLLM calls a decoder block, as data: a family's `FamilySpec.layout`, composed with its block kind at load.

vLLM runs every request of a step as one flat ``[tokens, hidden]`` batch and
nnsight hands each invoke its own rows; the values serve them as
``[1, tokens, hidden]``. A block is called one of three ways, each a layout
here: with the stream in two halves it hands on fused into the next norm
(`Fused`, most families; block 0 gets residual None and the embeddings as
hidden_states), with the stream whole (`WholeStream`: where it sits in the
call, whether the block returns it first in a tuple), or as transformers' own
module inside vLLM's Transformers backend (`Backend`). Every layout skips per
request (`VllmSkip`). The engine composes the layout with the family's
engine-neutral block kind (`block_kind`); the sublayers are `streamscope.blocks`'
own, but for the attention, whose internals are read at vLLM's attention layer
(`streamscope.vllm.attention`).
"""

from __future__ import annotations

import ast
from dataclasses import astuple, dataclass
from typing import Any, Callable, Optional

import torch

from ..blocks.composed import Composer
from .. import values
from ..values import INPUT, OUTPUT, Host, StreamValue, argument, in_dtype, is_edited
from . import write_batch


class Summed(StreamValue):
    """The stream at a call that takes or returns it in two halves, hidden + residual, [1, tokens, hidden_size].

    A fused block hands its stream on as ``(hidden_states, residual)`` and the
    next norm adds the two (in place, on GPU): the stream is their sum,
    computed for the read, so it is nobody's buffer. An edit goes back as a
    change to the hidden half, and a read that edits nothing writes nothing. A
    call without the residual (block 0's input) is its stream alone.

    Args:
        hidden, residual: Where the halves sit in an input call, as
            ``(index, name)``; an output is the pair ``(hidden, residual)``.
    """

    def __init__(self, module: Optional[str], where: str, *, hidden: tuple[int, str] = (0, "x"),
                 residual: tuple[int, str] = (1, "residual"), description: Optional[str] = None) -> None:
        super().__init__(module, where, description=description)
        self.hidden, self.residual = hidden, residual

    def halves(self, raw: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.where == INPUT:
            return argument(raw, *self.hidden), argument(raw, *self.residual)
        if isinstance(raw, tuple):
            return raw[0], raw[1]
        return raw, None

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        return self.halves(raw)[0]

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        hidden, residual = self.halves(raw)
        with torch.inference_mode(False):
            if residual is None:
                return host.to_user(hidden, self.name).clone()
            return host.to_user(hidden + residual, self.name)

    def stream_rows(self, raw: Any, rows: Any) -> Optional[torch.Tensor]:
        """Rows `rows` of the stream (a slice or a tensor of row indices), ``[rows, hidden_size]``, bit for bit the
        whole batch's read there (`_read`) at those rows; None where the halves are not the step's flattened tokens.

        A harvest reads a few rows of the batch at every block: a slice of
        rows sums those rows only, one kernel; scattered rows take the whole
        sum, then the rows (two kernels, as the whole read then its rows).
        """
        hidden, residual = self.halves(raw)
        if hidden.dim() != 2 or (residual is not None and residual.shape != hidden.shape):
            return None
        if residual is None:
            # never a view of the engine's tensor: a harvest's copy to the host may still be reading the rows when
            # the next step writes it (`streamscope.bulk.apply.Applier.store`)
            return hidden[rows].clone() if type(rows) is slice else hidden[rows]
        if type(rows) is slice:
            return hidden[rows] + residual[rows]
        return (hidden + residual)[rows]

    def edit_rows(self, raw: Any, rows: Any, operation: Any, mode: Optional[str] = None) -> bool:
        """Apply a bulk steer's `operation` to rows `rows` of the stream (a slice or a tensor of row indices),
        those rows only; False, doing nothing, where the halves are not the step's flattened tokens.

        With `mode` (``"add"`` or ``"set"``, a server's steers batched across
        its requests) `operation` is instead the vector to add or set,
        ``[hidden]`` or one per row, in the engine's dtype.

        The hidden half of each edited row takes ``edited - stream``, bit
        for bit the change the write-back of the whole batch (`write`) would
        make; an ablation or a clamp adds its change straight from the two
        halves, rounded once (`Operation.add_change`); a stream without a
        residual half (block 0's input) takes the edited rows themselves, as
        `write` copies them. No other row is touched, and the whole batch is
        neither summed, copied nor written back.
        """
        hidden, residual = self.halves(raw)
        if hidden.dim() != 2 or (residual is not None and residual.shape != hidden.shape):
            return False
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._edit_rows(hidden, residual, rows, operation, mode)
        return self._edit_rows(hidden, residual, rows, operation, mode)

    def row_editor(self, operation: Any, otherwise: Callable[[Any, Any], None],
                   graphs: Any = None) -> Callable[[Any, Any], None]:
        """``edit(raw, rows)``: `edit_rows` for one steer's `operation`, chosen once for the run, or `otherwise`
        (the site's general edit) where the halves are not the step's flattened tokens.

        A direction's ablate or clamp at every row of the step (the usual
        steer, with no padding rows past the step's tokens) is its three or
        four kernels on the halves themselves (`Operation.add_change`): no
        slice, no sum, no other Python call. With `graphs` (a
        `streamscope.vllm.graphed.GraphedEdits`, at the taps of an engine
        that replays CUDA graphs), the same kernels on the step's leading rows,
        past which a tap's buffers hold padding, replay as one captured graph.
        """
        if not getattr(operation, "along_direction", False):
            def general(raw: Any, rows: Any) -> None:
                if not self.edit_rows(raw, rows, operation):
                    otherwise(raw, rows)
            return general
        halves, add_change, output = self.halves, operation.add_change, self.where == OUTPUT

        def edit(raw: Any, rows: Any) -> None:
            # `halves`, written out for an output (a block's layer_output): this runs once a block a step.
            if output:
                hidden, residual = (raw[0], raw[1]) if isinstance(raw, tuple) else (raw, None)
            else:
                hidden, residual = halves(raw)
            if (type(rows) is slice and rows.start == 0 and hidden.dim() == 2 and rows.stop <= hidden.shape[0]
                    and (residual is None or residual.shape == hidden.shape) and not torch.is_grad_enabled()):
                if graphs is not None and graphs.replay(operation, hidden, residual, rows.stop):
                    return
                if rows.stop == hidden.shape[0]:
                    add_change(hidden, hidden, residual)
                    return
            if not self.edit_rows(raw, rows, operation):
                otherwise(raw, rows)
        return edit

    @staticmethod
    def _edit_rows(hidden: torch.Tensor, residual: Optional[torch.Tensor], rows: Any, operation: Any,
                   mode: Optional[str] = None) -> bool:
        if mode is None and getattr(operation, "along_direction", False):
            if isinstance(rows, slice):
                target = hidden[rows]
                operation.add_change(target, target, None if residual is None else residual[rows])
            else:
                operation.add_change_at(hidden, rows, hidden[rows], None if residual is None else residual[rows])
            return True
        # Every row (a server's requests all steered alike): the halves themselves, no views of them.
        whole = type(rows) is slice and not rows.start and rows.step is None and (
            rows.stop is None or rows.stop >= hidden.shape[0])
        mine = hidden if whole else hidden[rows]
        stream = mine if residual is None else mine + (residual if whole else residual[rows])
        if mode == "add":
            edited = stream + operation
        elif mode == "set":
            edited = operation.to(hidden.dtype).expand_as(stream)
        elif mode is not None:
            raise ValueError(f"mode {mode!r}: a batched edit adds or sets ('add', 'set')")
        else:
            edited = stream + operation.delta if getattr(operation, "adds_only", False) else operation(stream)
        if residual is None:
            # A stream in one tensor (block 0's input) takes the edited rows as they are, as `write` copies them.
            hidden[rows] = edited.to(hidden.dtype)
            return True
        # Anything else adds edited - stream, bit for bit the write-back's change.
        change = edited.to(hidden.dtype) - stream
        if whole:
            hidden.add_(change)
        elif isinstance(rows, slice):
            hidden[rows].add_(change)
        else:
            hidden.index_add_(0, rows, change)
        return True

    def _write_back(self, host: Host, view: torch.Tensor, raw: Any) -> Any:
        # Inside a visit of vLLM's batch the edit and its NaN/inf scan wait for the visit's end, to land with the
        # other invokes' in one set of kernels (`streamscope.vllm.write_batch`). Only an edited read's write-back
        # waits: its copy is the trace's own, and the invoke runs again only once it has landed. (An assignment's
        # tensor is the user's, who may go on to change it before the visit ends.)
        if not is_edited(view):
            return raw
        hidden, residual = self.halves(raw)
        start = write_batch.span(hidden, residual)
        if start is None:
            self.write(host, raw, self.checked(host, raw, view))
            return raw
        if view.dtype != hidden.dtype or view.shape[1:] != hidden.shape or view.shape[0] != 1:
            # Not the read's own copy as it was served ([1, tokens, hidden_size], the halves' dtype): an
            # assignment's tensor, checked as one.
            live = host.to_user(hidden, self.name)
            self.validate(host, tuple(live.shape), view, live, warn=False)
        scanned = values.WARN_NON_FINITE and view.is_floating_point()
        write_batch.hold(start, hidden, residual, host.to_engine(in_dtype(view, hidden.dtype), hidden, self.name),
                         self.named(host) if scanned else None)
        return raw

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # vLLM runs in inference mode, where grad is off already
            with torch.no_grad():
                return self.write(host, raw, value)
        hidden, residual = self.halves(raw)
        value = host.to_engine(in_dtype(value, hidden.dtype), hidden, self.name)
        if residual is None:
            hidden.copy_(value)
        else:
            hidden.add_(value - (hidden + residual))


class VllmSkip:
    """skip on vLLM: the block's own rows of its output are replaced, other requests keep theirs.

    The engine runs every request of a step through the block in one batch,
    so the block does run; this request's rows of what it returns are then
    `hidden`. Other requests batched in the same step are untouched (nnsight's
    own skip would answer for all of them).
    """

    def skip(self, hidden: torch.Tensor) -> None:
        """Skip this block for this request, handing `hidden` ([1, tokens, hidden_size]) on as its layer_output."""
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"{self.where()}.skip takes a tensor [1, tokens, hidden_size], "
                             f"not a {type(hidden).__name__}.")
        # As on transformers, a skip waits for the block's call: once the block has run (a value of it, or
        # of a later block, was read), it is too late, and the run says so rather than overwrite that read.
        self.block_input(type(self).layer_input.location(self))  # Granite reads it at its first norm
        try:
            self.layer_output = hidden
        except ValueError as error:
            raise ValueError(f"{self.where()}.skip takes the block's layer_output: {error}") from None



#: In a layout's `Layout.stretches`: the next block's layer_input.
NEXT_INPUT = "next.layer_input"
STREAM_DOC = "The residual stream entering this block, before any of its norms, [1, tokens, hidden_size]."
HALVES = ": hidden_states + residual, [1, tokens, hidden_size]"


@dataclass(frozen=True)
class Layout:
    """How vLLM calls a family's blocks: what the engine adds to the block kind to read its values there."""

    def namespace(self, kind: type) -> dict[str, Any]:
        """What the composed class overrides on `kind`: the values this call layout moves, and its settings."""
        return {"FLATTENS_TOKENS": False}  # vLLM's tokens are flat already: nothing to reshape

    def token(self) -> str:
        """This layout as the first part of a composed class's name: ``WholeStream((0, 'hidden_states'), ...)``."""
        return f"{type(self).__name__}{astuple(self)!r}"

    def stretches(self) -> tuple[tuple[str, ...], ...]:
        """The runs of a block's values whose module calls follow one another with nothing between them, each in
        call order (`NEXT_INPUT`: the next block's layer_input): the same tensors flow from one to the next, so the
        graph ops run a run's sites in one launch at its last call (`streamscope.vllm.graph_wiring`). A family
        whose block computes between two of them states its own (``FamilySpec.stretches``)."""
        return ()


@dataclass(frozen=True)
class Fused(Layout):
    """A block with the residual add fused into the next norm (Llama, Qwen, Gemma, Mamba, most families).

    It is called ``forward(positions, hidden_states, residual)`` and returns
    ``(hidden_states, residual)``: hidden_states is what the last sublayer
    produced and residual the stream before it, so the stream is their sum,
    entering and leaving. Its norms are called ``norm(x, residual)`` and return
    ``(normed(x + residual), x + residual)``: layer_mid is the halves' sum at
    the norm the kind reads it at (``post_attention_layernorm``; a sandwich
    block's ``pre_feedforward_layernorm``).
    """

    def stretches(self) -> tuple[tuple[str, ...], ...]:
        # ``x = self_attn(...); x, residual = norm(x, residual)`` and ``x = mlp(x); return x, residual``, the next
        # block called with what this one returned
        return (("self_attn.attention_output", "layer_mid"), ("mlp.mlp_output", "layer_output", NEXT_INPUT))

    def namespace(self, kind: type) -> dict[str, Any]:
        middle = getattr(kind, "layer_mid")  # the kind's own declaration (a descriptor, read on the class)
        return {
            **super().namespace(kind),
            "layer_input": Summed(None, INPUT, hidden=(1, "hidden_states"), residual=(2, "residual"),
                                  description=f"The residual stream entering this block{HALVES}"),
            "layer_mid": Summed(middle.module, INPUT,
                                description=f"The residual stream after the attention add{HALVES}"),
            "layer_output": Summed(None, OUTPUT, description=f"The residual stream leaving this block{HALVES}"),
        }


@dataclass(frozen=True)
class WholeStream(Layout):
    """A block called with the residual stream whole, which returns it (GPT-2, GPT-J, OPT, Falcon, Cohere, ...).

    Args:
        stream: Where the stream sits in the block's call, ``(index, name)``:
            most take the positions first, GPT-2's and OPT's take it alone.
        returns_tuple: Whether the block returns a tuple with the stream
            first (Cohere, Exaone4, StableLM); the values read its first element.
        input_at: A module whose input is the block's input, where the block
            changes its argument before it runs (Granite, whose model scales
            the embeddings in place after block 0 is called): layer_input is
            read there. None: at the block's call.
    """

    stream: tuple[int, str] = (1, "hidden_states")
    returns_tuple: bool = False
    input_at: Optional[str] = None

    def stretches(self) -> tuple[tuple[str, ...], ...]:
        # a sublayer's output is added to the stream in the block's own code; the next block takes what this one
        # returned (read at its call: not where a module of the block reads its input)
        return (("layer_output", NEXT_INPUT),) if self.input_at is None else ()

    def namespace(self, kind: type) -> dict[str, Any]:
        if self.input_at is None:
            layer_input = StreamValue(None, INPUT, argument="STREAM", description=STREAM_DOC)
        else:
            layer_input = StreamValue(self.input_at, INPUT, description=STREAM_DOC)
        return {**super().namespace(kind), "STREAM": self.stream, "RETURNS_TUPLE": self.returns_tuple,
                "layer_input": layer_input}


@dataclass(frozen=True)
class Backend(Layout):
    """transformers' own block inside vLLM's Transformers backend (where the installed vLLM has no class of its
    own for the family): values ``[1, tokens, hidden]`` already, the call as on transformers."""

    def namespace(self, kind: type) -> dict[str, Any]:
        return {}


#: The layout of a family that states none.
FUSED = Fused()
LAYOUTS = {layout.__name__: layout for layout in (Fused, WholeStream, Backend)}


def _layout_part(token: str) -> tuple[str, tuple[type, ...], Callable[[type], dict]]:
    name, _, fields = token.partition("(")
    layout = LAYOUTS[name](*ast.literal_eval(f"({fields}"))
    return "Vllm", (VllmSkip,), layout.namespace


#: The blocks composed here, importable as ``streamscope.vllm.blocks.<qualified name>`` in every process.
BLOCKS = Composer(__name__, _layout_part)


def __getattr__(name: str) -> type:
    return BLOCKS.rebuild(name)


def block_kind(kind: type, layout: Optional[Layout]) -> type:
    """The envoy class of a block of `kind` called the way `layout` says (`FUSED` where it says nothing)."""
    return BLOCKS.compose((layout or FUSED).token(), kind)
