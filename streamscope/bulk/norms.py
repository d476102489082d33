"""Per-block stream norms, ``||h||``: what a steer's dose is measured against.

A steer's dose is its edit's size over ``||h||``, the steered value's mean
row norm at its block (`streamscope.bulk.spec.check_dose`). streamscope
measures it once per model on a short calibration text
(`streamscope.bulk.spec.stream_norms`); `norms` measures it on any prompts, so a
researcher can see the scale a dose is relative to, or choose a scale as a
dose: ``scale = dose * norms[layer] / vector.norm()``. A direction made by
`streamscope.directions.find` carries its block's norm over the prompts it
was fit on (`fit_norms`, ``Direction.stream_norm``), and its steer hands it to
the dose check, which uses it over any norm measured on the calibration text
(`streamscope.bulk.dose.check_bulk_doses`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .results import Harvest
from .spec import CALIBRATION_TEXT, ROOT_VALUES

#: Prompts harvested at once by `norms`: every position of every block of these is held in memory together.
CHUNK = 32


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
    total: Optional[torch.Tensor] = None
    count = 0
    # A chunk of prompts a harvest: every position of every block is held only for the prompts of one chunk.
    for start in range(0, len(texts), CHUNK):
        harvest = model.harvest(texts[start:start + CHUNK], value, layers=None if root else layers, positions="all",
                                progress=False)
        for rows in harvest[value]:
            rows = rows.float()
            rows = rows.unsqueeze(0) if rows.dim() == 2 else rows  # [blocks, positions, hidden]
            kept = rows[:, 1:] if rows.shape[1] > 1 else rows
            summed = kept.norm(dim=-1).sum(-1)
            total = summed if total is None else total + summed
            count += kept.shape[1]
    assert total is not None
    return total / count


def fit_norms(model: Any, positive: Any, negative: Any, value: str, layers: list[int]) -> Optional[list[float]]:
    """The stream norm of each block in `layers` (one, at a root value) over a direction's training prompts, both
    classes pooled, as `norms` measures it: what a `streamscope.directions.Direction` made from them carries (its
    ``stream_norm``). None where the examples are harvests already made (their positions may not be every one)."""
    if isinstance(positive, Harvest) or isinstance(negative, Harvest):
        return None
    measured = norms(model, list(positive) + list(negative), value, None if value in ROOT_VALUES else layers)
    return [float(number) for number in measured]


__all__ = ["norms", "fit_norms", "CHUNK"]
