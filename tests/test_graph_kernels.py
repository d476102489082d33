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
from .graph_stretch import HARVESTED, ROUNDS, STRETCHES, Stretch, every_mode
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
    """No row marked: the stream (NaN, inf, -0.0 in it) and a harvest buffer are every bit as they were."""
    case = Case("clamp", True, True, 48, torch.float32)
    hidden = case.hidden_buffer[:ROWS].clone()
    hidden[2, 5], hidden[6, 7] = float("-inf"), -0.0
    idle = torch.full((PADDED,), -1, dtype=torch.int32)
    for residual in (case.residual(), None):
        (edited, *_), _ = interpreted("edit_stream", hidden.clone(), residual, idle, *case.buffers)
        assert torch.equal(bits(edited), bits(hidden))
    out = torch.randn(5, 48, generator=generator(7))
    (kept, *_), _ = interpreted("harvest_stream", out.clone(), hidden, case.residual(), idle[:5])
    assert torch.equal(bits(kept), bits(out))


# ---------------------------------------------------------------- the harvest kernel


def harvested_by_torch(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                       sources: torch.Tensor) -> torch.Tensor:
    """A copy of `out` after the harvest op's torch body (the kernel's reference)."""
    taken = out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.harvest_stream(taken, hidden, residual, sources)
    finally:
        graph_ops.use_body(previous)
    return taken


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_harvest_kernel_copies_the_named_rows(interpreted: Interpreter, dtype: torch.dtype, fused: bool,
                                              block: Optional[int]) -> None:
    """Each buffer row takes its source row (the halves' sum: the bulk read's bits, and the torch body's); a
    source of -1 or past the call's rows leaves its buffer row as it was; NaN padding rows past the call, and
    index entries past the buffer's capacity, are not read; a whole stream's row is copied bit for bit."""
    width = 100
    hidden_buffer = torch.full((12, width), float("nan"), dtype=dtype)
    hidden_buffer[:10] = (torch.randn(10, width, generator=generator(9)) * 3).to(dtype)
    hidden_buffer[7, 3], hidden_buffer[0, 4] = -0.0, float("inf")
    residual = (torch.randn(10, width, generator=generator(10)) * 5).to(dtype) if fused else None
    hidden = hidden_buffer[:10]
    out = torch.randn(6, width, generator=generator(11)).to(dtype)
    sources = torch.tensor([7, -1, 0, 3, 10, 9, 2, 2], dtype=torch.int32)  # 10: past the rows; 2, 2: past capacity
    call, options = ("harvest_rows", {"block": block}) if block else ("harvest_stream", {})
    (taken, *others), _ = interpreted(call, out.clone(), hidden, residual, sources, **options)
    for before, after in zip((hidden, residual, sources), others):  # the op mutates `out` only
        assert (before is None and after is None) or torch.equal(bits(before), bits(after))
    named = torch.tensor([7, 0, 3, 9])
    bulk = Summed(None, OUTPUT).stream_rows(hidden if residual is None else (hidden, residual), named)
    assert bulk is not None
    assert torch.equal(bits(taken[[0, 2, 3, 5]]), bits(bulk))
    assert torch.equal(bits(taken[[1, 4]]), bits(out[[1, 4]]))
    assert torch.equal(bits(taken), bits(harvested_by_torch(out, hidden, residual, sources)))


def test_a_harvest_launch_is_as_wide_as_the_call_not_the_buffer(interpreted: Interpreter) -> None:
    """The harvest kernel launches one program per buffer row below the call's rows (a decode step of 64 rows with
    a buffer for 8,192: 64 programs), and fills the buffer as the torch body does, rows past the call kept."""
    hidden = torch.randn(64, 48, generator=generator(21))
    assert graph_kernels.harvest_launch(torch.empty(8192, 48), hidden, None, torch.full((8192,), -1))[0] == (64,)
    assert graph_kernels.harvest_launch(torch.empty(16, 48), hidden, None, torch.full((16,), -1))[0] == (16,)
    small = hidden[:4]
    out = torch.randn(9, 48, generator=generator(22))
    sources = torch.tensor([2, -1, 0, 3, 1, 1, 0, 2, 3], dtype=torch.int32)
    (taken, *_), _ = interpreted("harvest_stream", out.clone(), small, None, sources)
    assert torch.equal(bits(taken), bits(harvested_by_torch(out, small, None, sources)))
    assert torch.equal(bits(taken[4:]), bits(out[4:])) and torch.equal(bits(taken[[0, 2, 3]]), bits(small[[2, 0, 3]]))


