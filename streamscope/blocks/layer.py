"""Layer: a decoder block, whose residual stream is layer_output."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch

from .. import nnsight_seam as seam
from ..errors import Unavailable, missing_module
from ..support import BlockSupport
from ..values import INPUT, OUTPUT, Residual, StreamValue, check_write, first_tensor, in_trace
from .envoy import StreamEnvoy, record_stream_shape
from .sublayers import NEURONS, Attention, LinearAttention, Mlp, Sublayer

#: The modules a block's values are keyed on, under their aliased names.
MODULE_NAMES = ("self_attn", "linear_attn", "mlp", "input_layernorm", "post_attention_layernorm")


#: The residual stream's boundaries on a block, as the stream passes them: before the attention half, between
#: the halves, after the block. `Layer.ORDER` is all of them; every other list of the names is built from these.
BEFORE_ATTENTION = ("layer_input", "attention_norm_output")
BETWEEN_HALVES = ("layer_mid", "mlp_norm_output", "mlp_input")
AFTER_BLOCK = ("layer_output",)


class Layer(StreamEnvoy):
    """A decoder block. Its hidden states are layer_output, whatever the block returns.

    The base is the pre-norm block, ``x + attn(norm1(x))`` then
    ``+ mlp(norm2(.))``. Between layer_input and layer_output it has four more
    boundaries, each the input or output of one of its modules, keyed on the
    aliased names ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``. A block built otherwise is a
    subclass that points each name at its own modules or marks it unserved
    with the reason; a block without a module reports "no <module> module on
    this block".

    Attributes:
        self_attn: The softmax attention, an `Attention`.
        linear_attn: The recurrent mixer, a `LinearAttention` (hybrid and
            state-space families).
        mlp: The feed-forward, an `Mlp`.
        input_layernorm, post_attention_layernorm: The block's norms under
            their aliased names, where the family has them.
    """

    IS_BLOCK = True
    #: The sublayers a support table lists for this kind of block.
    ROLES: ClassVar[tuple[str, ...]] = ("self_attn", "mlp")
    #: Whether the block returns a tuple with the stream first (skip packs the same way).
    RETURNS_TUPLE: ClassVar[bool] = False
    #: Whether the block flattens its tokens for a sublayer, so values there need the stream's shape.
    FLATTENS_TOKENS: ClassVar[bool] = False
    ORDER = (*BEFORE_ATTENTION, *BETWEEN_HALVES, *AFTER_BLOCK)
    _ROLE_KINDS: ClassVar[dict[str, type[Sublayer]]] = {
        "self_attn": Attention, "linear_attn": LinearAttention, "mlp": Mlp,
    }

    @StreamValue(None, INPUT)
    def layer_input(self) -> Residual:
        """The residual stream entering this block, before any of its norms, [batch, seq, hidden_size].

        With the contributions it is the identity the values are defined by:
        layer_input + attention_output + mlp_output == layer_output. In-place
        edits and assignment reach the model.
        """

    @StreamValue("input_layernorm", OUTPUT)
    def attention_norm_output(self) -> Residual:
        """The attention's pre-norm output: what the attention is called with, [batch, seq, hidden_size]."""

    @StreamValue("post_attention_layernorm", INPUT)
    def layer_mid(self) -> Residual:
        """The residual stream between the two sublayers, layer_input + attention_output, [batch, seq, hidden_size]."""

    @StreamValue("post_attention_layernorm", OUTPUT)
    def mlp_norm_output(self) -> Residual:
        """The MLP's pre-norm output, [batch, seq, hidden_size]."""

    @StreamValue("mlp", INPUT)
    def mlp_input(self) -> Residual:
        """What the MLP is called with, [batch, seq, hidden_size]: mlp_norm_output where nothing sits between."""

    @StreamValue(None, OUTPUT)
    def layer_output(self) -> Residual:
        """The residual stream leaving this block, [batch, seq, hidden_size]: the next block's layer_input."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        if self.FLATTENS_TOKENS:
            record_stream_shape(module)

    def module_bound(self, module: torch.nn.Module) -> None:
        if self.FLATTENS_TOKENS:
            record_stream_shape(module)

    def index(self) -> int:
        """This block's position in `model.layers`."""
        return int(self.path.rsplit(".", 1)[-1])

    def where(self) -> str:
        return f"model.layers[{self.index()}]"

    def __getattr__(self, name: str) -> Any:
        if name in MODULE_NAMES and "_module" in self.__dict__:
            module = getattr(seam.module_of(self), name, None)
            if not isinstance(module, torch.nn.Module):
                raise Unavailable(name, self.where(), missing_module(name))
        return super().__getattr__(name)

    def skip(self, hidden: torch.Tensor) -> None:
        """Skip this block, handing `hidden` on as its residual stream, [batch, seq, hidden_size].

        The block does not run; `hidden` takes the place of its layer_output,
        packed the way the block would have returned it (a tuple family gets
        ``(hidden, None)``). Call it inside a trace, before the block runs.
        """
        live = first_tensor(self.block_input())
        expected = tuple(self.to_user(live, "layer_output").shape)
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != expected:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(
                f"{self.where()}.skip takes the block's layer_output, a tensor of shape {expected} "
                f"[batch, seq, hidden_size]; got {got}."
            )
        check_write(f"{self.where()}.skip", "[batch, seq, hidden_size]", expected, hidden)
        # A copy: the model may work on the block's output in place, and `hidden` is the user's (often a read).
        replacement = self.to_engine(hidden.to(live.dtype, copy=True), live, "layer_output")
        seam.skip_at(seam.location(self.path, "skip"), self.pack(replacement))

    def block_input(self, location: Optional[str] = None) -> Any:
        """The block's call as the model makes it (or the call at `location`, the block's first value where a
        family reads it inside the block); a skip waits for it, and comes too late once it has passed."""
        location = location or seam.location(self.path, INPUT)
        mediator = in_trace(f"{self.where()}.skip", "called")
        mediator.streamscope_wanted = (location, f"{self.where()}.skip")
        return seam.read_at(location)

    def pack(self, hidden: torch.Tensor) -> Any:
        """`hidden` as the block returns its stream."""
        return (hidden, None) if self.RETURNS_TUPLE else hidden

    def support(self) -> BlockSupport:
        """Every value of this block: served, or the reason it is not. Runs nothing."""
        rows: dict[str, Any] = dict(self.value_reasons())
        for role in self.ROLES:
            sublayer = self.__dict__.get(role)
            if isinstance(sublayer, Sublayer):
                rows.update(_sublayer_rows(sublayer, role))
            else:
                for name in self._ROLE_KINDS[role].value_names():
                    rows[f"{role}.{name}"] = missing_module(role)

        def nested(role: str, known: list[str]) -> list[str]:  # a sublayer's sublayers' rows, after its own
            return [name for name in rows if name.startswith(role + ".") and name not in known]

        attention = [f"self_attn.{name}" for name in Attention.ORDER]
        mlp = [f"mlp.{name}" for name in Mlp.ORDER]
        order = [*BEFORE_ATTENTION, *attention, *nested("self_attn", attention),
                 f"{LinearAttention.ROLE}.{LinearAttention.CONTRIBUTION}",
                 *BETWEEN_HALVES, *mlp, *nested("mlp", mlp), *AFTER_BLOCK]
        rank = {name: position for position, name in enumerate(order)}
        ordered = sorted(rows, key=lambda name: rank.get(name, len(order)))
        return BlockSupport(self.where(), {name: rows[name] for name in ordered})


