"""The graph-op backend's routing (`streamscope.vllm.graph_backend`), without an engine: which of a request's steers
and harvest go to the plan, which stay on the hooks, and that a refused request leaves the plan as it was.

The values through the ops on vLLM's engine are held to the hook path and the oracle in
tests/vllm/test_graph_backend.py; here the rules, on sites made of plain modules.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from streamscope.serve.worker import _refusal
from streamscope.vllm.graph_backend import (CONFIG_KEY, GraphBackend, GraphOps, GraphOptions, LeftOnHooks,
                                            check_harvest_memory, engine_config, operation_of, row_rule)
from streamscope.bulk.operations import prepare
from streamscope.bulk.steer import Steer, steer_positions
from streamscope.bulk.apply import run_requests, steer_plans
from streamscope.bulk.requests import Live, RequestApplier, Span, SteerEntry
from streamscope.vllm.graph_ops import IDLE, MODE_CODES, SALT_KEY
from streamscope.vllm.graph_plan import GraphPlan, default_pool

HIDDEN = 4


def site(module: torch.nn.Module, where: str = "output") -> Any:
    return SimpleNamespace(module=module, where=where, descriptor=object(), key=(id(module), where), value="v",
                           location=f"{id(module)}.{where}")


class Setup:
    """Three sites ``a``, ``b`` (one module call) and ``c`` (another), the ops at each with two rounds, harvest ops
    at ``a`` and ``c``; a bank of `slots`."""

    def __init__(self, slots: int = 4) -> None:
        shared, other = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.sites = {"a": site(shared), "b": site(shared), "c": site(other)}
        self.plan = GraphPlan(["a", "b", "c"], 2, 16, HIDDEN, torch.float32, "cpu", slots=slots,
                              harvest_sites=["a", "c"])
        names = {(id(found.module), found.where, id(found.descriptor)): name for name, found in self.sites.items()}
        self.ops = GraphOps(self.plan, names, None, order={"a": 0, "b": 1, "c": 2})
        self.backend = GraphBackend(self.ops)

    def entry(self, name: str, mode: str = "add", order: int = 0, seed: int = 0, **more: Any) -> SteerEntry:
        vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))
        operation = prepare(mode, vector, 1.0, 0.5, False, torch.float32, "cpu")
        return SteerEntry(self.sites[name], operation, None, None, True, 6, order, **more)


def test_each_steer_goes_where_the_request_s_order_holds() -> None:
    setup = Setup()
    sae_like = setup.entry("b")
    sae_like.delta = SimpleNamespace(mode="sae_clamp")  # not an operation a slot holds
    steers = [setup.entry("a", seed=1), sae_like, setup.entry("b", "ablate", 1, seed=2), setup.entry("c", seed=3)]
    live = Live(list(steers), harvest_sites=[setup.sites["a"]], positions=[0, 1], slots={0: 0, 1: 1})
    setup.backend.enter("r", live)
    # a on the ops; the SAE clamp on the hooks, and the ablate after it at the same call with it; c on the ops.
    assert live.steers == [steers[1], steers[2]]
    assert live.harvest_sites == [setup.sites["a"]]  # read after hook edits: the hooks read it
    assert setup.ops.served == {"steers": 2, "harvests": 0} and setup.plan.bank.live == 2


def test_the_ops_order_and_rounds_at_a_module_call() -> None:
    setup = Setup()
    # b then a at one call: the ops run a first, so a stays on the hooks (and so does everything after it there).
    backwards = [setup.entry("b", seed=1), setup.entry("a", seed=2), setup.entry("b", order=1, seed=3)]
    live = Live(list(backwards))
    setup.backend.enter("r", live)
    assert live.steers == backwards[1:]
    # Three steers at c: two rounds on the ops, the third on the hooks.
    three = [setup.entry("c", order=number, seed=number) for number in range(3)]
    live = Live(list(three), harvest_sites=[setup.sites["c"]], positions=[1, 2])
    setup.backend.enter("s", live)
    assert live.steers == three[2:] and live.positions == [1, 2]


def test_a_request_served_whole_by_the_ops_harvests_there() -> None:
    setup = Setup()
    live = Live([setup.entry("a"), setup.entry("c", "clamp")], harvest_sites=[setup.sites["c"], setup.sites["a"]],
                positions=[0, 2], slots={0: 0, 2: 1})
    setup.backend.enter("r", live)
    assert live.steers == [] and live.harvest_sites == [] and live.positions == [] and not live.planned()
    assert setup.ops.served == {"steers": 2, "harvests": 1} and setup.backend.harvesting == {"r"}
    # Unsorted positions, a site without a harvest op, or a readout: the hooks read.
    for number, extra in enumerate(({"positions": [2, 0]}, {"harvest_sites": [setup.sites["b"]]},
                                   {"readout": torch.relu})):
        other = Live([], **{"harvest_sites": [setup.sites["a"]], "positions": [0, 2], **extra})
        setup.backend.enter(("h", number), other)
        assert other.positions


def test_conditions_and_refusals_leave_the_request_to_the_hooks_and_the_plan_as_it_was() -> None:
    setup = Setup(slots=2)
    gated = [setup.entry("a"), setup.entry("c", condition_site=setup.sites["a"])]
    live = Live(list(gated))
    setup.backend.enter("g", live)
    assert live.steers == gated and setup.plan.live == 0
    assert operation_of(gated[1]) is None
    # Three distinct operations for a bank of two: the plan refuses, the hooks serve the whole request.
    full = [setup.entry("a", seed=1), setup.entry("b", seed=2), setup.entry("c", seed=3)]
    live = Live(list(full), harvest_sites=[setup.sites["a"]], positions=[0])
    setup.backend.enter("f", live)
    assert live.steers == full and live.positions == [0]
    assert setup.plan.live == 0 and setup.plan.bank.live == 0 and setup.ops.served["steers"] == 0


def test_the_backend_sets_the_ops_idle_switch_for_each_step_and_counts_the_steps() -> None:
    """`GraphBackend.step` sets `graph_ops.IDLE` from the plan before the step runs: on for a step that marks no
    row, off for one that does, and on again for the step after a steered request left."""
    setup = Setup()
    applier = RequestApplier("cpu", graph=setup.backend)
    applier.step([Span(None, 0, 5, 0)])
    assert IDLE.step and setup.ops.steps == {"marked": 0, "idle": 1}
    applier.enter("r", Live([setup.entry("c")]))
    applier.step([Span(None, 0, 2, 0), Span("r", 2, 6, 0)])
    assert not IDLE.step and setup.ops.steps == {"marked": 1, "idle": 1}
    applier.leave("r")
    applier.step([Span(None, 0, 1, 2)])
    assert IDLE.step and setup.ops.steps == {"marked": 1, "idle": 2}
    assert not setup.plan.slots_of("c")[:8].ge(0).any()  # the idle step still reset the steered rows
    with pytest.raises(ValueError, match="graph plan holds 16"):
        setup.backend.step([Span(None, 0, 17, 0)])  # a fill that fails leaves the ops on for its step
    assert not IDLE.step
    applier.close()


def test_the_applier_plans_through_the_backend_and_close_empties_the_plan() -> None:
    setup = Setup()
    applier = RequestApplier("cpu", graph=setup.backend)
    shared = setup.entry("a", "ablate")
    for key in range(3):  # one operation for all three: one slot
        applier.enter(key, Live([SteerEntry(shared.site, shared.delta, None, None, True, 6, 0)]))
    assert setup.plan.live == 3 and setup.plan.bank.live == 1 and not applier.hooks
    applier.step([Span(0, 0, 6, 0), Span(None, 6, 2, 0), Span(2, 8, 6, 0)])
    column = setup.plan.slots_of("a")
    assert column[:6].tolist() == [0] * 6 and column[6:8].tolist() == [-1, -1] and column[8:14].tolist() == [0] * 6
    applier.leave(2)
    assert setup.plan.live == 2
    applier.close()
    assert setup.plan.live == 0 and setup.plan.bank.live == 0 and not applier.live


def test_requests_sending_the_same_steers_share_the_plan_s_record_of_them() -> None:
    """A server's requests bring entries of their own around shared sites and operations (`ServeState.shared`):
    those with the same steers and rows share the plan's steers and its record of their edits (worked out once,
    most of an entry's host time), each with its own table row, whatever their prompts' lengths where the steers
    edit every row; other rows or another operation get their own, and the rows each request's steers mark are
    its own."""
    setup = Setup()
    first, second = setup.entry("a", "ablate"), setup.entry("c", seed=1)

    def live(length: int = 6, operation: Any = None, chosen: Any = None) -> Live:
        return Live([SteerEntry(first.site, operation or first.delta, None, chosen, True, length, 0),
                     SteerEntry(second.site, second.delta, None, None, True, length, 0)])

    for key, length in (("r0", 6), ("r1", 6), ("longer", 9)):
        setup.backend.enter(key, live(length))
    same = [setup.plan._live[key] for key in ("r0", "r1", "longer")]
    assert all(record.edits is same[0].edits for record in same) and setup.plan.bank.live == 2
    assert len({record.row for record in same}) == 3
    setup.backend.enter("some", live(chosen=frozenset({1, 2})))
    other = setup.entry("a", "ablate", seed=7).delta
    setup.backend.enter("other", live(operation=other))
    assert all(setup.plan._live[key].edits is not same[0].edits for key in ("some", "other"))
    assert setup.plan.bank.live == 3
    setup.backend.step([Span("r0", 0, 6, 0), Span("other", 6, 6, 0), Span("r1", 12, 2, 6)])
    a, c = setup.plan.slots_of("a")[:14].tolist(), setup.plan.slots_of("c")[:14].tolist()
    slot = setup.plan._live["r0"].edits[0].slot
    assert a[:6] + a[12:] == [slot] * 8 and len(set(a[6:12])) == 1 and a[6] not in (slot, -1)
    assert c == [setup.plan._live["r0"].edits[1].slot] * 14
    for key in ("r0", "r1", "longer", "some", "other"):
        setup.backend.leave(key)
    assert setup.plan.live == 0 and setup.plan.bank.live == 0


def test_requests_steering_alike_with_vectors_of_their_own_each_run_their_own() -> None:
    """A server's requests that send the same steers with a vector each (a sweep over directions) share the plan's
    sites and rules, never their operations: each request's slot holds its own vector and mode, and a step marks
    its rows with that slot; all slots are free once they leave."""
    setup = Setup(slots=16)
    deltas = {}
    for number in range(5):
        first, second = setup.entry("a", "ablate", seed=10 + number), setup.entry("c", seed=20 + number)
        deltas[f"r{number}"] = (first.delta, second.delta)
        setup.backend.enter(f"r{number}", Live([first, second]))
    assert setup.plan.bank.live == 10
    setup.backend.step([Span(f"r{number}", 2 * number, 2, 0) for number in range(5)])
    bank = setup.plan.bank
    for number in range(5):
        ablate, add = deltas[f"r{number}"]
        slot_a = int(setup.plan.slots_of("a")[2 * number])
        slot_c = int(setup.plan.slots_of("c")[2 * number])
        assert torch.equal(bank.bank[slot_a], ablate.unit) and bank.modes[slot_a] == MODE_CODES["ablate"]
        assert torch.equal(bank.bank[slot_c], add.delta) and bank.modes[slot_c] == MODE_CODES["add"]
    for number in range(5):
        setup.backend.leave(f"r{number}")
    assert setup.plan.live == 0 and bank.live == 0


def test_row_rules_are_the_entries_rows() -> None:
    setup = Setup()
    default = setup.entry("a", skip_first=True)
    chosen = SteerEntry(setup.sites["a"], default.delta, None, frozenset({1, 4}), True, 6, 0, from_step=2)
    for entry in (default, chosen, setup.entry("c")):
        rule = row_rule(entry)
        for span in (Span(0, 0, 6, 0), Span(0, 3, 1, 6), Span(0, 3, 1, 7), Span(0, 3, 1, 9), Span(0, 2, 3, 1),
                     Span(0, 0, 2, 0), Span(0, 4, 4, 5)):
            ranges = rule.ranges(span.start, span.count, span.first)
            assert ranges == entry.ranges(span), (entry.rule, span)
            assert rule.covers(span.first, span.count) == (ranges == [(span.start, span.start + span.count)])
    # every row, and every row but the first, are one rule for any length (requests of any length share a plan)
    for skip_first in (False, True):
        rules = {id(row_rule(SteerEntry(default.site, default.delta, None, None, True, length, 0,
                                        skip_first=skip_first))) for length in (2, 6, 300)}
        assert len(rules) == 1


def test_a_bulk_run_s_requests_share_their_entries_where_no_row_depends_on_the_length() -> None:
    """A steer at every position, or every one but the first (the default), edits rows no prompt's length
    decides: one entry serves the run's requests of every length, their lists of steers are one list, and the
    graph backend routes that list once (a begin of 256 requests of about 120 lengths made 120 of each). A steer
    at chosen positions, or from a later generated token, keeps an entry a length. Each entry's rows are its
    steer's positions for each request."""
    lengths = [3, 5, 5, 9, 12]
    keys = [f"p{number}" for number in range(len(lengths))]

    def steered(setup: Setup, **options: Any) -> tuple[list, dict]:
        steers = [(Steer("layer_output", block, torch.ones(HIDDEN), **options), setup.sites[name])
                  for block, name in enumerate(("a", "c"))]
        return steers, run_requests([], {}, steer_plans(steers, keys, lengths, torch.float32, "cpu"), None)

    for options, lists in (({}, 1), ({"positions": "all"}, 1), ({"positions": "last"}, 4), ({"from_step": 1}, 4)):
        setup = Setup()
        steers, requests = steered(setup, **options)
        assert len({id(live.steers) for live in requests.values()}) == lists, options
        for number, key in enumerate(keys):
            for entry, (steer, _) in zip(requests[key].steers, steers):
                span = Span(key, 0, lengths[number] + 3, 0)  # the prompt and three generated tokens
                rows = [row for low, high in entry.ranges(span) for row in range(low, high)]
                prompt = sorted(steer_positions(steer, lengths[number], number))
                generated = list(range(lengths[number], lengths[number] + 3))[steer.from_step:]
                assert rows == prompt + generated, (options, key)
        backend = setup.backend
        for key, live in requests.items():
            backend.enter(key, live)
        assert len(backend._by_list) == lists and backend.plan.live == len(keys), options


