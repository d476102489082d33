"""Cohere (Command R): a parallel block with one LayerNorm feeding both the attention and the MLP."""

from ...blocks import Attention, Mlp, SharedNormParallelLayer
from .llama import RENAME

ENVOYS = {"layers.*": SharedNormParallelLayer, "self_attn": Attention, "mlp": Mlp}

__all__ = ["ENVOYS", "RENAME"]
