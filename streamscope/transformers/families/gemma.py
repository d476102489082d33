"""Gemma (1): Llama's tree and Llama's pre-norm block."""

from .llama import SPEC

__all__ = ["SPEC"]
