"""Gemma (1): Llama's tree and Llama's pre-norm block (the embeddings scaled inside ``embed_tokens``)."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["gemma"]
