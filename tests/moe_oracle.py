"""The mixture-of-experts oracle: what transformers' own routers and shared experts return, caught with torch hooks.

Nothing here imports streamscope's serving code. `MOE` says, per family, in
transformers' module names from a block: the feed-forward, its router, where
the router's output holds the logits, and the shared expert (None: none). The
TF32-truncated experts forward that measures a float32 GPU tolerance is the
reference side's own, shared with `streamscope check`
(`streamscope.testing.precision`).
"""

from __future__ import annotations

from typing import Optional

import torch

from streamscope.testing.precision import (TRUNCATED_TF32, TRUNCATED_TF32_FAMILIES,  # noqa: F401
                                           experts_in_truncated_tf32, truncated_to_tf32)

MOE = {
    "mixtral": {"mlp": "mlp", "router": "gate", "logits": 0, "shared": None},
    "qwen3_moe": {"mlp": "mlp", "router": "gate", "logits": 0, "shared": None},
    "qwen3_next": {"mlp": "mlp", "router": "gate", "logits": 0, "shared": "shared_expert"},
    "llama4_text": {"mlp": "feed_forward", "router": "router", "logits": 1, "shared": "shared_expert"},
}


def shared_first(family: str) -> bool:
    """Whether the family's block runs its shared expert before its router (Qwen3-Next)."""
    return family == "qwen3_next"


def moe_blocks(model: torch.nn.Module, family: str) -> dict[int, torch.nn.Module]:
    """Each mixture-of-experts block's feed-forward module, by block index (dense blocks left out)."""
    spec = MOE.get(family)
    if spec is None:
        return {}
    layers = model.model.layers
    return {index: getattr(layer, spec["mlp"]) for index, layer in enumerate(layers)
            if hasattr(getattr(layer, spec["mlp"]), "experts")}


@torch.no_grad()
def router_outputs(model: torch.nn.Module, family: str, input_ids: torch.Tensor) -> dict[int, dict]:
    """Per mixture-of-experts block: router_logits [batch, seq, experts], chosen_experts and routing_weights
    [batch, seq, top_k] (chosen in the router's order, best first), and the shared expert's output."""
    spec: Optional[dict] = MOE.get(family)
    found: dict[int, dict] = {}
    handles = []

    def shaped(tensor):
        return tensor.reshape(*input_ids.shape, tensor.shape[-1]).clone()

    def on_router(index):
        def hook(_, args, output):
            logits = shaped(output[spec["logits"]])
            if family == "llama4_text":
                # (scores, logits): the chosen experts are those the scores leave non-zero, best logit first.
                scores = shaped(output[0])
                top_k = int((scores[0, 0] != 0).sum())
                chosen = logits.masked_fill(scores == 0, float("-inf")).topk(top_k, dim=-1).indices
                weights = scores.gather(-1, chosen)
            else:  # (logits, weights, experts)
                weights, chosen = shaped(output[1]), shaped(output[2])
            found.setdefault(index, {}).update(router_logits=logits, chosen_experts=chosen, routing_weights=weights)
        return hook

    for index, feed_forward in moe_blocks(model, family).items():
        handles.append(getattr(feed_forward, spec["router"]).register_forward_hook(on_router(index)))
        if spec["shared"]:
            handles.append(getattr(feed_forward, spec["shared"]).register_forward_hook(
                lambda _, args, output, index=index: found.setdefault(index, {}).__setitem__("shared", shaped(output))))
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return found
