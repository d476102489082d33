"""The write-backs a visit holds (`streamscope.vllm.write_batch`), on their own: how they land, and what they scan.

The traces that hold them are in test_trace_transport.py (held against made at once, bit for bit, in traces of
several invokes); these check the landing's rules directly against each write-back's arithmetic done here with
plain torch: `hidden += value - (hidden + residual)`, span by span.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

from streamscope import nonfinite
from streamscope.vllm import write_batch

HIDDEN = 48


@pytest.fixture(autouse=True)
def empty_queue():
    write_batch._ended(failed=True)
    yield
    write_batch._ended(failed=True)
    nonfinite.warn_pending(raising=False)


@pytest.fixture
def landings(monkeypatch):
    """The sizes (in writes) of the runs landed, in order."""
    sizes: list[int] = []
    apply = write_batch._apply

    def counted(run):
        sizes.append(len(run))
        apply(run)

    monkeypatch.setattr(write_batch, "_apply", counted)
    return sizes


def batch(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, HIDDEN, generator=generator).to(dtype),
            torch.randn(rows, HIDDEN, generator=generator).to(dtype))


def hold_spans(hidden, residual, spans, name="model.layers[1].layer_output"):
    """Hold a write-back for each (start, size) span, its value the stream there plus a span's own amount; the
    values, by span."""
    values = {}
    for start, size in spans:
        own_hidden, own_residual = hidden.narrow(0, start, size), residual.narrow(0, start, size)
        value = (own_hidden + own_residual) + (start + 1) / 7
        values[(start, size)] = value
        write_batch.hold(start, own_hidden, own_residual, value, name)
    return values


def warned() -> list[str]:
    """The warnings the scans read when an invoke ends give."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nonfinite.warn_pending()
    return [str(warning.message) for warning in caught]


def each_alone(hidden, residual, values):
    """What each write-back alone makes of the halves (plain torch, span by span, on copies)."""
    hidden, residual = hidden.clone(), residual.clone()
    for (start, size), value in values.items():
        own_hidden, own_residual = hidden.narrow(0, start, size), residual.narrow(0, start, size)
        own_hidden.add_(value - (own_hidden + own_residual))
    return hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adjacent_spans_land_as_one_run_bit_for_bit_each_write_back(dtype, landings):
    hidden, residual = batch(10, dtype)
    values = hold_spans(hidden, residual, [(4, 3), (0, 1), (1, 3), (7, 3)])  # held out of order
    expected = each_alone(hidden, residual, values)
    write_batch.land()
    assert landings == [4]
    assert torch.equal(hidden, expected)


def test_spans_with_a_gap_or_of_other_tensors_land_apart(landings):
    hidden, residual = batch(10, torch.float32)
    other_hidden, other_residual = batch(6, torch.float32)
    values = hold_spans(hidden, residual, [(0, 2), (2, 2), (6, 1)])  # rows 4-5 are nobody's
    other_values = hold_spans(other_hidden, other_residual, [(0, 3), (3, 3)])
    expected, other_expected = each_alone(hidden, residual, values), each_alone(other_hidden, other_residual,
                                                                                other_values)
    write_batch.land()
    assert sorted(landings) == [1, 2, 2]
    assert torch.equal(hidden, expected) and torch.equal(other_hidden, other_expected)


def test_a_run_that_fails_drops_what_it_held_and_one_that_ends_lands_it(landings):
    hidden, residual = batch(4, torch.float32)
    before = hidden.clone()
    hold_spans(hidden, residual, [(0, 2), (2, 2)])
    write_batch._ended(failed=True)  # its views are of buffers a later step reuses: nothing may land in them
    write_batch.land()
    assert landings == [] and torch.equal(hidden, before)
    values = hold_spans(hidden, residual, [(0, 2), (2, 2)])
    expected = each_alone(hidden, residual, values)
    write_batch._ended(failed=False)
    assert landings == [2] and torch.equal(hidden, expected)


def test_a_worker_served_rows_it_holds_an_edit_for_has_it_landed_first(landings):
    hidden, residual = batch(6, torch.float32)
    hold_spans(hidden, residual, [(0, 3), (3, 3)])
    write_batch._serving([5, 1])  # rows nobody in the queue owns: nothing lands yet
    assert landings == []
    write_batch._serving([3, 3])  # the second span's worker, served again in the same visit
    assert landings == [2]
    hold_spans(hidden, residual, [(0, 3)])
    write_batch._serving(None)  # a worker served every row
    assert landings == [2, 1]


