"""The transformers engine: one family module per model type under `families/`."""

from .model import StandardizedTransformers, load

__all__ = ["StandardizedTransformers", "load"]
