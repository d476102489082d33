"""Post-norm and sandwich-norm blocks: a norm after each sublayer, before its add (or after it: OPT's post-LN)."""

from __future__ import annotations

from typing import Optional

from .. import nnsight_seam as seam
from ..errors import POST_LN, POST_NORM_ATTENTION, POST_NORM_MLP
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


_POST_LN_UNSERVED = {
    "attention_norm_output": POST_NORM_ATTENTION, "mlp_norm_output": POST_NORM_MLP,
    "self_attn.attention_output": POST_LN, "mlp.mlp_output": POST_LN,
}


class OPTLayer(Layer):
    """OPT's block: Llama's pre-norm block with the MLP as ``fc2(act(fc1(.)))`` on the block itself (fc2 aliased to
    `mlp`), or, with ``do_layer_norm_before=False`` (OPT-350m), a post-LN block: a norm after each residual add.

    transformers' block flattens the MLP half to ``[batch*seq, hidden]``; its values are served as
    ``[batch, seq, hidden]``, in the shape the block was called with.
    """

    FLATTENS_TOKENS = True

    @StreamValue("fc1", INPUT)
    def mlp_input(self) -> Residual:
        """What the MLP's first projection fc1 is called with, [batch, seq, hidden_size]."""

    def _post_ln(self) -> bool:
        return not getattr(seam.module_of(self), "do_layer_norm_before", True)

    def reason(self, name: str) -> Optional[str]:
        if self._post_ln() and name in _POST_LN_UNSERVED:
            return _POST_LN_UNSERVED[name]
        return super().reason(name)

    def relocated(self) -> dict:
        # Post-LN: the stream between the sublayers is the attention half's norm output.
        return {"layer_mid": ("input_layernorm", OUTPUT)} if self._post_ln() else {}