def _sublayer_rows(sublayer: Sublayer, prefix: str) -> dict[str, Any]:
    """A sublayer's rows under `prefix` (``mlp``), then those of the sublayers inside it (``mlp.shared_experts``)."""
    rows = {f"{prefix}.{name}": reason for name, reason in sublayer.value_reasons().items()}
    seen: set[int] = set()
    for attribute, child in list(sublayer.__dict__.items()):
        if isinstance(child, Sublayer) and id(child) not in seen:
            seen.add(id(child))
            rows.update(_sublayer_rows(child, child.ROLE))
    return rows


#: The residual stream's boundaries on every block, in the order the block computes them.
BOUNDARIES = Layer.ORDER
#: The sublayers that add to the stream, and the value each adds under its role: ``self_attn.attention_output``.
CONTRIBUTORS = (Attention, LinearAttention, Mlp)
CONTRIBUTIONS = tuple(f"{kind.ROLE}.{kind.CONTRIBUTION}" for kind in CONTRIBUTORS)
#: A contribution's short name (the sublayer's own value name) and the roles that may add it, first found first.
SHORT_CONTRIBUTIONS = {name: tuple(kind.ROLE for kind in CONTRIBUTORS if kind.CONTRIBUTION == name)
                       for name in dict.fromkeys(kind.CONTRIBUTION for kind in CONTRIBUTORS)}
#: The boundaries, the short contributions and a dense MLP's neurons, in the order a block computes them.
STREAM_ORDER = (*BEFORE_ATTENTION, Attention.CONTRIBUTION, *BETWEEN_HALVES, *NEURONS, Mlp.CONTRIBUTION, *AFTER_BLOCK)
