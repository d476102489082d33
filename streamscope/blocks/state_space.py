"""Blocks whose mixer is recurrent: state-space blocks and hybrids."""

from __future__ import annotations

from ..errors import STATE_SPACE
from .layer import Layer


class StateSpaceLayer(Layer):
    """``x + mixer(norm(x))`` (Mamba): one sublayer, the mixer, aliased to `linear_attn`; no MLP."""

    ROLES = ("linear_attn", "mlp")
    UNSERVED = {"layer_mid": STATE_SPACE, "mlp_norm_output": STATE_SPACE, "mlp_input": STATE_SPACE}


class HybridLayer(Layer):
    """A pre-norm block whose mixer is softmax attention on some blocks and a recurrent one on others (Qwen3-Next)."""

    ROLES = ("self_attn", "linear_attn", "mlp")
