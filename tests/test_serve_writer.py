"""The serve worker's harvest writer on the host: a step's rows into a request's buffer, and the buffer to a file.

The whole path (a server, its engine, the download) is tests/vllm/test_serve.py's; these pin the host steps on
every layout the engine hands them, against safetensors' own reader and a row-by-row copy, and the writer's
process (`streamscope.serve.writer` run as a script) against the same code run on the worker's thread.
"""

import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from streamscope.serve.writer_thread import HarvestWriter
from streamscope.serve.writer import Record, Store, put, save_runs, store_every_site


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
    (harvest key, site index, slots, start, count, width) of every request."""
    rows = sum(len(slots) for _, slots in requests)
    host = torch.randn(sites * rows * width)
    pieces, start = [], 0
    for site in range(sites):
        for key, slots in requests:
            pieces.append((key, site, slots, start, len(slots), width))
            start += len(slots) * width
    return host, pieces


def _one_by_one(buffer, host, group):
    for _, index, slots, start, count, width in group:
        put(buffer[index], slots, host[start:start + count * width].view(count, width))


@pytest.mark.parametrize("slots", [[3], [1, 2, 3], [0, 2, 4]], ids=["one", "following", "scattered"])
def test_every_site_of_a_request_is_stored_in_one_copy_as_row_by_row(slots):
    host, pieces = _step(4, [(1, [0, 1]), (2, slots)])
    group = [piece for piece in pieces if piece[0] == 2][::-1]  # any order of the sites
    expected, got = torch.zeros(4, 5, 6), torch.zeros(4, 5, 6)
    _one_by_one(expected, host, group)
    assert store_every_site(got, host, group)
    assert torch.equal(got, expected) and expected.abs().sum() > 0


def test_sites_stored_in_reverse_of_their_reads_go_row_by_row_and_land_where_each_belongs():
    """A harvest that asks blocks last-first stores site 0 where the step read last: the copies stand at a negative
    spacing, which one strided copy cannot take; each site lands in its own slot all the same."""
    host, pieces = _step(3, [(1, [0, 1])])
    reversed_sites = [(key, len(pieces) - 1 - index, slots, start, count, width)
                      for key, index, slots, start, count, width in pieces]
    assert not store_every_site(torch.zeros(3, 5, 6), host, reversed_sites)
    expected = torch.zeros(3, 5, 6)
    _one_by_one(expected, host, reversed_sites)
    assert torch.equal(expected[2, :2], host[:12].view(2, 6)) and expected.abs().sum() > 0


def test_a_step_that_read_some_sites_only_is_left_to_the_row_by_row_copy():
    host, pieces = _step(3, [(1, [0])])
    assert not store_every_site(torch.zeros(4, 1, 6), host, pieces)  # the request harvests 4 sites; this step read 3
    uneven = [pieces[0], pieces[1], (*pieces[2][:3], pieces[2][3] + 6, *pieces[2][4:])]
    assert not store_every_site(torch.zeros(3, 1, 6), host, uneven)


# ---------------------------------------------------------------- whole harvests, on the thread and in the process

HARVEST = "0123456789abcdef" * 2
OTHER = "fedcba9876543210" * 2


def _record(harvest_id=HARVEST, blocks=3, positions=2):
    """A harvest of token_embeddings (a root value) and layer_output at `blocks` blocks, at two prompt positions."""
    meta = {"values": ["token_embeddings", "layer_output"], "layers": list(range(blocks)), "positions": [4, 7]}
    runs = [("token_embeddings", 0, 1, True), ("layer_output", 1, blocks, False)]
    return Record(harvest_id, 1 + blocks, positions, meta, runs)


def _two_steps(dtype, width=8, sites=4):
    """A request's two prompt steps, each reading every site at one of its positions (a second request's rows
    between its own), and the buffer they make."""
    steps, expected = [], torch.zeros(sites, 2, width, dtype=dtype)
    for slot in range(2):
        host = torch.randn(sites * 3 * width).to(dtype)
        pieces = []
        for site in range(sites):  # each site read [other request, this request's one row, other request]
            start = (site * 3 + 1) * width
            pieces.append((1, site, [slot], start, 1, width))
            expected[site, slot] = host[start:start + width]
        steps.append((host, pieces))
    return steps, expected


def _wait_for(path, seconds=60.0):
    until = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < until, f"{path.name} was not written in {seconds:.0f} s"
        time.sleep(0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_store_writes_a_harvest_once_its_last_rows_are_in(tmp_path, dtype):
    store = Store(tmp_path)
    store.admit(1, _record())
    steps, expected = _two_steps(dtype)
    store.rows(*steps[0], complete=[])
    assert not (tmp_path / f"{HARVEST}.safetensors").exists()  # half its rows: nothing written yet
    store.rows(*steps[1], complete=[1])
    read = load_file(str(tmp_path / f"{HARVEST}.safetensors"))
    assert torch.equal(read["token_embeddings"], expected[0]) and torch.equal(read["layer_output"], expected[1:])
    assert read["layer_output"].dtype == dtype and not store.records


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_writers_process_writes_the_file_its_thread_would(tmp_path, dtype, monkeypatch):
    steps, _ = _two_steps(dtype)
    files = {}
    for how in ("process", "thread"):
        folder = tmp_path / how
        folder.mkdir()
        if how == "thread":
            monkeypatch.setenv("STREAMSCOPE_SERVE_WRITER", "thread")
        writer = HarvestWriter(folder, 0)
        writer.put(("admit", 1, _record()))
        writer.put(("admit", 2, _record(OTHER)))
        writer.put(("rows", None, [steps[0]], []))
        writer.put(("drop", 2))  # its request ended before its prompt ran: nothing of it is written
        writer.put(("rows", None, [steps[1]], [1, 2]))
        _wait_for(folder / f"{HARVEST}.safetensors")
        writer.queue.join()
        assert (writer.process is not None) == (how == "process") and not writer.held
        files[how] = (folder / f"{HARVEST}.safetensors").read_bytes()
        assert sorted(path.name for path in folder.iterdir()) == [f"{HARVEST}.safetensors"]
        if writer.process is not None:
            writer.process.stdin.close()  # the worker exiting: the process ends with its input
            assert writer.process.wait(30) == 0
    assert files["process"] == files["thread"]


def test_a_writer_whose_process_died_fails_what_it_held_and_writes_the_rest_itself(tmp_path):
    steps, expected = _two_steps(torch.float32)
    writer = HarvestWriter(tmp_path, 0)
    writer.put(("admit", 1, _record(OTHER)))
    writer.queue.join()
    writer.process.kill()
    writer.process.wait(30)
    writer.put(("admit", 1, _record()))
    writer.put(("rows", None, [steps[0]], []))
    writer.put(("rows", None, [steps[1]], [1]))
    writer.queue.join()
    assert "writer's process stopped" in (tmp_path / f"{OTHER}.error").read_text()
    read = load_file(str(tmp_path / f"{HARVEST}.safetensors"))
    assert torch.equal(read["layer_output"], expected[1:])


def test_rows_that_do_not_fit_their_harvest_fail_it_and_no_other(tmp_path):
    store = Store(tmp_path)
    store.admit(1, _record())
    store.admit(2, _record(OTHER, blocks=1))
    steps, _ = _two_steps(torch.float32)
    host, pieces = steps[0]
    wrong = [(2, index, slots, start, count, width) for _, index, slots, start, count, width in pieces]
    store.rows(host, pieces + wrong, complete=[])  # four sites' rows for a harvest of two
    assert "Error" in (tmp_path / f"{OTHER}.error").read_text() and 2 not in store.records
    store.rows(*steps[1], complete=[1])
    assert (tmp_path / f"{HARVEST}.safetensors").exists()
