"""The mixture-of-experts oracle: what transformers' own routers and shared experts return, caught with torch hooks.

Nothing here imports streamscope. `MOE` says, per family, in transformers'
module names from a block: the feed-forward, its router, where the router's
output holds the logits, and the shared expert (None: none).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

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


def truncated_to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (float32) with its mantissa cut to TF32's 10 bits, toward zero: what a tensor core does with
    the low 13 bits of a float32 operand that no one rounded first."""
    return (tensor.contiguous().view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32)


def experts_in_truncated_tf32(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts forward (concatenated gate and up projections, no bias) whose two matmuls take
    their operands truncated to TF32 and sum in float32: how vLLM's fused MoE Triton kernel computes a float32
    mixture of experts on a GPU (Triton's `tl.dot` hands float32 operands to the tensor cores as they are).

    A one-off probe (tests/GPU.md, run F; `git show 377664b:scripts/probe_moe_tf32.py`) measured it on the H200: vLLM 0.22's `fused_experts` against this rounding,
    7e-7 to 9e-5 relative; against float64, 2.1-2.3e-3, where cuBLAS's TF32 (rounded to nearest) keeps 3.7-6.9e-4.
    """
    assert not (experts.has_bias or experts.is_transposed) and experts.is_concatenated, type(experts).__name__
    output = torch.zeros_like(hidden_states)
    for expert in range(experts.num_experts):
        token, position = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate_up = truncated_to_tf32(hidden_states[token]) @ truncated_to_tf32(experts.gate_up_proj[expert]).T
        inner = truncated_to_tf32(experts._apply_gate(gate_up))
        added = (inner @ truncated_to_tf32(experts.down_proj[expert]).T) * top_k_weights[token, position, None]
        output.index_add_(0, token, added.to(output.dtype))
    return output


#: transformers' name for the experts forward above (`experts_implementation=`).
TRUNCATED_TF32 = "truncated_tf32"
ALL_EXPERTS_FUNCTIONS.register(TRUNCATED_TF32, experts_in_truncated_tf32)
#: Families whose float32 GPU tolerance is measured with that forward. Not Llama 4: its transformers experts are
#: one batched matmul, with no implementation to choose (cuBLAS's TF32 measures it, and it passed so on the
#: H200), nor Qwen3-Next, which runs bfloat16 only.
TRUNCATED_TF32_FAMILIES = ("mixtral", "qwen3_moe")
