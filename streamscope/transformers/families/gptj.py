"""GPT-J: a parallel block with one norm, ``x + attn(ln_1(x)) + mlp(ln_1(x))``; the block returns a tuple."""

from ...blocks import Attention, Mlp, SharedNormParallelLayer

RENAME = {
    "transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
    "attn": "self_attn", "ln_1": "input_layernorm",
}


class GPTJLayer(SharedNormParallelLayer):
    RETURNS_TUPLE = True


ENVOYS = {"layers.*": GPTJLayer, "self_attn": Attention, "mlp": Mlp}
