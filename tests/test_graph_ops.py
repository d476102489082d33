"""The graph ops (`streamscope.vllm.graph_ops`) and their buffers' fill (`streamscope.vllm.graph_plan`), on the CPU.

Each op is held to `streamscope.bulk.operations`' arithmetic, written out
here in float64 from its definitions (the oracle), and to the bulk path's own
row edit and read (`streamscope.vllm.blocks.Summed`) within `CPU_FLOAT32`;
rows no slot marks stay bit for bit what they were. torch.compile with
``fullgraph=True`` keeps each op as one opaque node and gives the eager
results. The fill is held to a brute-force account of which rows each
request's steer and harvest touch.
"""

from __future__ import annotations

import math
import random
from typing import Any, Optional

import pytest
import torch

from streamscope.bulk.apply import Span
from streamscope.bulk.operations import Operation, prepare
from streamscope.bulk.spec import Steer
from streamscope.values import OUTPUT
from streamscope.vllm import graph_ops
from streamscope.vllm.blocks import Summed
from streamscope.vllm.graph_plan import GraphPlan, PlannedSteer, SlotBank
from streamscope.vllm.row_rules import EVERY_ROW, EVERY_ROW_BUT_FIRST, RowRule

from .graph_stretch import EDITED_THEN_COPIED, EVERYWHERE, POOL, ROUNDS, STRETCHES, Stretch, pool_of, pooled
from .precision import CPU_FLOAT32

HIDDEN = 48
MODES = ("add", "set", "ablate", "clamp")
SETTINGS = {"add": (0.7, 0.0), "set": (1.3, 0.0), "ablate": (0.6, 0.0), "clamp": (1.0, 2.5)}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def operation(mode: str, norm_match: bool, seed: int = 1) -> Operation:
    scale, projection = SETTINGS[mode]
    vector = torch.randn(HIDDEN, generator=generator(seed))
    return prepare(mode, vector, scale, projection, norm_match, torch.float32, "cpu")


