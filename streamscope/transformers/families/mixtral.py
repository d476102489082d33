"""Mixtral: Llama's tree; every block's `mlp` is a mixture of experts (`MixtralSparseMoeBlock`).

Its router (`gate`) returns the logits, the chosen experts' softmax weights
(renormalized over the top-k) and the chosen experts: served on `mlp` as
router_logits, routing_weights and chosen_experts (`TopKRouterMlp`).
"""

from ...families.neutral import NEUTRAL
from ...families.spec import derive
from ..moe import TopKRouterMlp

SPEC = derive(NEUTRAL["mixtral"], envoys={"mlp": TopKRouterMlp})
