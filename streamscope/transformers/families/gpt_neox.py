"""GPT-NeoX (Pythia): ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else Llama's sequential pre-norm block."""

from typing import Optional

from ...blocks import Attention, Layer, Mlp
from ...errors import PARALLEL

RENAME = {
    "gpt_neox.layers": "layers", "gpt_neox.embed_in": "embed_tokens", "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",  # older transformers name the unembedding embed_out
    "attention": "self_attn",
}


class GPTNeoXLayer(Layer):
    """Parallel or sequential, as the block's ``use_parallel_residual`` says."""

    def reason(self, name: str) -> Optional[str]:
        if name == "layer_mid" and getattr(self._module, "use_parallel_residual", False):
            return PARALLEL
        return super().reason(name)


ENVOYS = {"layers.*": GPTNeoXLayer, "self_attn": Attention, "mlp": Mlp}
