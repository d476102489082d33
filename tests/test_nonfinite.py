"""The NaN/inf scan of writes on its own (`streamscope.nonfinite`): what it warns, when it reads, what it holds.

The engines' tests (tests/misuse.py, run on both) check the scan inside traces; these check its rules directly,
against a count made here with plain torch, read at the write and deferred.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from streamscope import nonfinite


@pytest.fixture(autouse=True, params=["read at once", "deferred"])
def reading(request, monkeypatch):
    """Both ways a scan is read: at the write (host tensors), and deferred to the invoke's end (device tensors,
    forced here on host tensors): the same warnings either way."""
    nonfinite.warn_pending(raising=False)
    if request.param == "deferred":
        monkeypatch.setattr(nonfinite, "READ_ON_THE_HOST", False)
    yield request.param
    nonfinite.warn_pending(raising=False)


def warned() -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nonfinite.warn_pending()
    return caught


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_count_is_the_entries_brought_in_and_the_line_is_the_writes(dtype):
    current = torch.randn(3, 5, 8).to(dtype)
    value = current.clone()
    value[0, 1, :3] = float("nan")
    value[2, 4, 7] = float("-inf")
    nonfinite.scan_write("model.layers[0].layer_output", value, current); line = sys._getframe().f_lineno  # noqa: E702
    caught = warned()
    assert len(caught) == 1
    expected = int((~torch.isfinite(value)).sum())
    assert str(caught[0].message).startswith(
        f"model.layers[0].layer_output is written with NaN or inf at {expected} of its {value.numel()} entries")
    assert (caught[0].filename, caught[0].lineno, caught[0].category) == (__file__, line, RuntimeWarning)


def test_finite_writes_and_sums_that_only_overflow_warn_nothing():
    big = torch.full((4, 16), 3.0e38)  # finite entries whose float32 sum is inf
    assert not torch.isfinite(big.sum())
    nonfinite.scan_write("model.layers[0].layer_mid", big, torch.zeros(4, 16))
    nonfinite.scan_write("model.layers[1].layer_mid", torch.ones(4, 16), torch.zeros(4, 16))
    assert warned() == []


def test_a_write_over_the_models_own_non_finite_values_warns_nothing():
    current = torch.zeros(2, 4)
    current[0, 0] = float("nan")
    nonfinite.scan_write("model.layers[2].layer_input", current * 2, current)
    assert warned() == []


def test_a_write_with_nothing_to_compare_warns_on_any_non_finite_entry():
    logits = torch.zeros(1, 10)
    logits[0, 3] = float("inf")
    nonfinite.scan_write("model.logits", logits, None)
    messages = [str(warning.message) for warning in warned()]
    assert len(messages) == 1 and "at 1 of its 10 entries" in messages[0]


def test_a_tensor_changed_in_place_after_its_write_is_not_given_a_wrong_count(reading):
    value = torch.zeros(2, 4)
    value[1, 1] = float("nan")
    nonfinite.scan_write("model.layers[0].layer_output", value, torch.zeros(2, 4))
    value.zero_()  # the caller's buffer, refilled before the warnings are given
    messages = [str(warning.message) for warning in warned()]
    # Read at the write, the count is the write's; deferred, it cannot be known any more, and says so.
    expected = "at 1 of its 8 entries" if reading == "read at once" else "at some of its 8 entries"
    assert len(messages) == 1 and expected in messages[0], messages


def test_scans_are_read_once_they_hold_too_much(reading):
    if reading != "deferred":  # read at the write, a host tensor's scan holds nothing, however many writes
        for _ in range(nonfinite.HOLD_COUNT + 1):
            nonfinite.scan_write("model.layers[0].layer_output", torch.ones(2), torch.ones(2))
            assert nonfinite.pending() == 0
        return
    count = nonfinite.HOLD_COUNT + 1
    for _ in range(count):
        nonfinite.scan_write("model.layers[0].layer_output", torch.ones(2), torch.ones(2))
    assert nonfinite.pending() == 0  # read at the last write, with nothing to warn about
    per_write = 1 << 20  # 4 MiB of float32
    writes = nonfinite.HOLD_BYTES // (4 * per_write) + 1
    for _ in range(writes - 1):
        nonfinite.scan_write("model.layers[0].layer_output", torch.ones(per_write), None)
    assert nonfinite.pending() == writes - 1
    nonfinite.scan_write("model.layers[0].layer_output", torch.ones(per_write), None)
    assert nonfinite.pending() == 0


def test_a_warning_made_an_error_is_dropped_only_while_another_error_is_raised():
    value = torch.full((2,), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        nonfinite.scan_write("model.logits", value, None)
        with pytest.raises(RuntimeWarning, match="model.logits is written with NaN or inf"):
            nonfinite.warn_pending()
        nonfinite.scan_write("model.logits", value, None)
        nonfinite.warn_pending(raising=False)  # an invoke already failing keeps its own error
    assert nonfinite.pending() == 0
