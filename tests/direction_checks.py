"""Contrastive prompts and plain-torch references for streamscope.directions, shared by both engines' tests."""

from __future__ import annotations

import numpy as np
import torch

import oracle

POSITIVE = [f"I love this {thing}, it is wonderful and I am happy" for thing in
            ("film", "book", "song", "meal", "city", "game", "park", "song today", "show", "trip", "team", "garden")]
NEGATIVE = [f"I hate this {thing}, it is awful and I am sad" for thing in
            ("film", "book", "song", "meal", "city", "game", "park", "song today", "show", "trip", "team", "garden")]


def oracle_last_positions(reference, family: str, tokenizer, prompts) -> torch.Tensor:
    """``[blocks, prompts, hidden]``: the oracle's layer_output at each prompt's last position."""
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        values = oracle.values(reference, family, ids)
        rows.append(torch.stack([block[0, -1] for block in values["layer_output"]]))
    return torch.stack(rows, dim=1)


def numpy_pca_component(positive: torch.Tensor, negative: torch.Tensor) -> np.ndarray:
    """The first principal component of the centred paired differences, by numpy's SVD (sign undetermined)."""
    differences = positive.double().numpy() - negative.double().numpy()
    centred = differences - differences.mean(axis=0)
    return np.linalg.svd(centred, full_matrices=False)[2][0]
