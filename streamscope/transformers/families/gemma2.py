"""Gemma 2: Llama's tree with sandwich norms: each sublayer's output passes a post-norm before its add.

The MLP's pre-norm is ``pre_feedforward_layernorm``; the contributions are the
post-norms' outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``).
The embeddings are scaled by sqrt(hidden_size) inside ``embed_tokens``.

Gemma 2 soft-caps its attention logits (``attn_logit_softcapping``), and
transformers' sdpa kernel, its default, drops the cap: the model it runs is
not Gemma 2, and not what vLLM runs. Loaded here it takes the eager kernel,
which applies the cap, unless the caller names another implementation.
"""

from typing import Any, Mapping

from ...families.logits import soft_capped
from ...families.neutral import NEUTRAL
from ...families.spec import derive


def capped_attention(config: Any, asked: Mapping[str, Any]) -> dict[str, Any]:
    """The eager kernel for a checkpoint whose attention logits are capped, where the caller chose no kernel."""
    if getattr(config, "attn_logit_softcapping", None) is None or "attn_implementation" in asked:
        return {}
    return {"attn_implementation": "eager"}


SPEC = derive(NEUTRAL["gemma2"], logit_scaling=soft_capped, checkpoint_defaults=capped_attention)
