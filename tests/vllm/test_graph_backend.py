"""The graph-op backend of the one applier on vLLM's CPU engine: the bulk path with the ops equals the hook path.

Each family's checkpoint is loaded twice, eager as the suite's engines are:
with ``graph_ops=True`` (the worker inserts the ops at every block's stream
boundaries when it loads the model, and the applier hands each steer and
harvest they serve to the graph plan) and without (every steer and harvest on
hooks). `model.harvest(..., steer=[...])` and `model.generate(..., steer=[...],
harvest=...)` on the first equal the same calls on the second within
`CPU_FLOAT32`, add and set bit for bit (docs/graph-ops.md), for every mode and
norm matching at every value the ops serve, with chosen positions and the
default first-token skip; a count of what the ops served proves they ran. A
condition stays on the hooks in the same run; requests enter and leave across
steps (three sequences at a time, stop tokens); one case per mode is also held
to transformers' float32 forward with plain hooks (tests/steer_checks.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import vllm

import attention_oracle
import precision
import sae_checks
import steer_checks
import streamscope
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS
from streamscope.vllm.graph_backend import CONFIG_KEY, GraphOptions, graph_ops_of
from streamscope.sae import from_sae_lens
from streamscope.vllm import graph_ops
from streamscope.vllm.graph_ops import SALT_KEY
from streamscope.vllm.model import beside_engine
from transformers import AutoTokenizer

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the ops run eagerly in the CPU build's engine here; the "
                                "GPU session checks them compiled and graphed (issue 39, docs/graph-ops.md item 4)")

#: Sequences an engine runs at once: more prompts than this enter as others leave.
SEQUENCES = 3
#: The values the ops serve on every bulk family (`graph_wiring.VALUES`).
VALUES = ("layer_input", "layer_mid", "mlp_input", "layer_output", "self_attn.attention_output", "mlp.mlp_output")
#: Each mode plain and norm-matched, at a value and block of their own, with a position rule: every value the ops
#: serve, chosen prompt positions, the default (every position but the first), prompt only, generated from a step.
CASES = [
    ("add", False, "layer_output", 0, {}),
    ("add", True, "mlp.mlp_output", 1, {"positions": [1, 3]}),
    ("set", False, "layer_mid", 1, {"positions": "last", "generated": False}),
    ("set", True, "mlp_input", 0, {"positions": "all"}),
    ("ablate", False, "layer_input", 1, {"positions": "all"}),
    ("ablate", True, "self_attn.attention_output", 0, {"positions": [0, 2], "from_step": 1}),
    ("clamp", False, "mlp_input", 1, {"positions": "none", "from_step": 2}),
    ("clamp", True, "layer_output", 1, {}),
]
SETTINGS = {"add": {"scale": 2.0}, "set": {"scale": 1.5}, "ablate": {"scale": 1.0}, "clamp": {"projection": 3.0}}


class Pair:
    """A family's checkpoint on two engines, the ops inserted in one, with the oracle and tokenizer."""

    def __init__(self, family: str, path: Any) -> None:
        self.family = family
        options = {"max_num_seqs": SEQUENCES, **precision.engine_kwargs()}
        self.graphed = streamscope.load(path, engine="vllm", graph_ops=True, **options)
        self.hooked = streamscope.load(path, engine="vllm", **options)
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ops = graph_ops_of(runner(self.graphed))

    def at(self, value: str, layer: int) -> str:
        """`value`, or where the family's blocks have no op there (GPT-J's parallel block has no ``layer_mid``), the
        stream boundary it has at that point (``mlp_input``)."""
        return value if f"layers.{layer}.{value}" in self.ops.order else "mlp_input"

    def served(self) -> tuple[int, int]:
        """(steers, harvests) the graphed engine's ops have served so far."""
        return self.ops.served["steers"], self.ops.served["harvests"]


def runner(model: Any) -> Any:
    return model.vllm_entrypoint.llm_engine.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module", params=list(BULK_FAMILIES))
def pair(request: Any, checkpoints: Any) -> Any:
    loaded = Pair(request.param, checkpoints(request.param))
    yield loaded
    loaded.graphed.close()
    loaded.hooked.close()


def steer_of(pair: Pair, mode: str, norm_match: bool, value: str, layer: int, rule: dict, seed: int,
             **more: Any) -> streamscope.Steer:
    vector = torch.randn(pair.graphed.hidden_size, generator=torch.Generator().manual_seed(seed))
    return streamscope.Steer(pair.at(value, layer), layer, vector, mode=mode, norm_match=norm_match, **SETTINGS[mode],
                             **{**rule, **more})


def equal(got: torch.Tensor, want: torch.Tensor, bits: bool) -> bool:
    if bits:
        return torch.equal(got, want)
    return relative_error(got, want) <= precision.CPU_FLOAT32


