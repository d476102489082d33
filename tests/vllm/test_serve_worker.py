"""The serve worker's plan of a step (`streamscope.serve.worker.ServeState`), driven step by step on a real model.

`tests/vllm/test_serve.py` holds the server's answers to an in-process engine; this file holds what those answers
cannot show: that hooks sit on exactly the module calls the live requests need and come off with the last request
that needed them, that requests all steered alike are planned as one block of rows (one shared tensor, no rows of
their own), and that the counts the plan keeps in place of a pass over every request (work left, steer sets) stay
right as requests come and go. The model is a tiny Llama in a plain in-process vLLM engine, its runner stood in for
by the few attributes the plan reads; the steps are scheduler outputs written out by hand.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

import precision
from streamscope.serve.protocol import XARG, vector_bytes
from streamscope.serve.worker import ServeState
from streamscope.testing import build_checkpoint

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the plan is device-independent Python over a step's schedule, checked here; on a GPU this file's engine would ask for vLLM's default 90% of the memory beside the GPU suite's engines, and the GPU server's path runs end to end in benchmarks/serve_load.py")

HIDDEN = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process, to hook and step by hand
    from vllm import LLM

    path = build_checkpoint("llama", tmp_path_factory.mktemp("serve-worker") / "llama")
    llm = LLM(str(path), enforce_eager=True, dtype="float32", enable_prefix_caching=False, max_model_len=256)
    if previous is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    yield llm.llm_engine.model_executor.driver_worker.worker.model_runner
    del llm


@pytest.fixture
def state(model):
    """A `ServeState` on the model, its runner the attributes the plan reads: the batch's order of requests
    (`input_batch.req_ids`) and each request's tokens computed so far (`requests`), both kept by `step`."""
    runner = SimpleNamespace(get_model=model.get_model, model_config=model.model_config,
                             execute_model=lambda *args, **kwargs: None, _update_states=lambda output: None,
                             input_batch=SimpleNamespace(req_ids=[]), requests={})
    return ServeState(runner, "llama", folder=None, writer=False)


def steer(layer: int, seed: int, scale: float = 1.0, value: str = "layer_output", **options) -> dict:
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))
    return {"value": value, "layer": layer, "vector": vector_bytes(vector), "scale": scale, "positions": "all",
            "mode": "add", "generated": True, **options}


def new(request_id: str, plan: dict, length: int = 5) -> SimpleNamespace:
    return SimpleNamespace(req_id=request_id, prompt_token_ids=list(range(length)),
                           sampling_params=SimpleNamespace(extra_args={XARG: json.dumps(plan)}))


def step(state: ServeState, scheduled: dict[str, int], arriving=(), finished=()) -> None:
    """One step's plan: `scheduled` (request -> its tokens this step, in the batch's order), `arriving` new, and
    `finished` gone since the last step; then each request's computed tokens move on by its count."""
    runner = state.runner
    for request_id in finished:
        runner.requests.pop(request_id, None)
    for data in arriving:
        runner.requests[data.req_id] = SimpleNamespace(num_computed_tokens=0)
    runner.input_batch.req_ids = list(scheduled)
    state.observe(SimpleNamespace(scheduled_new_reqs=list(arriving), finished_req_ids=set(finished),
                                  num_scheduled_tokens=dict(scheduled),
                                  total_num_scheduled_tokens=sum(scheduled.values())))
    for request_id, count in scheduled.items():
        runner.requests[request_id].num_computed_tokens += count




def hooked_modules(state: ServeState) -> dict[str, int]:
    """Every module of the model with hooks on it: its name, and how many."""
    found = {}
    for name, module in state.runner.get_model().named_modules():
        count = len(module._forward_hooks) + len(module._forward_pre_hooks)
        if count:
            found[name] = count
    return found


def test_requests_steered_alike_are_one_block_of_rows_and_their_hooks_come_off_with_the_last(state):
    first, second = steer(1, seed=1, scale=2.0), steer(1, seed=1, scale=2.0)  # the same vector and scale
    step(state, {"a": 5, "b": 3}, arriving=[new("a", {"steer": [first]}), new("b", {"steer": [second]}, 3)])
    assert state.uniform is not None and state.planned == 2
    assert list(hooked_modules(state).values()) == [1], "one hook, on the steered block"
    [(key, (edits, reads))] = state.work.items()
    assert reads == [] and len(edits) == 1
    site, mode, rows, delta = edits[0]
    assert (site.value, site.layer, mode, rows) == ("layer_output", 1, "add", slice(0, 8))
    expected = 2.0 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    assert torch.equal(delta, expected.to(delta.dtype)), "the shared tensor is scale * vector"
    assert state.live["a"].steers[0].delta is state.live["b"].steers[0].delta, "one tensor for both requests"

    step(state, {"a": 1, "b": 1})  # a decode step: the same plan over the step's two rows
    assert state.work[key][0][0][2] == slice(0, 2)

    # A request steered otherwise (another scale): the step is no longer one block; its hook is the same call's.
    step(state, {"c": 4}, arriving=[new("c", {"steer": [steer(1, seed=1, scale=-1.0)]}, 4)])
    assert state.uniform is None and state.planned == 3
    assert list(hooked_modules(state).values()) == [1]

    step(state, {"c": 1}, finished=["a", "b"])
    assert state.uniform is not None and state.planned == 1  # c alone: one set of steers again
    step(state, {}, finished=["c"])
    assert hooked_modules(state) == {} and state.hooks == {} and state.locations == {}
    assert state.planned == 0 and state.work == {} and state.live == {}
    assert state.signatures == {} and state.representatives == {} and state.key_counts == {}


