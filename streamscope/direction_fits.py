"""Fitting a direction on one block's activations: the methods, the held-out split and its scores.

Each method takes ``[examples, hidden]`` activations of the positive and the
negative class (`streamscope.directions.find` harvests and averages them per
prompt): ``mean_difference``, ``pca`` (of the paired differences) and
``probe`` (logistic regression). `fit` checks the examples, scores a fit on a
held-out split and fits again on all of them. `streamscope.directions`
re-exports every public name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: The fitting methods `fit` (and `streamscope.directions.find`) take.
METHODS = ("mean_difference", "pca", "probe")


def mean_difference(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """``mean(positive) - mean(negative)``, ``[hidden]``, from ``[examples, hidden]`` each."""
    return positive.double().mean(0).sub(negative.double().mean(0)).float()


def pca(positive: torch.Tensor, negative: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The paired differences' first principal component, signed and scaled; and its explained variance ratio.

    The differences ``positive[i] - negative[i]`` are centred; the component
    is signed so that the differences project positively on average, and
    scaled to their mean projection (so it has the units of a difference).
    """
    differences = positive.double() - negative.double()
    centred = differences - differences.mean(0)
    _, singular, right = torch.linalg.svd(centred, full_matrices=False)
    component = right[0]
    mean_projection = float(differences.mean(0) @ component)
    if mean_projection < 0:
        component, mean_projection = -component, -mean_projection
    total = float((singular ** 2).sum())
    explained = float(singular[0] ** 2) / total if total > 0 else 0.0
    return (component * mean_projection).float(), explained


