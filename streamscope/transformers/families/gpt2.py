"""GPT-2 (GPT2LMHeadModel): a pre-norm block, ``x + attn(ln_1(x))`` then ``+ mlp(ln_2(.))``, returning a tensor."""

from ...blocks import Attention, Layer, Mlp
from ...families import FamilySpec

SPEC = FamilySpec(
    rename={"transformer.h": "layers", "transformer.wte": "embed_tokens", "transformer.ln_f": "norm",
            "attn": "self_attn", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"},
    envoys={"layers.*": Layer, "self_attn": Attention, "mlp": Mlp},
    learned_positions=True,
)
