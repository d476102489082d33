"""Llama 4 (text): Llama's pre-norm block; the feed-forward is `feed_forward`, aliased to `mlp`.

Every `interleave_moe_layer_step`-th block's feed-forward is a mixture of
experts (routed experts plus a shared expert) that works on flattened tokens,
the others a dense MLP.
"""

from ...blocks import Attention, Layer, Mlp
from .llama import RENAME as LLAMA_RENAME


class Llama4Layer(Layer):
    FLATTENS_TOKENS = True


RENAME = {**LLAMA_RENAME, "feed_forward": "mlp"}
ENVOYS = {"layers.*": Llama4Layer, "self_attn": Attention, "mlp": Mlp}

__all__ = ["ENVOYS", "RENAME"]
