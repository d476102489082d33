"""Tiny random checkpoints of every family, for tests, demos and users' own experiments.

    from streamscope.testing import build_checkpoint
    path = build_checkpoint("llama", "/tmp/tiny-llama")
    model = streamscope.load(path)
"""

from .checkpoints import FAMILIES, FAMILY_CONFIGS, build_checkpoint, tiny_config
from .tokenizer import train_tokenizer

__all__ = ["FAMILIES", "FAMILY_CONFIGS", "build_checkpoint", "tiny_config", "train_tokenizer"]