def reference(mode: str, norm_match: bool, rows: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """operations.py's definitions in float64: add x + s v, set s v, ablate x - s (x.d) d, clamp x + (p - x.d) d."""
    scale, projection = SETTINGS[mode]
    vector = torch.randn(HIDDEN, generator=generator(seed)).double()
    x = rows.double()
    unit = vector / vector.norm()
    if mode == "add":
        edited = x + scale * vector
    elif mode == "set":
        edited = (scale * vector).expand_as(x)
    elif mode == "ablate":
        edited = x - scale * (x @ unit).unsqueeze(-1) * unit
    else:
        edited = x + (projection - x @ unit).unsqueeze(-1) * unit
    if norm_match:
        edited = edited * (x.norm(dim=-1, keepdim=True) / edited.norm(dim=-1, keepdim=True))
    return edited


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within CPU_FLOAT32 of the reference, relative to its largest entry."""
    return float((got.double() - want.double()).abs().max()) <= CPU_FLOAT32 * float(want.abs().max())


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def call_edit(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: SlotBank) -> None:
    graph_ops.edit_stream(hidden, residual, slots, *bank.buffers)


def stream(rows: int, seed: int, fused: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    hidden = torch.randn(rows, HIDDEN, generator=generator(seed)) * 3
    residual = torch.randn(rows, HIDDEN, generator=generator(seed + 100)) * 5 if fused else None
    return hidden, residual


def whole(hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
    return hidden if residual is None else hidden + residual


# ---------------------------------------------------------------- the edit op


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("norm_match", [False, True], ids=["plain", "norm_match"])
@pytest.mark.parametrize("mode", MODES)
def test_edit_equals_the_operation(mode: str, norm_match: bool, fused: bool) -> None:
    bank = SlotBank(3, HIDDEN, torch.float32, "cpu")
    op = operation(mode, norm_match)
    slot = bank.acquire("v", op)
    hidden, residual = stream(9, 3, fused)
    marked = [1, 2, 5, 8]
    slots = torch.full((12,), -1, dtype=torch.int32)  # longer than the rows: a graph's padding is never read
    slots[marked] = slot
    before = whole(hidden, residual).clone()
    edited = hidden.clone()
    call_edit(edited, residual, slots, bank)
    after = whole(edited, residual)
    assert close(after[marked], reference(mode, norm_match, before[marked]))
    # The bulk path's own edit of the same rows (the Applier's, through Summed): the same stream.
    bulk = hidden.clone()
    Summed(None, OUTPUT).edit_rows((bulk, residual) if fused else bulk, torch.tensor(marked), op)
    assert close(after[marked], whole(bulk, residual)[marked])
    untouched = [row for row in range(9) if row not in marked]
    assert torch.equal(bits(edited[untouched]), bits(hidden[untouched]))
    if residual is not None:
        assert torch.equal(bits(edited[untouched] + residual[untouched]), bits(before[untouched]))


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
@pytest.mark.parametrize("norm_match", [False, True], ids=["plain", "norm_match"])
@pytest.mark.parametrize("mode", ["add", "set"])
def test_add_and_set_are_the_bulk_paths_bits(mode: str, norm_match: bool, fused: bool) -> None:
    # Their rows go back as the bulk path writes them: the edited rows themselves on a whole stream, their
    # `edited - stream` added to the hidden half (`Summed._edit_rows`); no reduction of another order is involved.
    bank = SlotBank(1, HIDDEN, torch.float32, "cpu")
    op = operation(mode, norm_match)
    bank.acquire("v", op)
    hidden, residual = stream(6, 4, fused)
    slots = torch.tensor([0, -1, 0, 0, -1, 0], dtype=torch.int32)
    mine, bulk = hidden.clone(), hidden.clone()
    call_edit(mine, residual, slots, bank)
    Summed(None, OUTPUT).edit_rows((bulk, residual) if fused else bulk, torch.tensor([0, 2, 3, 5]), op)
    assert torch.equal(bits(mine), bits(bulk))


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
def test_each_row_takes_its_own_slot(fused: bool) -> None:
    """Eight operations (every mode, plain and norm-matched) in one call, rows interleaved: each row as if alone."""
    bank = SlotBank(8, HIDDEN, torch.float32, "cpu")
    kinds = [(mode, norm_match) for mode in MODES for norm_match in (False, True)]
    for number, (mode, norm_match) in enumerate(kinds):
        assert bank.acquire((mode, norm_match), operation(mode, norm_match, seed=10 + number)) == number
    hidden, residual = stream(20, 5, fused)
    slots = torch.tensor([(row * 3) % 9 - 1 for row in range(20)], dtype=torch.int32)  # -1 and 0..7, mixed
    before = whole(hidden, residual).clone()
    edited = hidden.clone()
    call_edit(edited, residual, slots, bank)
    after = whole(edited, residual)
    for row in range(20):
        slot = int(slots[row])
        if slot < 0:
            assert torch.equal(bits(edited[row]), bits(hidden[row]))
            continue
        mode, norm_match = kinds[slot]
        assert close(after[row:row + 1], reference(mode, norm_match, before[row:row + 1], seed=10 + slot)), (row, mode)


def test_idle_leaves_every_bit() -> None:
    bank = SlotBank(2, HIDDEN, torch.float32, "cpu")
    bank.acquire("v", operation("clamp", True))
    hidden, residual = stream(7, 6, True)
    hidden[0, 0], hidden[1, 1], hidden[2, 2] = float("nan"), float("inf"), -0.0  # odd values stay what they were
    edited = hidden.clone()
    slots = torch.full((16,), -1, dtype=torch.int32)
    call_edit(edited, residual, slots, bank)
    assert torch.equal(bits(edited), bits(hidden))
    alone = hidden.clone()
    call_edit(alone, None, slots, bank)
    assert torch.equal(bits(alone), bits(hidden))
    out = torch.randn(5, HIDDEN, generator=generator(7))
    kept = out.clone()
    graph_ops.harvest_stream(out, hidden, residual, slots)
    assert torch.equal(bits(out), bits(kept))


def test_bad_buffers_are_refused_by_name() -> None:
    bank = SlotBank(2, HIDDEN, torch.float32, "cpu")
    hidden, residual = stream(4, 8, True)
    with pytest.raises(ValueError, match="slots holds 2 entries for 4 rows"):
        call_edit(hidden, residual, torch.full((2,), -1, dtype=torch.int32), bank)
    with pytest.raises(ValueError, match="residual half"):
        call_edit(hidden, residual[:3], torch.full((4,), -1, dtype=torch.int32), bank)
    with pytest.raises(ValueError, match="bank is"):
        graph_ops.edit_stream(hidden, residual, torch.full((4,), -1, dtype=torch.int32), bank.bank.double(),
                              *bank.buffers[1:])
    with pytest.raises(ValueError, match="harvest pool is"):
        graph_ops.harvest_stream(torch.zeros(3, HIDDEN + 1), hidden, residual, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="SAE feature clamp stays on the hook path"):
        bank.acquire("sae", object())  # type: ignore[arg-type]


# ---------------------------------------------------------------- the harvest op


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
def test_harvest_copies_the_named_rows(fused: bool) -> None:
    """Each stream row with a target is stored in that pool row, the bulk read's bits; pool rows no row names, the
    spare among them, keep theirs; entries of the targets at or past the call's rows (a column sized for the
    largest step), naming pool rows, are not read: an idle step of 10 rows looks at 10 entries."""
    hidden, residual = stream(10, 9, fused)
    out = pool_of(8, HIDDEN, torch.float32, 11)
    kept = out.clone()
    targets = torch.tensor([1, -1, -1, 4, -1, -1, -1, 0, -1, 5, 2, 3], dtype=torch.int32)  # 10, 11: past the rows
    graph_ops.harvest_stream(out, hidden, residual, targets)
    bulk = Summed(None, OUTPUT).stream_rows((hidden, residual) if fused else hidden, torch.tensor([0, 3, 7, 9]))
    assert bulk is not None
    assert torch.equal(bits(out[[1, 4, 0, 5]]), bits(bulk))
    assert torch.equal(bits(out[[2, 3, 6, 7]]), bits(kept[[2, 3, 6, 7]]))


@pytest.mark.parametrize("fused", [True, False], ids=["halves", "whole"])
def test_sites_harvest_their_own_rows_of_one_pool(fused: bool) -> None:
    """Two harvest sites of one step, each with its own targets into the one pool (each op gets the whole pool, so
    that no view of it is mutated in a compiled graph): row 7, harvested at both and edited between them, holds
    each site's row in its own pool row; the rows neither names, the spare among them, keep their bits."""
    hidden, residual = stream(10, 9, fused)
    pool, bank = pool_of(8, HIDDEN, torch.float32, 13), SlotBank(2, HIDDEN, torch.float32, "cpu")
    kept = pool.clone()
    bank.acquire("a", operation("add", False, seed=3))
    slots = torch.tensor([0, -1, -1, 0, -1, -1, -1, 0, -1, -1], dtype=torch.int32)
    graph_ops.harvest_stream(pool, hidden, residual, torch.tensor([2, -1, -1, -1, -1, -1, -1, 0, -1, -1]))
    edited = hidden.clone()
    graph_ops.edit_harvest_stream(edited, residual, slots, *bank.buffers, pool,
                                  torch.tensor([-1, -1, -1, 1, -1, -1, -1, 5, -1, 3]))
    assert torch.equal(bits(pool[[0, 2]]), bits(whole(hidden, residual)[[7, 0]]))
    assert torch.equal(bits(pool[[5, 1, 3]]), bits(whole(edited, residual)[[7, 3, 9]]))
    assert not torch.equal(pool[5], pool[0]) and torch.equal(bits(pool[[4, 6, 7]]), bits(kept[[4, 6, 7]]))


