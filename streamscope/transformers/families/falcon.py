"""Falcon: a parallel block, ``x + attn(ln_attn(x)) + mlp(ln_mlp(x))`` (new layout) or with one norm shared
(``num_ln_in_parallel_attn=1``, or the old ``parallel_attn``), else the sequential pre-norm block; it returns a tuple."""

from typing import Optional

from ...blocks import Attention, Layer, Mlp
from ...blocks.envoy import module_config
from ...errors import PARALLEL
from ...values import OUTPUT

RENAME = {
    "transformer.h": "layers", "transformer.word_embeddings": "embed_tokens", "transformer.ln_f": "norm",
    "self_attention": "self_attn", "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm",
}


class FalconLayer(Layer):
    """One of Falcon's three layouts, as the block's config and norms say."""

    RETURNS_TUPLE = True

    def _parallel(self) -> bool:
        config = module_config(self)
        return bool(config.new_decoder_architecture or config.parallel_attn)

    def reason(self, name: str) -> Optional[str]:
        if name == "layer_mid" and self._parallel():
            return PARALLEL
        return super().reason(name)

    def relocated(self) -> dict:
        if self._parallel() and not hasattr(self._module, "ln_mlp"):
            # One norm feeds both sublayers.
            return {"mlp_norm_output": ("input_layernorm", OUTPUT)}
        return {}


ENVOYS = {"layers.*": FalconLayer, "self_attn": Attention, "mlp": Mlp}
