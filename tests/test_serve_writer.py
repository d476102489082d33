"""The serve worker's harvest writer on the host: a step's rows into a request's buffer, and the buffer to a file.

The whole path (a server, its engine, the download) is tests/vllm/test_serve.py's; these pin the two host
steps on every layout the engine hands them, against safetensors' own reader and a row-by-row copy.
"""

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from streamscope.serve.worker import _put, _store_every_site, save_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_harvest_file_is_the_buffers_runs_as_safetensors_reads_them(tmp_path, dtype):
    buffer = torch.randn(1 + 3 + 3, 5, 8).to(dtype)  # a root value, then two values of three blocks each
    parts = [("token_embeddings", 0, 1, True), ("layer_mid", 1, 3, False), ("layer_output", 4, 3, False)]
    path = tmp_path / "h.safetensors"
    save_runs(path, buffer, parts, {"values": '["token_embeddings", "layer_mid", "layer_output"]'})
    read = load_file(str(path))
    assert torch.equal(read["token_embeddings"], buffer[0])
    assert torch.equal(read["layer_mid"], buffer[1:4]) and torch.equal(read["layer_output"], buffer[4:7])
    assert all(tensor.dtype == dtype for tensor in read.values())
    with safe_open(str(path), "pt") as opened:
        assert opened.metadata() == {"values": '["token_embeddings", "layer_mid", "layer_output"]'}


def test_parts_that_do_not_follow_each_other_are_refused(tmp_path):
    with pytest.raises(AssertionError, match="follow each other"):
        save_runs(tmp_path / "h.safetensors", torch.zeros(4, 2, 3), [("a", 0, 1, True), ("b", 2, 2, False)], {})


def _step(sites, requests, width=6):
    """A step's copy as `send` lays it out: one read per site, each the requests' rows in one order; the pieces
    (host, live, site index, slots, start, count, width) of every request."""
    rows = sum(len(slots) for _, slots in requests)
    host = torch.randn(sites * rows * width)
    pieces, start = [], 0
    for site in range(sites):
        for live, slots in requests:
            pieces.append((host, live, site, slots, start, len(slots), width))
            start += len(slots) * width
    return host, pieces


def _one_by_one(buffer, group):
    for host, _, index, slots, start, count, width in group:
        _put(buffer[index], slots, host[start:start + count * width].view(count, width))


@pytest.mark.parametrize("slots", [[3], [1, 2, 3], [0, 2, 4]], ids=["one", "following", "scattered"])
def test_every_site_of_a_request_is_stored_in_one_copy_as_row_by_row(slots):
    first, second = SimpleNamespace(), SimpleNamespace()
    host, pieces = _step(4, [(first, [0, 1]), (second, slots)])
    group = [piece for piece in pieces if piece[1] is second][::-1]  # any order of the sites
    expected, got = torch.zeros(4, 5, 6), torch.zeros(4, 5, 6)
    _one_by_one(expected, group)
    assert _store_every_site(got, group)
    assert torch.equal(got, expected) and expected.abs().sum() > 0


def test_a_step_that_read_some_sites_only_is_left_to_the_row_by_row_copy():
    live = SimpleNamespace()
    _, pieces = _step(3, [(live, [0])])
    assert not _store_every_site(torch.zeros(4, 1, 6), pieces)  # the request harvests 4 sites; this step read 3
    uneven = [pieces[0], pieces[1], (*pieces[2][:4], pieces[2][4] + 6, *pieces[2][5:])]
    assert not _store_every_site(torch.zeros(3, 1, 6), uneven)
