"""Parallel blocks: the attention and the MLP read the same stream and both add to it."""

from __future__ import annotations

from ..errors import PARALLEL
from ..values import OUTPUT, Residual, StreamValue
from .layer import Layer


class ParallelLayer(Layer):
    """``x + attn(norm1(x)) + mlp(norm2(x))`` (GPT-NeoX, Falcon's new layout): no stream between the sublayers."""

    UNSERVED = {"layer_mid": PARALLEL}


class SharedNormParallelLayer(ParallelLayer):
    """``x + attn(norm(x)) + mlp(norm(x))`` (GPT-J, Cohere): one norm feeds both sublayers."""

    @StreamValue("input_layernorm", OUTPUT)
    def mlp_norm_output(self) -> Residual:
        """The MLP's pre-norm output, the block's one norm: the same tensor as attention_norm_output."""
