"""Where a bulk run's harvested rows go (`streamscope.bulk.apply.Applier.store`), without an engine.

On the CPU the rows are copied into each request's buffer on the current
stream, as they always were. On a GPU the copies to host memory run on the
applier's side stream: `settle` waits for that stream's event only (the
compute stream goes on), the rows arrive bit for bit, and a read's memory is
not handed to the compute stream's next kernels while its copy is pending.
The reads that reach `store` are the hooks' own tensors, never the engine's
memory, which the side stream's copies rely on: that is held here too.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from streamscope.bulk.apply import STAGED_ROWS, Applier
from streamscope.bulk.sites import Site
from streamscope.vllm.blocks import Summed
from streamscope.values import OUTPUT

HIDDEN = 8
POSITIONS = 8
#: Many rows a request (straight into its buffer) and few (staged for `settle`): the two ways of `store`.
MANY, FEW = list(range(6)), [6]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream's copies need a CUDA device")


def site(module: torch.nn.Module) -> Any:
    return SimpleNamespace(module=module, where=OUTPUT, descriptor=object(), key=(id(module), OUTPUT), value="v",
                           location=f"{id(module)}.{OUTPUT}", prepare=lambda device: None)


def applier(device: str) -> Applier:
    """Two sites (one module call each) and two requests of `POSITIONS` positions, nothing hooked."""
    sites = [site(torch.nn.Identity()), site(torch.nn.Identity())]
    return Applier(sites, {0: list(range(POSITIONS)), 1: list(range(POSITIONS))}, [], device)


def store_both(found: Applier, rows: torch.Tensor, slots: list[int], site_index: int) -> None:
    """Both requests' `slots` at site `site_index`, one read: request 0's rows, then request 1's."""
    assert len(slots) * 2 == rows.shape[0]
    found.store(rows, [(found.live[0], site_index, slots), (found.live[1], site_index, slots)])


def piece(rows: torch.Tensor, slots: list[int], request: int) -> torch.Tensor:
    """Request `request`'s rows of a read `store_both` stored, on the host."""
    return rows[request * len(slots):(request + 1) * len(slots)].cpu()


def test_the_two_ways_of_store_are_the_ones_tested() -> None:
    assert len(MANY) > STAGED_ROWS >= len(FEW)


def test_on_the_cpu_rows_are_stored_as_before_with_no_stream() -> None:
    found = applier("cpu")
    torch.manual_seed(0)
    many, few = torch.randn(2 * len(MANY), HIDDEN), torch.randn(2 * len(FEW), HIDDEN)
    plain = {"many": many.clone(), "few": few.clone()}
    store_both(found, many, MANY, 0)
    store_both(found, few, FEW, 1)
    # the many rows are in their buffers already; the few wait for `settle`, as before
    assert len(found._pending) == 1 and set(found.harvested) == {0, 1}
    many.zero_()  # what the buffers hold are copies, not views of the read
    few.zero_()
    taken = {request: found.take(request) for request in (0, 1)}
    assert found.side is None and found.copied is None and not found._pending
    for request, buffer in taken.items():
        assert buffer is not None and buffer.shape == (2, POSITIONS, HIDDEN) and not buffer.is_pinned()
        assert buffer.device.type == "cpu" and buffer.dtype == torch.float32
        assert torch.equal(buffer[0, MANY], piece(plain["many"], MANY, request))
        assert torch.equal(buffer[1, FEW], piece(plain["few"], FEW, request))


def test_a_read_is_never_the_engine_s_memory() -> None:
    # A descriptor whose whole-batch read is the engine's tensor itself (no real one is this careless): a read of a
    # slice of rows or of scattered rows is still a tensor of its own, which the next step's writes leave alone.
    engine = torch.randn(6, HIDDEN)
    descriptor = SimpleNamespace(_read=lambda host, raw: raw)
    careless = Site("layer_output", 0, None, descriptor, torch.nn.Identity(), OUTPUT, "x")  # type: ignore[arg-type]
    fused = Summed(None, OUTPUT)
    residual = torch.randn(6, HIDDEN)
    for rows in (slice(1, 4), torch.tensor([0, 2, 5])):
        reads = [careless.read_rows(engine, rows), fused.stream_rows((engine, residual), rows),
                 fused.stream_rows(engine, rows)]
        values = [read.clone() for read in reads]
        for read in reads:
            assert read is not None
            assert read.untyped_storage().data_ptr() not in (engine.untyped_storage().data_ptr(),
                                                             residual.untyped_storage().data_ptr())
        engine.add_(1.0)
        residual.add_(1.0)
        assert all(torch.equal(read, value) for read, value in zip(reads, values))


@needs_cuda
def test_on_a_gpu_the_copies_run_on_a_side_stream_and_settle_waits_for_it_alone() -> None:
    found = applier("cuda")
    torch.manual_seed(0)
    many = torch.randn(2 * len(MANY), HIDDEN, device="cuda", dtype=torch.bfloat16)
    few = torch.randn(2 * len(FEW), HIDDEN, device="cuda", dtype=torch.bfloat16)
    plain = {name: rows.to("cpu") for name, rows in (("many", many), ("few", few))}  # a synchronous copy
    store_both(found, many, MANY, 0)
    store_both(found, few, FEW, 1)
    compute = torch.cuda.current_stream()
    assert found.side is not None and found.copied is not None and found.side != compute
    torch.cuda._sleep(1 << 30)  # the compute stream's next step: about half a second of work
    found.settle()
    assert not compute.query(), "settle waited for the compute stream, not the side stream's copies alone"
    for request in (0, 1):
        buffer = found.take(request)
        assert buffer is not None and buffer.is_pinned() and buffer.dtype == torch.bfloat16
        assert torch.equal(buffer[0, MANY], piece(plain["many"], MANY, request))
        assert torch.equal(buffer[1, FEW], piece(plain["few"], FEW, request))
    torch.cuda.synchronize()


@needs_cuda
@pytest.mark.parametrize("slots", [MANY, FEW], ids=["many", "few"])
def test_on_a_gpu_a_read_s_memory_is_not_reused_while_its_copy_waits(slots: list[int]) -> None:
    found = applier("cuda")
    store_both(found, torch.zeros(2 * len(slots), HIDDEN, device="cuda"), slots, 1)  # makes the side stream
    assert found.side is not None
    with torch.cuda.stream(found.side):
        torch.cuda._sleep(1 << 28)  # the side stream's copies lag behind the compute stream
    rows = torch.randn(2 * len(slots), HIDDEN, device="cuda")
    plain = rows.to("cpu")
    store_both(found, rows, slots, 0)
    del rows  # the hook drops its read; the compute stream's next kernel asks for a block of the same size
    overwrite = torch.full((2 * len(slots), HIDDEN), 7.0, device="cuda")
    found.settle()
    for request in (0, 1):
        buffer = found.take(request)
        assert buffer is not None
        assert torch.equal(buffer[0, slots], piece(plain, slots, request))
    del overwrite
    torch.cuda.synchronize()
