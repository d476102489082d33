"""Granite on vLLM (vllm.model_executor.models.granite): Llama's tree, a whole-stream block with multipliers.

``forward(positions, hidden_states)`` returns the stream; each sublayer's
output is scaled by ``residual_multiplier`` before its add (served scaled, as
on transformers). The model multiplies the embeddings by
``embedding_multiplier`` in place, after ``embed_tokens``, so token_embeddings
is read where the scaled embeddings are first called with as a first
argument: block 0's input norm. Each block's layer_input is read there too
(the block hands its input, unchanged, to that norm first), so the two are
one read in the order transformers computes them.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ...values import INPUT
from ..blocks import WholeStream

# The attention's internals are read at vLLM's attention layer, whose scale is the config's attention_multiplier.
SPEC = derive(NEUTRAL["granite"], layout=WholeStream(input_at="input_layernorm"),
              root_sites={"token_embeddings": ("layers.0.input_layernorm", INPUT)})
