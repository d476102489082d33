"""Llama (LlamaForCausalLM): the pre-norm block every other family is described against."""

from ...blocks import Attention, Layer, Mlp
from ...families.renames import LLAMA as RENAME

# Keyed on aliased path suffixes, so every family with Llama's tree shares it.
ENVOYS = {"layers.*": Layer, "self_attn": Attention, "mlp": Mlp}