def test_a_bulk_run_makes_each_request_s_entries_as_its_steers_say_whatever_the_mix() -> None:
    """`run_requests` makes a list once for each kind of request (the steers' positions for it, and its length where
    an entry's rows depend on it): over a mix of rules, prompt subsets, later tokens and unsteered prompts, prompts
    of one and two tokens among them, every request's list holds one entry for each steer that applies to it, in the
    run's order, with that steer's rows for it; requests with the same rows from every steer share one list. Steers
    holding one tensor with one setting share one operation, and the run's requests take one slot of the graph
    ops' bank for it, where they took one for each site."""
    rng = random.Random(7)
    lengths = [rng.choice((1, 2, 3, 5, 5, 9, 12)) for _ in range(40)]
    keys = [f"p{number}" for number in range(len(lengths))]
    shared = torch.ones(HIDDEN)
    # first the mixes where one rule's rows are every row for some lengths and all but the first for others ("last"
    # at one token and at two), then mixes at random
    fixed = [["last"], ["all", "last"], ["default", 0]]
    for trial in range(24):
        setup = Setup(slots=16)
        steers = []
        rules = fixed[trial] if trial < len(fixed) else [
            rng.choice(("default", "all", "last", 0, [1, 2], "subset", "from_step", "prompt only"))
            for _ in range(rng.randrange(1, 6))]
        for rule in rules:
            options: dict[str, Any] = {}
            if rule == "subset":
                options["prompts"] = sorted(rng.sample(range(len(keys)), 10))
            elif rule == "from_step":
                options["from_step"] = 1
            elif rule == "prompt only":
                options["generated"] = False
            elif rule == [1, 2]:
                options["positions"] = [1, 2]
                options["prompts"] = [number for number, length in enumerate(lengths) if length > 2]
            elif rule != "default":
                options["positions"] = rule
            vector = shared if rng.random() < 0.6 else torch.randn(HIDDEN)
            name = rng.choice(("a", "c"))
            steers.append((Steer("layer_output", 0, vector, **options), setup.sites[name]))
        plans = steer_plans(steers, keys, lengths, torch.float32, "cpu")
        requests = run_requests([], {}, plans, None)
        lists: dict[tuple, int] = {}
        for number, key in enumerate(keys):
            mine = [(order, steer) for order, (steer, _) in enumerate(steers)
                    if steer.prompts is None or number in steer.prompts]
            live = requests.get(key)
            if not mine:
                assert live is None or not live.steers, (trial, key)
                continue
            assert live is not None and len(live.steers) == len(mine), (trial, key)
            for entry, (order, steer) in zip(live.steers, mine):
                assert entry.site is steers[order][1] and entry.delta is plans[order].operation, (trial, key)
                span = Span(key, 0, lengths[number] + 3, 0)  # the prompt and three generated tokens
                rows = [row for low, high in entry.ranges(span) for row in range(low, high)]
                prompt = sorted(steer_positions(steer, lengths[number], number))
                generated = list(range(lengths[number], lengths[number] + 3))[steer.from_step:] \
                    if steer.generated else []
                assert rows == prompt + generated, (trial, key, steer)
            # each steer's positions depend on the length alone here: requests of one length that the same steers
            # apply to have the same entries, in one list
            kind = (lengths[number], tuple(order for order, _ in mine))
            assert lists.setdefault(kind, id(live.steers)) == id(live.steers), (trial, key)
        distinct = {(id(steer.vector), steer.mode) for steer, _ in steers}
        assert len({id(plan.operation) for plan in plans}) == len(distinct), trial
        for key, live in requests.items():
            setup.backend.enter(key, live)
        served = {id(operation) for operations in setup.backend.kept.values() for operation in operations}
        assert served and setup.plan.bank.live == len(served) <= len(distinct), trial