def test_requests_sending_the_same_steers_share_their_entries_of_any_length_where_no_row_depends_on_it(state):
    """The worker makes a list of steers once for the requests that send the same steers (`ServeState.admitted_steers`:
    the entries and the applier's work on them shared, as a bulk run's are), of any length where each steer edits
    every position or every one but the first; a steer at chosen positions keeps a list a prompt length, whose rows
    are that length's; a conditional steer is made for its request alone."""
    every = [steer(1, seed=1), steer(2, seed=2, positions="all_but_first", scale=0.5)]
    last = [steer(1, seed=1, positions="last")]
    arriving = [new("a", {"steer": every}, 5), new("b", {"steer": every}, 3), new("c", {"steer": last}, 5),
                new("d", {"steer": last}, 5), new("e", {"steer": last}, 3)]
    step(state, {"a": 5, "b": 3, "c": 5, "d": 5, "e": 3}, arriving=arriving)
    lists = {key: state.live[key].steers for key in "abcde"}
    assert lists["a"] is lists["b"] and lists["c"] is lists["d"] and lists["e"] is not lists["c"]
    assert lists["c"][0].chosen == frozenset({4}) and lists["e"][0].chosen == frozenset({2})
    edits, _ = state.work[(id(lists["a"][0].site.module), lists["a"][0].site.where)]
    rows = {entry_rows for _, _, entry_rows, _ in edits}
    assert rows, "the step planned the shared steers' rows"
    gated = steer(1, seed=1, condition={"value": "layer_output", "layer": 0, "vector": vector_bytes(torch.ones(HIDDEN)),
                                        "threshold": 0.0, "compare": "greater", "measure": "projection", "scope": "row"})
    step(state, {"f": 4, "g": 4}, arriving=[new("f", {"steer": [gated]}, 4), new("g", {"steer": [gated]}, 4)],
         finished=list("abcde"))
    assert state.live["f"].steers is not state.live["g"].steers
    assert state.live["f"].steers[0].delta is not state.live["g"].steers[0].delta  # each request its own gate
    step(state, {}, finished=["f", "g"])
    assert hooked_modules(state) == {} and state.live == {}


def test_hooks_follow_the_requests_that_need_them_and_a_read_harvest_leaves_no_work(state):
    harvest = {"harvest": {"values": ["layer_output"], "layers": None, "positions": "last", "id": "h" * 32}}
    steers = {"steer": [steer(0, seed=2), steer(2, seed=3, value="mlp_output")]}
    step(state, {"s": 5, "h": 4}, arriving=[new("s", steers), new("h", harvest, 4)])
    blocks = len(state.root.layers)
    assert sum(hooked_modules(state).values()) == blocks + 1, "every block's output for the harvest, the steered MLP"
    assert state.uniform is None and state.planned == 2
    reads = [(site.layer, rows, layout[0][1:]) for key, (_, harvests) in state.work.items()
             for site, rows, layout in harvests]
    # h's last prompt position is the step's row 8 (s's 5 rows come first), slot 0 of its harvest, at every block
    assert sorted(reads) == [(block, slice(8, 9), (block, [0])) for block in range(blocks)]
    for key, (_, harvests) in list(state.work.items()):
        if harvests:  # the blocks' outputs, as the hooks get them: the fused halves of the step's 9 rows
            state.apply(key, (torch.randn(9, HIDDEN), torch.randn(9, HIDDEN)))
    state.send()  # another rank's way (no writer): the rows are counted, and the harvest is read in full
    assert state.live["h"].written and state.planned == 1, "s still steers; h has no work left"
    step(state, {"h": 1, "s": 1})
    assert all(not harvests for _, harvests in state.work.values()), "no read once the harvest is in"
    step(state, {"h": 1}, finished=["s"])
    assert sum(hooked_modules(state).values()) == blocks, "the steer's MLP hook is off; the blocks' stay on"
    assert state.planned == 0 and state.work == {}, "a step of a read harvest alone plans nothing"
    step(state, {}, finished=["h"])
    assert hooked_modules(state) == {} and state.planned == 0 and state.key_counts == {}


def test_a_request_admitted_again_under_its_id_replaces_its_plan(state):
    step(state, {"a": 5}, arriving=[new("a", {"steer": [steer(0, seed=4)]})])
    step(state, {"a": 5}, arriving=[new("a", {"steer": [steer(2, seed=5)]})])
    assert state.planned == 1 and len(state.live) == 1
    [(name, count)] = hooked_modules(state).items()
    assert count == 1 and name.endswith("layers.2")
    step(state, {}, finished=["a"])
    assert hooked_modules(state) == {} and state.planned == 0 and state.key_counts == {}


