"""OLMo 2: a post-norm block, ``x + norm(attn(x))`` then ``+ norm(mlp(.))``: the sublayers read the stream itself."""

from dataclasses import replace

from ...blocks import PostNormedAttention, PostNormedMlp, PostNormLayer
from . import llama

SPEC = replace(llama.SPEC, envoys={"layers.*": PostNormLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp})
