"""The running moments' arithmetic without an engine: `Moments.add_each` and the `Accumulator`'s stacked path
against the module's stated arithmetic redone prompt by prompt with plain torch, bit for bit.

The engine suites (tests/*/test_reductions.py) prove the same on float32 harvests of real runs; these cases reach
what a CPU float32 engine does not produce: bfloat16, float16 and float64 rows, rows of widely spread exponents
(where a product of float64 rows rounds, and a fused multiply-add would not equal the stated two roundings), and
labels interleaved with pairs across chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

from streamscope.bulk.moments import DIFFERENCE, Accumulator, Moments, reduce_positions

LAYERS, HIDDEN = 3, 24


def stated(rows: list[torch.Tensor], labels: list, pairs: list) -> dict:
    """The module's arithmetic, prompt by prompt: rows ``[layers, 1, hidden]``; then the pairs' differences."""
    out: dict = {}

    def add(label, x):
        count, total, square = out.get(label, (0, torch.zeros(LAYERS, HIDDEN, dtype=torch.float64),
                                                torch.zeros(LAYERS, HIDDEN, HIDDEN, dtype=torch.float64)))
        out[label] = (count + x.shape[1], total + x.sum(1), square + x.mT @ x)

    for row, label in zip(rows, labels):
        if label is not None:
            add(label, row.to(torch.float64))
    for first, second in pairs:
        add(DIFFERENCE, rows[first].to(torch.float64) - rows[second].to(torch.float64))
    return out


def spread_rows(count: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Rows ``[layers, 1, hidden]`` whose entries span many orders of magnitude (and some exact zeros)."""
    generator = torch.Generator().manual_seed(seed)
    low, high = (-12, 12) if dtype == torch.float16 else (-60, 60)
    rows = []
    for _ in range(count):
        scale = torch.pow(2.0, torch.randint(low, high, (LAYERS, 1, HIDDEN), generator=generator).double())
        row = torch.randn(LAYERS, 1, HIDDEN, generator=generator, dtype=torch.float64) * scale
        row[torch.rand(row.shape, generator=generator) < 0.05] = 0.0
        rows.append(row.to(dtype))
    return rows


class Chunk:
    """A harvest's shape as the `Accumulator` reads it: one tensor ``[layers, rows, hidden]`` a prompt."""

    reduce = "last"

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.values = {"layer_output": rows}

    def __getitem__(self, value: str) -> list[torch.Tensor]:
        return self.values[value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_stacked_moments_equal_the_stated_arithmetic_bit_for_bit(dtype):
    rows = spread_rows(23, dtype, seed=1)
    labels = ["a", "b", None, "a", 3, "b", "a"] * 3 + ["c", None]
    pairs = [(0, 1), (4, 2), (0, 22), (7, 7), (21, 3)]
    expected = stated(rows, labels, pairs)
    moments = Moments("layer_output", list(range(LAYERS)), second=True, reduce="last")
    accumulator = Accumulator(moments, labels, pairs, "last")
    for start in range(0, len(rows), 5):  # chunks that split pairs and labels
        indices = list(range(start, min(start + 5, len(rows))))
        accumulator.add_part(Chunk([rows[index] for index in indices]), indices)
    # labels open in the order they first appear; "difference" once a chunk completes the first pair
    assert [label for label in moments.labels if label != DIFFERENCE] == [label for label in expected
                                                                          if label != DIFFERENCE]
    assert moments.labels.index(DIFFERENCE) == 3  # after the first chunk (prompts 0-4: "a", "b", 3)
    for label, (count, total, square) in expected.items():
        assert moments.counts[label] == count
        assert torch.equal(moments.sums[label], total), (dtype, label)
        assert torch.equal(moments.squares[label], square), (dtype, label)
    assert not accumulator.waiting  # every paired prompt's rows let go once its last pair is added


def test_add_each_is_add_row_by_row_and_many_rows_a_prompt_keep_the_stated_matmul():
    rows = spread_rows(9, torch.float64, seed=2)
    one_by_one = Moments("layer_output", list(range(LAYERS)), second=True)
    for row in rows:
        one_by_one.add("x", row)
    stacked = Moments("layer_output", list(range(LAYERS)), second=True)
    stacked.add_each("x", torch.cat(rows, dim=1).transpose(0, 1))
    expected = stated(rows, ["x"] * len(rows), [])["x"]
    for moments in (one_by_one, stacked):
        assert moments.counts["x"] == len(rows)
        assert torch.equal(moments.sums["x"], expected[1]) and torch.equal(moments.squares["x"], expected[2])
    # Several rows a prompt (reduce=None): the stated x.sum(1) and x.mT @ x, as they are.
    many = torch.cat(rows[:4], dim=1)
    whole = Moments("layer_output", list(range(LAYERS)), second=True)
    whole.add("x", many)
    assert torch.equal(whole.sums["x"], many.sum(1)) and torch.equal(whole.squares["x"], many.mT @ many)
    with pytest.raises(ValueError, match=r"\[rows, layers, hidden\] with 3 layers"):
        stacked.add_each("x", torch.zeros(2, 4, HIDDEN))


def test_a_last_reduction_is_a_copy_that_holds_no_other_position():
    rows = torch.randn(2, 7, HIDDEN)
    last = reduce_positions(rows, "last")
    assert torch.equal(last, rows[..., -1:, :])
    assert last.untyped_storage().nbytes() == 2 * HIDDEN * rows.element_size()
    single = rows[:, :1]
    assert reduce_positions(single, "last") is single  # one position: nothing to copy
