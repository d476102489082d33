"""Per-block stream norms, ``||h||``: what a steer's dose is measured against.

A steer's dose is its edit's size over ``||h||``, the steered value's mean
row norm at its block (`streamscope.bulk.spec.check_dose`). streamscope
measures it once per model on a short calibration text
(`streamscope.bulk.spec.stream_norms`); `norms` measures it on any prompts, so a
researcher can see the scale a dose is relative to, or choose a scale as a
dose: ``scale = dose * norms[layer] / vector.norm()``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .spec import CALIBRATION_TEXT, ROOT_VALUES


def norms(model: Any, prompts: Optional[Sequence[Any]] = None, value: str = "layer_output",
          layers: Any = None) -> torch.Tensor:
    """``||h||`` per block: `value`'s row norm (float32) averaged over every position after the first of each
    prompt (a one-token prompt's own position), the rows of all prompts pooled.

    Args:
        model: A streamscope model on either engine.
        prompts: Texts or token-id lists; None for streamscope's calibration text, so the result is the norms
            the dose check uses (`streamscope.bulk.spec.stream_norms`).
        value: The value measured, as `model.harvest` names it (a root value gives one norm).
        layers: The blocks (None: every block).

    Returns:
        ``[len(layers)]`` float32 (``[1]`` for a root value), in the order of `layers`.

    The first position is left out as the dose check leaves it out: in trained models it is an attention sink whose
    norm can be a hundred times the others'.
    """
    texts = [CALIBRATION_TEXT] if prompts is None else list(prompts)
    if not texts:
        raise ValueError("norms needs at least one prompt (or None for streamscope's calibration text).")
    root = value in ROOT_VALUES
    harvest = model.harvest(texts, value, layers=None if root else layers, positions="all", progress=False)
    total: Optional[torch.Tensor] = None
    count = 0
    for rows in harvest[value]:
        rows = rows.float()
        rows = rows.unsqueeze(0) if rows.dim() == 2 else rows  # [blocks, positions, hidden]
        kept = rows[:, 1:] if rows.shape[1] > 1 else rows
        summed = kept.norm(dim=-1).sum(-1)
        total = summed if total is None else total + summed
        count += kept.shape[1]
    assert total is not None
    return total / count


__all__ = ["norms"]
