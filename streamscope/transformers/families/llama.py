"""Llama (LlamaForCausalLM): the pre-norm block every other family is described against; nothing
transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["llama"]
