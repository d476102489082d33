"""Qwen3-Next: a hybrid: each pre-norm block mixes with softmax attention (`self_attn`) or a gated delta net
(`linear_attn`).

The `mlp` is a mixture of experts with a gated shared expert: the router
(`gate`) as Qwen3-MoE's (`TopKRouterMlp`), and the shared expert
(`shared_expert`, aliased to `shared_experts` as Llama 4's is named) whose
mlp_output is its output before the sigmoid gate (`shared_expert_gate`): the
mixture adds ``sigmoid(shared_expert_gate(x)) * mlp_output``.
"""

from dataclasses import replace

from ...blocks import Attention, HybridLayer, LinearAttention
from ...blocks import SharedExpert
from ...families import QWEN3_NEXT_GATED_HEAD_OUTPUTS
from ..moe import TopKRouterMlp
from . import llama

SPEC = replace(
    llama.SPEC, rename={**llama.SPEC.rename, "shared_expert": "shared_experts"},
    gated_head_outputs=QWEN3_NEXT_GATED_HEAD_OUTPUTS,
    envoys={"layers.*": HybridLayer, "self_attn": Attention, "linear_attn": LinearAttention, "mlp": TopKRouterMlp,
            "shared_experts": SharedExpert},
)
