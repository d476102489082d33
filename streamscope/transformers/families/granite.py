"""Granite: Llama's block with multipliers: each sublayer's output is scaled by `residual_multiplier` before its add.

The embeddings are multiplied by `embedding_multiplier` in the model's forward,
after ``embed_tokens``, so token_embeddings is read where the stream enters
block 0; the logits are divided by `logits_scaling` (model.logits is after it).
"""

from ...blocks import Attention, Layer, Mlp
from ...blocks.envoy import module_config
from ...values import INPUT, OUTPUT, StreamValue
from .llama import RENAME


def _residual_multiplier(envoy) -> float:
    return module_config(envoy).residual_multiplier


class GraniteAttention(Attention):
    @StreamValue(None, OUTPUT, factor=_residual_multiplier)
    def attention_output(self):
        """What the attention adds to the stream: its output times residual_multiplier, [batch, seq, hidden_size]."""


class GraniteMlp(Mlp):
    @StreamValue(None, OUTPUT, factor=_residual_multiplier)
    def mlp_output(self):
        """What the MLP adds to the stream: its output times residual_multiplier, [batch, seq, hidden_size]."""


ENVOYS = {"layers.*": Layer, "self_attn": GraniteAttention, "mlp": GraniteMlp}
ROOT_SITES = {"token_embeddings": ("layers.0", INPUT)}

__all__ = ["ENVOYS", "RENAME", "ROOT_SITES"]
