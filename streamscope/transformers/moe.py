"""Mixtures of experts on transformers: the router's values on a block's `mlp`.

Every `Mlp` has three routing values, in transformers' conventions:

* ``router_logits`` ``[batch, seq, num_experts]``: what the router computes for
  each token, before its top-k;
* ``chosen_experts`` ``[batch, seq, top_k]``: the experts each token is sent
  to, as the model chose them (in the order its top-k returns them);
* ``routing_weights`` ``[batch, seq, top_k]``: the weight of each chosen
  expert's output (Llama 4: of its input) in the sum the block adds.

A dense MLP has no router, and says so. A family whose mixture of experts
computes its routing outside a fused kernel serves them through a subclass
here, `TopKRouterMlp` (Mixtral, Qwen3-MoE, Qwen3-Next: a router module that
returns ``(logits, weights, experts)``) or `Llama4Mlp` (a router that returns
``(scores, logits)``; it holds no tensor of its choice, so chosen_experts and
routing_weights are recomputed from its logits, as its code computes them, and
are read-only). The router computes its choice from its logits inside its own
call, so an edit of ``router_logits`` reaches the model this way: the
router's top-k (restated from transformers' router code in `reroute`) is run
on the edited logits, and its choice and weights replace the router's
outputs, in place, before the experts read them.

The shared expert of a mixture (Llama 4's ``shared_expert``, Qwen3-Next's, both
aliased to ``shared_experts``) is a dense MLP, so it is an `Mlp` too
(`streamscope.blocks.SharedExpert`, which both engines use).

These read transformers' router modules, so they live with the transformers
engine; vLLM's fused kernel routes inside itself (`streamscope.vllm.moe`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from .. import nnsight_seam as seam
from ..values import OUTPUT, ComputedValue, Host, StreamValue
from ..blocks.envoy import record_stream_shape
from ..blocks.sublayers import DENSE, ROUTING, Mlp  # noqa: F401  (ROUTING: re-exported)

_LOGITS, _CHOSEN, _WEIGHTS = (
    "[batch, seq, num_experts]", "[batch, seq, top_k]", "[batch, seq, top_k]")


class RouterHost(Host, Protocol):
    """What a router value that reroutes needs of its `Mlp` envoy, beyond `Host`."""

    def reroute(self, raw: Any) -> None:
        """Re-run the router's top-k on its (edited) output `raw`, so its choice reaches the experts."""


class RouterOutput(StreamValue):
    """One element of a router module's output tuple, served as the other values are (a private copy, edits in place).

    Args:
        module: The router module, named from the `Mlp` envoy.
        index: The element of the router's output.
        reroutes: Whether an edit re-runs the router's top-k (`Mlp.reroute`) on
            the edited tensor, so that its choice reaches the experts.
    """

    def __init__(self, module: str, index: int, *, shape: str, reroutes: bool = False,
                 description: Optional[str] = None) -> None:
        super().__init__(module, OUTPUT, shape=shape, description=description)
        self.index, self.reroutes = index, reroutes

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        return raw[self.index]

    def write(self, host: RouterHost, raw: Any, value: torch.Tensor) -> None:
        super().write(host, raw, value)
        if self.reroutes:
            host.reroute(raw)


class ComputedRouterValue(ComputedValue):
    """A read-only value computed from one element of a router module's output tuple."""

    def __init__(self, module: str, index: int, *, shape: str, description: Optional[str] = None) -> None:
        super().__init__(module, OUTPUT, shape=shape, description=description)
        self.index = index

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        return raw[self.index]


class _RecordsStream(Mlp):
    """A transformers mixture of experts that flattens its tokens for the router: keeps its stream's shape."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        if self.is_moe():
            record_stream_shape(module)

    def module_bound(self, module: torch.nn.Module) -> None:
        if self.is_moe():
            record_stream_shape(module)

    def routing_reason(self, name: str) -> Optional[str]:
        return None if self.is_moe() else DENSE


class TopKRouterMlp(_RecordsStream):
    """transformers' mixture of experts whose router (`gate`) returns ``(logits, weights, experts)``.

    Mixtral, Qwen3-MoE and Qwen3-Next: the router projects each token to
    logits, takes the softmax, keeps the top-k (renormalized to sum to 1 where
    the family does: Mixtral always, the Qwen families by ``norm_topk_prob``).
    All three values are the router's own outputs: edits of chosen_experts and
    routing_weights reach the experts as they are; an edit of router_logits
    re-runs that top-k on the edited logits and replaces both.
    """

    router_logits = RouterOutput("gate", 0, shape=_LOGITS, reroutes=True, description=(
        "The router's logits, before the softmax and top-k, [batch, seq, num_experts]; an edit re-routes."))
    routing_weights = RouterOutput("gate", 1, shape=_WEIGHTS, description=(
        "The softmax weight of each chosen expert (renormalized over the top-k where the family does), "
        "[batch, seq, top_k]; edits reach the experts."))
    chosen_experts = RouterOutput("gate", 2, shape=_CHOSEN, description=(
        "The experts each token is sent to, in the router's top-k order, [batch, seq, top_k]; "
        "edits reach the experts."))

    def reroute(self, raw: Any) -> None:
        router = seam.module_of(self).gate
        logits = raw[0]
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probabilities, router.top_k, dim=-1)
        if getattr(router, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            raw[1].copy_(top)
            raw[2].copy_(chosen)


class Llama4Mlp(_RecordsStream):
    """transformers' Llama 4 mixture of experts, whose router returns ``(scores, logits)``.

    The router keeps each token's top-k logits and scores the chosen experts
    by their sigmoid (the others 0); each chosen expert is called with the
    token scaled by its score, and the shared expert's output is added to
    their sum. The router holds no tensor of the choice, so chosen_experts
    and routing_weights are recomputed from the logits, as the router does it
    (read-only); an edit of router_logits re-runs the router's top-k and
    replaces its scores.
    """

    router_logits = RouterOutput("router", 1, shape=_LOGITS, reroutes=True, description=(
        "The router's logits, before its top-k, [batch, seq, num_experts]; an edit re-routes."))

    @ComputedRouterValue("router", 1, shape=_CHOSEN)
    def chosen_experts(self, logits: torch.Tensor) -> torch.Tensor:
        """The experts each token is sent to, the router's top-k of its logits, [batch, seq, top_k] (read-only)."""
        return torch.topk(logits, seam.module_of(self).router.top_k, dim=-1).indices

    @ComputedRouterValue("router", 1, shape=_WEIGHTS)
    def routing_weights(self, logits: torch.Tensor) -> torch.Tensor:
        """The sigmoid of each chosen expert's logit, which scales the token it is called with, [batch, seq, top_k]
        (read-only)."""
        top = torch.topk(logits, seam.module_of(self).router.top_k, dim=-1).values
        return torch.sigmoid(top.float()).to(logits.dtype)

    def reroute(self, raw: Any) -> None:
        logits = raw[1]
        top, chosen = torch.topk(logits, seam.module_of(self).router.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, chosen, top)
        with torch.no_grad():
            raw[0].copy_(torch.sigmoid(scores.float()).to(scores.dtype))