def test_ops_pass_torch_library_checks() -> None:
    """Schema, fake implementation, functionalization and compile-time registrations (torch.library.opcheck)."""
    bank = SlotBank(2, HIDDEN, torch.float32, "cpu")
    bank.acquire("v", operation("ablate", False))
    hidden, residual = stream(5, 12, True)
    slots = torch.tensor([0, -1, 0, -1, 0, -1], dtype=torch.int32)
    torch.library.opcheck(graph_ops.edit_stream, (hidden.clone(), residual, slots, *bank.buffers))
    torch.library.opcheck(graph_ops.edit_stream, (hidden.clone(), None, slots, *bank.buffers))
    targets = torch.tensor([2, -1, 3, -1, 0, -1], dtype=torch.int32)
    torch.library.opcheck(graph_ops.harvest_stream, (pool_of(5, HIDDEN, torch.float32, 14), hidden, residual, targets))
    for second in (residual, None):
        torch.library.opcheck(graph_ops.edit_harvest_stream,
                              (hidden.clone(), second, slots, *bank.buffers, pool_of(5, HIDDEN, torch.float32, 14), targets))
    # A site's rounds side by side: a strided [rows, rounds] view of a plan's index, one op for them all.
    index = torch.full((6, 5), -1, dtype=torch.int32)
    index[:, 1], index[:, 2] = slots, torch.tensor([-1, 0, 0, -1, -1, 0], dtype=torch.int32)
    rounds = index[:, 1:3]
    torch.library.opcheck(graph_ops.edit_stream, (hidden.clone(), residual, rounds, *bank.buffers))
    torch.library.opcheck(graph_ops.edit_harvest_stream,
                          (hidden.clone(), residual, rounds, *bank.buffers, pool_of(5, HIDDEN, torch.float32, 14), targets))
    with pytest.raises(ValueError, match=r"slots \[rows, rounds\] holds at least one round"):
        graph_ops.edit_stream(hidden.clone(), residual, index[:, 1:1], *bank.buffers)
    with pytest.raises(ValueError, match="slots holds 6 entries for 7 rows"):
        graph_ops.edit_stream(torch.zeros(7, HIDDEN), None, rounds, *bank.buffers)


def test_fake_implementations_check_shapes_only() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(5, HIDDEN)
        bank = SlotBank(2, HIDDEN, torch.float32, "cpu")
        slots = torch.empty(8, dtype=torch.int32)
        graph_ops.edit_stream(hidden, hidden, slots, *bank.buffers)  # no data read: fake tensors have none
        graph_ops.harvest_stream(torch.empty(3, HIDDEN), hidden, None, slots)
        with pytest.raises(ValueError, match="targets holds 2 entries"):
            graph_ops.harvest_stream(torch.empty(3, HIDDEN), hidden, None, slots[:2])
        graph_ops.edit_harvest_stream(hidden, hidden, slots, *bank.buffers, torch.empty(3, HIDDEN), slots)
        with pytest.raises(ValueError, match="targets holds 2 entries"):
            graph_ops.edit_harvest_stream(hidden, None, slots, *bank.buffers, torch.empty(3, HIDDEN), slots[:2])
        index, pool = torch.empty(8, 6, dtype=torch.int32), torch.empty(7, HIDDEN)
        graph_ops.edit_stretch(hidden, hidden, index, *bank.buffers, pool, [0, 2], 2, [5, -1], [False, True])
        with pytest.raises(ValueError, match="stage 1's lane 5 with 2 rounds reaches outside"):
            graph_ops.edit_stretch(hidden, hidden, index, *bank.buffers, pool, [0, 5], 2, [4, -1], [False, True])


# ---------------------------------------------------------------- a stretch of sites in one op


