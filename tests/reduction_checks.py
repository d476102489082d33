"""Reductions at the source and running moments, shared by both engines' tests (test_reductions.py).

Two kinds of proof:

* bit for bit: a harvest reduced where it is read (``reduce=``) and the moments of `model.statistics` equal
  the arithmetic stated in `streamscope.bulk.moments`, redone here with plain torch on a full harvest of the
  same prompts (every position, the same batches);
* against the oracle: directions fit from the moments equal plain torch / numpy on transformers' float32
  forward read with torch hooks (tests/oracle.py), at the suite's float32 tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import direction_checks
from access import relative_error
from direction_checks import NEGATIVE, POSITIVE
from streamscope.bulk.moments import DIFFERENCE, Moments
from streamscope.bulk.results import load_harvest
from streamscope.directions import from_moments

#: float32 on the CPU: the engine's values against the oracle's (tests/precision.py's CPU_FLOAT32).
RELATIVE = 1e-5
PROMPTS = POSITIVE[:5] + NEGATIVE[:5]


def plain_mean(rows: torch.Tensor) -> torch.Tensor:
    """`reduce="mean"` as stated: float64 sum over the positions axis, over the count, to float32."""
    return (rows.double().sum(-2, keepdim=True) / rows.shape[-2]).float()


def plain_moments(rows: list[torch.Tensor], labels: list, pairs: list) -> dict:
    """The stated running moments of per-prompt rows ``[layers, rows, hidden]``, prompt by prompt, then pairs."""
    out: dict = {}
    for row, label in zip(rows, labels):
        x = row.double()
        count, total, square = out.get(label, (0, 0, 0))
        out[label] = (count + x.shape[1], total + x.sum(1), square + x.mT @ x)
    for first, second in pairs:
        x = rows[first].double() - rows[second].double()
        count, total, square = out.get(DIFFERENCE, (0, 0, 0))
        out[DIFFERENCE] = (count + x.shape[1], total + x.sum(1), square + x.mT @ x)
    return out


def check_reduced_harvests_equal_reducing_a_full_harvest(model, tmp_path, **options) -> None:
    for value, layers in (("layer_output", None), ("final_norm_output", None)):
        full = model.harvest(PROMPTS, value, layers=layers, positions="all", progress=False, **options)
        assert full.reduce is None
        for reduce in ("last", "mean"):
            reduced = model.harvest(PROMPTS, value, layers=layers, positions="all", reduce=reduce, progress=False,
                                    **options)
            assert reduced.reduce == reduce and reduced.positions == full.positions
            for index, rows in enumerate(full[value]):
                expected = rows[..., -1:, :] if reduce == "last" else plain_mean(rows)
                got = reduced[value][index]
                assert got.shape == expected.shape and got.dtype == expected.dtype
                assert torch.equal(got, expected), (value, reduce, index)
    folder = model.harvest(PROMPTS, "layer_output", layers=[0], positions="all", reduce="mean", progress=False,
                           out=tmp_path / "reduced", **options)
    back = load_harvest(folder)
    memory = model.harvest(PROMPTS, "layer_output", layers=[0], positions="all", reduce="mean", progress=False,
                           **options)
    assert back.reduce == "mean"
    assert all(torch.equal(a, b) for a, b in zip(back["layer_output"], memory["layer_output"]))


def check_statistics_equal_the_moments_of_a_full_harvest(model, **options) -> None:
    labels = ["positive"] * 5 + ["negative"] * 5
    pairs = [(index, index + 5) for index in range(5)]
    full = model.harvest(PROMPTS, "layer_output", positions="all", progress=False, **options)
    for reduce in ("mean", "last", None):
        rows = [rows if reduce is None else rows[..., -1:, :] if reduce == "last" else plain_mean(rows)
                for rows in full["layer_output"]]
        chunked = {"chunk_size": 3} if reduce == "mean" else {}  # chunked runs add in the same order
        moments = model.statistics(PROMPTS, labels, "layer_output", positions="all", reduce=reduce, second=True,
                                   pairs=pairs if reduce else None, progress=False, **chunked, **options)
        expected = plain_moments(rows, labels, pairs if reduce else [])
        assert moments.labels == list(expected) and moments.layers == list(range(model.num_layers))
        for label, (count, total, square) in expected.items():
            assert moments.counts[label] == count
            assert torch.equal(moments.sums[label], total), (reduce, label)
            assert torch.equal(moments.squares[label], square), (reduce, label)
    # A root value, first moments only: nothing of hidden x hidden kept.
    root = model.statistics(PROMPTS, labels, "final_norm_output", progress=False, **options)
    assert root.layers == [None] and not root.squares
    last = model.harvest(PROMPTS, "final_norm_output", progress=False, **options)["final_norm_output"]
    expected = plain_moments([rows.unsqueeze(0) for rows in last], labels, [])
    assert all(torch.equal(root.sums[label], expected[label][1]) for label in expected)
    # What a server sends back: safetensors-ready tensors and JSON metadata, the same moments again.
    tensors, meta = moments.tensors()
    again = Moments.from_tensors(tensors, meta)
    assert again.counts == moments.counts and again.reduce == moments.reduce
    assert all(torch.equal(again.squares[label], moments.squares[label]) for label in moments.labels)


def check_directions_from_moments_equal_the_oracle(model, reference, family: str, tokenizer, **options) -> None:
    positive = direction_checks.oracle_last_positions(reference, family, tokenizer, POSITIVE)
    negative = direction_checks.oracle_last_positions(reference, family, tokenizer, NEGATIVE)
    count = len(POSITIVE)
    prompts = [prompt for pair in zip(POSITIVE, NEGATIVE) for prompt in pair]  # interleaved: pairs finish early
    labels = ["happy", "sad"] * count
    pairs = [(2 * index, 2 * index + 1) for index in range(count)]
    moments = model.statistics(prompts, labels, "layer_output", second=True, pairs=pairs, progress=False, **options)
    assert moments.nbytes() == 3 * model.num_layers * model.hidden_size * (1 + model.hidden_size) * 8
    means = from_moments(moments, "happy", "sad")
    components = from_moments(moments, method="pca")
    for block in range(model.num_layers):
        expected = positive[block].mean(0) - negative[block].mean(0)
        assert relative_error(means[block].vector, expected) <= RELATIVE, block
        assert means[block].details["positives"] == count and "separation_in_sample" in means[block].details
        component = torch.tensor(direction_checks.numpy_pca_component(positive[block], negative[block]))
        found = components[block].vector.double()
        assert abs(abs(float(found @ component / found.norm())) - 1) <= RELATIVE, block
        # its length: the differences' mean projection on it, as the rows' method states
        differences = (positive[block] - negative[block]).double().numpy()
        projection = abs(float(differences.mean(axis=0) @ component.numpy()))
        assert abs(float(found.norm()) - projection) <= RELATIVE * projection, block
        assert 0 < components[block].details["explained_variance"] <= 1


def check_bad_reductions_are_refused_with_the_fix(model) -> None:
    with pytest.raises(ValueError, match="reduce='max'.*\"last\".*\"mean\""):
        model.harvest(PROMPTS[:2], "layer_output", reduce="max", progress=False)
    with pytest.raises(ValueError, match="labels has 1 entries for 2 prompts"):
        model.statistics(PROMPTS[:2], ["a"], progress=False)
    with pytest.raises(ValueError, match="reduce each prompt to one row"):
        model.statistics(PROMPTS[:2], ["a", "b"], reduce=None, pairs=[(0, 1)], progress=False)
    with pytest.raises(ValueError, match="pairs holds"):
        model.statistics(PROMPTS[:2], ["a", "b"], pairs=[(0, 7)], progress=False)
    moments = model.statistics(PROMPTS[:2], ["a", "b"], layers=[0], progress=False)
    with pytest.raises(ValueError, match="a probe is fit by gradient steps on the rows"):
        from_moments(moments, "a", "b", method="probe")
    with pytest.raises(ValueError, match="gather the moments with pairs="):
        from_moments(moments, method="pca")
    with pytest.raises(ValueError, match="positive='c' is not a label"):
        from_moments(moments, "c", "b")
    with pytest.raises(ValueError, match="second=True"):
        moments.covariance("a")
    assert np.isfinite(moments.mean("a").numpy()).all()
