"""OLMo 2: a post-norm block, ``x + norm(attn(x))`` then ``+ norm(mlp(.))``: the sublayers read the stream itself."""

from ...blocks import PostNormedAttention, PostNormedMlp, PostNormLayer
from .llama import RENAME

ENVOYS = {"layers.*": PostNormLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp}

__all__ = ["ENVOYS", "RENAME"]
