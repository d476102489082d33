"""The graph ops' harvest pool (`streamscope.vllm.graph_plan.GraphPlan`): each (position, site) a request asks for in
a row of its own, laid out site by site, and a harvest admitted only while no step could overflow the pool.

The ops run their torch body on the CPU; each request's rows are held to the streams the test gave each site, bit
for bit (a harvest copies rows: no arithmetic on a whole stream's rows).
"""

from __future__ import annotations

import pytest
import torch

from streamscope.bulk.apply import Span
from streamscope.vllm import graph_ops
from streamscope.bulk.operations import prepare
from streamscope.vllm.graph_plan import POOL_SITES, GraphPlan, PlannedSteer, PoolBusy, default_pool
from streamscope.vllm.row_rules import RowRule

HIDDEN = 32
SITES = ["s0", "s1", "s2", "s3"]


def streams(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """A different stream at each site, ``[rows, HIDDEN]``."""
    generator = torch.Generator().manual_seed(seed)
    return {site: torch.randn(rows, HIDDEN, generator=generator) for site in SITES}


def run_step(plan: GraphPlan, spans: list[Span], at: dict[str, torch.Tensor]) -> None:
    """One step: the plan's fill, each harvest site's op on its stream, the rows to each request."""
    harvest = plan.step(spans)
    for site in plan.harvest_sites:
        graph_ops.harvest_stream(plan.pool, at[site], None, plan.targets_of(site))
    plan.settle(plan.copy_out(harvest))


def test_requests_asking_different_sites_in_one_step_each_get_their_own_rows() -> None:
    plan = GraphPlan(["s0"], 1, 16, HIDDEN, torch.float32, "cpu", harvest_sites=SITES, harvest_pool=40)
    plan.enter("a", harvest_positions=[1, 2, 3], harvest_sites=["s2", "s0"])  # its own order of sites
    plan.enter("b", harvest_positions=[0, 4], harvest_sites=["s1"])
    plan.enter("c", harvest_positions=[5], harvest_sites=SITES)
    spare = plan.pool[-1].clone()
    at = streams(16, 1)
    spans = [Span("b", 0, 6, 0), Span("a", 6, 4, 0), Span("c", 10, 6, 0)]
    harvest = plan.step(spans)
    assert harvest.used == 3 * 2 + 2 + 4  # a (position, site) a row, nothing more
    for site in SITES:
        targets = plan.targets_of(site)
        assert int(targets.max()) < plan.pool_rows  # the spare row is never named
        graph_ops.harvest_stream(plan.pool, at[site], None, targets)
    plan.settle(plan.copy_out(harvest))
    assert torch.equal(plan.pool[-1], spare)
    a, b, c = plan.take("a"), plan.take("b"), plan.take("c")
    assert a is not None and b is not None and c is not None
    assert torch.equal(a, torch.stack([at["s2"][[7, 8, 9]], at["s0"][[7, 8, 9]]]))
    assert torch.equal(b, at["s1"][[0, 4]].unsqueeze(0))
    assert torch.equal(c, torch.stack([at[site][[15]] for site in SITES]))


def test_a_prompt_in_chunks_fills_its_positions_step_by_step() -> None:
    plan = GraphPlan([], 1, 8, HIDDEN, torch.float32, "cpu", harvest_sites=SITES, harvest_pool=16)
    plan.enter("p", harvest_positions=[0, 2, 3, 6, 9], harvest_sites=["s3", "s1"])
    first, second, decode = streams(8, 2), streams(8, 3), streams(8, 4)
    run_step(plan, [Span("p", 2, 5, 0)], first)  # positions 0-4 at rows 2-6
    assert not plan.complete("p")
    run_step(plan, [Span("p", 0, 5, 5)], second)  # positions 5-9 at rows 0-4
    assert plan.complete("p")
    written = plan._written
    run_step(plan, [Span("p", 3, 1, 10)], decode)  # a decode step reads nothing: no harvest column is written
    assert not set(plan.harvest_lane_of.values()) & set(plan._written) and written
    taken = plan.take("p")
    assert taken is not None
    for number, site in enumerate(["s3", "s1"]):
        assert torch.equal(taken[number], torch.cat([first[site][[2, 4, 5]], second[site][[1, 4]]]))


def test_a_harvest_the_pool_cannot_hold_is_refused_for_good_or_for_now() -> None:
    plan = GraphPlan([], 1, 8, HIDDEN, torch.float32, "cpu", harvest_sites=SITES, harvest_pool=20)
    # 3 sites at each of a step's 8 rows: 24 rows, more than the pool: never
    with pytest.raises(ValueError, match=r"up to 24 rows in one step.*holds 20.*harvest_pool"):
        plan.enter("big", harvest_positions=range(12), harvest_sites=SITES[:3])
    assert plan.live == 0
    plan.enter("p", harvest_positions=range(4), harvest_sites=SITES)  # 4 positions at 4 sites: 16 rows
    assert plan.most_harvested() == 16
    # 2 positions at 4 sites could share p's step: 24 rows. Not now.
    with pytest.raises(PoolBusy, match=r"pool \(20 rows\) is held.*could harvest 24 rows"):
        plan.enter("q", harvest_positions=[3, 5], harvest_sites=SITES)
    assert plan.live == 1 and "q" not in plan._live
    plan.enter("last", harvest_positions=[7], harvest_sites=SITES)  # 4 rows more: 20, it fits beside p
    run_step(plan, [Span("p", 0, 8, 0)], streams(8, 5))  # p's prompt read: it holds no row of a step any more
    assert plan.complete("p") and plan.most_harvested() == 4
    plan.enter("q", harvest_positions=[3, 5], harvest_sites=SITES)
    assert plan.most_harvested() == 4 + 8


def test_the_most_a_step_harvests_gives_its_rows_to_the_widest_harvests_first() -> None:
    plan = GraphPlan([], 1, 10, HIDDEN, torch.float32, "cpu", harvest_sites=SITES, harvest_pool=1000)
    plan.enter("wide", harvest_positions=[0, 1, 2], harvest_sites=SITES)  # 3 rows at 4 sites
    plan.enter("narrow", harvest_positions=range(20), harvest_sites=["s0"])  # 20 rows at 1 site
    plan.enter("two", harvest_positions=range(5), harvest_sites=["s0", "s1"])  # 5 rows at 2 sites
    assert plan.most_harvested() == 3 * 4 + 5 * 2 + 2 * 1
    assert plan.most_harvested((3, 1)) == 3 * 4 + 1 * 3 + 5 * 2 + 1 * 1


def test_the_default_pool_holds_eight_sites_at_every_row() -> None:
    assert POOL_SITES == 8 and default_pool(8192, 192) == 8 * 8192 and default_pool(8192, 3) == 3 * 8192
    plan = GraphPlan(["s0"], 1, 16, HIDDEN, torch.bfloat16, "cpu", harvest_sites=SITES)
    assert plan.pool_rows == 4 * 16 and plan.pool.shape == (4 * 16 + 1, HIDDEN) and plan.pool.dtype == torch.bfloat16
    assert GraphPlan(["s0"], 1, 16, HIDDEN, torch.float32, "cpu").pool.shape == (1, HIDDEN)


def test_a_run_of_positions_makes_the_rule_a_loop_over_them_makes() -> None:
    """A steer at every position (or all but the first) comes as a range, which makes its rule in one step (a
    32-block steer of a 512-token prompt took 2.8 ms of the engine's host to enter, position by position): the
    same rule as its positions one by one, and the same refusal of a position outside the prompt."""
    for positions, length in ((range(0, 512), 512), (range(1, 512), 512), (range(3, 3), 8), (range(2, 5), 9)):
        fast = RowRule.of(positions, length, True, 2)
        assert fast == RowRule.of(list(positions), length, True, 2)
        for first, count in ((0, length), (1, 3), (length, 1), (length + 2, 1)):
            assert fast.ranges(10, count, first) == RowRule.of(list(positions), length, True, 2).ranges(10, count, first)
    for positions in (range(0, 9), range(-1, 4)):
        with pytest.raises(ValueError, match="is not in a 8-token prompt"):
            RowRule.of(positions, 8)
        with pytest.raises(ValueError, match="is not in a 8-token prompt"):
            RowRule.of(list(positions), 8)


def test_requests_of_one_list_of_steers_share_their_edits_and_each_is_refused_alone() -> None:
    """A bulk run hands its requests of one length one list of steers: they share one record of edits (worked out
    once, which took most of a 256-request run's begin), each still with its own table row and slot uses; a list
    whose slots differ gets its own, and a steer at a site with no op is refused for every request that asks,
    leaving the plan as it was."""
    add = prepare("add", torch.ones(HIDDEN), 1.0, 0.0, False, torch.float32, "cpu")
    ablate = prepare("ablate", torch.ones(HIDDEN), 1.0, 0.0, False, torch.float32, "cpu")
    plan = GraphPlan(["s0", "s1"], 1, 16, HIDDEN, torch.float32, "cpu", slots=4)
    rule = RowRule.of(range(0, 4), 4, True, 0)
    steers = [PlannedSteer(["s0"], add, rule, "add"), PlannedSteer(["s1"], ablate, rule, "ablate")]
    plan.enter("a", steers)
    plan.enter("b", steers)
    a, b = plan._live["a"], plan._live["b"]
    assert a.edits is b.edits and a.row != b.row and plan.bank.live == 2
    assert plan._table[a.row].tolist() == plan._table[b.row].tolist() == [a.edits[0].slot, a.edits[1].slot]
    other = [PlannedSteer(["s0"], ablate, rule, "ablate"), PlannedSteer(["s1"], add, rule, "add")]
    plan.enter("c", other)
    assert plan._live["c"].edits is not a.edits
    assert plan._table[plan._live["c"].row].tolist() == [a.edits[1].slot, a.edits[0].slot]
    refused = [PlannedSteer(["s2"], add, rule, "add")]
    for key in ("d", "e"):
        with pytest.raises(ValueError, match="steers site 's2' 1 time"):
            plan.enter(key, refused)
    assert plan.live == 3 and plan.bank.live == 2
    for key in ("a", "b", "c"):
        plan.leave(key)
    assert plan.bank.live == 0 and not plan._table.any(where=plan._table >= 0)


def test_a_step_is_idle_exactly_where_it_marks_no_row() -> None:
    """`GraphPlan.idle` after each step: a step of plain requests, of a harvest read to its end, and the step that
    resets the last one's marks are idle; a step with a live steer (begun or not: the plan fills its rows, -1
    where the steer edits none yet) or a harvest read in it is not."""
    add = prepare("add", torch.ones(HIDDEN), 1.0, 0.0, False, torch.float32, "cpu")
    plan = GraphPlan(["s0"], 1, 16, HIDDEN, torch.float32, "cpu", harvest_sites=["s1"], harvest_pool=8)
    assert plan.idle  # before any step
    plan.step([Span("plain", 0, 4, 0)])
    assert plan.idle
    plan.enter("late", [PlannedSteer(["s0"], add, RowRule.of([], 3, True, 1), "v")])  # from the 2nd generated token
    plan.step([Span("plain", 0, 4, 4), Span("late", 4, 3, 0)])
    assert not plan.idle and not plan.index[:, 0].ge(0).any()
    plan.step([Span("plain", 0, 1, 8), Span("late", 1, 1, 4)])
    assert not plan.idle and plan.index[1, 0] >= 0
    plan.leave("late")
    plan.step([Span("plain", 0, 1, 10)])  # the reset of the last step's marks: nothing marked
    assert plan.idle and not plan.index[:, 0].ge(0).any()
    plan.enter("read", harvest_positions=[1, 2], harvest_sites=["s1"])
    harvest = plan.step([Span("read", 0, 3, 0)])
    assert not plan.idle and harvest.used == 2
    plan.step([Span("read", 0, 1, 3)])  # its positions read: a decode step marks nothing
    assert plan.idle


def test_the_ops_skip_an_idle_step_and_run_in_any_other_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `graph_ops.IDLE` set for a step, the ops leave the stream and the pool as they were, marks or not; inside
    a CUDA graph capture other than the idle graphs' they run whatever the step says (the steered steps replay it);
    inside the idle graphs' capture they skip."""
    add = prepare("add", torch.ones(HIDDEN), 2.0, 0.0, False, torch.float32, "cpu")
    plan = GraphPlan(["s0"], 1, 8, HIDDEN, torch.float32, "cpu", harvest_sites=["s0"], harvest_pool=8)
    plan.enter("a", [PlannedSteer(["s0"], add, RowRule.of(range(4), 4), "v")], harvest_positions=[0, 3])
    plan.step([Span("a", 0, 4, 0)])
    stream = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(5))
    bank = plan.bank

    def run(hidden: torch.Tensor) -> None:
        graph_ops.edit_harvest_stream(hidden, None, plan.rounds_of("s0"), bank.bank, bank.modes, bank.scales,
                                      bank.projections, bank.norm_match, plan.pool, plan.targets_of("s0"))

    switch = graph_ops.IDLE
    monkeypatch.setattr(switch, "step", True)
    hidden, pool = stream.clone(), plan.pool.clone()
    run(hidden)
    assert torch.equal(hidden, stream) and torch.equal(plan.pool, pool)  # skipped, marks and all
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert switch.skips(torch.device("cuda"))  # an idle step on a GPU, uncaptured
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not switch.skips(torch.device("cuda"))  # vLLM's own capture: the graph holds the ops
    with switch.capture():
        assert switch.skips(torch.device("cuda")) and switch.skips(torch.device("cpu"))
    assert not switch.capturing
    monkeypatch.setattr(switch, "step", False)
    assert not switch.skips(torch.device("cuda")) and not switch.skips(torch.device("cpu"))
    run(hidden)
    assert torch.equal(hidden, stream + 2.0)  # the same call, the step not idle: edited
    assert torch.equal(plan.pool[[0, 1]], hidden[[0, 3]])


