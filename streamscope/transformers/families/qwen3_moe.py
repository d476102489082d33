"""Qwen3-MoE: Llama's tree; the `mlp` of a block is a mixture of experts (or a dense MLP on `mlp_only_layers`).

The router (`gate`) returns the logits, the chosen experts' softmax weights
(renormalized where ``norm_topk_prob``) and the chosen experts: served on a
mixture's `mlp` as router_logits, routing_weights and chosen_experts
(`TopKRouterMlp`); a dense block's `mlp` says it has no router.
"""

from dataclasses import replace

from ..moe import TopKRouterMlp
from . import llama

SPEC = replace(llama.SPEC, envoys={**llama.SPEC.envoys, "mlp": TopKRouterMlp})
