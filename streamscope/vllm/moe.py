"""Mixtures of experts on vLLM: the routing values are unavailable, and say why; so is the shared expert's output.

vLLM's fused MoE layer (`FusedMoE`, the mixture's `experts`) takes the
router's logits and routes inside one call: its kernel picks each token's
top-k experts, weights them and sums their outputs, and no module of the
model holds the choice or the weights. The shared expert is called by that
layer too (vLLM's `SharedExperts`: on a separate CUDA stream, or inside the
kernel, where the device allows), and its output is added to the routed
experts' there. `mlp.mlp_output`, what the whole mixture adds, is served as
on transformers.
"""

from __future__ import annotations

from typing import Optional

from .. import blocks
from ..blocks import SharedExpert

FUSED_ROUTING = {
    "router_logits": ("vLLM's fused MoE layer takes the router's logits and routes inside one call; streamscope "
                      "serves the routing values on transformers (engine='transformers')"),
    "chosen_experts": ("vLLM's fused MoE kernel chooses each token's experts inside one call, so no module of "
                       "vLLM's model holds the choice"),
    "routing_weights": ("vLLM's fused MoE kernel weights the chosen experts inside one call, so no module of "
                        "vLLM's model holds the weights"),
}
FUSED_SHARED_EXPERT = (
    "vLLM's fused MoE layer calls the shared expert itself (on another CUDA stream or inside its kernel, where "
    "the device allows) and adds its output to the routed experts' there; Qwen3-Next's applies its sigmoid gate "
    "inside the shared expert on vLLM"
)


class VllmMlp(blocks.Mlp):
    """A vLLM feed-forward: a dense MLP, or a fused mixture of experts whose routing values say why they are
    unavailable."""

    def routing_reason(self, name: str) -> Optional[str]:
        return FUSED_ROUTING[name] if self.is_moe() else blocks.sublayers.DENSE


class VllmSharedExpert(SharedExpert):
    """The shared expert on vLLM (`mlp.shared_experts`): called and added inside the fused MoE layer, so its
    mlp_output is unavailable."""

    UNSERVED = {"mlp_output": FUSED_SHARED_EXPERT}
