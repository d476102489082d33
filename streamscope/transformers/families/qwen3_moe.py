"""Qwen3-MoE: Llama's tree; the `mlp` of a block is a mixture of experts (or a dense MLP on `mlp_only_layers`).

The router (`gate`) returns the logits, the chosen experts' softmax weights
(renormalized where ``norm_topk_prob``) and the chosen experts: served on a
mixture's `mlp` as router_logits, routing_weights and chosen_experts
(`TopKRouterMlp`); a dense block's `mlp` says it has no router.
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..moe import TopKRouterMlp

SPEC = derive(NEUTRAL["qwen3_moe"], envoys={"mlp": TopKRouterMlp})
