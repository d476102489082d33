"""Mamba: a state-space block, ``x + mixer(norm(x))``: one sublayer (the mixer, served as `linear_attn`), no MLP."""

from ...blocks import LinearAttention, StateSpaceLayer

# Block keys first: "norm" must not bind on the root, where "norm" is the final norm's alias.
RENAME = {
    "norm": "input_layernorm", "mixer": "linear_attn",
    "backbone.layers": "layers", "backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm",
}

ENVOYS = {"layers.*": StateSpaceLayer, "linear_attn": LinearAttention}

NO_HEADS = "a state-space model has no attention heads: its mixer is a selective scan, not attention"
UNSERVED = {"num_heads": NO_HEADS, "num_kv_heads": NO_HEADS, "head_dim": NO_HEADS}
