"""Gemma (1) on vLLM (vllm.model_executor.models.gemma): Llama's names and Llama's fused block.

One difference from transformers: vLLM multiplies the embeddings by
sqrt(hidden_size) after `embed_tokens` (in the model's forward), where
transformers scales inside its embedding module. The token embeddings, after
the scaling, are therefore served where they first exist: block 0's
hidden_states argument (block 0 is called with residual None, so that argument
is the whole stream; an edit there is the stream block 0 receives).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import INPUT
from ..blocks import FUSED

#: Where vLLM's Gemma models first hold the scaled token embeddings: block 0's stream argument.
SCALED_EMBEDDINGS = {"token_embeddings": ("layers.0", INPUT, (1, "hidden_states"))}

SPEC = derive(NEUTRAL["gemma"], layout=FUSED, root_sites=SCALED_EMBEDDINGS)
