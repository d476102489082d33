"""Qwen3-Next: a hybrid: each pre-norm block mixes with softmax attention (`self_attn`) or a gated delta net (`linear_attn`)."""

from ...blocks import Attention, HybridLayer, LinearAttention, Mlp
from .llama import RENAME

ENVOYS = {"layers.*": HybridLayer, "self_attn": Attention, "linear_attn": LinearAttention, "mlp": Mlp}

__all__ = ["ENVOYS", "RENAME"]
