"""Gemma 3 (text): Gemma 2's sandwich-norm block, with sliding and full attention by layer type."""

from .gemma2 import SPEC

__all__ = ["SPEC"]
