"""The graph ops' Triton kernels (`streamscope.vllm.graph_kernels`), run on the CPU through Triton's interpreter.

The kernels are held to what the torch body is held to (tests/test_graph_ops.py):
`streamscope.bulk.operations`' arithmetic written out in float64 (the
oracle) within `CPU_FLOAT32` in float32, and within a bound derived from the
dtype's rounding in bfloat16 and float16; a plain add or set gives the torch
body's bits in every dtype; rows no slot marks keep every bit (NaN, inf and
-0.0 rows among them); a graph's padding (index entries and stream rows past
the call's rows, bank slots no row uses) holds NaN and is never read. Every
mode, plain and norm-matched, on fused halves and on a whole stream, at
hidden sizes of one partial block, of several blocks, and wider than the
largest block.

The interpreter must be on before triton is first imported, and this process
imported it long ago, so the kernels run in a subprocess
(tests/graph_kernel_worker.py) and come back here to be checked. Here, the
kernels are also compiled for an H100/H200 (sm_90) from the launches the ops
make, which the interpreter does not do: an idle row loads its slot and
branches away before any other memory access.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

from streamscope.bulk.operations import DIRECTIONAL, prepare
from streamscope.vllm import graph_ops
from streamscope.vllm.blocks import Summed
from streamscope.values import OUTPUT

from .graph_kernel_worker import receive, send
from .graph_stretch import (COLUMNS, EDITED_THEN_COPIED, EVERYWHERE, POOL, ROUNDS, STRETCHES, Stretch,
                            every_mode, pool_of, pooled)
from .precision import CPU_FLOAT32

triton = pytest.importorskip("triton")
from streamscope.vllm import graph_kernels  # noqa: E402  (needs triton)

MODES = ("add", "set", "ablate", "clamp")
SETTINGS = {"add": (0.7, 0.0), "set": (1.3, 0.0), "ablate": (0.6, 0.0), "clamp": (1.0, 2.5)}
#: (hidden size, block): one partial block; four blocks of 32, the last partial; two blocks of the widest (1024).
WIDTHS = [(48, None), (100, 32), (1100, None)]
#: The values the body rounds to the stream's dtype on its longest path (a norm-matched edit of fused halves):
#: the summed stream, the projection, the coefficient, the change, the edited row, the two norms, their
#: quotient, the rescaled row, ``edited - stream`` and the written half. Each is within half an ulp (eps / 2,
#: relative) of its exact value, and none is larger than the row's scale (`scale_of`), so to first order the
#: result is within ROUNDINGS * eps / 2 of the scale from the float64 definition (second-order terms are eps^2).
ROUNDINGS = 11
ROWS, PADDED = 9, 12
MARKED = [1, 2, 5, 8]
ODD = {0: float("nan"), 3: float("inf"), 4: -0.0}  # unmarked rows holding odd values, kept bit for bit


class Interpreter:
    """tests/graph_kernel_worker.py in a subprocess: each call runs there and its tensors come back."""

    def __init__(self) -> None:
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
            [str(root)] + [part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part]))
        env[graph_ops.BODY_VARIABLE] = "triton"
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("graph_kernel_worker.py"))],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def __call__(self, call: str, *arguments: Any, carried: tuple = (), **options: Any) -> tuple[list, tuple]:
        assert self.process.stdin is not None and self.process.stdout is not None
        send(self.process.stdin, (call, list(arguments), options, tuple(carried)))
        answer = receive(self.process.stdout)
        if answer is None:
            raise RuntimeError(f"the interpreter's worker ended (exit code {self.process.wait()})")
        if answer[0] == "error":
            raise AssertionError(f"the interpreted {call} failed:\n{answer[1]}")
        return answer[0], answer[1]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def interpreted() -> Iterator[Interpreter]:
    worker = Interpreter()
    yield worker
    worker.close()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[tensor.element_size()])


class Case:
    """One edit call: a stream in a padded buffer, a bank whose other slots are NaN, marks past the rows.

    Slot 1 holds the operation; slots 0 and 2 are NaN (their mode a
    norm-matched clamp), so a row that read them would turn NaN. The stream
    is the first `ROWS` rows of buffers of `PADDED` rows; the index marks the
    padding rows too, whose hidden half holds a finite sentinel (an edit of
    it would change it) and whose residual half is NaN (a read of it would
    show). Each row carries `along` times the operation's direction, so a
    direction's edit moves it by more than the dtype's rounding.
    """

    def __init__(self, mode: str, norm_match: bool, fused: bool, width: int, dtype: torch.dtype,
                 seed: int = 1, along: float = 0.0) -> None:
        scale, projection = SETTINGS[mode]
        self.mode, self.norm_match, self.dtype = mode, norm_match, dtype
        self.op = prepare(mode, torch.randn(width, generator=generator(seed)), scale, projection, norm_match,
                          dtype, "cpu")
        self.bank = torch.full((3, width), float("nan"), dtype=dtype)
        self.bank[1] = self.op.unit if mode in DIRECTIONAL else self.op.delta
        self.modes = torch.full((3,), graph_ops.CLAMP, dtype=torch.int32)
        self.modes[1] = graph_ops.MODE_CODES[mode]
        self.scales = torch.tensor([float("nan"), scale, float("nan")])
        self.projections = torch.tensor([float("nan"), projection, float("nan")])
        self.norm_flags = torch.tensor([True, norm_match, True])
        direction = self.bank[1].float() / self.bank[1].float().norm()
        self.hidden_buffer = torch.full((PADDED, width), 7.0, dtype=dtype)
        self.hidden_buffer[:ROWS] = (torch.randn(ROWS, width, generator=generator(seed + 10)) * 3
                                     + along * direction).to(dtype)
        self.residual_buffer: Optional[torch.Tensor] = None
        if fused:
            self.residual_buffer = torch.full((PADDED, width), float("nan"), dtype=dtype)
            self.residual_buffer[:ROWS] = (torch.randn(ROWS, width, generator=generator(seed + 20)) * 5).to(dtype)
        for row, value in ODD.items():
            self.hidden_buffer[row, row % width] = value
        self.slots = torch.full((PADDED + 4,), -1, dtype=torch.int32)
        self.slots[MARKED] = 1
        self.slots[ROWS:] = 1  # padding marked: never read, as the call has ROWS rows

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.bank, self.modes, self.scales, self.projections, self.norm_flags

    def residual(self) -> Optional[torch.Tensor]:
        return None if self.residual_buffer is None else self.residual_buffer[:ROWS]

    def stream(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stream the halves make, in float64: exactly the sum a reader of the two halves means."""
        residual = self.residual()
        return hidden.double() if residual is None else hidden.double() + residual.double()

    def by_kernel(self, interpreted: Interpreter, block: Optional[int]) -> torch.Tensor:
        """The hidden buffer after the kernel's edit of its first ROWS rows (padding rows included)."""
        buffer = self.hidden_buffer.clone()
        call = ("edit_rows",) if block is not None else ("edit_stream",)
        options = {"block": block} if block is not None else {}
        sent = (self.residual(), self.slots, *self.buffers)
        (hidden, *others), (whole,) = interpreted(*call, buffer[:ROWS], *sent, carried=(buffer,), **options)
        assert hidden.data_ptr() == whole.data_ptr()  # the view came back with its base
        for before, after in zip(sent, others):  # the op mutates `hidden` only (its schema says so)
            assert (before is None and after is None) or torch.equal(bits(before), bits(after))
        return whole

    def by_torch(self) -> torch.Tensor:
        hidden = self.hidden_buffer[:ROWS].clone()
        previous = graph_ops.use_body("torch")
        try:
            graph_ops.edit_stream(hidden, self.residual(), self.slots, *self.buffers)
        finally:
            graph_ops.use_body(previous)
        return hidden

    def reference(self) -> torch.Tensor:
        """`Operation`'s definition in float64 on the marked rows' stream, with the bank's vector as it is."""
        x = self.stream(self.hidden_buffer[:ROWS])[MARKED]
        vector = self.bank[1].double()
        scale, projection = SETTINGS[self.mode]
        if self.mode == "add":
            edited = x + vector
        elif self.mode == "set":
            edited = vector.expand_as(x)
        elif self.mode == "ablate":
            edited = x - scale * (x @ vector).unsqueeze(-1) * vector
        else:
            edited = x + (projection - x @ vector).unsqueeze(-1) * vector
        self.unmatched = edited
        if self.norm_match:
            edited = edited * (x.norm(dim=-1, keepdim=True) / edited.norm(dim=-1, keepdim=True))
        return edited

    def scale_of(self, want: torch.Tensor) -> torch.Tensor:
        """Each marked row's scale: the largest L2 norm among the values its edit rounds (the halves, the stream,
        the edited row before and after a norm match, the change)."""
        hidden = self.hidden_buffer[:ROWS][MARKED].double()
        residual = self.residual()
        x = self.stream(self.hidden_buffer[:ROWS])[MARKED]
        norms = [hidden.norm(dim=-1), x.norm(dim=-1), self.unmatched.norm(dim=-1), want.norm(dim=-1),
                 (self.unmatched - x).norm(dim=-1)]
        if residual is not None:
            norms.append(residual[MARKED].double().norm(dim=-1))
        return torch.stack(norms).amax(0)


