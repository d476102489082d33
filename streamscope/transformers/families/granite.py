"""Granite: Llama's block with multipliers: each sublayer's output is scaled by `residual_multiplier` before its add.

The embeddings are multiplied by `embedding_multiplier` in the model's forward,
after ``embed_tokens``, so token_embeddings is read where the stream enters
block 0; the logits are divided by `logits_scaling` (model.logits is after it).
"""

from ...blocks import Layer
from ...blocks.scaled import GraniteAttention, GraniteMlp
from ...values import INPUT
from .llama import RENAME

ENVOYS = {"layers.*": Layer, "self_attn": GraniteAttention, "mlp": GraniteMlp}
ROOT_SITES = {"token_embeddings": ("layers.0", INPUT)}

__all__ = ["ENVOYS", "RENAME", "ROOT_SITES"]
