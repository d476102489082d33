"""Blocks whose mixer is recurrent: state-space blocks and hybrids."""

from __future__ import annotations

from ..errors import NO_HEADS, STATE_SPACE
from .layer import Layer

#: The sizes a state-space model has none of, with the reason: a family's unserved root values.
HEADLESS = {"num_heads": NO_HEADS, "num_kv_heads": NO_HEADS, "head_dim": NO_HEADS}


class StateSpaceLayer(Layer):
    """``x + mixer(norm(x))`` (Mamba): one sublayer, the mixer, aliased to `linear_attn`; no MLP."""

    ROLES = ("linear_attn", "mlp")
    UNSERVED = {"layer_mid": STATE_SPACE, "mlp_norm_output": STATE_SPACE, "mlp_input": STATE_SPACE}


class HybridLayer(Layer):
    """A pre-norm block whose mixer is softmax attention on some blocks and a recurrent one on others (Qwen3-Next)."""

    ROLES = ("self_attn", "linear_attn", "mlp")
