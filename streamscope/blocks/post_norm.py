"""Post-norm and sandwich-norm blocks: a norm after each sublayer, before its add."""

from __future__ import annotations

from ..errors import POST_NORM_ATTENTION, POST_NORM_MLP
from ..values import INPUT, OUTPUT, Residual, StreamValue
from .layer import Layer


class PostNormLayer(Layer):
    """``x + norm1(attn(x))`` then ``+ norm2(mlp(.))`` (Olmo2, Exaone4): the sublayers read the stream itself.

    Pair it with `PostNormedAttention` and `PostNormedMlp`, whose contributions
    are the post-norms' outputs.
    """

    UNSERVED = {"attention_norm_output": POST_NORM_ATTENTION, "mlp_norm_output": POST_NORM_MLP}

    @StreamValue("mlp", INPUT)
    def layer_mid(self) -> Residual:
        """The residual stream between the two sublayers, which the MLP reads itself, [batch, seq, hidden_size]."""


class SandwichLayer(Layer):
    """Norms on both sides of each sublayer (Gemma 2 and 3).

    ``x + post1(attn(pre1(x)))`` then ``+ post2(mlp(pre2(.)))``: the MLP's
    pre-norm is ``pre_feedforward_layernorm``, so layer_mid and mlp_norm_output
    are keyed on it. Pair it with `PostNormedAttention` and `PostNormedMlp`.
    """

    @StreamValue("pre_feedforward_layernorm", INPUT)
    def layer_mid(self) -> Residual:
        """The residual stream between the two sublayers, layer_input + attention_output, [batch, seq, hidden_size]."""

    @StreamValue("pre_feedforward_layernorm", OUTPUT)
    def mlp_norm_output(self) -> Residual:
        """The MLP's pre-norm output, [batch, seq, hidden_size]."""
