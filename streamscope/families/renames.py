"""The ``rename=`` maps both engines use: transformers' module names, which vLLM's own model classes keep."""

from __future__ import annotations

#: Llama's tree, shared by every family built like it (``model.layers``, ``model.embed_tokens``, ``model.norm``).
LLAMA = {"model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.norm": "norm"}

FALCON = {
    "transformer.h": "layers", "transformer.word_embeddings": "embed_tokens", "transformer.ln_f": "norm",
    "self_attention": "self_attn", "ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm",
}

GPT_NEOX = {
    "gpt_neox.layers": "layers", "gpt_neox.embed_in": "embed_tokens", "gpt_neox.final_layer_norm": "norm",
    "embed_out": "lm_head",  # older transformers name the unembedding embed_out
    "attention": "self_attn",
}

# Block keys first: "norm" must not bind on the root, where "norm" is the final norm's alias.
MAMBA = {
    "norm": "input_layernorm", "mixer": "linear_attn",
    "backbone.layers": "layers", "backbone.embeddings": "embed_tokens", "backbone.norm_f": "norm",
}

OPT = {
    "model.decoder.layers": "layers", "model.decoder.embed_tokens": "embed_tokens",
    "model.decoder.final_layer_norm": "norm",
    "self_attn_layer_norm": "input_layernorm", "final_layer_norm": "post_attention_layernorm", "fc2": "mlp",
}
