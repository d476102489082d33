"""Qwen3-MoE: Llama's tree; the `mlp` of a block is a mixture of experts (or a dense MLP on `mlp_only_layers`)."""

from .llama import ENVOYS, RENAME

__all__ = ["ENVOYS", "RENAME"]
