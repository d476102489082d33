"""Llama (LlamaForCausalLM): the pre-norm block every other family is described against."""

from ...blocks import Attention, Layer, Mlp

RENAME = {"model.embed_tokens": "embed_tokens", "model.layers": "layers", "model.norm": "norm"}

# Keyed on aliased path suffixes, so every family with Llama's tree shares it.
ENVOYS = {"layers.*": Layer, "self_attn": Attention, "mlp": Mlp}
