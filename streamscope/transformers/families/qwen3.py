"""Qwen3: Llama's tree and Llama's pre-norm block; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["qwen3"]