def test_a_failed_hook_or_plan_aborts_the_steps_requests_with_a_verdict_each(model, tmp_path):
    """A hook that raises mid-step (here: a call's tensors it cannot edit) drops the step's work, writes a 500
    verdict for each request with work in the step (under its ticket, for the front end's `refusals.Guard`), and
    those requests leave as the next step is planned; a live request not in the step is untouched. A step whose
    plan cannot be made (a scheduled request the runner does not know) aborts its requests the same way."""
    from streamscope.serve.refusals import Refusals

    runner = SimpleNamespace(get_model=model.get_model, model_config=model.model_config,
                             execute_model=lambda *args, **kwargs: None, _update_states=lambda output: None,
                             input_batch=SimpleNamespace(req_ids=[]), requests={})
    state = ServeState(runner, "llama", folder=None, writer=False, refusal_folder=str(tmp_path))
    tickets = {name: name * 32 for name in "abcd"}
    plans = {name: {"ticket": tickets[name], "steer": [steer(layer, seed=seed)]}
             for name, layer, seed in (("a", 1, 1), ("b", 0, 0), ("c", 2, 2), ("d", 2, 3))}
    plain = SimpleNamespace(req_id="p", prompt_token_ids=[0, 1, 2], sampling_params=SimpleNamespace(extra_args={}))
    # c arrives, scheduled in no step yet: it has no work in this one; p has no plan
    step(state, {"a": 5, "b": 5, "p": 3}, arriving=[new("a", plans["a"]), new("b", plans["b"]), plain,
                                                   new("c", plans["c"])])
    at_one = next(key for key, (edits, _) in state.work.items() if edits[0][0].layer == 1)
    state.apply(at_one, None)  # the hook's call holds nothing it can edit: it raises inside the hook
    assert state.work == {}
    verdicts = Refusals(tmp_path)
    for name in "ab":
        error = verdicts.verdict(tickets[name])
        assert error is not None and error.status == 500, name
        assert "aborted this request rather than serve it unsteered" in error.message
        assert "the hook at layers.1.layer_output failed" in error.message and "Error: " in error.message
    assert verdicts.verdict(tickets["c"]) is None
    step(state, {"a": 1, "b": 1, "p": 1, "c": 5})  # vLLM's abort not in yet: a and b run unplanned
    assert set(state.live) == {"c"} and state.planned == 1
    assert [name for name in hooked_modules(state)][0].endswith("layers.2"), "only c's hook is on"
    assert all(site.layer == 2 for edits, _ in state.work.values() for site, *_ in edits)

    del runner.requests["c"]
    runner._update_states(SimpleNamespace(  # d arrives; c is scheduled but its runner state is gone
        scheduled_new_reqs=[new("d", plans["d"])], finished_req_ids=set(), num_scheduled_tokens={"c": 1, "d": 5},
        total_num_scheduled_tokens=6))
    assert state.work == {}
    for name in "cd":
        error = verdicts.verdict(tickets[name])
        assert error is not None and "the step's plan failed" in error.message, name
    step(state, {}, finished=["a", "b", "c", "d", "p"])
    assert state.live == {} and hooked_modules(state) == {} and state.planned == 0 and state.tickets == {}


def test_a_request_scoped_condition_over_a_prompt_in_pieces_aborts_its_request(model, tmp_path):
    """A request-scoped condition decides on the whole prompt; should its prompt be scheduled in pieces (the front
    end refuses such a server setup, but a worker cannot rule it out), the request is aborted with a 500 verdict
    naming the fix, not run unsteered; its batchmate keeps its plan."""
    from streamscope.serve.refusals import Refusals

    runner = SimpleNamespace(get_model=model.get_model, model_config=model.model_config,
                             execute_model=lambda *args, **kwargs: None, _update_states=lambda output: None,
                             input_batch=SimpleNamespace(req_ids=[]), requests={})
    state = ServeState(runner, "llama", folder=None, writer=False, refusal_folder=str(tmp_path))
    direction = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7))
    condition = {"value": "layer_output", "layer": 0, "vector": vector_bytes(direction), "threshold": 0.0,
                 "compare": "greater", "measure": "projection", "scope": "request"}
    plans = {"g": {"ticket": "e" * 32, "steer": [steer(1, seed=1, condition=condition)]},
             "s": {"ticket": "f" * 32, "steer": [steer(1, seed=2)]}}
    step(state, {"g": 3, "s": 5}, arriving=[new("g", plans["g"], length=8), new("s", plans["s"])])
    error = Refusals(tmp_path).verdict("e" * 32)
    assert error is not None and error.status == 500
    assert "deciding rows" in error.message and "enable_chunked_prefill=False" in error.message
    assert Refusals(tmp_path).verdict("f" * 32) is None
    step(state, {"g": 5, "s": 1})  # g leaves as this step is planned; s keeps its plan
    assert set(state.live) == {"s"}
