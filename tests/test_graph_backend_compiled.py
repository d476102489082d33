"""The graph-op backend where its applier's hooks do not fire (a compiled engine): a request whose work would stay
on the hooks is refused whole, naming why (`streamscope.vllm.graph_backend.LeftOnHooks`), the plan as it was, never
entered with steers that would silently not run. The eager backend's routing is tests/test_graph_backend.py's."""

from __future__ import annotations

import pytest
import torch

from streamscope.bulk.requests import Live, RequestApplier
from streamscope.vllm.graph_backend import GraphBackend, LeftOnHooks
from test_graph_backend import Setup


def compiled(slots: int = 4) -> Setup:
    setup = Setup(slots)
    setup.backend = GraphBackend(setup.ops, hooks_fire=False)
    return setup


def test_what_the_ops_serve_whole_enters() -> None:
    setup = compiled()
    live = Live([setup.entry("a"), setup.entry("c", "clamp")], harvest_sites=[setup.sites["a"]], positions=[0, 2],
                slots={0: 0, 2: 1})
    setup.backend.enter("r", live)
    assert not live.planned() and setup.plan.live == 1 and setup.ops.served == {"steers": 2, "harvests": 1}


@pytest.mark.parametrize("case", ["order", "rounds", "condition", "harvest-beside", "positions", "readout"])
def test_work_left_on_the_hooks_is_refused_and_the_plan_left_as_it_was(case: str) -> None:
    setup = compiled()
    a, b, c = (setup.entry(name, seed=seed) for seed, name in enumerate("abc"))
    lives = {"order": Live([b, a]),  # a after b at one call: the ops run a first
             "rounds": Live([setup.entry("c", order=number, seed=number) for number in range(3)]),
             "condition": Live([a, setup.entry("c", condition_site=setup.sites["a"])]),
             "harvest-beside": Live([b, a], harvest_sites=[setup.sites["c"]], positions=[0]),
             "positions": Live([], harvest_sites=[setup.sites["a"]], positions=[2, 0]),
             "readout": Live([], harvest_sites=[setup.sites["a"]], positions=[0], readout=torch.relu)}
    live = lives[case]
    steers = list(live.steers)
    with pytest.raises(LeftOnHooks, match="compiled, where hooks do not fire.*cannot serve its work at") as error:
        setup.backend.enter("r", live)
    assert not error.value.busy and error.value.where
    assert live.steers == steers and setup.plan.live == 0 and setup.plan.bank.live == 0
    assert setup.ops.served == {"steers": 0, "harvests": 0} and not setup.backend.entered


def test_a_full_bank_refuses_the_request_as_busy_and_the_applier_takes_nothing() -> None:
    setup = compiled(slots=2)
    applier = RequestApplier("cpu", graph=setup.backend)
    applier.enter("first", Live([setup.entry("a", seed=1), setup.entry("c", seed=2)]))
    assert setup.plan.bank.live == 2
    third = Live([setup.entry("a", seed=3)])
    with pytest.raises(LeftOnHooks, match="slot bank is full") as error:
        applier.enter("third", third)
    assert error.value.busy and error.value.slots == 2
    assert set(applier.live) == {"first"} and not applier.hooks and setup.plan.live == 1
    applier.leave("first")
    assert setup.plan.bank.live == 0
    applier.enter("third", third)  # the bank has room again
    assert setup.plan.live == 1 and not applier.hooks


@pytest.mark.parametrize("hooks_fire", [True, False])
def test_a_live_request_s_operation_keeps_its_slot_from_later_operations(hooks_fire: bool) -> None:
    """A slot is keyed by its operation's identity, and the request's own entries leave it once the ops serve them:
    the backend keeps the operations alive while the request is, so a later operation (which could otherwise take a
    freed object's id) gets a slot of its own, holding its own vector."""
    count = 48
    setup = Setup(slots=count)
    setup.backend = GraphBackend(setup.ops, hooks_fire=hooks_fire)
    for number in range(count):
        setup.backend.enter(number, Live([setup.entry("a", seed=number)]))  # the entries are dropped here
    assert setup.plan.bank.live == count and setup.plan.live == count
    slots = [setup.plan._live[number].edits[0].slot for number in range(count)]
    vectors = {tuple(setup.plan.bank.bank[slot].tolist()) for slot in slots}
    assert len(vectors) == count  # each request's own vector in its own slot
