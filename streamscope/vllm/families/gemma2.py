"""Gemma 2 on vLLM (vllm.model_executor.models.gemma2): a fused block with sandwich norms.

The block calls ``input_layernorm(x, residual)`` and
``pre_feedforward_layernorm(x, residual)`` (the fused adds: the stream is the
halves' sum there), and ``post_attention_layernorm(x)`` and
``post_feedforward_layernorm(x)`` on a sublayer's output alone, so the
contributions are the post-norms' outputs as on transformers. The embeddings
are scaled by sqrt(hidden_size) after `embed_tokens`, as on Gemma (1): served
at block 0's hidden_states. vLLM's Gemma 2 has no `lm_head`: its logits use
`embed_tokens`' weight (tied, as on transformers).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import FUSED
from .gemma import SCALED_EMBEDDINGS

SPEC = derive(NEUTRAL["gemma2"], layout=FUSED, root_sites=SCALED_EMBEDDINGS)
