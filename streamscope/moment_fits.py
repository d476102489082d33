"""Directions fit from running moments (`streamscope.bulk.moments.Moments`), without the rows.

`streamscope.directions.from_moments` is the entry point. What the moments determine, per block:

* ``mean_difference``: the positive label's mean less the negative label's,
  ``[hidden]``, the vector `streamscope.directions.mean_difference` computes
  from the rows (float64 sums over the counts, cast to float32);
* ``pca``: the first principal component of the paired differences (moments
  gathered with ``pairs=``, under the label ``"difference"``, with
  ``second=True``): the top eigenvector of their covariance, signed so the
  differences project positively on average and scaled to their mean
  projection, with its explained variance ratio: what
  `streamscope.directions.pca` computes by an SVD of the rows.

A probe is fit by gradient steps on the rows themselves, which moments do not
keep: it is refused with that said. Held-out scores need rows too (a split of
the examples), so these directions carry none; with second moments of both
labels, ``details["separation_in_sample"]`` states the classes' difference of
mean projections over their pooled standard deviation on the examples the
direction was fit on.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Optional

import torch

from .bulk.moments import DIFFERENCE, Moments


def _check(moments: Moments, method: str, positive: Optional[Hashable], negative: Optional[Hashable]) -> None:
    if not isinstance(moments, Moments):
        raise TypeError(f"from_moments takes a streamscope Moments (model.statistics, Client.statistics); got "
                        f"{type(moments).__name__}.")
    if method == "probe":
        raise ValueError("a probe is fit by gradient steps on the rows, which moments do not keep: harvest the rows "
                         "(model.harvest(..., reduce=\"mean\")) and use streamscope.directions.find or fit.")
    if method == "mean_difference":
        for name, label in (("positive", positive), ("negative", negative)):
            if label not in moments.counts:
                raise ValueError(f"{name}={label!r} is not a label of these moments (they hold {moments.labels}): "
                                 f"name the labels given to model.statistics.")
        return
    if method != "pca":
        raise ValueError(f"unknown method {method!r}: from moments, choose \"mean_difference\" or \"pca\" (a probe "
                         f"needs the rows).")
    if DIFFERENCE not in moments.counts:
        raise ValueError("pca is the first principal component of paired differences: gather the moments with pairs="
                         "[(positive index, negative index), ...] and second=True (model.statistics).")
    if DIFFERENCE not in moments.squares:
        raise ValueError("pca needs the paired differences' second moments: gather them with second=True.")
    if moments.counts[DIFFERENCE] < 2:
        raise ValueError(f"pca needs at least 2 pairs; these moments hold {moments.counts[DIFFERENCE]}.")


def _separation(moments: Moments, positive: Hashable, negative: Hashable, slot: int,
                vector: torch.Tensor) -> Optional[float]:
    """The classes' gap of mean projections on `vector` over their pooled standard deviation, from the moments."""
    if positive not in moments.squares or negative not in moments.squares:
        return None
    unit = vector.double() / vector.double().norm().clamp_min(1e-300)
    gap = float((moments.mean(positive)[slot] - moments.mean(negative)[slot]) @ unit)
    spreads = [(moments.counts[label], float(unit @ moments.covariance(label)[slot] @ unit))
               for label in (positive, negative)]
    pooled = math.sqrt(max(sum(count * spread for count, spread in spreads) / sum(c for c, _ in spreads), 0.0))
    return gap / pooled if pooled > 0 else math.copysign(math.inf, gap) if gap else 0.0


def _pca(moments: Moments, slot: int) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(vector ``[hidden]``, explained variance ratio, mean difference) of the paired differences at `slot`."""
    covariance = moments.covariance(DIFFERENCE)[slot]
    covariance = (covariance + covariance.mT) / 2  # exactly symmetric for eigh
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    component = eigenvectors[:, -1]
    mean = moments.mean(DIFFERENCE)[slot]
    mean_projection = float(mean @ component)
    if mean_projection < 0:
        component, mean_projection = -component, -mean_projection
    total = float(eigenvalues.clamp_min(0).sum())
    explained = float(eigenvalues[-1].clamp_min(0)) / total if total > 0 else 0.0
    return (component * mean_projection).float(), explained, mean


def fit_moments(moments: Moments, positive: Optional[Hashable] = None, negative: Optional[Hashable] = None,
                method: str = "mean_difference") -> list[tuple[Optional[int], torch.Tensor, dict[str, Any]]]:
    """The `method`'s direction at every block of `moments`: ``(block, vector [hidden] float32, details)`` each,
    which `streamscope.directions.from_moments` makes a `Sweep` of (no held-out scores; see the module)."""
    _check(moments, method, positive, negative)
    directions = []
    for slot, layer in enumerate(moments.layers):
        details: dict[str, Any] = {"from": "moments", "reduce": moments.reduce, "positions": moments.positions}
        if method == "mean_difference":
            vector = (moments.mean(positive)[slot] - moments.mean(negative)[slot]).float()
            details.update(positives=moments.counts[positive], negatives=moments.counts[negative])
            separation = _separation(moments, positive, negative, slot, vector)
            if separation is not None:
                details["separation_in_sample"] = separation
        else:
            vector, explained, difference = _pca(moments, slot)
            cosine = float(vector.double() @ difference
                           / (vector.double().norm() * difference.norm()).clamp_min(1e-300))
            details.update(pairs=moments.counts[DIFFERENCE], explained_variance=explained,
                           cosine_to_mean_difference=cosine)
        directions.append((layer, vector, details))
    return directions
