"""OPT: Llama's pre-norm block with LayerNorms (``self_attn_layer_norm``, ``final_layer_norm``) and no MLP module.

The MLP half runs ``fc2(act(fc1(.)))`` on the stream flattened to
``[batch*seq, hidden]``: `fc2` is served as `mlp`, fc1's input is mlp_input,
and every value there is served as ``[batch, seq, hidden]``. With
``do_layer_norm_before=False`` (OPT-350m) a norm follows each residual add.
"""

from typing import Optional

from ...blocks import Attention, Layer, Mlp
from ...errors import POST_LN, POST_NORM_ATTENTION, POST_NORM_MLP
from ...values import INPUT, OUTPUT, Residual, StreamValue

RENAME = {
    "model.decoder.layers": "layers", "model.decoder.embed_tokens": "embed_tokens",
    "model.decoder.final_layer_norm": "norm",
    "self_attn_layer_norm": "input_layernorm", "final_layer_norm": "post_attention_layernorm", "fc2": "mlp",
}

_POST_LN_UNSERVED = {
    "attention_norm_output": POST_NORM_ATTENTION, "mlp_norm_output": POST_NORM_MLP,
    "self_attn.attention_output": POST_LN, "mlp.mlp_output": POST_LN,
}


class OPTLayer(Layer):
    """Serves the flattened MLP half as ``[batch, seq, hidden]``, in the shape the block was called with."""

    FLATTENS_TOKENS = True

    @StreamValue("fc1", INPUT)
    def mlp_input(self) -> Residual:
        """What the MLP's first projection fc1 is called with, [batch, seq, hidden_size]."""

    def _post_ln(self) -> bool:
        return not getattr(self._module, "do_layer_norm_before", True)

    def reason(self, name: str) -> Optional[str]:
        if self._post_ln() and name in _POST_LN_UNSERVED:
            return _POST_LN_UNSERVED[name]
        return super().reason(name)

    def relocated(self) -> dict:
        # Post-LN: the stream between the sublayers is the attention half's norm output.
        return {"layer_mid": ("input_layernorm", OUTPUT)} if self._post_ln() else {}


ENVOYS = {"layers.*": OPTLayer, "self_attn": Attention, "mlp": Mlp}
