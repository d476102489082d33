"""Mamba: a state-space block, ``x + mixer(norm(x))``: one sublayer (the mixer, served as `linear_attn`), no
MLP; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["mamba"]