@pytest.mark.parametrize("reading", ["read at once", "deferred"])
def test_the_scan_of_writes_landed_together_warns_for_exactly_the_one_that_brought_nan(reading, monkeypatch):
    if reading == "deferred":
        monkeypatch.setattr(nonfinite, "READ_ON_THE_HOST", False)
    hidden, residual = batch(6, torch.float32)
    spans = [(0, 2), (2, 2), (4, 2)]
    values = {}
    for index, (start, size) in enumerate(spans):
        own_hidden, own_residual = hidden.narrow(0, start, size), residual.narrow(0, start, size)
        value = own_hidden + own_residual
        if index == 1:
            value[1, 5] = float("nan")
        values[(start, size)] = value
        write_batch.hold(start, own_hidden, own_residual, value, f"model.layers[{index}].layer_output")
    write_batch.land()
    messages = warned()
    assert len(messages) == 1 and messages[0].startswith(
        f"model.layers[1].layer_output is written with NaN or inf at 1 of its {2 * HIDDEN} entries"), messages
    assert hidden[3, 5].isnan() and hidden[[0, 1, 2, 4, 5]].isfinite().all()


def test_writes_not_scanned_land_beside_scanned_ones_and_warn_nothing():
    """A write held without a name (the check off, or not numbers to warn about) lands in the same run as scanned
    ones and is left out of their scan: its NaN warns nothing, a scanned write's NaN still does."""
    hidden, residual = batch(4, torch.float32)
    spans = [(0, 2), (2, 2)]
    for index, (start, size) in enumerate(spans):
        own_hidden, own_residual = hidden.narrow(0, start, size), residual.narrow(0, start, size)
        value = own_hidden + own_residual
        value[0, 0] = float("nan")
        write_batch.hold(start, own_hidden, own_residual, value, None if index == 0 else "model.layers[2].layer_mid")
    write_batch.land()
    messages = warned()
    assert len(messages) == 1 and messages[0].startswith("model.layers[2].layer_mid is written with NaN or inf at 1 "), \
        messages
    assert hidden[0, 0].isnan() and hidden[2, 0].isnan()


def test_a_landed_scan_keeps_nothing_of_what_was_written(monkeypatch):
    """The scan of writes landed together counts their NaN/inf entries as they land: until it is read it keeps
    two counts a row, not the written tensors (a trace that writes at every step would otherwise hold them)."""
    monkeypatch.setattr(nonfinite, "READ_ON_THE_HOST", False)  # deferred, as on a device
    hidden, residual = batch(6, torch.float32)
    values = hold_spans(hidden, residual, [(0, 2), (2, 2), (4, 2)])
    written = [weakref.ref(value) for value in values.values()]
    write_batch.land()
    del values
    assert nonfinite.pending() == 3
    assert [reference() for reference in written] == [None, None, None]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the copy without a wait (pinned memory and an event) is CUDA's path; on the host the "
                           "counts are read as they are made, which the tests above check (passed on the H200)")
def test_on_a_gpu_landing_and_scanning_never_wait_for_the_device():
    """On a GPU the counts go to the host without a wait and are read once there: landing a visit's edits and
    starting their scan make no synchronizing call (torch's sync debug mode raises on one), and the warning of
    the write that brought NaN still comes when the invoke ends."""
    hidden, residual = (half.cuda() for half in batch(6, torch.float32))
    spans = [(0, 2), (2, 2), (4, 2)]
    values = [hidden.narrow(0, start, size) + residual.narrow(0, start, size) for start, size in spans]
    values[2][0, 7] = float("inf")  # (a Python number into a device tensor is itself a wait: made before)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for index, ((start, size), value) in enumerate(zip(spans, values)):
            write_batch.hold(start, hidden.narrow(0, start, size), residual.narrow(0, start, size), value,
                             f"model.layers[{index}].layer_output")
        write_batch.land()
        nonfinite._read_row_scans(wait=False)  # what has arrived is read; nothing is waited for
    finally:
        torch.cuda.set_sync_debug_mode(0)
    messages = warned()
    assert len(messages) == 1 and messages[0].startswith(
        f"model.layers[2].layer_output is written with NaN or inf at 1 of its {2 * HIDDEN} entries"), messages
    assert hidden[4, 7].isinf() and hidden[[0, 1, 2, 3, 5]].isfinite().all()
