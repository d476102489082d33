"""EXAONE 4 on vLLM (vllm.model_executor.models.exaone4): a whole-stream post-norm block, no input norm.

``x + post_attention_layernorm(attn(x))`` then ``+ post_feedforward_layernorm(mlp(.))``;
``forward(positions, hidden_states, residual)`` ignores the residual and
returns ``(hidden_states, residual)``: the whole stream first, layer_mid
second; the values read the first.
"""

from dataclasses import replace

from ...blocks import PostNormedAttention, PostNormedMlp, PostNormLayer
from ..blocks import WholeStream
from . import llama

SPEC = replace(llama.SPEC, envoys={"layers.*": PostNormLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp},
               layout=WholeStream(returns_tuple=True))
