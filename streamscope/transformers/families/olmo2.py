"""OLMo 2: a post-norm block, ``x + norm(attn(x))`` then ``+ norm(mlp(.))``: the sublayers read the stream
itself; nothing transformers-only."""

from ...families.neutral import NEUTRAL

SPEC = NEUTRAL["olmo2"]
