"""Mixtral: Llama's tree; every block's `mlp` is a mixture of experts (`MixtralSparseMoeBlock`)."""

from .llama import ENVOYS, RENAME

__all__ = ["ENVOYS", "RENAME"]