def test_the_worker_inserts_the_ops_at_load_and_salts_the_compile_cache(pair: Pair) -> None:
    ops, layers = pair.ops, pair.graphed.num_layers
    assert ops is not None and graph_ops_of(runner(pair.hooked)) is None
    missing = {"gptj": {"layer_mid"}}.get(pair.family, set())  # a parallel block has no stream between its halves
    names = {f"layers.{layer}.{value}" for layer in range(layers) for value in VALUES if value not in missing}
    assert set(ops.plan.sites) == names == set(ops.plan.harvest_sites), ops.skipped
    assert all("parallel block" in reason for reason in ops.skipped.values()) and len(ops.skipped) == len(missing) * layers
    assert ops.plan.max_rows == runner(pair.graphed).max_num_tokens and ops.plan.bank.bank.shape[0] == 256
    config = pair.graphed.vllm_entrypoint.llm_engine.vllm_config.additional_config
    assert config[CONFIG_KEY] == GraphOptions().config() and config[SALT_KEY] == GraphOptions().salt()
    assert GraphOptions(rounds=1).salt() != GraphOptions().salt()  # another set of ops, another cache
    assert ops.plan.live == 0 and ops.plan.bank.live == 0  # nothing left over from a run


@pytest.mark.parametrize("case", CASES, ids=[f"{case[0]}{'-nm' if case[1] else ''}-{case[2]}" for case in CASES])
def test_a_steer_through_the_ops_equals_the_hook_path(pair: Pair, case: tuple) -> None:
    mode, norm_match, value, layer, rule = case
    steer = steer_of(pair, mode, norm_match, value, layer, rule, 3, prompts=[0, 1, 3])
    bits = mode in ("add", "set")
    before = pair.served()
    got = pair.graphed.harvest(PROMPTS, "layer_output", positions="all", steer=[steer], progress=False)
    want = pair.hooked.harvest(PROMPTS, "layer_output", positions="all", steer=[steer], progress=False)
    # The ops ran the steer of each prompt it steers and every prompt's harvest (and the dose check's, before).
    assert pair.served()[0] == before[0] + 3 and pair.served()[1] >= before[1] + len(PROMPTS)
    plain = pair.graphed.harvest(PROMPTS, "layer_output", positions="all", progress=False)
    for index in range(len(PROMPTS)):
        assert equal(got["layer_output"][index], want["layer_output"][index], bits), (case, index)
    for index in (2, 4):  # the unsteered batchmates: their unsteered run's bits
        assert torch.equal(got["layer_output"][index], plain["layer_output"][index]), (case, index)
    run = {"max_tokens": 4, "ignore_eos": True, "return_logits": True, "progress": False,
           "harvest": {"values": ["layer_output", "mlp_output"], "layers": [0, 1], "positions": "all"}}
    generated = pair.graphed.generate(PROMPTS, steer=[steer], **run)
    hooked = pair.hooked.generate(PROMPTS, steer=[steer], **run)
    assert generated.tokens == hooked.tokens, case
    for index in range(len(PROMPTS)):
        assert equal(generated.logits[index], hooked.logits[index], bits), (case, index)
        for name in ("layer_output", "mlp_output"):
            assert equal(generated.harvest[name][index], hooked.harvest[name][index], bits), (case, name, index)


def test_every_block_one_vector_and_a_second_round_at_one_site(pair: Pair) -> None:
    """An ablation at every block (one operation, one slot) and two steers at one site (two rounds, in order)."""
    layers = range(pair.graphed.num_layers)
    steers = [steer_of(pair, "ablate", False, "layer_output", layer, {"positions": "all"}, 7) for layer in layers]
    steers += [steer_of(pair, "add", False, "layer_mid", 0, {}, 8),
               steer_of(pair, "clamp", True, "layer_mid", 0, {"positions": "all"}, 9)]
    before = pair.served()
    values = ["layer_output", pair.at("layer_mid", 0)]
    got = pair.graphed.harvest(PROMPTS, values, positions="all", steer=steers, progress=False)
    want = pair.hooked.harvest(PROMPTS, values, positions="all", steer=steers, progress=False)
    assert pair.served()[0] == before[0] + len(steers) * len(PROMPTS)
    for name in values:
        for index in range(len(PROMPTS)):
            assert equal(got[name][index], want[name][index], False), (name, index)