def test_the_option_and_the_engine_s_config() -> None:
    assert GraphOptions.of(False) is None and GraphOptions.of(None) is None and GraphOptions.of(True) == GraphOptions()
    assert GraphOptions.of({"slots": 16}).slots == 16
    with pytest.raises(ValueError, match="unknown option"):
        GraphOptions.of({"slot": 16})
    with pytest.raises(ValueError, match="no op sits at"):
        GraphOptions(values=("self_attn.head_results",))
    with pytest.raises(TypeError, match="pass True"):
        GraphOptions.of("yes")
    config = engine_config({"rounds": 1}, {"other": 1})
    assert config is not None and config["other"] == 1 and config[CONFIG_KEY]["rounds"] == 1
    assert config[SALT_KEY] == GraphOptions(rounds=1).salt() != GraphOptions().salt()
    assert engine_config(False, {"other": 1}) is None


def test_a_harvest_pool_too_large_for_the_device_is_refused_naming_the_fix() -> None:
    """The default pool (8 sites at every one of 8,192 rows) takes 1 GiB at the Llama-3-70B width in bfloat16, which
    fits beside FP8 weights on an H200 (65 GiB left); a pool of 480 sites' rows (every default value at every block,
    what the per-site buffers took: 60 GiB) is refused, naming the setting."""
    check_harvest_memory(default_pool(8192, 480), 8192, torch.bfloat16, 65 * 2**30)
    with pytest.raises(ValueError, match=r"harvest pool \(3932160 rows x 8192, torch.bfloat16\) needs 60\.0 GiB.*"
                                         r"--graph-ops '\{\"harvest_pool\": 983040\}'"):
        check_harvest_memory(480 * 8192, 8192, torch.bfloat16, 65 * 2**30)