def probe(positive: torch.Tensor, negative: torch.Tensor, l2: float = 1e-3,
          steps: int = 200) -> tuple[torch.Tensor, float]:
    """A logistic-regression probe (positives as class 1): its weights ``[hidden]`` and bias.

    Fit in float64 with L-BFGS on the mean log loss plus ``l2 * |w|^2``,
    the features standardized for the fit and the weights mapped back, so
    ``w . x + b > 0`` predicts the positive class on the raw activations.
    """
    features = torch.cat([positive, negative]).double()
    labels = torch.cat([torch.ones(len(positive)), torch.zeros(len(negative))]).double()
    centre, spread = features.mean(0), features.std(0).clamp_min(1e-12)
    standard = (features - centre) / spread
    weights = torch.zeros(features.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(standard @ weights + bias, labels)
        value = value + l2 * weights.pow(2).sum()
        value.backward()
        return value

    with torch.enable_grad():
        optimizer.step(loss)
    raw = (weights / spread).detach()
    return raw.float(), float(bias.detach() - (centre * raw).sum())


def _fit(method: str, positive: torch.Tensor, negative: torch.Tensor) -> tuple[torch.Tensor, float, dict]:
    """(vector, bias, details) of `method` on these examples; bias 0 except for a probe."""
    if method == "mean_difference":
        return mean_difference(positive, negative), 0.0, {}
    if method == "pca":
        vector, explained = pca(positive, negative)
        return vector, 0.0, {"explained_variance": explained}
    vector, bias = probe(positive, negative)
    return vector, bias, {}


def _scores(method: str, vector: torch.Tensor, bias: float, train: tuple[torch.Tensor, torch.Tensor],
            held: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Held-out accuracy and separation of a direction fit on `train`."""
    unit = vector.double() / vector.double().norm().clamp_min(1e-300)
    positive, negative = (part.double() @ unit for part in held)
    if method == "probe":
        scale = float(vector.double().norm())
        threshold = -bias / scale if scale > 0 else 0.0
    else:
        threshold = float((train[0].double().mean(0) @ unit + train[1].double().mean(0) @ unit) / 2)
    right = int((positive > threshold).sum()) + int((negative <= threshold).sum())
    accuracy = right / (len(positive) + len(negative))
    pooled = torch.cat([positive - positive.mean(), negative - negative.mean()])
    spread = float(pooled.pow(2).mean().sqrt())
    gap = float(positive.mean() - negative.mean())
    separation = gap / spread if spread > 0 else math.copysign(math.inf, gap) if gap else 0.0
    return {"accuracy": accuracy, "separation": separation}


def _split(count: int, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    held = max(1, round(count * held_out))
    return order[held:], order[:held]


@dataclass
class HeldOutFit:
    """A direction fit on the training split of the examples and scored on the rest.

    Attributes:
        vector: ``[hidden]``: the training split's direction (what `find` steers with on held-out prompts).
        bias: Its probe bias (0 for the other methods).
        scores: Held-out ``accuracy`` and ``separation``.
        split: ``(train positives, held-out positives, train negatives, held-out negatives)``: example indices.
    """

    vector: torch.Tensor
    bias: float
    scores: dict[str, float]
    split: tuple[list[int], list[int], list[int], list[int]]


def held_out_split(positives: int, negatives: int, method: str, held_out: float,
                   seed: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(train positives, held-out positives, train negatives, held-out negatives)``: `fit`'s split of the
    example indices (pairs kept together for ``pca``)."""
    if method == "pca":
        train, held = _split(positives, held_out, seed)
        return train.tolist(), held.tolist(), train.tolist(), held.tolist()
    train_p, held_p = _split(positives, held_out, seed)
    train_n, held_n = _split(negatives, held_out, seed + 1)
    return train_p.tolist(), held_p.tolist(), train_n.tolist(), held_n.tolist()


def fit_held_out(positive: torch.Tensor, negative: torch.Tensor, method: str = "mean_difference",
                 held_out: float = 0.25, seed: int = 0) -> HeldOutFit:
    """`method`'s direction fit on the training split and scored on the held-out one (`held_out` > 0)."""
    split = held_out_split(len(positive), len(negative), method, held_out, seed)
    train_pos, held_pos, train_neg, held_neg = (part[index] for part, index in
                                                zip((positive, positive, negative, negative), split))
    vector, bias, _ = _fit(method, train_pos, train_neg)
    return HeldOutFit(vector, bias, _scores(method, vector, bias, (train_pos, train_neg), (held_pos, held_neg)),
                      split)


def fit(positive: torch.Tensor, negative: torch.Tensor, method: str = "mean_difference", held_out: float = 0.25,
        seed: int = 0) -> tuple[torch.Tensor, float, dict[str, float], dict[str, Any]]:
    """One block's direction: (vector, bias, held-out scores, details), from ``[examples, hidden]`` per class.

    Checks the examples first (both classes, finite, equal counts for
    ``pca``'s pairs, enough for the split) and refuses them with the fix.
    The details state the sample sizes (``positives``, ``negatives``,
    ``held_out_positives``, ``held_out_negatives``) and, for ``pca`` and
    ``probe``, ``cosine_to_mean_difference``.
    """
    check_examples(positive, negative, method, held_out)
    held = fit_held_out(positive, negative, method, held_out, seed) if held_out > 0 else None
    vector, bias, details = _fit(method, positive, negative)
    details = {**details, "positives": len(positive), "negatives": len(negative), "held_out": held_out,
               "held_out_positives": len(held.split[1]) if held else 0,
               "held_out_negatives": len(held.split[3]) if held else 0}
    if method != "mean_difference":
        difference = mean_difference(positive, negative).double()
        cosine = float(vector.double() @ difference / (vector.double().norm() * difference.norm()).clamp_min(1e-300))
        details["cosine_to_mean_difference"] = cosine
    return vector, bias, dict(held.scores) if held else {}, details


def check_examples(positive: torch.Tensor, negative: torch.Tensor, method: str, held_out: float) -> None:
    """Refuse examples a fit cannot use, with the fix: an unknown method, a class empty or not finite, widths that
    differ, unpaired or too few ``pca`` pairs, a `held_out` outside [0, 1) or one that leaves a class too few."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}.")
    for name, part, other in (("positive", positive, negative), ("negative", negative, positive)):
        if len(part) == 0:
            raise ValueError(f"no {name} examples (and {len(other)} of the other class): a direction separates two "
                             f"classes, so give examples of both (a probe on one class learns nothing).")
        if not bool(torch.isfinite(part).all()):
            raise ValueError(f"the {name} activations hold NaN or inf: harvest them again from a model whose "
                             f"values are finite (a steer or edit may have written NaN).")
    if positive.shape[1:] != negative.shape[1:]:
        raise ValueError(f"the classes have widths {positive.shape[-1]} and {negative.shape[-1]}: take both "
                         f"from the same value of the same model.")
    if method == "pca" and len(positive) != len(negative):
        raise ValueError(f"pca takes pairs: {len(positive)} positives and {len(negative)} negatives. Give one "
                         f"negative per positive (contrastive pairs), or use method='mean_difference'.")
    if method == "pca" and len(positive) < 2:
        raise ValueError("pca needs at least 2 pairs (its differences are centred: one pair leaves nothing).")
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out={held_out}: a fraction in [0, 1) of the examples kept out of the fit.")
    if held_out > 0:
        least = 2 if method == "pca" else 1  # training examples per class the fit needs
        for name, part in (("positive", positive), ("negative", negative)):
            if len(part) - max(1, round(len(part) * held_out)) < least:
                raise ValueError(f"held_out={held_out} leaves too few {name} examples ({len(part)}) to both fit "
                                 f"and score: give more examples, or held_out=0 (no scores).")


__all__ = ["HeldOutFit", "METHODS", "check_examples", "fit", "fit_held_out", "held_out_split", "mean_difference", "pca",
           "probe"]