@pytest.mark.parametrize("name", list(STRETCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_stretch_is_its_sites_one_by_one(dtype: torch.dtype, name: str) -> None:
    """`edit_stretch`'s torch body gives the bits of each stage's `edit_harvest_stream` or `edit_stream`, stage
    after stage (a whole stage on the hidden half alone, a fused one on the two halves), harvests at some stages
    only, each into its own rows of one pool (tests/test_graph_kernels.py holds the kernel to the same): a row
    harvested at a stage that does not edit it, after an earlier stage did, is copied with that edit; a row
    harvested at two stages holds each stage's row; rows no stage names, the spare among them, keep their bits."""
    stretch = Stretch(name, 20, 100, dtype)
    index, start, harvest_lanes, maps = pooled(stretch)
    one_by_one, one_by_one_pool = stretch.hidden.clone(), start.clone()
    for lane, harvest_lane, fused in zip(stretch.lanes, harvest_lanes, stretch.fused):
        slots, residual = index[:, lane:lane + ROUNDS], stretch.residual if fused else None
        if harvest_lane >= 0:
            graph_ops.edit_harvest_stream(one_by_one, residual, slots, *stretch.slot_buffers, one_by_one_pool,
                                          index[:, harvest_lane])
        else:
            graph_ops.edit_stream(one_by_one, residual, slots, *stretch.slot_buffers)
    together, together_pool = stretch.hidden.clone(), start.clone()
    rest = (stretch.lanes, ROUNDS, harvest_lanes, stretch.fused)
    graph_ops.edit_stretch(together, stretch.residual, index, *stretch.slot_buffers, together_pool, *rest)
    assert torch.equal(stretch_bits(together), stretch_bits(one_by_one))
    assert torch.equal(stretch_bits(together_pool), stretch_bits(one_by_one_pool))
    assert not torch.equal(stretch_bits(together), stretch_bits(stretch.hidden))  # the comparison can fail
    residual = stretch.residual if stretch.fused[-1] else None
    copied = together_pool[maps[-1][EDITED_THEN_COPIED]]  # by the last stage, which does not edit it: the first did
    assert torch.equal(copied, whole(together, residual)[EDITED_THEN_COPIED])
    assert not torch.equal(copied, whole(stretch.hidden, residual)[EDITED_THEN_COPIED])
    if len(maps) == 2:  # EVERYWHERE at two stages, edited between them: a row of each
        assert not torch.equal(together_pool[maps[0][EVERYWHERE]], together_pool[maps[1][EVERYWHERE]])
    kept = [row for row in range(POOL) if all(row not in targets.values() for targets in maps)]
    assert torch.equal(stretch_bits(together_pool[kept]), stretch_bits(start[kept]))
    idle, kept_pool = stretch.hidden.clone(), start.clone()
    idle[0, 1], idle[3, 4], idle[4, 0] = float("nan"), float("inf"), -0.0
    kept_hidden = idle.clone()
    graph_ops.edit_stretch(kept_hidden, stretch.residual, torch.full_like(index, -1), *stretch.slot_buffers,
                           kept_pool, *rest)
    assert torch.equal(stretch_bits(kept_hidden), stretch_bits(idle))  # idle: every bit of the stream and the pool
    assert torch.equal(stretch_bits(kept_pool), stretch_bits(start))
    graph_ops.edit_stretch(idle[:0], stretch.residual[:0], index, *stretch.slot_buffers, kept_pool, *rest)  # no rows


def test_stretch_refusals_name_the_fix() -> None:
    stretch = Stretch("three-stages", 20, 48, torch.float32)
    index, pool, harvest_lanes, _ = pooled(stretch)  # the index's 10 columns, then two of targets
    hidden, residual = stretch.hidden.clone(), stretch.residual

    def call(lanes: list[int], harvests: list[int], fused: list[bool], second: Optional[torch.Tensor] = residual,
             rounds: int = ROUNDS, into: torch.Tensor = pool) -> None:
        graph_ops.edit_stretch(hidden, second, index, *stretch.slot_buffers, into, lanes, rounds, harvests, fused)

    with pytest.raises(ValueError, match="lanes, harvest_lanes and fused hold one entry a stage.*not 3, 2 and 3"):
        call([1, 4, 7], [10, -1], [False, True, True])
    with pytest.raises(ValueError, match="a stretch runs 1 to 4 stages in one launch, not 5: split"):
        call([0, 1, 2, 3, 4], [-1] * 5, [True] * 5)
    with pytest.raises(ValueError, match="runs 1 to 4 stages in one launch, not 0"):
        call([], [], [])
    with pytest.raises(ValueError, match="stage 1 is fused .* no residual is given: pass the block's residual"):
        call([1, 4], [-1, -1], [False, True], second=None)
    with pytest.raises(ValueError, match="stage 1's lane 11 with 2 rounds reaches outside the index's 12 columns"):
        call([1, 11], [-1, -1], [True, True])
    for outside in (12, -2):
        with pytest.raises(ValueError, match=f"harvest_lanes \\[{outside}, -1\\] name a column outside the index's "
                                             "12: each is the column of a stage's targets, or -1"):
            call([1, 4], [outside, -1], [True, True])
    with pytest.raises(ValueError, match="at least one round, not rounds=0"):
        call([1, 4], [-1, -1], [True, True], rounds=0)
    with pytest.raises(ValueError, match=r"harvest pool is \[rows, 48\] .* not \(1, 16, 48\).*pass the plan's whole"):
        call([1, 4], [10, -1], [True, True], into=pool.unsqueeze(0))
    call([1, 4], [-1, -1], [False, False], second=None, into=torch.empty(0))  # no fused stage, no harvest: neither
    torch.library.opcheck(graph_ops.edit_stretch, (hidden.clone(), residual, index, *stretch.slot_buffers, pool,
                                                   [1, 4, 7], ROUNDS, harvest_lanes, [False, True, True]))


def stretch_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


# ---------------------------------------------------------------- torch.compile


class TwoBlocks(torch.nn.Module):
    """A fused-layout stand-in: two blocks handing on (hidden, residual), an edit at each block's input and output,
    a harvest at each output, all from one plan's buffers."""

    def __init__(self, plan: GraphPlan, together: bool = False) -> None:
        super().__init__()
        self.plan, self.together = plan, together
        self.mixers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        residual = torch.zeros_like(hidden)
        for number, mixer in enumerate(self.mixers):
            torch.ops.streamscope.edit_stream(hidden, residual, plan.slots_of(f"in{number}"), *plan.bank.buffers)
            residual = hidden + residual
            hidden = mixer(residual)
            if self.together:  # the output's edit and its harvest in one op
                torch.ops.streamscope.edit_harvest_stream(hidden, residual, plan.slots_of(f"out{number}"),
                                                          *plan.bank.buffers, plan.pool,
                                                          plan.targets_of(f"out{number}"))
                continue
            torch.ops.streamscope.edit_stream(hidden, residual, plan.slots_of(f"out{number}"), *plan.bank.buffers)
            torch.ops.streamscope.harvest_stream(plan.pool, hidden, residual, plan.targets_of(f"out{number}"))
        return hidden + residual


def compile_plan() -> GraphPlan:
    plan = GraphPlan(["in0", "out0", "in1", "out1"], 1, 16, HIDDEN, torch.float32, "cpu", slots=4,
                     harvest_sites=["out0", "out1"])
    plan.enter("a", [PlannedSteer(["in0", "out1"], operation("ablate", False), RowRule.of(range(1, 5), 5), "abl"),
                     PlannedSteer(["out0"], operation("clamp", True, seed=2), RowRule.of([4], 5), "clamp")],
               harvest_positions=[0, 4])
    plan.enter("b", [PlannedSteer(["in1"], operation("add", False, seed=3), RowRule.of(range(3), 3), "add")])
    plan.step([Span("a", 0, 5, 0), Span("b", 5, 3, 0), Span(None, 8, 2, 0)])
    return plan


def test_compile_keeps_the_ops_opaque_in_one_graph() -> None:
    plan = compile_plan()
    model = TwoBlocks(plan)
    torch.manual_seed(0)
    inputs = torch.randn(10, HIDDEN)
    explained = torch._dynamo.explain(model)(inputs.clone())
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    seen: list[Any] = []

    def backend(graph: torch.fx.GraphModule, example: Any) -> Any:
        seen.extend(node.target for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    torch.compile(model, fullgraph=True, backend=backend)(inputs.clone())
    # Each op is one node the tracer did not look into: called as itself, four edits and two harvests.
    edits = (torch.ops.streamscope.edit_stream, torch.ops.streamscope.edit_stream.default)
    harvests = (torch.ops.streamscope.harvest_stream, torch.ops.streamscope.harvest_stream.default)
    assert sum(target in edits for target in seen) == 4
    assert sum(target in harvests for target in seen) == 2


@pytest.mark.parametrize("together", [False, True], ids=["edit-then-harvest", "edit-harvest"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend: str, together: bool) -> None:
    plan = compile_plan()
    model = TwoBlocks(plan, together)
    torch.manual_seed(0)
    inputs = torch.randn(10, HIDDEN)
    with torch.no_grad():  # as vLLM runs its model
        eager = model(inputs.clone())
        eager_harvest = plan.pool.clone()
        assert bool(eager_harvest.abs().sum(-1).gt(0).any())
        if together:  # the one op is the two, bit for bit
            plan.pool.zero_()
            separate = TwoBlocks(plan)
            separate.load_state_dict(model.state_dict())
            assert torch.equal(separate(inputs.clone()), eager) and torch.equal(plan.pool, eager_harvest)
        plan.pool.zero_()
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        assert close(compiled(inputs.clone()), eager) and close(plan.pool, eager_harvest)
        # The same compiled graph, its buffers refilled for another batch (request b gone): read, not recompiled.
        plan.leave("b")
        plan.step([Span("a", 0, 5, 0), Span(None, 5, 5, 0)])
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = compiled(inputs.clone())
        refilled = model(inputs.clone())
        assert close(again, refilled)
        assert not close(refilled, eager)  # b's add is gone: the refill changed what the graph computes


# ---------------------------------------------------------------- the fill


def brute_rows(positions: set[int], length: int, generated: bool, from_step: int, span: Span) -> list[int]:
    """Which rows of `span` a steer edits, one position at a time."""
    rows = []
    for offset in range(span.count):
        position = span.first + offset
        if position < length:
            steered = position in positions
        else:
            steered = generated and position - length >= from_step
        if steered:
            rows.append(span.start + offset)
    return rows


def random_requests(rng: random.Random, count: int) -> dict[str, dict[str, Any]]:
    requests = {}
    for number in range(count):
        length = rng.randint(1, 12)
        choice = rng.random()
        if choice < 0.3:
            positions = set(range(length))
        elif choice < 0.6:
            positions = set(range(1, length))
        else:
            positions = {position for position in range(length) if rng.random() < 0.4}
        requests[f"r{number}"] = {"length": length, "positions": positions, "generated": rng.random() < 0.8,
                                  "from_step": rng.choice([0, 0, 2]),
                                  "sites": rng.sample(["s0", "s1", "s2"], rng.randint(1, 3)),
                                  "share": rng.choice(["x", "y", f"own{number}"]),
                                  "harvest": sorted(rng.sample(range(length), rng.randint(0, length)))}
    return requests


class _NoEvent:
    """`torch.cuda.Event` on this CPU, for the plan's GPU copy path (`staged`)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


def staged(plan: GraphPlan, monkeypatch: pytest.MonkeyPatch) -> GraphPlan:
    """`plan` copying its index as on a GPU: the lanes packed into staging buffers, then put in their columns by an
    indexed copy (here in host memory, where a GPU's staging is pinned and its landing on the device)."""
    columns, rows = plan._lanes.shape
    plan._staging = [(torch.empty(columns * rows, dtype=torch.int32), torch.empty(columns, dtype=torch.long))
                     for _ in range(2)]
    plan._landing = (torch.empty(columns * rows, dtype=torch.int32), torch.empty(columns, dtype=torch.long))
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)
    return plan


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_fill_matches_brute_force_over_steps(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests enter, prefill (some in two chunks), decode and leave over steps of changing sizes; after every step
    the device index holds exactly the brute-force marks and nothing stale, and the harvest layout names every
    harvested position once; by the CPU's copy and by the GPU's (lanes packed, then put in their columns)."""
    rng = random.Random(3)
    requests = random_requests(rng, 14)
    plan = GraphPlan(["s0", "s1", "s2"], 2, 64, HIDDEN, torch.float32, "cpu", slots=16, harvest_sites=["h"])
    if path == "gpu":
        staged(plan, monkeypatch)
    ops = {share: operation("add", False, seed=20 + number) for number, share in enumerate(["x", "y"])}
    done: dict[str, int] = {}  # tokens computed so far
    live: list[str] = []
    waiting = list(requests)
    harvested: dict[str, list[int]] = {}
    for _ in range(12):
        while waiting and len(live) < 6 and rng.random() < 0.7:
            key = waiting.pop(0)
            spec = requests[key]
            op = ops.get(spec["share"]) or operation("add", False, seed=40)
            rule = RowRule.of(spec["positions"], spec["length"], spec["generated"], spec["from_step"])
            steers = [PlannedSteer(spec["sites"], op, rule, spec["share"])]
            if spec["share"] == "y":  # a second steer by another rule, at its first site's second round
                steers.append(PlannedSteer(spec["sites"][:1], ops["x"], RowRule.of(range(spec["length"]),
                                                                                      spec["length"]), "x"))
            plan.enter(key, steers, harvest_positions=spec["harvest"])
            done[key] = 0
            live.append(key)
        spans, start = [], 0
        for key in live:
            length = requests[key]["length"]
            count = 1 if done[key] >= length else min(length - done[key], rng.choice([length, 3]))
            spans.append(Span(key, start, count, done[key]))
            start += count
        spans.append(Span(None, start, 2, 0))  # a request no plan owns
        harvest = plan.step(spans)
        expected = torch.full((64, 7), -1, dtype=torch.int32)  # 6 lanes, then the harvest site's stream row -> pool row
        for span in spans[:-1]:
            spec = requests[span.key]
            rows = brute_rows(spec["positions"], spec["length"], spec["generated"], spec["from_step"], span)
            for site in spec["sites"]:
                expected[rows, plan.lane_of[(site, 0)]] = plan.bank._held[spec["share"]][0]
            if spec["share"] == "y":
                every = brute_rows(set(range(spec["length"])), spec["length"], True, 0, span)
                expected[every, plan.lane_of[(spec["sites"][0], 1)]] = plan.bank._held["x"][0]
        for key, count, offset, base in harvest.layout:
            wanted = requests[key]["harvest"][offset:offset + count]
            span = next(span for span in spans if span.key == key)
            stream_rows = torch.tensor([span.start + p - span.first for p in wanted])
            expected[stream_rows, plan.harvest_lane_of["h"]] = torch.arange(base, base + count, dtype=torch.int32)
            harvested.setdefault(key, []).extend(wanted)
        assert torch.equal(plan.index, expected)
        for span in spans[:-1]:
            done[span.key] += span.count
        for key in [key for key in live if done[key] > requests[key]["length"] + 2]:
            plan.leave(key)
            live.remove(key)
    shares = {requests[key]["share"] for key in live}
    assert plan.bank.live == len(shares | ({"x"} if "y" in shares else set()))
    assert len(harvested) >= 5  # requests harvested, some over several steps
    for key, positions in harvested.items():
        assert positions == requests[key]["harvest"]


def test_a_step_copies_the_index_only_up_to_its_last_mark() -> None:
    """The host fills and copies a step's index rows only up to the last row a slot or a harvest marks, and the last
    step's marks past it (reset to -1): a step of plain requests after another copies nothing, and a steered
    request's rows cost their own, not the whole batch's (it once copied every row of the step, 386 columns of them
    at the Llama-3-8B shape), and only the lanes its requests mark and the last step's."""
    plan = GraphPlan(["s0", "s1"], 2, 64, HIDDEN, torch.float32, "cpu", slots=2, harvest_sites=["s0"])
    copied: list[tuple[int, int]] = []  # (rows, lanes) of each copy
    copy = plan._copy
    plan._copy = lambda rows, lanes: (copied.append((rows, len(lanes))), copy(rows, lanes))  # type: ignore
    plan.step([Span(None, 0, 40, 0)])
    plan.enter("a", [PlannedSteer(["s1"], operation("add", False, seed=1), RowRule.of(range(5), 5), "a")])
    plan.enter("b", harvest_positions=[2])
    plan.step([Span(None, 0, 20, 0), Span("b", 20, 4, 0), Span("a", 24, 5, 0), Span(None, 29, 30, 0)])
    # a's lane and the harvest site's column, of the plan's five
    assert copied == [(29, 2)] and int((plan.index[:, plan.lane_of[("s1", 0)]] >= 0).sum()) == 5
    plan.step([Span("b", 0, 1, 4), Span(None, 1, 50, 0), Span("a", 51, 1, 5)])  # decode: b's harvest is done
    assert copied == [(29, 2), (52, 2)]  # a's lane, and the harvest column reset
    plan.leave("a")
    plan.step([Span("b", 0, 1, 5), Span(None, 1, 60, 0)])  # nothing marked: the last step's lane reset
    plan.step([Span(None, 0, 60, 0)])
    assert copied == [(29, 2), (52, 2), (52, 1)] and bool((plan.index == -1).all())


@pytest.mark.parametrize("path", ["cpu", "gpu"])
def test_a_steady_decode_batch_fills_and_copies_its_index_once(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps of the same requests in the same rows, each steered whole, leave the index the first of them
    copied: nothing is filled or copied again (on the H100 the fill and copy were half of a steered step's plan),
    while the device index stays what each step marks. A change of rows, a request's leave and another's entry into
    the same table row, a steer that begins at a later token and a harvest each fill and copy anew."""
    plan = GraphPlan(["s0", "s1"], 1, 32, HIDDEN, torch.float32, "cpu", slots=4, harvest_sites=["s0"])
    if path == "gpu":
        staged(plan, monkeypatch)
    copied: list[int] = []
    copy = plan._copy
    plan._copy = lambda rows, lanes: (copied.append(rows), copy(rows, lanes))  # type: ignore
    add, ablate = operation("add", False, seed=1), operation("ablate", False, seed=2)
    every = RowRule.of(range(3), 3)
    plan.enter("a", [PlannedSteer(["s0", "s1"], add, every, "add")])
    plan.enter("b", [PlannedSteer(["s1"], ablate, every, "ablate")])
    slots = {share: held[0] for share, held in plan.bank._held.items()}

    def step(spans: list[Span], marks: dict[int, tuple[int, int]], pool: dict[int, int] = {}) -> None:
        plan.step(spans)
        expected = torch.full((32, 3), -1, dtype=torch.int32)  # two lanes, then the harvest's stream row -> pool row
        for row, (s0, s1) in marks.items():
            expected[row, 0], expected[row, 1] = s0, s1
        for row, target in pool.items():
            expected[row, 2] = target
        assert torch.equal(plan.index, expected)

    decode = {0: (slots["add"], slots["add"]), 2: (-1, slots["ablate"])}
    for first in range(3, 7):  # a, a plain request, b: one row each
        step([Span("a", 0, 1, first), Span(None, 1, 1, 0), Span("b", 2, 1, first)], decode)
    assert copied == [3]
    step([Span("b", 0, 1, 7), Span("a", 1, 1, 7)], {1: decode[0], 0: decode[2]})  # other rows
    assert copied == [3, 3]
    row = plan._live["b"].row
    plan.leave("b")
    plan.enter("c", [PlannedSteer(["s0"], ablate, every, "ablate")])
    assert plan._live["c"].row == row  # b's table row, other marks
    step([Span("c", 0, 1, 7), Span("a", 1, 1, 7)], {0: (slots["ablate"], -1), 1: decode[0]})
    assert copied == [3, 3, 2]
    late = RowRule.of([], 3, True, 2)  # from the third generated token on
    plan.enter("d", [PlannedSteer(["s1"], add, late, "add")])
    for first, marked in ((3, False), (4, False), (5, True), (6, True)):
        step([Span("a", 0, 1, first + 5), Span("d", 1, 1, first)],
             {0: decode[0], **({1: (-1, slots["add"])} if marked else {})})
    # d's rows are worked out span by span while its rule covers part of them (copied each step), then it is
    # steered whole: the step after the first such copies nothing
    assert copied == [3, 3, 2, 2, 2, 2]
    plan.enter("h", harvest_positions=[0, 1])
    step([Span("a", 0, 1, 12), Span("h", 1, 2, 0)], {0: decode[0]}, {1: 0, 2: 1})
    step([Span("a", 0, 1, 13), Span("h", 1, 1, 2)], {0: decode[0]})
    assert copied[-2:] == [3, 3]  # the harvest's rows, then their reset
    step([Span("a", 0, 1, 14), Span("h", 1, 1, 3)], {0: decode[0]})
    step([Span("a", 0, 1, 15), Span("h", 1, 1, 4)], {0: decode[0]})
    assert len(copied) == 8  # the harvest done and its column reset: the same marks again, nothing copied


@pytest.mark.parametrize("path", ["cpu", "gpu"])
@pytest.mark.parametrize("distinct", [1, 256])
def test_a_decode_batch_at_every_block(distinct: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 requests decoding, each steered at every block (lanes evenly spaced: two rounds a site), by one shared
    operation or each by its own: every row's marks, and one slot a distinct operation; by either copy path."""
    sites = [f"b{block}" for block in range(8)]
    plan = GraphPlan(sites, 2, 512, HIDDEN, torch.float32, "cpu", slots=256)
    if path == "gpu":
        staged(plan, monkeypatch)
    ops = [operation("ablate", False, seed=number) for number in range(distinct)]
    for number in range(256):
        plan.enter(number, [PlannedSteer(sites, ops[number % distinct], RowRule.of([0], 1), number % distinct)])
    plan.step([Span(number, number, 1, 5) for number in range(256)])
    slots = {share: held[0] for share, held in plan.bank._held.items()}
    expected = torch.full((512, 16), -1, dtype=torch.int32)
    for number in range(256):
        expected[number, 0:16:2] = slots[number % distinct]  # round 0 of each site
    assert torch.equal(plan.index, expected)
    assert plan.bank.live == distinct
    plan.step([Span(number, 2 * number, 2, 1) for number in range(0, 256, 2)])  # other rows, fewer requests
    expected.fill_(-1)
    for number in range(0, 256, 2):
        expected[2 * number:2 * number + 2, 0:16:2] = slots[number % distinct]
    assert torch.equal(plan.index, expected)


def test_rule_of_a_steer_is_its_positions() -> None:
    for positions, length in (("all", 6), ("all_but_first", 6), ("last", 6), ([0, 2, 3, -1], 7), (slice(1, 4), 9)):
        steer = Steer("layer_output", 0, torch.ones(HIDDEN), positions=positions, from_step=1)
        rule = RowRule.of_steer(steer, length, 0)
        from streamscope.bulk.spec import steer_positions

        chosen = set(steer_positions(steer, length, 0))
        for first, count in ((0, length), (0, 2), (2, length - 1), (length, 1), (length + 1, 1), (length + 3, 2)):
            span = Span("k", 4, count, first)
            rows = [row for low, high in rule.ranges(span.start, span.count, span.first) for row in range(low, high)]
            assert rows == brute_rows(chosen, length, True, 1, span), (positions, first, count)
            assert rule.covers(first, count) == (rows == list(range(4, 4 + count))), (positions, first, count)


def test_a_rule_says_from_which_position_it_edits_every_row() -> None:
    """`RowRule.every_from` lets a step skip its `covers` check of a span (a steady decode step of 256 requests
    steered at every block spent half its plan there): a span starting at or past it is covered whatever its
    length, and none starting before it is covered for every length, for the rules a steer makes and for the
    length-free rules of the graph backend."""
    length = 6
    rules = [EVERY_ROW, EVERY_ROW_BUT_FIRST, RowRule.of((), 0), RowRule.of((), 0, False)]
    for positions in ("all", "all_but_first", "last", [0, 2, 3], [4, 5], slice(0, 6), slice(0, 5)):
        for generated, from_step in ((True, 0), (True, 1), (True, 3), (False, 0)):
            steer = Steer("layer_output", 0, torch.ones(HIDDEN), positions=positions, generated=generated,
                          from_step=from_step)
            rules.append(RowRule.of_steer(steer, length, 0))
    answers = set()
    for rule in rules:
        starts = range(length + 6)
        every = [first for first in starts if all(rule.covers(later, count) for later in starts if later >= first
                                                  for count in (1, 2, length + 1))]
        assert (min(every) if every else math.inf) == rule.every_from, rule
        answers.add(rule.every_from)
    assert {0, 1, 4, math.inf} <= answers


def test_each_op_is_defined_with_the_tensors_it_writes_and_no_python_layer_before_its_body() -> None:
    """torch.compile keeps an op opaque and orders the writes by its schema, so the schema marks exactly the tensors
    the op writes. And the dispatcher goes from the op to its body with no Python kernel on the way
    (`torch.library.custom_op` puts one at autograd and another at ADInplaceOrView: 40-45 us a call on the CPU, at
    every op of every forward no CUDA graph replays; benchmarks/op_call.py)."""
    written = {graph_ops.edit_stream: {"hidden"}, graph_ops.harvest_stream: {"out"},
               graph_ops.edit_harvest_stream: {"hidden", "out"}, graph_ops.edit_stretch: {"hidden", "pool"}}
    for op, names in written.items():
        arguments = op._schema.arguments
        assert {argument.name for argument in arguments
                if argument.alias_info is not None and argument.alias_info.is_write} == names, op
        name = op._schema.name
        for key in ("CPU", "CUDA", "Meta"):  # (Meta: the fake implementation)
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)
        for key in ("Autograd", "ADInplaceOrView", "CompositeImplicitAutograd"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


def test_plan_refusals_name_the_fix() -> None:
    plan = GraphPlan(["s"], 1, 8, HIDDEN, torch.float32, "cpu", slots=1, harvest_sites=["s"], harvest_pool=2)
    add = operation("add", False)
    rule = RowRule.of(range(4), 4)
    with pytest.raises(ValueError, match="1 edit round"):
        plan.enter("a", [PlannedSteer(["s"], add, rule, "v"), PlannedSteer(["s"], add, rule, "w")])
    assert plan.live == 0 and plan.bank.live == 0  # a refused request leaves nothing behind
    with pytest.raises(ValueError, match="no edit op"):
        plan.enter("a", [PlannedSteer(["t"], add, rule, "v")])
    with pytest.raises(ValueError, match=r"up to 3 rows in one step.*holds 2.*harvest_pool"):
        plan.enter("a", [PlannedSteer(["s"], add, rule, "v")], harvest_positions=[0, 1, 2])
    assert plan.live == 0 and plan.bank.live == 0
    plan.enter("a", [PlannedSteer(["s"], add, rule, "v")], harvest_positions=[0, 1])
    with pytest.raises(RuntimeError, match="slot bank is full"):
        plan.enter("b", [PlannedSteer(["s"], operation("set", False), rule, "other")])
    assert plan.live == 1
    with pytest.raises(ValueError, match="size max_rows"):
        plan.step([Span(None, 0, 9, 0)])


def test_plan_and_ops_harvest_each_request() -> None:
    """A prefill in two chunks and a decode step through the ops: each request's `take` is its stream's rows at its
    positions and sites, bit for bit."""
    plan = GraphPlan(["a", "b"], 1, 32, HIDDEN, torch.float32, "cpu", harvest_sites=["a", "b"])
    plan.enter("p", harvest_positions=[0, 3, 5])
    plan.enter("q", harvest_positions=[1, 2], harvest_sites=["b"])
    streams: dict[str, list[torch.Tensor]] = {"p": [], "q": []}
    steps = [[Span("p", 0, 4, 0), Span("q", 4, 3, 0)], [Span("p", 0, 3, 4), Span("q", 3, 1, 3)]]
    for seed, spans in enumerate(steps):
        halves = {site: stream(8, 50 + 10 * seed + number, True) for number, site in enumerate("ab")}
        harvest = plan.step(spans)
        for site, (hidden, residual) in halves.items():
            graph_ops.harvest_stream(plan.pool, hidden, residual, plan.targets_of(site))
        plan.settle(plan.copy_out(harvest))
        for span in spans:
            for offset in range(span.count):
                position = span.first + offset
                wanted = {"p": [0, 3, 5], "q": [1, 2]}[span.key]
                if position in wanted:
                    sites = "ab" if span.key == "p" else "b"
                    streams[span.key].append(torch.stack([whole(*halves[site])[span.start + offset]
                                                          for site in sites]))
    assert plan.complete("p") and plan.complete("q")
    for key in "pq":
        taken = plan.take(key)
        assert taken is not None
        assert torch.equal(bits(taken), bits(torch.stack(streams[key], dim=1)))


def test_scaled_and_computed_values_stay_on_the_hook_path() -> None:
    from types import SimpleNamespace

    from streamscope.bulk.spec import Site
    from streamscope.vllm.graph_wiring import unserved

    def site(**descriptor: Any) -> Site:
        served = SimpleNamespace(**{"factor": None, **descriptor})
        return Site("layer_output", 0, SimpleNamespace(), served, torch.nn.Identity(),  # type: ignore[arg-type]
                    OUTPUT, "model.layers.0.output")

    assert unserved(site()) is None
    assert "scaled value" in str(unserved(site(factor=lambda host: 0.2)))
    assert "computed from another point" in str(unserved(site(bulk_site=lambda host: None)))


# ---------------------------------------------------------------- the compile cache's salt


def test_salt_changes_with_the_ops_code_and_set() -> None:
    base = graph_ops.cache_salt(["layers.0.layer_output"], 1, [])
    assert base == graph_ops.cache_salt(["layers.0.layer_output"], 1, [])
    source = graph_ops.ops_source()
    assert "def edit_stream" in source and "def harvest_stream" in source and "_edited" in source
    changed = source.replace("clamp_min(0)", "clamp_min(1)")
    assert changed != source
    assert graph_ops.cache_salt(["layers.0.layer_output"], 1, [], source=changed) != base
    assert graph_ops.cache_salt(["layers.0.layer_output", "layers.1.layer_output"], 1, []) != base
    assert graph_ops.cache_salt(["layers.0.layer_output"], 2, []) != base
    assert graph_ops.cache_salt(["layers.0.layer_output"], 1, ["layers.0.layer_output"]) != base


def test_salt_of_inserted_ops_covers_the_hooks() -> None:
    """The hooks' code decides which tensors the ops get; vLLM's AOT cache hashes no traced file, so the salt
    `insert_ops` hands out hashes it too."""
    from streamscope.vllm.graph_wiring import wiring_source

    wiring = wiring_source()
    assert all(name in wiring for name in ("def insert_ops", "class StreamAt", "def stream_at", "def stream_of",
                                           "def argument", "def first_tensor"))
    sites = ["layers.0.layer_output"]
    assert (graph_ops.cache_salt(sites, 1, [], graph_ops.ops_source() + wiring)
            != graph_ops.cache_salt(sites, 1, []))


def test_salt_reaches_vllms_config_hash() -> None:
    """vLLM's compile cache directory is a hash of its config's hash (and the environment, compiler and traced
    files): the salt in ``additional_config`` changes it."""
    config = pytest.importorskip("vllm.config")
    salt = graph_ops.cache_salt(["layers.0.layer_output"], 1, [])
    other = graph_ops.cache_salt(["layers.0.layer_input"], 1, [])
    hashes = {config.VllmConfig(additional_config=extra).compute_hash()
              for extra in ({}, graph_ops.salted(None, salt), graph_ops.salted({"user": 1}, salt),
                            graph_ops.salted(None, other))}
    assert len(hashes) == 4
    assert graph_ops.salted({"user": 1}, salt) == {"user": 1, graph_ops.SALT_KEY: salt}


def test_the_salt_covers_the_runs_each_family_joins() -> None:
    """Which sites one launch serves is stated in the families' modules and their layouts': their text is in the
    salt, so a changed run compiles anew; so is whether runs are joined at all."""
    from streamscope.vllm.graph_backend import GraphOptions
    from streamscope.vllm.graph_wiring import wiring_source

    wiring = wiring_source()
    assert "def chains" in wiring and "def stretches(self)" in wiring and "SPEC = derive(NEUTRAL[\"llama\"]" in wiring
    assert GraphOptions().salt() != GraphOptions(join=False).salt()
    assert GraphOptions.of({"join": False}) == GraphOptions(join=False)


def fake_sites(names: dict[str, tuple[int, str]]) -> dict[str, Any]:
    from types import SimpleNamespace

    return {name: SimpleNamespace(key=key) for name, key in names.items()}


RUNS = (("self_attn.attention_output", "layer_mid"), ("mlp.mlp_output", "layer_output", "next.layer_input"))


def test_chains_follow_the_runs_over_sites_without_an_op() -> None:
    """A run's sites with an op, each alone at its module call, are one chain in call order; a value of the run
    with no op there (the options leave it out) does not break it (nothing is computed there); the next block's
    input joins a block's output, and the last block's output ends its chain."""
    from streamscope.vllm.graph_wiring import chains

    values = ["layer_input", "self_attn.attention_output", "layer_mid", "mlp.mlp_output", "layer_output"]
    names = [f"layers.{layer}.{value}" for layer in range(2) for value in values]
    sites = fake_sites({name: (index, "output") for index, name in enumerate(names)})
    plan = GraphPlan([name for name in names if not name.endswith("layer_output")], 1, 4, 8, torch.float32, "cpu",
                     slots=2)
    found = chains(plan, sites, RUNS)
    assert found == [["layers.0.self_attn.attention_output", "layers.0.layer_mid"],
                     ["layers.0.mlp.mlp_output", "layers.1.layer_input"],
                     ["layers.1.self_attn.attention_output", "layers.1.layer_mid"]]


def test_a_shared_call_or_a_harvest_alone_breaks_a_chain() -> None:
    """A site whose module call holds another site, or that has a harvest op and no edit op, is not joined: the
    run's sites either side of it are chains of their own where two or more remain."""
    from streamscope.vllm.graph_wiring import chains

    names = ["layers.0.mlp.mlp_output", "layers.0.layer_output", "layers.1.layer_input", "layers.1.mlp.mlp_output",
             "layers.1.layer_output"]
    shared = fake_sites({name: (index, "output") for index, name in enumerate(names)})
    shared["layers.0.layer_output"].key = shared["layers.0.mlp.mlp_output"].key  # one call holds both
    plan = GraphPlan(names, 1, 4, 8, torch.float32, "cpu", slots=2)
    assert chains(plan, shared, RUNS) == [["layers.1.mlp.mlp_output", "layers.1.layer_output"]]
    alone = fake_sites({name: (index, "output") for index, name in enumerate(names)})
    harvest_only = GraphPlan([name for name in names if name != "layers.0.layer_output"], 1, 4, 8, torch.float32,
                             "cpu", slots=2, harvest_sites=["layers.0.layer_output"])
    assert chains(harvest_only, alone, RUNS) == [["layers.1.mlp.mlp_output", "layers.1.layer_output"]]
    assert chains(plan, alone, ()) == []