def test_in_a_marked_step_a_site_the_step_marks_nothing_at_returns_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`IdleSwitch.leaves`: with the columns a plan's step marks set (`GraphBackend.step` sets them), an op at a site
    whose columns the step marks none of returns at once, at a site it marks runs, and an op on a tensor of one's
    own (not the plan's) always runs. A stretch runs only its marked stages in its torch body. Each result is the
    bits of the same ops run with no columns set (every op run), and inside a CUDA capture nothing is left out."""
    add = prepare("add", torch.ones(HIDDEN), 2.0, 0.0, False, torch.float32, "cpu")
    plan = GraphPlan(["s0", "s1", "s2"], 2, 8, HIDDEN, torch.float32, "cpu", harvest_sites=["s1", "s2"],
                     harvest_pool=8)
    plan.enter("a", [PlannedSteer(["s1"], add, RowRule.of(range(4), 4), "v")], harvest_positions=[0, 3],
               harvest_sites=["s2"])
    plan.step([Span("a", 0, 4, 0)])
    assert plan.marked_columns == {plan.rounds_of("s1").data_ptr(), plan.targets_of("s2").data_ptr()}
    bank = plan.bank
    buffers = (bank.bank, bank.modes, bank.scales, bank.projections, bank.norm_match)
    calls: list[int] = []
    edit = graph_ops._edit_by_torch

    def counted(hidden, residual, slots, *rest):  # type: ignore[no-untyped-def]
        calls.append(slots.data_ptr())
        edit(hidden, residual, slots, *rest)

    monkeypatch.setattr(graph_ops, "_edit_by_torch", counted)
    stream = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(7))
    index = plan.index
    lanes = [plan.lane_of[(site, 0)] for site in ("s0", "s1", "s2")]
    harvest_lanes = [-1, plan.harvest_lane_of["s1"], plan.harvest_lane_of["s2"]]

    def every_op(hidden: torch.Tensor) -> None:
        for site in ("s0", "s1", "s2"):
            graph_ops.edit_stream(hidden, None, plan.rounds_of(site), *buffers)
        graph_ops.harvest_stream(plan.pool, hidden, None, plan.targets_of("s1"))
        graph_ops.edit_harvest_stream(hidden, None, plan.rounds_of("s0"), *buffers, plan.pool, plan.targets_of("s2"))
        graph_ops.edit_stretch(hidden, None, index, *buffers, plan.pool, lanes, 2, harvest_lanes, [False] * 3)

    def outcome(columns: object) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        monkeypatch.setattr(graph_ops.IDLE, "columns", columns)
        calls.clear()
        plan.pool.zero_()
        hidden = stream.clone()
        every_op(hidden)
        return hidden, plan.pool.clone(), list(calls)

    everything = outcome(None)
    left_out = outcome((plan.marked_columns, plan.columns))
    assert torch.equal(left_out[0], everything[0]) and torch.equal(left_out[1], everything[1])
    assert not torch.equal(everything[0], stream)  # the steer at s1 acted
    # (the torch body calls itself a round at a time: a site's calls are at its two columns)
    column = {site: {plan.slots_of(site, round_).data_ptr() for round_ in range(2)} for site in ("s0", "s1", "s2")}
    assert set(everything[2]) == column["s0"] | column["s1"] | column["s2"]
    # s1's own op and the stretch's s1 stage; the edit-harvest op at s0 with s2's targets, one launch for both, as
    # s2's harvest is marked; s0's and s2's edit ops and the stretch's edits at them left out
    assert set(left_out[2]) == column["s1"] | column["s0"]
    assert len(left_out[2]) == 3 * 3  # each of the three calls: the call, then its two rounds
    own = torch.full((8, 2), -1, dtype=torch.int32)
    calls.clear()
    graph_ops.edit_stream(stream.clone(), None, own, *buffers)  # not the plan's columns: it runs
    assert calls[:1] == [own.data_ptr()]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not graph_ops.IDLE.leaves(torch.device("cuda"), (plan.rounds_of("s0").data_ptr(),))  # a graph holds all
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graph_ops.IDLE.leaves(torch.device("cuda"), (plan.rounds_of("s0").data_ptr(),))


def test_a_step_that_marks_the_lean_sites_only_may_replay_the_lean_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`GraphPlan.step` sets `IDLE.lean` where every column the step marks is one of `lean_columns` (a steer or a
    harvest at the lean sites only, or nothing), never where the plan keeps no lean set; in the lean set's capture
    an op runs where one of its columns is kept, whatever the step marks, and a stretch keeps only its kept
    stages (the edit at s1, the harvest at s1), each with the bits of the same stages run whole."""
    add = prepare("add", torch.ones(HIDDEN), 2.0, 0.0, False, torch.float32, "cpu")
    plan = GraphPlan(["s0", "s1"], 2, 8, HIDDEN, torch.float32, "cpu", harvest_sites=["s0", "s1"], harvest_pool=8)
    switch = graph_ops.IDLE
    plan.enter("lean", [PlannedSteer(["s1"], add, RowRule.of(range(4), 4), "v")], harvest_positions=[0, 3],
               harvest_sites=["s1"])
    plan.step([Span("lean", 0, 4, 0)])
    assert plan.lean_columns is None and not switch.lean  # no lean set kept: vLLM's graphs
    plan.lean_columns = plan.columns_of(["s1"])
    assert plan.lean_columns == {plan.rounds_of("s1").data_ptr(), plan.targets_of("s1").data_ptr()}
    plan.step([Span("lean", 0, 4, 4)])
    assert switch.lean and not switch.step and switch.graph_sets() == (graph_ops.LEAN_SET,)
    plan.enter("other", [PlannedSteer(["s0"], add, RowRule.of(range(2), 2), "v")])
    plan.step([Span("lean", 0, 1, 8), Span("other", 1, 2, 0)])
    assert not switch.lean and switch.graph_sets() == ()
    plan.leave("other")
    plan.leave("lean")
    plan.step([Span("plain", 0, 2, 0)])
    assert switch.step and switch.graph_sets() == (graph_ops.IDLE_SET, graph_ops.LEAN_SET)
    plan.enter("read", harvest_positions=[0], harvest_sites=["s0"])  # a harvest at a site the lean set leaves out
    plan.step([Span("read", 0, 2, 0)])
    assert not switch.lean and not switch.step

    cuda = torch.device("cuda")
    with switch.capture(graph_ops.LEAN_SET, plan.lean_columns):  # the columns the step marks play no part
        assert not switch.skips(cuda) and switch.graph_sets() == (graph_ops.LEAN_SET,)
        assert switch.leaves(cuda, (plan.rounds_of("s0").data_ptr(),))
        assert not switch.leaves(cuda, (plan.rounds_of("s1").data_ptr(),))
        assert not switch.leaves(cuda, (plan.rounds_of("s0").data_ptr(), plan.targets_of("s1").data_ptr()))
    with switch.capture():
        assert switch.skips(cuda) and switch.leaves(cuda, (plan.rounds_of("s1").data_ptr(),))
    assert switch.capturing is None and switch.kept == frozenset()

    # a stretch over both sites in the lean capture: its s1 stage runs as in the stretch run whole (its s0 stage
    # left out), on a step that marks s1 only, which is the step the lean graphs replay
    plan.leave("read")
    plan.enter("lean", [PlannedSteer(["s1"], add, RowRule.of(range(4), 4), "v")], harvest_positions=[0, 3],
               harvest_sites=["s1"])
    plan.step([Span("lean", 0, 4, 0)])
    assert switch.lean
    bank, index = plan.bank, plan.index
    lanes = [plan.lane_of[("s0", 0)], plan.lane_of[("s1", 0)]]
    harvest_lanes = [plan.harvest_lane_of["s0"], plan.harvest_lane_of["s1"]]
    stream = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(11))

    def stretch() -> tuple[torch.Tensor, torch.Tensor]:
        hidden = stream.clone()
        plan.pool.zero_()
        graph_ops.edit_stretch(hidden, None, index, bank.bank, bank.modes, bank.scales, bank.projections,
                               bank.norm_match, plan.pool, lanes, 2, harvest_lanes, [False, False])
        return hidden, plan.pool.clone()

    monkeypatch.setattr(switch, "columns", None)
    whole = stretch()
    with switch.capture(graph_ops.LEAN_SET, plan.lean_columns):
        lean = stretch()
    assert torch.equal(lean[0], whole[0]) and torch.equal(lean[1], whole[1])
    assert torch.equal(whole[0], stream + 2.0)