@pytest.mark.parametrize("block", [None, 32], ids=["one-block", "blocks-of-32"])
@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_edit_and_its_harvest_in_one_launch_are_the_two_ops(interpreted: Interpreter, dtype: torch.dtype,
                                                              fused: bool, block: Optional[int]) -> None:
    """`edit_harvest_stream`'s kernel gives the bits of `edit_stream` then `harvest_stream` (kernels both): every
    mode, plain and norm-matched, rows interleaved; a harvested row the edit leaves (its row as it was), an edited
    row nobody harvests, idle rows and buffer rows no row fills, all as the two ops leave them. Its torch body is
    the two torch bodies, in order."""
    width, rows = 100, 20
    buffers, hidden, residual = every_mode(width, rows, dtype, fused, seed=50)
    slots = torch.tensor([(row * 3) % 9 - 1 for row in range(rows)], dtype=torch.int32)  # -1 and 0..7, mixed
    harvested = [7, 0, 3, 9, 2, 13]  # edited rows and rows the edit leaves (slot -1: rows 0, 3, 6, ...)
    sources = torch.full((8,), -1, dtype=torch.int32)
    sources[:len(harvested)] = torch.tensor(harvested, dtype=torch.int32)
    targets = torch.full((rows,), -1, dtype=torch.int32)
    targets[harvested] = torch.arange(len(harvested), dtype=torch.int32)
    out = torch.randn(8, width, generator=generator(53)).to(dtype)
    options = {"block": block} if block else {}
    (edited, *_), _ = interpreted("edit_rows" if block else "edit_stream", hidden.clone(), residual, slots, *buffers,
                                  **options)
    (taken, *_), _ = interpreted("harvest_rows" if block else "harvest_stream", out.clone(), edited, residual,
                                 sources, **options)
    if block:
        (both, _, _, _, _, _, _, _, both_out, _), _ = interpreted(
            "edit_harvest_rows", hidden.clone(), residual, slots, *buffers, out.clone(), targets, **options)
    else:
        (both, _, _, _, _, _, _, _, both_out, _, _), _ = interpreted(
            "edit_harvest_stream", hidden.clone(), residual, slots, *buffers, out.clone(), sources, targets)
    assert torch.equal(bits(both), bits(edited)) and torch.equal(bits(both_out), bits(taken))
    assert torch.equal(bits(both_out[len(harvested):]), bits(out[len(harvested):]))  # rows no row fills: kept
    assert not torch.equal(bits(edited), bits(hidden))  # the edits acted, so the comparison above can fail
    by_torch, by_torch_out = hidden.clone(), out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.edit_harvest_stream(by_torch, residual, slots, *buffers, by_torch_out, sources, targets)
        separate, separate_out = hidden.clone(), out.clone()
        graph_ops.edit_stream(separate, residual, slots, *buffers)
        graph_ops.harvest_stream(separate_out, separate, residual, sources)
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
    harvested = [7, 0, 3, 9, 2, 13, 11]
    sources = torch.full((8,), -1, dtype=torch.int32)
    sources[:len(harvested)] = torch.tensor(harvested, dtype=torch.int32)
    targets = torch.full((rows,), -1, dtype=torch.int32)
    targets[harvested] = torch.arange(len(harvested), dtype=torch.int32)
    out = torch.randn(8, width, generator=generator(63)).to(dtype)
    options = {"block": block} if block else {}
    edit, edit_harvest = ("edit_rows", "edit_harvest_rows") if block else ("edit_stream", "edit_harvest_stream")
    one_by_one = hidden.clone()
    for round_ in range(rounds):
        (one_by_one, *_), _ = interpreted(edit, one_by_one, residual, slots[:, round_].contiguous(), *buffers,
                                          **options)
    (taken, *_), _ = interpreted("harvest_rows" if block else "harvest_stream", out.clone(), one_by_one, residual,
                                 sources, **options)
    (together, *_), _ = interpreted(edit, hidden.clone(), residual, slots, *buffers, **options)
    assert torch.equal(bits(together), bits(one_by_one))
    assert not torch.equal(bits(together), bits(hidden))  # the rounds acted, so the comparison above can fail
    if block:
        (both, _, _, _, _, _, _, _, both_out, _), _ = interpreted(
            edit_harvest, hidden.clone(), residual, slots, *buffers, out.clone(), targets, **options)
    else:
        (both, _, _, _, _, _, _, _, both_out, _, _), _ = interpreted(
            edit_harvest, hidden.clone(), residual, slots, *buffers, out.clone(), sources, targets)
    assert torch.equal(bits(both), bits(one_by_one)) and torch.equal(bits(both_out), bits(taken))
    by_torch, by_torch_out = hidden.clone(), out.clone()
    previous = graph_ops.use_body("torch")
    try:
        graph_ops.edit_harvest_stream(by_torch, residual, slots, *buffers, by_torch_out, sources, targets)
        separate, separate_out = hidden.clone(), out.clone()
        for round_ in range(rounds):
            graph_ops.edit_stream(separate, residual, slots[:, round_], *buffers)
        graph_ops.harvest_stream(separate_out, separate, residual, sources)
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
    only: rows edited at no stage, at some and at every round of all; a row harvested at a stage that does not
    edit it, after an earlier stage did, is copied with that edit (tests/graph_stretch.py)."""
    stretch = Stretch(name, 20, 100, dtype)
    slot_buffers, options = stretch.slot_buffers, ({"block": block} if block else {})

    def edit(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        (edited, *_), _ = interpreted("edit_rows" if block else "edit_stream", hidden, residual, slots, *slot_buffers,
                                      **options)
        return edited

    def edit_harvest(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                     out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        maps = (stretch.targets,) if block else (stretch.sources, stretch.targets)
        arguments, _ = interpreted("edit_harvest_rows" if block else "edit_harvest_stream", hidden, residual, slots,
                                   *slot_buffers, out, *maps, **options)
        return arguments[0], arguments[8]

    one_by_one, one_by_one_harvested = stretch.one_by_one(edit, edit_harvest)
    if block:
        arguments, _ = interpreted("edit_stretch_rows", stretch.hidden.clone(), stretch.residual, stretch.index,
                                   *slot_buffers, stretch.harvested.clone(), stretch.targets, stretch.lanes, ROUNDS,
                                   stretch.buffers, stretch.fused, block=block)
    else:
        arguments, _ = interpreted("edit_stretch", stretch.hidden.clone(), stretch.residual, *stretch.arguments())
    together, together_harvested = arguments[0], arguments[8]
    assert torch.equal(bits(together), bits(one_by_one))
    assert torch.equal(bits(together_harvested), bits(one_by_one_harvested))
    assert not torch.equal(bits(together), bits(stretch.hidden))  # the stages acted: the comparison can fail
    stretch.check_harvest(together, together_harvested)


def test_an_idle_stretch_leaves_every_bit(interpreted: Interpreter) -> None:
    """No slot marked at any stage: the stream (NaN, inf, -0.0 in it) keeps every bit; with no target the harvest
    buffers too; with targets, only the targeted rows of the harvesting stages' buffers change (the rows copied)."""
    stretch = Stretch("three-stages", 20, 48, torch.float32)
    stretch.index.fill_(-1)
    hidden = stretch.hidden.clone()
    hidden[0, 1], hidden[3, 4], hidden[4, 0], hidden[9, 2] = float("nan"), float("inf"), -0.0, float("-inf")
    nowhere = (torch.full_like(stretch.sources, -1), torch.full_like(stretch.targets, -1))
    for maps in (nowhere, (stretch.sources, stretch.targets)):
        arguments, _ = interpreted("edit_stretch", hidden.clone(), stretch.residual, stretch.index,
                                   *stretch.slot_buffers, stretch.harvested.clone(), *maps, stretch.lanes, ROUNDS,
                                   stretch.buffers, stretch.fused)
        kept, harvested = arguments[0], arguments[8]
        assert torch.equal(bits(kept), bits(hidden))
        filled = [buffer for buffer in stretch.buffers if buffer >= 0] if maps is not nowhere else []
        untouched = [buffer for buffer in range(stretch.harvested.shape[0]) if buffer not in filled]
        assert torch.equal(bits(harvested[untouched]), bits(stretch.harvested[untouched]))
        assert torch.equal(bits(harvested[:, len(HARVESTED):]), bits(stretch.harvested[:, len(HARVESTED):]))
        if filled:  # the first stage (whole, buffer 2) copies its targeted rows as they are
            assert torch.equal(bits(harvested[2, :len(HARVESTED)]), bits(hidden[HARVESTED]))


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
    for name in ("FUSED", "BLOCK", "HARVEST", "ROUNDS", "WAIT", "STAGES", "SLOTS", "FUSED_MASK", "HARVEST_MASK"):
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
    # A stretch of three sites (a whole stream, then the fused one twice; harvests at the first and the last), one
    # launch: an idle row loads its slots (one load of them all) and its target, then branches away. A barrier
    # before each round but the first (nothing before it stored the row) and before each harvesting stage's copy.
    harvested, stages = torch.empty(3, 256, width, **meta), ([0, -1, 2], [False, True, True])
    stretch = compiled(graph_kernels._edit_stretch_rows,
                       graph_kernels.stretch_launch(hidden, residual, index, *bank, harvested, index[:, -2], [3, 5, 7],
                                                    2, *stages))
    ptx = stretch.asm["ptx"]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    assert stretch.asm["cubin"] and body[:body.index("bra")].count("ld.global") == 2
    assert stretch.asm["ttir"].count("ttg.barrier") == 3 * 2 - 1 + 2
    assert "fma.rn.f32" not in ptx and "ld.global.v4" in ptx and "st.global.v4" in ptx
    if dtype == torch.float32:  # the lanes and buffers are runtime arguments: other ones, the same kernel
        other = compiled(graph_kernels._edit_stretch_rows,
                         graph_kernels.stretch_launch(hidden, residual, index, *bank, harvested, index[:, -2],
                                                      [16, 1, 32], 2, [1, -1, 0], stages[1]))
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
    with pytest.raises(ValueError, match="harvest buffer is on meta"):
        graph_ops.harvest_stream(torch.empty(4, 48, device="meta"), hidden, None, case.slots)
    with pytest.raises(ValueError, match="sources is on meta"):
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
