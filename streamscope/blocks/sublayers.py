"""The sublayers of a block: what each adds to the residual stream."""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from ..values import OUTPUT, StreamValue
from .envoy import StreamEnvoy
from .heads import INTERNALS, AttentionInternals


class Sublayer(StreamEnvoy):
    """A sublayer of a decoder block, under the name `ROLE` on its block."""

    #: The sublayer's name on its block: self_attn, linear_attn or mlp.
    ROLE: ClassVar[str] = ""

    def block(self) -> Optional[StreamEnvoy]:
        """The decoder block this sublayer belongs to."""
        from .layer import Layer

        node = self.parent
        while node is not None and not isinstance(node, Layer):
            node = node.parent
        return node

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is not None:
            return own
        block = self.block()
        return block.reason(f"{self.ROLE}.{name}") if block is not None else None

    def where(self) -> str:
        block = self.block()
        return f"{block.where()}.{self.ROLE}" if block is not None else self.path


class Mixer(Sublayer):
    """A sublayer that mixes positions: softmax attention (`Attention`) or a recurrent mixer (`LinearAttention`)."""

    @StreamValue(None, OUTPUT)
    def attention_output(self):
        """What the attention adds to the residual stream, [batch, seq, hidden_size].

        The attention's output projection on a pre-norm block; after the
        post-norm where the family has one (Gemma 2 and 3, Olmo2, Exaone4), and
        scaled where the family scales it (Granite). In-place edits and
        assignment reach the model.
        """


class Attention(AttentionInternals, Mixer):
    """The softmax attention of a block (`self_attn`): its output, and its queries, keys, values, scores,
    pattern and head outputs (`streamscope.blocks.heads`)."""

    ROLE = "self_attn"
    ORDER = (*INTERNALS, "attention_output")

    def reason(self, name: str) -> Optional[str]:
        own = super().reason(name)
        if own is None and name in INTERNALS:
            return self.kernel_reason()
        return own

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        if name in INTERNALS:
            return self.internals_to_user(tensor, name)
        return super().to_user(tensor, name)

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        if name in INTERNALS:
            return self.internals_to_engine(value, live, name)
        return super().to_engine(value, live, name)


class LinearAttention(Mixer):
    """A recurrent mixer in the attention's place (`linear_attn`): a gated delta net, a Mamba mixer."""

    ROLE = "linear_attn"


class Mlp(Sublayer):
    """The feed-forward of a block (`mlp`): a dense MLP or a mixture of experts."""

    ROLE = "mlp"

    @StreamValue(None, OUTPUT)
    def mlp_output(self):
        """What the MLP adds to the residual stream, [batch, seq, hidden_size].

        The MLP's down projection on a pre-norm block (a mixture of experts:
        the routed experts' weighted sum plus any shared expert); after the
        post-norm where the family has one. In-place edits and assignment
        reach the model.
        """


class PostNormedAttention(Attention):
    """An attention whose output passes through the block's `post_attention_layernorm` before the add."""

    @StreamValue("..post_attention_layernorm", OUTPUT)
    def attention_output(self):
        """What the attention adds to the residual stream, after its post-norm, [batch, seq, hidden_size]."""


class PostNormedMlp(Mlp):
    """An MLP whose output passes through the block's `post_feedforward_layernorm` before the add."""

    @StreamValue("..post_feedforward_layernorm", OUTPUT)
    def mlp_output(self):
        """What the MLP adds to the residual stream, after its post-norm, [batch, seq, hidden_size]."""
