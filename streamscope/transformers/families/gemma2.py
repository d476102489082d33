"""Gemma 2: Llama's tree with sandwich norms: each sublayer's output passes a post-norm before its add.

The MLP's pre-norm is ``pre_feedforward_layernorm``; the contributions are the
post-norms' outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``).
The embeddings are scaled by sqrt(hidden_size) inside ``embed_tokens``.
"""

from dataclasses import replace

from ...blocks import PostNormedAttention, PostNormedMlp, SandwichLayer
from ...families.logits import soft_capped
from . import llama

SPEC = replace(llama.SPEC, envoys={"layers.*": SandwichLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp},
               logit_scaling=soft_capped)
