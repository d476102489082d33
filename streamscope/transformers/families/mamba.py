"""Mamba: a state-space block, ``x + mixer(norm(x))``: one sublayer (the mixer, served as `linear_attn`), no MLP."""

from ...blocks import LinearAttention, StateSpaceLayer
from ...blocks.state_space import HEADLESS as UNSERVED
from ...families.renames import MAMBA as RENAME

ENVOYS = {"layers.*": StateSpaceLayer, "linear_attn": LinearAttention}

__all__ = ["ENVOYS", "RENAME", "UNSERVED"]
