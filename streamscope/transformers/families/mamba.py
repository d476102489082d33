"""Mamba: a state-space block, ``x + mixer(norm(x))``: one sublayer (the mixer, served as `linear_attn`), no MLP."""

from ...blocks import LinearAttention, StateSpaceLayer
from ...blocks.state_space import HEADLESS
from ...families import FamilySpec
from ...families.renames import MAMBA

SPEC = FamilySpec(rename=MAMBA, envoys={"layers.*": StateSpaceLayer, "linear_attn": LinearAttention}, unserved=HEADLESS)
