"""What the test suites share: the streamscope value an oracle name stands for, and the error measure.

The oracle (`oracle.py`) names values as they are computed; these helpers
reach the same value through streamscope's public names, on either engine.
"""

from __future__ import annotations

import torch


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest absolute difference over the reference's largest magnitude, in float32."""
    value, reference = value.detach().float().cpu(), reference.detach().float().cpu()
    return ((value - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


def difference_tolerance(logits: torch.Tensor, relative: float) -> float:
    """What a difference of two of `logits` may be off by, absolutely, when the logits are held to `relative`
    (relative_error's measure: of their largest magnitude): each of the two by that much, so twice."""
    return 2 * relative * logits.detach().float().abs().max().item()


def sum_tolerance(parts: torch.Tensor, relative: float) -> float:
    """What the sum of `parts` (over dim 0) may be off by, absolutely, when each part is held to `relative` of its
    own largest magnitude: the sum of those bounds."""
    return relative * parts.detach().float().flatten(1).abs().max(-1).values.sum().item()


def mixer(layer):
    """The block's attention, or its recurrent mixer where it has one and no softmax attention."""
    return layer.linear_attn if "linear_attn" in layer.__dict__ and "self_attn" not in layer.__dict__ else layer.self_attn


def value_of(model, name: str, block):
    """The streamscope value `name` (an oracle name) of `block`; a root value where block is None."""
    if block is None:
        return getattr(model, name)
    layer = model.layers[block]
    if name == "attention_output":
        return mixer(layer).attention_output
    if name in ("mlp_output", "neurons_pre", "neurons"):
        return getattr(layer.mlp, name)
    return getattr(layer, name)


def set_value(model, name: str, block, value) -> None:
    """Assign `value` to the streamscope value `name` of `block`."""
    if block is None:
        setattr(model, name, value)
    elif name == "attention_output":
        mixer(model.layers[block]).attention_output = value
    elif name in ("mlp_output", "neurons_pre", "neurons"):
        setattr(model.layers[block].mlp, name, value)
    else:
        setattr(model.layers[block], name, value)


def row(support, name: str, block: int):
    """The support table's entry for `name` (an oracle name) on `block`: None where served, else the reason."""
    rows = support[block].rows
    return rows[next(key for key in rows if key == name or key.endswith("." + name))]