def test_a_step_that_marks_no_row_runs_none_of_the_ops(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain run's steps are idle (`GraphPlan.idle`): the ops return before their arithmetic in every one of them.
    A steered run after them runs the ops, at the steered site only (`IdleSwitch.leaves`: no other site's edit
    runs), a plain run after that is its first run's bits, and the steered run again is its own bits and the hook
    path's."""
    ran = {"ops": 0}
    edited: set[int] = set()  # the index columns the edits ran at

    def counted(body: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            ran["ops"] += 1
            if body.__name__ == "_edit_by_torch":
                edited.add(args[2].data_ptr())
            return body(*args, **kwargs)
        return run

    for name in ("_edit_by_torch", "_harvest_by_torch"):  # each op's torch body, this CPU's
        monkeypatch.setattr(graph_ops, name, counted(getattr(graph_ops, name)))
    steer = steer_of(pair, "add", False, "layer_output", 0, {"positions": "all"}, 21, prompts=[1])
    run = {"max_tokens": 3, "ignore_eos": True, "return_logits": True, "progress": False}
    steps = dict(pair.ops.steps)
    plain = pair.graphed.generate(PROMPTS[:2], **run)
    assert ran["ops"] == 0 and pair.ops.steps["marked"] == steps["marked"]
    assert pair.ops.steps["idle"] >= steps["idle"] + 3  # a prefill and two decode steps at least
    steered = pair.graphed.generate(PROMPTS[:2], steer=[steer], **run)
    assert ran["ops"] > 0 and pair.ops.steps["marked"] > steps["marked"]
    plan = pair.ops.plan
    site = next(name for name in plan.sites if str(name) == f"layers.0.{steer.value}")
    assert edited and edited <= {plan.slots_of(site, round_).data_ptr() for round_ in range(plan.rounds)}
    ran["ops"] = 0
    again = pair.graphed.generate(PROMPTS[:2], **run)
    assert ran["ops"] == 0 and again.tokens == plain.tokens
    assert all(torch.equal(got, want) for got, want in zip(again.logits, plain.logits))
    steered_again = pair.graphed.generate(PROMPTS[:2], steer=[steer], **run)
    hooked = pair.hooked.generate(PROMPTS[:2], steer=[steer], **run)
    assert steered_again.tokens == steered.tokens == hooked.tokens
    for index in range(2):
        assert torch.equal(steered_again.logits[index], steered.logits[index]), index
        assert equal(steered.logits[index], hooked.logits[index], True), index
    assert not torch.equal(steered.logits[1], plain.logits[1])  # the steer acted


def test_a_step_no_applier_planned_reads_no_stale_mark(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM called straight through ``model.vllm_entrypoint``, and a trace, after a steered run whose last step
    marked rows (so the index on the device still holds them): their steps run no op body, the raw call's logprobs
    are the bits of the same call before the run, and the trace reads what the hook engine reads. Before the ops
    closed each step no applier planned (`GraphOps.close_step`), the raw call was edited by the finished run's
    steer and ran every op body."""
    ran = {"ops": 0}

    def counted(body: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            ran["ops"] += 1
            return body(*args, **kwargs)
        return run

    for name in ("_edit_by_torch", "_harvest_by_torch"):
        monkeypatch.setattr(graph_ops, name, counted(getattr(graph_ops, name)))
    prompts = [{"prompt_token_ids": pair.tokenizer(text).input_ids} for text in PROMPTS[:2]]
    params = vllm.SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)

    def raw() -> list[list[dict[int, float]]]:
        outputs = pair.graphed.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
        return [[{token: item.logprob for token, item in step.items()} for step in output.outputs[0].logprobs]
                for output in outputs]

    before = raw()
    assert ran["ops"] == 0
    steer = steer_of(pair, "add", False, "layer_output", 0, {"positions": "all"}, 23)
    pair.graphed.generate(PROMPTS[:2], steer=[steer], max_tokens=3, ignore_eos=True, progress=False)
    assert ran["ops"] > 0 and pair.ops.plan.marked_rows > 0  # the run's last step left its marks in the index
    ran["ops"], idle = 0, pair.ops.steps["idle"]
    assert raw() == before
    assert ran["ops"] == 0 and pair.ops.steps["idle"] >= idle + 3
    pair.graphed.generate(PROMPTS[:2], steer=[steer], max_tokens=3, ignore_eos=True, progress=False)
    assert pair.ops.plan.marked_rows > 0
    ran["ops"] = 0
    reads = {}
    for name, model in (("graphed", pair.graphed), ("hooked", pair.hooked)):
        with model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
            read = model.layers[0].layer_output.save()
        reads[name] = read
    assert ran["ops"] == 0 and torch.equal(reads["graphed"], reads["hooked"])


def test_a_condition_stays_on_the_hooks_beside_steers_on_the_ops(pair: Pair) -> None:
    """A conditional steer's request runs on the hooks (its harvest too); the other requests' on the ops; each
    equals the hook path."""
    direction = torch.randn(pair.graphed.hidden_size, generator=torch.Generator().manual_seed(11))
    condition = streamscope.Condition("layer_output", 0, direction, 0.0)
    steers = [streamscope.Steer("layer_output", 1, direction, scale=4.0, condition=condition, prompts=[0, 1]),
              steer_of(pair, "ablate", False, "layer_output", 1, {"positions": "all"}, 12, prompts=[2, 3])]
    before = pair.served()
    run = {"max_tokens": 3, "ignore_eos": True, "return_logits": True, "progress": False,
           "harvest": {"values": "layer_output", "layers": [1], "positions": "all"}}
    got = pair.graphed.generate(PROMPTS, steer=steers, **run)
    want = pair.hooked.generate(PROMPTS, steer=steers, **run)
    # prompts 2, 3 steered by the ops; 2, 3, 4 read there (and the dose checks' harvests)
    assert pair.served()[0] == before[0] + 2 and pair.served()[1] >= before[1] + 3
    assert got.tokens == want.tokens
    for index in range(len(PROMPTS)):
        assert equal(got.logits[index], want.logits[index], False), index
        assert equal(got.harvest["layer_output"][index], want.harvest["layer_output"][index], False), index


def test_an_sae_clamp_stays_on_the_hooks_and_keeps_the_request_s_order(pair: Pair) -> None:
    """An SAE feature clamp runs on the hooks; a steer after it at the same module call stays there too (the ops run
    first at a call), one at another call goes to the ops; the request's harvest stays on the hooks. A steer in a
    chain of joined sites (`graph_wiring.chains`: block 0's layer_output runs at block 1's input) whose value the
    request's harvest reads on the hooks leaves the chain for the hooks: joined, it would run after that read. Each
    equals the hook path."""
    sae = from_sae_lens(sae_checks.sae_lens_sae(pair.graphed.hidden_size, 4 * pair.graphed.hidden_size))
    steers = [steer_of(pair, "ablate", False, "mlp_input", 0, {"positions": "all"}, 17),  # alone at its call
              steer_of(pair, "ablate", False, "layer_output", 0, {"positions": "all"}, 15),
              sae.clamp(2, 6.0, positions="all"),  # at the SAE's site, block 1's layer_output
              steer_of(pair, "add", False, "layer_output", 1, {}, 16)]
    assert "layers.0.layer_output" in pair.ops.chain_of and "layers.0.mlp_input" not in pair.ops.chain_of
    before = pair.served()
    run = {"max_tokens": 3, "ignore_eos": True, "return_logits": True, "progress": False,
           "harvest": {"values": "layer_output", "layers": [0, 1], "positions": "all"}}
    got = pair.graphed.generate(PROMPTS, steer=steers, **run)
    want = pair.hooked.generate(PROMPTS, steer=steers, **run)
    assert pair.served()[0] == before[0] + len(PROMPTS)  # the ablation at mlp_input alone, for each prompt
    assert got.tokens == want.tokens
    for index in range(len(PROMPTS)):
        assert equal(got.logits[index], want.logits[index], False), index
        assert equal(got.harvest["layer_output"][index], want.harvest["layer_output"][index], False), index


def test_requests_entering_and_leaving_across_steps(pair: Pair) -> None:
    """Five prompts through three sequences at a time, each stopping at a token of its own: requests enter the plan
    as others leave it, mid-run, and each equals the hook path."""
    steers = [steer_of(pair, "add", True, "layer_input", 1, {}, 13),
              steer_of(pair, "clamp", False, "mlp.mlp_output", 0, {"positions": [1, 2]}, 14, prompts=[1, 2, 4])]
    run = {"max_tokens": 8, "ignore_eos": True, "progress": False}
    first = pair.hooked.generate(PROMPTS, steer=steers, **run)
    # The stop token that ends the prompts at the most different steps (read off the run without one).
    stop = max(sorted({token for tokens in first.tokens for token in tokens}),
               key=lambda token: len({tokens.index(token) if token in tokens else -1 for tokens in first.tokens}))
    run = {**run, "stop_token_ids": [stop], "return_logits": True,
           "harvest": {"values": "layer_output", "layers": [0, 1], "positions": "all"}}
    got = pair.graphed.generate(PROMPTS, steer=steers, **run)
    want = pair.hooked.generate(PROMPTS, steer=steers, **run)
    assert got.tokens == want.tokens
    assert len({len(tokens) for tokens in got.tokens}) > 1, got.tokens  # they left at different steps
    for index in range(len(PROMPTS)):
        assert equal(got.logits[index], want.logits[index], False), index
        assert equal(got.harvest["layer_output"][index], want.harvest["layer_output"][index], False), index
    assert pair.ops.plan.live == 0 and pair.ops.plan.bank.live == 0


@pytest.mark.parametrize("case", ["ablate", "clamp", "add_norm_match", "set_norm_match_prompt_positions",
                                  "several_blocks"])
def test_against_transformers_float32_with_plain_hooks(pair: Pair, case: str) -> None:
    before = pair.served()[0]
    steer_checks.check_case(pair.graphed, pair.reference, pair.tokenizer, pair.family, case)
    assert pair.served()[0] > before
