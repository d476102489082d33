"""Qwen3-Next: a hybrid: each pre-norm block mixes with softmax attention (`self_attn`) or a gated delta net
(`linear_attn`).

The `mlp` is a mixture of experts with a gated shared expert: the router
(`gate`) as Qwen3-MoE's (`TopKRouterMlp`), and the shared expert
(`shared_expert`, aliased to `shared_experts` as Llama 4's is named) whose
mlp_output is its output before the sigmoid gate (`shared_expert_gate`): the
mixture adds ``sigmoid(shared_expert_gate(x)) * mlp_output``.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..moe import TopKRouterMlp

SPEC = derive(NEUTRAL["qwen3_next"], envoys={"mlp": TopKRouterMlp})