def within_float32(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within CPU_FLOAT32 of the reference, relative to its largest entry (tests/test_graph_ops.py's measure)."""
    return float((got.double() - want.double()).abs().max()) <= CPU_FLOAT32 * float(want.abs().max())


def within_rounding(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Each row within ROUNDINGS half-ulps of its scale (L2) of the float64 definition."""
    bound = ROUNDINGS * torch.finfo(dtype).eps / 2 * scale
    return bool(((got - want).norm(dim=-1) <= bound).all())


def check_untouched(case: Case, whole: torch.Tensor) -> None:
    """Unmarked rows (odd values among them) and the padding rows past the call: every bit as before."""
    untouched = [row for row in range(PADDED) if row not in MARKED]
    assert torch.equal(bits(whole[untouched]), bits(case.hidden_buffer[untouched]))
    assert not bool(whole[MARKED].isnan().any())  # no NaN slot, padding row or odd row was read


# ---------------------------------------------------------------- the edit kernel


@pytest.mark.parametrize("width, block", WIDTHS, ids=[f"{width}-block{block}" for width, block in WIDTHS])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("norm_match", [False, True], ids=["plain", "norm_match"])
@pytest.mark.parametrize("mode", MODES)
def test_edit_kernel_equals_the_operation(interpreted: Interpreter, mode: str, norm_match: bool, fused: bool,
                                          width: int, block: Optional[int]) -> None:
    case = Case(mode, norm_match, fused, width, torch.float32)
    whole = case.by_kernel(interpreted, block)
    check_untouched(case, whole)
    after = case.stream(whole[:ROWS])[MARKED]
    assert within_float32(after, case.reference())
    torch_body = case.by_torch()
    if mode in ("add", "set") and not norm_match:  # no reduction involved: the torch body's bits
        assert torch.equal(bits(whole[:ROWS]), bits(torch_body))
    else:
        assert within_float32(after, case.stream(torch_body)[MARKED])
    # The bulk path's own edit of the same rows (the Applier's, through Summed).
    bulk = case.hidden_buffer[:ROWS].clone()
    residual = case.residual()
    Summed(None, OUTPUT).edit_rows(bulk if residual is None else (bulk, residual), torch.tensor(MARKED), case.op)
    assert within_float32(after, case.stream(bulk)[MARKED])


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("norm_match", [False, True], ids=["plain", "norm_match"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_edit_kernel_in_low_precision(interpreted: Interpreter, dtype: torch.dtype, mode: str, norm_match: bool,
                                      fused: bool) -> None:
    """bfloat16 and float16: within the dtype's rounding (ROUNDINGS half-ulps) of the float64 definition, as the
    torch body is; a plain add or set the torch body's bits (each value rounded where torch rounds it)."""
    case = Case(mode, norm_match, fused, 100, dtype, seed=2, along=40.0)
    whole = case.by_kernel(interpreted, 32)
    check_untouched(case, whole)
    want = case.reference()
    scale = case.scale_of(want)
    # The bound is narrower than the edit: the unedited stream is outside it, so a kernel that did nothing fails.
    assert not within_rounding(case.stream(case.hidden_buffer[:ROWS])[MARKED], want, scale, dtype)
    torch_body = case.by_torch()
    assert within_rounding(case.stream(whole[:ROWS])[MARKED], want, scale, dtype)
    assert within_rounding(case.stream(torch_body)[MARKED], want, scale, dtype)  # the bound holds the torch body
    if mode in ("add", "set") and not norm_match:
        assert torch.equal(bits(whole[:ROWS]), bits(torch_body))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_edit_kernel_at_sixteen_thousand_columns(interpreted: Interpreter, dtype: torch.dtype) -> None:
    """The longest path (a norm-matched clamp of fused halves) at hidden size 16,384, sixteen blocks a pass."""
    case = Case("clamp", True, True, 16384, dtype, along=40.0)
    whole = case.by_kernel(interpreted, None)
    check_untouched(case, whole)
    want = case.reference()
    got = case.stream(whole[:ROWS])[MARKED]
    if dtype == torch.float32:
        assert within_float32(got, want)
    else:
        assert within_rounding(got, want, case.scale_of(want), dtype)
        assert not within_rounding(case.stream(case.hidden_buffer[:ROWS])[MARKED], want, case.scale_of(want), dtype)


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
def test_each_row_takes_its_own_slot(interpreted: Interpreter, fused: bool) -> None:
    """Eight operations (every mode, plain and norm-matched) in one call of the op, rows interleaved, the marks a
    strided column of a plan's index in int64, the slots' settings and the hidden half's columns strided too: each
    row as if alone, unmarked rows untouched."""
    width, rows = 40, 20
    kinds = [(mode, norm_match) for mode in MODES for norm_match in (False, True)]
    ops = [prepare(mode, torch.randn(width, generator=generator(30 + number)), *SETTINGS[mode], norm_match,
                   torch.float32, "cpu") for number, (mode, norm_match) in enumerate(kinds)]
    bank = torch.stack([op.unit if op.mode in DIRECTIONAL else op.delta for op in ops])

    def strided(values: list, dtype: torch.dtype) -> torch.Tensor:  # every other entry of a longer buffer
        return torch.tensor([value for value in values for _ in range(2)], dtype=dtype)[::2]

    buffers = (bank, strided([graph_ops.MODE_CODES[op.mode] for op in ops], torch.int64),
               strided([op.scale for op in ops], torch.float32), strided([op.projection for op in ops], torch.float32),
               strided([op.norm_match for op in ops], torch.bool))
    hidden = (torch.randn(rows, 2 * width, generator=generator(5)) * 3)[:, ::2]  # columns strided too
    residual = torch.randn(rows, width, generator=generator(6)) * 5 if fused else None
    index = torch.full((24, 3), -1, dtype=torch.int64)
    index[:rows, 1] = torch.tensor([(row * 3) % 9 - 1 for row in range(rows)])  # -1 and 0..7, mixed
    slots = index[:, 1]
    (edited, *_), _ = interpreted("edit_stream", hidden, residual, slots, *buffers)  # the worker edits its copy
    assert edited.stride() == hidden.stride() == (2 * width, 2)
    before = hidden if residual is None else hidden + residual
    after = edited if residual is None else edited + residual
    for row in range(rows):
        slot = int(slots[row])
        if slot < 0:
            assert torch.equal(bits(edited[row]), bits(hidden[row]))
        else:
            assert within_float32(after[row], ops[slot](before[row:row + 1])[0]), (row, kinds[slot])


def test_idle_call_leaves_every_bit(interpreted: Interpreter) -> None:
    """No row marked: the stream (NaN, inf, -0.0 in it) and a harvest pool are every bit as they were."""
    case = Case("clamp", True, True, 48, torch.float32)
    hidden = case.hidden_buffer[:ROWS].clone()
    hidden[2, 5], hidden[6, 7] = float("-inf"), -0.0
    idle = torch.full((PADDED,), -1, dtype=torch.int32)
    for residual in (case.residual(), None):
        (edited, *_), _ = interpreted("edit_stream", hidden.clone(), residual, idle, *case.buffers)
        assert torch.equal(bits(edited), bits(hidden))
    out = torch.randn(5, 48, generator=generator(7))
    (kept, *_), _ = interpreted("harvest_stream", out.clone(), hidden, case.residual(), idle)
    assert torch.equal(bits(kept), bits(out))


# ---------------------------------------------------------------- the harvest kernel


def harvested_by_torch(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                       targets: torch.Tensor) -> torch.Tensor:
    """A copy of the pool `out` after the harvest op's torch body (the kernel's reference)."""
    taken = out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.harvest_stream(taken, hidden, residual, targets)
    finally:
        graph_ops.use_body(previous)
    return taken


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_harvest_kernel_copies_the_named_rows(interpreted: Interpreter, dtype: torch.dtype, fused: bool,
                                              block: Optional[int]) -> None:
    """Each stream row with a target is stored in that pool row (the halves' sum: the bulk read's bits, and the
    torch body's); pool rows no row names, the spare among them, keep their bits; NaN padding rows past the call,
    and index entries at or past the call's rows (naming pool rows), are not read; a whole row is copied bit for
    bit."""
    width = 100
    hidden_buffer = torch.full((12, width), float("nan"), dtype=dtype)
    hidden_buffer[:10] = (torch.randn(10, width, generator=generator(9)) * 3).to(dtype)
    hidden_buffer[7, 3], hidden_buffer[0, 4] = -0.0, float("inf")
    residual = (torch.randn(10, width, generator=generator(10)) * 5).to(dtype) if fused else None
    hidden = hidden_buffer[:10]
    out = pool_of(8, width, dtype, 11)
    targets = torch.tensor([1, -1, -1, 4, -1, -1, -1, 0, -1, 5, 2, 3], dtype=torch.int32)  # 10, 11: past the rows
    call, options = ("harvest_rows", {"block": block}) if block else ("harvest_stream", {})
    (taken, *others), _ = interpreted(call, out.clone(), hidden, residual, targets, **options)
    for before, after in zip((hidden, residual, targets), others):  # the op mutates `out` only
        assert (before is None and after is None) or torch.equal(bits(before), bits(after))
    bulk = Summed(None, OUTPUT).stream_rows(hidden if residual is None else (hidden, residual),
                                            torch.tensor([0, 3, 7, 9]))
    assert bulk is not None
    assert torch.equal(bits(taken[[1, 4, 0, 5]]), bits(bulk))
    assert torch.equal(bits(taken[[2, 3, 6, 7]]), bits(out[[2, 3, 6, 7]]))
    assert torch.equal(bits(taken), bits(harvested_by_torch(out, hidden, residual, targets)))


def test_a_harvest_launch_is_as_wide_as_the_call_not_the_pool(interpreted: Interpreter) -> None:
    """The harvest kernel launches one program per stream row of the call (a decode step of 64 rows with a pool for
    8,192: 64 programs, whatever the pool's size), and fills the pool as the torch body does, entries past the call
    not read."""
    hidden = torch.randn(64, 48, generator=generator(21))
    assert graph_kernels.harvest_launch(torch.empty(8192, 48), hidden, None, torch.full((64,), -1))[0] == (64,)
    assert graph_kernels.harvest_launch(torch.empty(16, 48), hidden, None, torch.full((64,), -1))[0] == (64,)
    small = hidden[:4]
    out = pool_of(9, 48, torch.float32, 22)
    targets = torch.tensor([2, -1, 0, 3, 1, 4, 5, 6, 7], dtype=torch.int32)  # entries 4..8 name pool rows: not read
    (taken, *_), _ = interpreted("harvest_stream", out.clone(), small, None, targets)
    assert torch.equal(bits(taken), bits(harvested_by_torch(out, small, None, targets)))
    assert torch.equal(bits(taken[[2, 0, 3]]), bits(small[[0, 2, 3]]))
    assert torch.equal(bits(taken[[1, 4, 5, 6, 7, 8]]), bits(out[[1, 4, 5, 6, 7, 8]]))


def targets_of(rows: int, harvested: list[int], pool_rows: list[int], padding: int = 4) -> torch.Tensor:
    """A site's column of targets: stream row ``harvested[k]`` -> pool row ``pool_rows[k]``, the others -1; the
    `padding` entries past the rows name pool row ``pool_rows[0]`` (never read)."""
    targets = torch.full((rows + padding,), -1, dtype=torch.int32)
    targets[harvested] = torch.tensor(pool_rows, dtype=torch.int32)
    targets[rows:] = pool_rows[0]
    return targets


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_edit_and_its_harvest_in_one_launch_are_the_two_ops(interpreted: Interpreter, dtype: torch.dtype,
                                                              fused: bool, block: Optional[int]) -> None:
    """`edit_harvest_stream`'s kernel gives the bits of `edit_stream` then `harvest_stream` (kernels both): every
    mode, plain and norm-matched, rows interleaved; a harvested row the edit leaves (its row as it was), an edited
    row nobody harvests, idle rows and pool rows no row fills (the spare among them), all as the two ops leave
    them. Its torch body is the two torch bodies, in order."""
    width, rows = 100, 20
    buffers, hidden, residual = every_mode(width, rows, dtype, fused, seed=50)
    slots = torch.tensor([(row * 3) % 9 - 1 for row in range(rows)], dtype=torch.int32)  # -1 and 0..7, mixed
    # Edited rows and rows the edit leaves (slot -1: rows 0, 3, 6, ...), into pool rows out of their order.
    targets = targets_of(rows, [7, 0, 3, 9, 2, 13], [4, 0, 6, 1, 3, 2])
    out = pool_of(9, width, dtype, 53)
    options = {"block": block} if block else {}
    (edited, *_), _ = interpreted("edit_rows" if block else "edit_stream", hidden.clone(), residual, slots, *buffers,
                                  **options)
    (taken, *_), _ = interpreted("harvest_rows" if block else "harvest_stream", out.clone(), edited, residual,
                                 targets, **options)
    (both, *_, both_out, _), _ = interpreted("edit_harvest_rows" if block else "edit_harvest_stream", hidden.clone(),
                                             residual, slots, *buffers, out.clone(), targets, **options)
    assert torch.equal(bits(both), bits(edited)) and torch.equal(bits(both_out), bits(taken))
    assert torch.equal(bits(both_out[[5, 7, 8]]), bits(out[[5, 7, 8]]))  # rows no row fills: kept
    assert not torch.equal(bits(edited), bits(hidden))  # the edits acted, so the comparison above can fail
    by_torch, by_torch_out = hidden.clone(), out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.edit_harvest_stream(by_torch, residual, slots, *buffers, by_torch_out, targets)
        separate, separate_out = hidden.clone(), out.clone()
        graph_ops.edit_stream(separate, residual, slots, *buffers)
        graph_ops.harvest_stream(separate_out, separate, residual, targets)
    finally:
        graph_ops.use_body(previous)
    assert torch.equal(bits(by_torch), bits(separate)) and torch.equal(bits(by_torch_out), bits(separate_out))


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_sites_rounds_in_one_launch_are_the_rounds_one_by_one(interpreted: Interpreter, dtype: torch.dtype,
                                                                fused: bool, block: Optional[int]) -> None:
    """A ``[rows, rounds]`` slot map runs every round in one launch and gives the bits of one launch a round, in
    order (each round edits the row as the round before left it: a clamp after an add sees the add), for the
    edit alone and with the harvest (which stores the row after the last round that edits it, or the row as it
    was); the torch body does the same rounds one by one. Rows edited in no round, in some and in all three."""
    width, rows, rounds = 100, 20, 3
    buffers, hidden, residual = every_mode(width, rows, dtype, fused, seed=60)
    # A plan's index: a site's rounds side by side among other columns (a strided [rows, rounds] view).
    index = torch.full((rows, 2 + rounds + 2), -1, dtype=torch.int32)
    for row in range(rows):
        for round_ in range(rounds):
            index[row, 2 + round_] = (row * (round_ + 2) + round_) % 9 - 1  # -1 (idle) and 0..7, mixed
    index[5, 2:2 + rounds] = index[15, 2:2 + rounds] = -1  # rows no round edits
    slots = index[:, 2:2 + rounds]
    assert (slots.min(dim=1).values >= 0).any() and (slots.max(dim=1).values < 0).any()  # all rounds, and none
    targets = targets_of(rows, [7, 0, 3, 9, 2, 13, 11], [6, 0, 2, 4, 1, 5, 3])
    out = pool_of(9, width, dtype, 63)
    options = {"block": block} if block else {}
    edit, edit_harvest = ("edit_rows", "edit_harvest_rows") if block else ("edit_stream", "edit_harvest_stream")
    one_by_one = hidden.clone()
    for round_ in range(rounds):
        (one_by_one, *_), _ = interpreted(edit, one_by_one, residual, slots[:, round_].contiguous(), *buffers,
                                          **options)
    (taken, *_), _ = interpreted("harvest_rows" if block else "harvest_stream", out.clone(), one_by_one, residual,
                                 targets, **options)
    (together, *_), _ = interpreted(edit, hidden.clone(), residual, slots, *buffers, **options)
    assert torch.equal(bits(together), bits(one_by_one))
    assert not torch.equal(bits(together), bits(hidden))  # the rounds acted, so the comparison above can fail
    (both, *_, both_out, _), _ = interpreted(edit_harvest, hidden.clone(), residual, slots, *buffers, out.clone(),
                                             targets, **options)
    assert torch.equal(bits(both), bits(one_by_one)) and torch.equal(bits(both_out), bits(taken))
    by_torch, by_torch_out = hidden.clone(), out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.edit_harvest_stream(by_torch, residual, slots, *buffers, by_torch_out, targets)
        separate, separate_out = hidden.clone(), out.clone()
        for round_ in range(rounds):
            graph_ops.edit_stream(separate, residual, slots[:, round_], *buffers)
        graph_ops.harvest_stream(separate_out, separate, residual, targets)
    finally:
        graph_ops.use_body(previous)
    assert torch.equal(bits(by_torch), bits(separate)) and torch.equal(bits(by_torch_out), bits(separate_out))


# ---------------------------------------------------------------- a stretch of sites in one launch


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("name", list(STRETCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_stretch_in_one_launch_is_its_sites_one_by_one(interpreted: Interpreter, dtype: torch.dtype, name: str,
                                                         block: Optional[int]) -> None:
    """`edit_stretch`'s kernel gives the bits of each stage's `edit_harvest_stream` or `edit_stream` kernel, stage
    after stage (a whole stage on the hidden half alone, a fused one on the two halves), harvests at some stages
    only, each stage into its own rows of one pool: rows edited at no stage, at some and at every round of all; a
    row harvested at a stage that does not edit it, after an earlier stage did, is copied with that edit; a row
    harvested at two stages holds each stage's row; rows no stage names, the spare among them, keep their bits."""
    stretch = Stretch(name, 20, 100, dtype)
    index, start, harvest_lanes, maps = pooled(stretch)
    options = {"block": block} if block else {}
    hidden, pool = stretch.hidden, start  # the worker changes its copies
    for lane, harvest_lane, fused in zip(stretch.lanes, harvest_lanes, stretch.fused):  # the ops one by one
        harvest = (pool, index[:, harvest_lane]) if harvest_lane >= 0 else ()
        arguments, _ = interpreted(("edit_harvest" if harvest else "edit") + ("_rows" if block else "_stream"),
                                   hidden, stretch.residual if fused else None, index[:, lane:lane + ROUNDS],
                                   *stretch.slot_buffers, *harvest, **options)
        hidden, pool = arguments[0], (arguments[8] if harvest else pool)
    arguments, _ = interpreted("edit_stretch_rows" if block else "edit_stretch", stretch.hidden, stretch.residual,
                               index, *stretch.slot_buffers, start, stretch.lanes, ROUNDS, harvest_lanes,
                               stretch.fused, **options)
    together, together_pool = arguments[0], arguments[8]
    assert torch.equal(bits(together), bits(hidden)) and torch.equal(bits(together_pool), bits(pool))
    assert not torch.equal(bits(together), bits(stretch.hidden))  # the stages acted: the comparison can fail
    residual = stretch.residual if stretch.fused[-1] else None
    row = EDITED_THEN_COPIED  # edited at the first stage, harvested unedited at the last
    before = stretch.hidden[row] if residual is None else stretch.hidden[row] + residual[row]
    stream = together[row] if residual is None else together[row] + residual[row]
    copied = together_pool[maps[-1][row]]
    assert torch.equal(copied, stream) and not torch.equal(copied, before)
    if len(maps) == 2:  # EVERYWHERE at two stages, edited between them: a row of each
        assert not torch.equal(together_pool[maps[0][EVERYWHERE]], together_pool[maps[1][EVERYWHERE]])
    kept = [pool_row for pool_row in range(POOL) if all(pool_row not in targets.values() for targets in maps)]
    assert torch.equal(bits(together_pool[kept]), bits(start[kept]))


def test_an_idle_stretch_leaves_every_bit(interpreted: Interpreter) -> None:
    """No slot marked at any stage: the stream (NaN, inf, -0.0 in it) keeps every bit; with no target the pool
    too; with targets, only the rows the harvesting stages' targets name change, each stage's rows copied as they
    are (a whole stage's the hidden half, a fused one's the sum)."""
    stretch = Stretch("three-stages", 20, 48, torch.float32)  # stages whole, fused, fused; the first and last harvest
    index, pool, harvest_lanes, (first, last) = pooled(stretch)
    index[:, :COLUMNS] = -1
    hidden = stretch.hidden.clone()
    hidden[0, 1], hidden[3, 4], hidden[4, 0], hidden[9, 2] = float("nan"), float("inf"), -0.0, float("-inf")
    for slots_and_targets in (torch.full_like(index, -1), index):
        arguments, _ = interpreted("edit_stretch", hidden.clone(), stretch.residual, slots_and_targets,
                                   *stretch.slot_buffers, pool.clone(), stretch.lanes, ROUNDS, harvest_lanes,
                                   stretch.fused)
        kept, filled = arguments[0], arguments[8]
        assert torch.equal(bits(kept), bits(hidden))
        named = list(first.values()) + list(last.values()) if slots_and_targets is index else []
        untouched = [row for row in range(POOL) if row not in named]
        assert torch.equal(bits(filled[untouched]), bits(pool[untouched]))
    # With targets, the first stage (whole) copies its rows' hidden half, the last (fused) their sum.
    assert torch.equal(bits(filled[list(first.values())]), bits(hidden[list(first)]))
    assert torch.equal(bits(filled[list(last.values())]), bits((hidden + stretch.residual)[list(last)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_two_stages_harvest_their_own_rows_of_one_pool(interpreted: Interpreter, dtype: torch.dtype) -> None:
    """A stretch of two stages, each harvesting into its own rows of one pool: a whole stage adds at row 1 and
    harvests rows 1 and 4, then a fused stage adds at rows 1 and 4 and harvests rows 1 and 2. Each pool row holds
    its stage's row (row 1 after the first add, before the second; row 4 as it was; rows 1 and 2 after the second
    stage, summed with the residual), the kernel's bits the torch body's (plain adds: no reduction), the other
    pool rows and the spare kept."""
    width, rows = 48, 6
    buffers, hidden, residual = every_mode(width, rows, dtype, True, seed=90)
    add = buffers[0][0]  # slot 0: a plain add of this vector (`every_mode`)
    index = torch.full((rows + 2, 4), -1, dtype=torch.int32)  # each stage's slots, then each stage's targets
    index[1, 0] = index[1, 1] = index[4, 1] = 0
    index[1, 2], index[4, 2], index[1, 3], index[2, 3] = 3, 0, 5, 2
    index[rows:] = 1  # padding: marked and naming pool row 1, never read
    pool = pool_of(7, width, dtype, 91)
    arguments = (index, *buffers, pool.clone(), [0, 1], 1, [2, 3], [False, True])
    (by_kernel, *_, by_kernel_pool, _, _, _, _), _ = interpreted("edit_stretch", hidden.clone(), residual, *arguments)
    by_torch, torch_pool = hidden.clone(), pool.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.edit_stretch(by_torch, residual, index, *buffers, torch_pool, [0, 1], 1, [2, 3], [False, True])
    finally:
        graph_ops.use_body(previous)
    assert torch.equal(bits(by_kernel), bits(by_torch)) and torch.equal(bits(by_kernel_pool), bits(torch_pool))
    first = hidden[1] + add  # row 1 after the first stage's add (a whole stream: the row itself)
    assert torch.equal(bits(by_kernel_pool[3]), bits(first)) and torch.equal(bits(by_kernel_pool[0]), bits(hidden[4]))
    assert not torch.equal(by_kernel[1], first) and not torch.equal(by_kernel[4], hidden[4])  # the second stage acted
    assert torch.equal(bits(by_kernel_pool[[5, 2]]), bits(by_kernel[[1, 2]] + residual[[1, 2]]))
    assert torch.equal(bits(by_kernel[2]), bits(hidden[2]))
    assert torch.equal(bits(by_kernel_pool[[1, 4, 6]]), bits(pool[[1, 4, 6]]))


# ---------------------------------------------------------------- compiled for a GPU, on this CPU


def compiled(kernel: Any, launch: graph_kernels.Launch) -> Any:
    """`kernel` compiled for sm_90 (H100, H200) with the specialization Triton's launcher gives these arguments:
    pointer and integer alignment, an integer of 1 made a constant."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    _, arguments, options = launch
    signature, constants, attributes = {}, {}, {}
    for number, (parameter, value) in enumerate(zip(kernel.params, arguments)):
        kind, key = native_specialize_impl(BaseBackend, value, False, not parameter.do_not_specialize, True)
        signature[parameter.name] = kind
        if kind == "constexpr":
            constants[parameter.name] = value
        elif key == "D":
            attributes[(number,)] = [["tt.divisibility", 16]]
    for name in ("FUSED", "BLOCK", "HARVEST", "ROUNDS", "WAIT", "STAGES", "SLOTS", "TARGETS", "FUSED_MASK",
                 "HARVEST_MASK"):
        if name in options:
            signature[name] = "constexpr"
            constants[name] = options[name]
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attributes)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"enable_fp_fusion": options["enable_fp_fusion"]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
def test_kernels_compile_for_hopper(dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the interpreter does not check: both kernels compile to a cubin for sm_90 from the launches the ops
    make (Llama-3-8B's width, a plan's strided index); an idle row's program loads its slot, one global load, and
    branches away before anything else is read; the norms are IEEE square roots and quotients; no multiply-add
    is fused (each product rounded as torch rounds it); rows are read and written in 16-byte vectors."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(graph_kernels._edit_rows, InterpretedFunction):
        pytest.skip("this process runs triton interpreted (TRITON_INTERPRET=1): nothing to compile")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    width, rows = 4096, 256
    meta = {"dtype": dtype, "device": "meta"}
    index = torch.empty(8192, 65, dtype=torch.int32, device="meta")
    bank = (torch.empty(256, width, **meta), torch.empty(256, dtype=torch.int32, device="meta"),
            torch.empty(256, device="meta"), torch.empty(256, device="meta"),
            torch.empty(256, dtype=torch.bool, device="meta"))
    hidden, residual = torch.empty(rows, width, **meta), torch.empty(rows, width, **meta)
    for second in (residual, None):
        edit = compiled(graph_kernels._edit_rows, graph_kernels.edit_launch(hidden, second, index[:, 3], *bank))
        ptx = edit.asm["ptx"]
        assert edit.asm["cubin"]
        body = ptx[ptx.index("{", ptx.index(".entry")):]
        before_branch = body[:body.index("bra")]
        assert before_branch.count("ld.global") == 1, before_branch
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "fma.rn.f32" not in ptx
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx
        harvest = compiled(graph_kernels._harvest_rows,
                           graph_kernels.harvest_launch(torch.empty(256, width, **meta), hidden, second,
                                                        index[:, -1]))
        assert harvest.asm["cubin"] and "st.global.v4" in harvest.asm["ptx"]
        # A site's last round with its harvest: an idle row loads its slot and its target, then branches away.
        both = compiled(graph_kernels._edit_rows,
                        graph_kernels.edit_launch(hidden, second, index[:, 3], *bank, None,
                                                  torch.empty(256, width, **meta), index[:, -2]))
        ptx = both.asm["ptx"]
        body = ptx[ptx.index("{", ptx.index(".entry")):]
        assert both.asm["cubin"] and body[:body.index("bra")].count("ld.global") == 2
        assert "fma.rn.f32" not in ptx and "st.global.v4" in ptx
        # A site's two rounds and its harvest: one launch, the second round behind a barrier (it reads what other
        # threads of the program stored in the first).
        rounds = compiled(graph_kernels._edit_rows,
                          graph_kernels.edit_launch(hidden, second, index[:, 3:5], *bank, None,
                                                    torch.empty(256, width, **meta), index[:, -2]))
        assert rounds.asm["cubin"] and rounds.asm["ttir"].count("ttg.barrier") == 1
        assert "ttg.barrier" not in both.asm["ttir"]
        # Launched as a programmatic dependent, a program waits for the kernel ahead before it reads anything.
        grid, arguments, options = graph_kernels.edit_launch(hidden, second, index[:, 3], *bank)
        waiting = compiled(graph_kernels._edit_rows, (grid, arguments, {**options, "WAIT": True}))
        body = waiting.asm["ptx"][waiting.asm["ptx"].index("{", waiting.asm["ptx"].index(".entry")):]
        assert "griddepcontrol.wait" in body[:body.index("ld.global")]
    # A stretch of three sites (a whole stream, then the fused one twice; harvests at the first and the last, each
    # into its own pool rows), one launch: an idle row loads its slots (one load of them all) and its stages'
    # targets (another), then branches away. A barrier before each round but the first (nothing before it stored
    # the row) and before each harvesting stage's copy.
    pool, stages = torch.empty(257, width, **meta), ([63, -1, 64], [False, True, True])
    stretch = compiled(graph_kernels._edit_stretch_rows,
                       graph_kernels.stretch_launch(hidden, residual, index, *bank, pool, [3, 5, 7], 2, *stages))
    ptx = stretch.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    assert stretch.asm["cubin"] and body[:body.index("bra")].count("ld.global") == 2
    assert stretch.asm["ttir"].count("ttg.barrier") == 3 * 2 - 1 + 2
    assert "fma.rn.f32" not in ptx and "ld.global.v4" in ptx and "st.global.v4" in ptx
    if dtype == torch.float32:  # the lanes and harvest lanes are runtime arguments: other ones, the same kernel
        other = compiled(graph_kernels._edit_stretch_rows,
                         graph_kernels.stretch_launch(hidden, residual, index, *bank, pool, [16, 1, 32], 2,
                                                      [60, -1, 2], stages[1]))
        assert other.asm["ptx"] == ptx


# ---------------------------------------------------------------- the body's choice and the salt


def test_the_body_follows_the_device_unless_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    previous = graph_ops.use_body(None)
    try:
        assert not graph_ops._runs_kernel(cpu) and graph_ops._runs_kernel(cuda)  # the default
        graph_ops.use_body("torch")
        assert not graph_ops._runs_kernel(cpu) and not graph_ops._runs_kernel(cuda)
        assert graph_ops.use_body("triton") == "torch"
        assert graph_ops._runs_kernel(cpu) and graph_ops._runs_kernel(cuda)
        with pytest.raises(ValueError, match="one of torch, triton"):
            graph_ops.use_body("cuda")
        monkeypatch.setenv(graph_ops.BODY_VARIABLE, "kernel")
        with pytest.raises(ValueError, match="STREAMSCOPE_GRAPH_OPS_BODY='kernel'"):
            graph_ops._body_of_environment()
        monkeypatch.setenv(graph_ops.BODY_VARIABLE, "triton")
        assert graph_ops._body_of_environment() == "triton"
    finally:
        graph_ops.use_body(previous)


def test_buffers_on_another_device_are_refused() -> None:
    """The kernels read raw addresses: a buffer on another device than the stream is refused by name, before
    either body runs."""
    case = Case("add", False, True, 48, torch.float32)
    hidden = case.hidden_buffer[:ROWS].clone()
    for number, name in enumerate(["bank", "modes", "scales", "projections", "norm_match"]):
        buffers = list(case.buffers)
        buffers[number] = buffers[number].to("meta")
        with pytest.raises(ValueError, match=f"{name} is on meta, the stream on cpu"):
            graph_ops.edit_stream(hidden, case.residual(), case.slots, *buffers)
    with pytest.raises(ValueError, match="slots is on meta"):
        graph_ops.edit_stream(hidden, case.residual(), case.slots.to("meta"), *case.buffers)
    with pytest.raises(ValueError, match="harvest pool is on meta"):
        graph_ops.harvest_stream(torch.empty(4, 48, device="meta"), hidden, None, case.slots)
    with pytest.raises(ValueError, match="targets is on meta"):
        graph_ops.harvest_stream(torch.empty(4, 48), hidden, None, case.slots.to("meta"))


def test_kernels_on_the_cpu_without_the_interpreter_are_refused() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(graph_kernels._edit_rows, InterpretedFunction):
        pytest.skip("this process runs triton interpreted (TRITON_INTERPRET=1)")
    case = Case("add", False, True, 48, torch.float32)
    previous = graph_ops.use_body("triton")
    try:
        with pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
            graph_ops.edit_stream(case.hidden_buffer[:ROWS].clone(), case.residual(), case.slots, *case.buffers)
    finally:
        graph_ops.use_body(previous)


def test_salt_covers_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels run inside an opaque op, so no file vLLM hashes holds them: the salt hashes their module."""
    source = graph_ops.ops_source()
    kernels = Path(graph_kernels.__file__).read_text(encoding="utf-8")
    assert kernels in source and "def _edit_rows" in source and "def _harvest_rows" in source
    sites = ["layers.0.layer_output"]
    base = graph_ops.cache_salt(sites, 1, [])
    monkeypatch.setattr(graph_ops, "kernel_source", lambda: kernels.replace("0x7FFF", "0x8000"))
    assert graph_ops.ops_source() != source
    assert graph_ops.cache_salt(sites, 1, []) != base
    monkeypatch.undo()
    assert graph_ops.cache_salt(sites, 1, []) == base


def test_the_kernel_has_a_branch_for_every_mode_the_ops_take() -> None:
    assert set(graph_kernels.KERNEL_MODES) == set(graph_ops.MODE_CODES), (
        "a mode of graph_ops.MODE_CODES has no branch in graph_kernels._edit_rows (or the other way round): "
        "write its coefficient there (docs/adding-an-operation.md, step 4)")
