"""Llama (LlamaForCausalLM): the pre-norm block every other family is described against."""

from ...blocks import Attention, Layer, Mlp
from ...families import FamilySpec
from ...families.renames import LLAMA

# Envoys keyed on aliased path suffixes, so every family with Llama's tree shares them.
SPEC = FamilySpec(rename=LLAMA, envoys={"layers.*": Layer, "self_attn": Attention, "mlp": Mlp})