def test_an_add_and_a_set_of_one_shared_vector_take_a_slot_each() -> None:
    """The server hands every request that sends one vector and scale the same ``scale * vector`` tensor, for add and
    set alike: their slots are keyed by the mode too, so a set beside an add of that tensor is a set."""
    setup = Setup()
    shared = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))
    added = Live([SteerEntry(setup.sites["a"], shared, "add", None, True, 6, 0)])
    replaced = Live([SteerEntry(setup.sites["a"], shared, "set", None, True, 6, 0)])
    added_again = Live([SteerEntry(setup.sites["a"], shared, "add", None, True, 6, 0)])
    for key, live in (("add", added), ("set", replaced), ("add again", added_again)):
        setup.backend.enter(key, live)
    slots = {key: setup.plan._live[key].edits[0].slot for key in ("add", "set", "add again")}
    assert slots["add"] == slots["add again"] != slots["set"] and setup.plan.bank.live == 2
    modes = setup.plan.bank.modes
    assert int(modes[slots["add"]]) == MODE_CODES["add"] and int(modes[slots["set"]]) == MODE_CODES["set"]


def test_a_harvest_the_pool_cannot_hold_is_refused_for_now_or_for_good_where_hooks_do_not_fire() -> None:
    """On a compiled engine (hooks do not fire) a harvest the pool cannot take is refused whole: for now (a 503 on a
    server, naming a larger pool) while other harvests hold the pool, for good (a 400) where it alone would not
    fit; on an eager engine the hooks read it instead."""
    setup = Setup()
    setup.plan = GraphPlan(["a", "b", "c"], 2, 16, HIDDEN, torch.float32, "cpu", harvest_sites=["a", "c"],
                           harvest_pool=24)
    setup.ops.plan = setup.plan
    compiled = GraphBackend(setup.ops, hooks_fire=False)

    def harvest(positions: list[int]) -> Live:
        return Live([], harvest_sites=[setup.sites["a"], setup.sites["c"]], positions=positions,
                    slots={position: slot for slot, position in enumerate(positions)})

    compiled.enter("first", harvest(list(range(10))))  # 2 sites x 10 positions: 20 rows of a step
    with pytest.raises(LeftOnHooks) as busy:
        compiled.enter("second", harvest([0, 1, 2]))  # 6 rows more could share the first one's step
    assert busy.value.busy and busy.value.pool == 24 and "first" in compiled.entered and "second" not in compiled.entered
    refusal = _refusal(busy.value)
    assert refusal.status == 503 and "harvest pool (24 rows" in str(refusal) and '"harvest_pool": 48' in str(refusal)
    with pytest.raises(LeftOnHooks) as never:
        compiled.enter("third", harvest(list(range(13))))  # 26 rows alone
    assert not never.value.busy and "harvest_pool" in str(never.value) and _refusal(never.value).status == 400
    eager = GraphBackend(setup.ops)
    live = harvest([0, 1, 2])
    eager.enter("hooked", live)  # the pool is held: the hooks read this one
    assert "hooked" not in eager.entered and live.harvest_sites and live.positions == [0, 1, 2]
