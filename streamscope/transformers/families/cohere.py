"""Cohere (Command R): a parallel block with one LayerNorm feeding both the attention and the MLP."""

from ...families.logits import times_logit_scale
from ...families.neutral import NEUTRAL
from ...families.spec import derive

# transformers' head multiplies the logits by logit_scale (vLLM's logits processor does so on vLLM).
SPEC = derive(NEUTRAL["cohere"], logit_scaling=times_logit_scale)
