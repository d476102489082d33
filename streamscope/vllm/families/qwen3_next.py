"""Qwen3-Next on vLLM (vllm.model_executor.models.qwen3_next): a hybrid fused block.

Each block mixes with softmax attention (`self_attn`) or a gated delta net
(`linear_attn`), then a mixture of experts with a gated shared expert (`mlp`,
whose output is what the block adds; the routing runs inside vLLM's fused MoE
kernel, and the routing values say so; the shared expert, `shared_experts` as
on transformers, is called and gated inside vLLM's fused MoE layer, so its
mlp_output is unavailable: `streamscope.vllm.moe`). The block is fused like
Llama's but is called with keywords in another order,
``forward(hidden_states, residual, positions)``; the values find the halves by
name. vLLM's CPU kernels for the gated delta net run bfloat16
only, with head dims of 64.
"""

from dataclasses import replace
from importlib.util import find_spec

import torch

from ...blocks import HybridLayer, LinearAttention
from ..attention import VllmAttention
from ..blocks import FusedLayer
from ..moe import VllmMlp, VllmSharedExpert
from . import llama


class Qwen3NextLayer(FusedLayer):
    """The fused block, listing both mixers in its support table (as transformers' `HybridLayer`)."""

    ROLES = HybridLayer.ROLES


SPEC = replace(
    llama.SPEC, rename={**llama.SPEC.rename, "shared_expert": "shared_experts"},
    envoys={"layers.*": Qwen3NextLayer, "self_attn": VllmAttention, "linear_attn": LinearAttention, "mlp": VllmMlp,
            "shared_experts": VllmSharedExpert},
    # vLLM runs the gated delta net's prefill with flashinfer on Hopper GPUs where it can; without flashinfer
    # installed it must be told to use its own Triton kernel, which runs on every GPU (CPUs have their own).
    engine_defaults={"gdn_prefill_backend": "triton"} if torch.cuda.is_available() and not find_spec("flashinfer")
    else {},
)
