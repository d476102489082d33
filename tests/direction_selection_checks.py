"""Direction selection by steering effect (issue 38, item 15), shared by both engines' tests.

`find` measures, per block, how far adding the block's direction moves held-out negative prompts' next-token
log-probs toward the positive class (`SteeringMeasure`). The oracle recomputes that measure with transformers'
float32 forward and a plain torch hook adding the same edit at the same positions (`oracle.site`), one prompt at a
time; the selection must follow it. The warnings are checked on `Harvest` objects built by hand, where what makes
a fit unreliable is put there on purpose.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import oracle
from streamscope.bulk.results import Harvest
from streamscope.directions import MIN_HELD_OUT, UnreliableFitWarning, find

THINGS = ("film", "book", "song", "meal", "city", "park", "game", "trip")
POSITIVE = [f"I love this {thing}, it is wonderful" for thing in THINGS]
NEGATIVE = [f"I hate this {thing}, it is awful" for thing in THINGS]
#: The effect is a ratio of log-prob changes (about 1e-1 here) computed from float32 logits that agree with the
#: oracle's to about 1e-6 relative (tests/precision.py): 1e-4 absolute leaves room for the ratio, no more.
EFFECT_TOLERANCE = 1e-4


@torch.no_grad()
def oracle_log_probs(reference: torch.nn.Module, tokenizer: Any, family: str, prompts: list, value: str,
                     block: int | None = None, edit: torch.Tensor | None = None) -> torch.Tensor:
    """``[prompts, vocab]``: next-token log-probs of each prompt alone, `edit` added to `value` of `block` at
    every position but the first (a torch hook on transformers' module)."""
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        if edit is None:
            logits = reference(ids).logits
        else:
            module, where, factor = oracle.site(reference, family, value, block)

            def add(tensor: torch.Tensor) -> None:
                stream = oracle._as_stream(tensor, ids.shape)
                stream[:, 1:].add_(edit / factor if factor is not None else edit)

            with oracle.hooked(module, where, add):
                logits = reference(ids).logits
        rows.append(torch.log_softmax(logits[0, -1].float(), -1))
    return torch.stack(rows)


def oracle_effect(reference: torch.nn.Module, tokenizer: Any, family: str, measure: Any, value: str,
                  edit: torch.Tensor) -> float:
    """`SteeringMeasure`'s effect of `edit`, recomputed on transformers' forward (see its docstring)."""
    positives, negatives = measure.gap_prompts
    gap = (oracle_log_probs(reference, tokenizer, family, positives, value).mean(0)
           - oracle_log_probs(reference, tokenizer, family, negatives, value).mean(0))
    plain = oracle_log_probs(reference, tokenizer, family, measure.prompts, value)
    moved = oracle_log_probs(reference, tokenizer, family, measure.prompts, value, measure.layer, edit) - plain
    return float((moved @ gap).mean()) / float(gap @ gap)


def check_selection_follows_the_measured_effect(model: Any, reference: torch.nn.Module, tokenizer: Any,
                                                family: str) -> None:
    with pytest.warns(UnreliableFitWarning, match="held out"):  # 2 per class held out: said, not hidden
        sweep = find(model, POSITIVE, NEGATIVE, progress=False)
    assert sorted(sweep.measures) == list(range(model.num_layers))
    for layer, measure in sweep.measures.items():
        # The measure, recomputed by the oracle: the direction's edit and the random baseline's.
        assert abs(measure.effect - oracle_effect(reference, tokenizer, family, measure, "layer_output",
                                                  measure.vector)) <= EFFECT_TOLERANCE, layer
        assert abs(measure.random_effect - oracle_effect(reference, tokenizer, family, measure, "layer_output",
                                                         measure.random_vector)) <= EFFECT_TOLERANCE, layer
        # The edit's size is the dose times the block's stream norm; its direction the training split's.
        assert float(measure.vector.norm()) == pytest.approx(measure.dose * measure.stream_norm, rel=1e-5)
        assert float(measure.random_vector.norm()) == pytest.approx(float(measure.vector.norm()), rel=1e-5)
        assert sweep[layer].scores["steering"] == pytest.approx(measure.effect - measure.random_effect, abs=1e-12)
    steering = {layer: sweep[layer].scores["steering"] for layer in sweep.layers}
    assert sweep.best.layer == max(steering, key=lambda layer: steering[layer])
    by_accuracy = sweep.best_by("accuracy")
    assert by_accuracy.scores["accuracy"] == max(d.scores["accuracy"] for d in sweep)
    # The table shows the sample sizes and each block's steering beside accuracy and separation.
    table = sweep.table()
    assert "8 positives, 8 negatives; held out 2 positives and 2 negatives" in table
    assert table.count("block") == model.num_layers + 1
    assert "steering" in table and f"{steering[sweep.best.layer]:+.3f}" in table


def _harvest(activations: torch.Tensor, layers: list[int]) -> Harvest:
    """A `Harvest` of `activations` ``[examples, layers, hidden]`` at one position each."""
    return Harvest({"layer_output": [example.unsqueeze(1) for example in activations]}, layers,
                   [[0]] * len(activations))


def _no_unreliable_warning(*args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreliableFitWarning)
        return find(*args, **kwargs)


def check_warnings_fire_where_a_fit_is_unreliable(model: Any) -> None:
    hidden, layers = model.hidden_size, list(range(model.num_layers))
    generator = torch.Generator().manual_seed(0)
    count = 20 * MIN_HELD_OUT  # held_out 0.25: 5 * MIN_HELD_OUT per class held out; more examples than widths
    axis = torch.zeros(hidden)
    axis[0] = 1.0
    # Isotropic noise of unit spread: a probe's weights, mapped back from standardized features, then keep the
    # classes' axis (a tiny spread in the other widths would blow their weights up).
    noise = torch.randn(count, len(layers), hidden, generator=generator)
    other = torch.randn(count, len(layers), hidden, generator=generator)
    # The positives' distance along the axis varies, so the paired differences vary most along it too (a centred
    # PCA of differences that vary only by noise would follow the noise: the case warned of below).
    reach = 3 + 6 * torch.randn(count, 1, 1, generator=generator).abs()
    positive, negative = _harvest(noise + reach * axis, layers), _harvest(other - 3 * axis, layers)
    # Well separated, enough held out: no warning, for each method.
    for method in ("mean_difference", "pca", "probe"):
        sweep = _no_unreliable_warning(model, positive, negative, method=method, progress=False)
        assert all(direction.scores["accuracy"] >= 0.95 for direction in sweep)
    # The same classes, too few of them held out.
    few = 4 * (MIN_HELD_OUT - 1)
    with pytest.warns(UnreliableFitWarning, match=f"only {MIN_HELD_OUT - 1} positive and {MIN_HELD_OUT - 1} "
                                                  f"negative examples are held out"):
        find(model, _harvest(noise[:few] + reach[:few] * axis, layers), _harvest(other[:few] - 3 * axis, layers),
             progress=False)
    # Both classes alike: accuracy at chance, at every block.
    same = _harvest(noise, layers)
    with pytest.warns(UnreliableFitWarning, match="cannot be told from chance.*blocks 0 ") as caught:
        find(model, same, _harvest(noise.clone(), layers), progress=False)
    assert not any("held out:" in str(warning.message) for warning in caught)
    # Paired differences along the first axis, with far more variance along the second: PCA follows the variance,
    # nearly orthogonal to the mean difference (the cosine 0.20).
    wobble = torch.zeros(hidden)
    wobble[1] = 1.0
    spread = 20 * torch.randn(count, 1, 1, generator=generator)
    spread = (spread - spread.mean()) * wobble  # no mean along the second axis: the difference lies on the first
    with pytest.warns(UnreliableFitWarning, match="pca direction is nearly orthogonal to the mean difference"):
        sweep = find(model, _harvest(noise + 3 * axis + spread, layers), _harvest(other - 3 * axis, layers),
                     method="pca", progress=False)
    assert all(abs(direction.details["cosine_to_mean_difference"]) < 0.3 for direction in sweep)
    # Harvests give no prompts to steer: best says it falls back to accuracy; best_by("accuracy") is asked for.
    sweep = _no_unreliable_warning(model, positive, negative, progress=False)
    assert not sweep.measures
    with pytest.warns(UnreliableFitWarning, match="no steering effect was measured"):
        sweep.best
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnreliableFitWarning)
        sweep.best_by("accuracy")
    with pytest.raises(ValueError, match="no 'steering' score.*not Harvest objects"):
        sweep.best_by("steering")
