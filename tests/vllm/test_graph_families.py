"""Every family vLLM runs, with steers and harvests through the graph ops: the ops against the hook path and the
oracle (issue 39, item 5).

tests/vllm/test_graph_backend.py holds the ops on the bulk families (a fused
block, a whole stream, a parallel block) through every position rule, entering
and leaving, conditions and SAE clamps on the hooks beside them. This file
holds the ops on every family: each family's checkpoint on two engines, one
started with ``graph_ops=True`` (the worker inserts the ops at every block's
stream boundaries and sublayer outputs at load) and one without (every steer
and harvest on hooks). For every value the ops serve (``layer_input``,
``layer_mid``, ``mlp_input``, ``layer_output``, ``self_attn.attention_output``,
``mlp.mlp_output``), one batch of ten prompts runs each operation (add, set,
ablate, clamp), plain and norm-matched, on a prompt of its own at that value,
with two prompts unsteered, generating with logits and a harvest read through
the ops:

* every steered prompt equals the hook path (add and set bit for bit on this
  CPU, where both engines run eagerly; else within the engine tolerance) and
  transformers' float32 forward edited by plain hooks (tests/steer_checks.py);
* each unsteered prompt is bit for bit its run in a batch nobody steers;
* a count of what the ops served proves they ran (read from the worker).

Then the steers run concurrently equal each prompt's solo run. A value a
family's blocks do not give the ops (Granite's scaled sublayer outputs, a
parallel block's ``layer_mid``) is skipped with the reason the ops' wiring
gives, and a family with no site at all skips every test with it.

On this CPU both engines run eagerly (the CPU suite's engines; a compiled
start costs a minute here: tests/vllm/test_graph_cache.py holds the compile),
one engine pair per family for this module, as few prompts as cover the
operations. On a GPU (tests/GPU.md; `scripts/gpu_suite.py`'s "graph" part, a
process per family) the graph-op engine must run compiled, with vLLM's
default CUDA graph mode, and is held to the eager hook path within
`precision.GPU_ENGINE_TOLERANCE`. STREAMSCOPE_TEST_FAMILIES picks families.
"""

from __future__ import annotations

import warnings

from dataclasses import replace
from typing import Any, Optional

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import bulk_checks
import precision
import steer_checks
import streamscope
from access import relative_error
from graph_engines import ops_state
from streamscope.families import FAMILIES, VLLM
from streamscope.vllm.graph_wiring import VALUES
from streamscope.vllm.model import beside_engine

#: Ten prompts: one for each operation, plain and norm-matched, and two that nobody steers (`UNSTEERED`).
PROMPTS = bulk_checks.PROMPTS + [
    "Water boils at one hundred degrees Celsius at sea level, and",
    "She opened the door, looked at the garden",
    "Attention heads move information between positions",
    "The Eiffel Tower is in Paris",
    "A short one",
]
#: Each steered prompt's operation, plain and norm-matched, with its settings.
OPERATIONS = [(mode, norm_match) for norm_match in (False, True) for mode in ("add", "set", "ablate", "clamp")]
SETTINGS = {"add": {"scale": 2.0}, "set": {"scale": 1.5}, "ablate": {"scale": 1.0}, "clamp": {"projection": 3.0}}
UNSTEERED = (8, 9)
#: A generation: greedy, a few tokens, with logits and the last block's stream read at every position.
STEPS = 3


def families() -> list[str]:
    """The families vLLM runs on this device (on a CPU, those its CPU build can run), as the run selects them."""
    names = [family.name for family in FAMILIES if VLLM in family.engines and family.model_type
             and (precision.ON_GPU or family.not_on_vllm_cpu is None)]
    return list(precision.selected({name: None for name in names}))


def engine_options(family: str) -> tuple[dict[str, Any], Optional[str]]:
    """The family's checkpoint overrides and engine dtype, as tests/vllm/test_families.py runs it: Qwen3-Next in
    bfloat16 (its kernels' only dtype), and the MoE families routed to every expert where rounding is measured."""
    dtype = "bfloat16" if family == "qwen3_next" else None
    overrides = precision.every_expert(family) if family == "qwen3_next" or (
        precision.measured(dtype) and family in precision.MOE_FAMILIES) else {}
    return overrides, dtype


class Pair:
    """A family's checkpoint on two engines, the graph ops in one, with the oracle, the tokenizer and tolerances."""

    def __init__(self, family: str, path: Any, dtype: Optional[str]) -> None:
        self.family, self.dtype = family, precision.engine_dtype(dtype)
        options: dict[str, Any] = {"max_num_seqs": len(PROMPTS), **precision.engine_kwargs(dtype)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the default options: on a GPU each batch's graph captured again without the ops (replayed on idle
            # steps) and with the layer_output sites' only (replayed on steps that mark no other site: the steers
            # at layer_output)
            self.graphed = streamscope.load(path, engine="vllm", graph_ops=True, **options)
        #: The warnings the graph-op engine's load gave.
        self.load_warnings = list(caught)
        self.hooked = streamscope.load(path, engine="vllm", **options)
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        #: Where both engines run the same kernels eagerly (this CPU, float32): add and set give the same bits.
        self.bits = not precision.ON_GPU and self.dtype == "float32"
        #: One engine against itself run otherwise (the ops or hooks, a batch or alone, compiled or eager).
        self.tolerance = precision.CPU_FLOAT32 if self.bits else precision.GPU_ENGINE_TOLERANCE[self.dtype]

    def state(self) -> dict[str, Any]:
        """The graph-op engine's worker: its ops' sites, skipped values, what they served, how it runs."""
        return self.graphed.vllm_entrypoint.collective_rpc(ops_state)[0]

    def close(self) -> None:
        self.graphed.close()
        self.hooked.close()


@pytest.fixture(scope="module", params=families())
def pair(request: Any, checkpoints: Any) -> Any:
    overrides, dtype = engine_options(request.param)
    loaded = Pair(request.param, checkpoints(request.param, **overrides), dtype)
    try:
        state = loaded.state()
        if not state.get("sites"):
            pytest.skip(f"{request.param}: the graph ops sit nowhere: {state.get('skipped')}")
        yield loaded
    finally:
        loaded.close()


def layer_of(pair: Pair, value: str) -> int:
    """The block `value` is steered at: one of its own (the values spread over the blocks) that the ops serve;
    the test skips with the wiring's reason where no block gives the ops that value."""
    state, layers = pair.state(), pair.graphed.num_layers
    served = [layer for layer in range(layers) if f"layers.{layer}.{value}" in state["sites"]]
    if not served:
        reasons = {state["skipped"].get(f"layers.{layer}.{value}", "no block has it") for layer in range(layers)}
        pytest.skip(f"{pair.family}: no graph op at {value}: {'; '.join(sorted(reasons))}")
    return served[VALUES.index(value) % len(served)]


def steers_at(pair: Pair, value: str, layer: int) -> list[streamscope.Steer]:
    """Each operation on its own prompt at `value` of block `layer` (default positions: every prompt position but
    the first, and the generated tokens)."""
    steers = []
    for index, (mode, norm_match) in enumerate(OPERATIONS):
        vector = torch.randn(pair.graphed.hidden_size, generator=torch.Generator().manual_seed(100 + index))
        steers.append(streamscope.Steer(value, layer, vector, mode=mode, norm_match=norm_match, **SETTINGS[mode],
                                        prompts=[index]))
    return steers


def run_of(pair: Pair) -> dict[str, Any]:
    return {"max_tokens": STEPS, "ignore_eos": True, "return_logits": True, "progress": False,
            "harvest": {"values": "layer_output", "layers": [pair.graphed.num_layers - 1], "positions": "all"}}


def agree(pair: Pair, got: Any, want: Any, index: int, bits: bool, label: Any, other: Optional[int] = None) -> None:
    """Prompt `index` of `got` and prompt `other` (`index` when None) of `want` agree: the same tokens, logits and
    harvested rows, bit for bit with `bits`, else within the pair's tolerance. Where rounding may flip a greedy
    token (a GPU, bfloat16), the runs are held up to the step where they part, whose logits must still agree (a
    near tie); in float32 on this CPU the tokens must be the same."""
    other, tolerance = index if other is None else other, pair.tolerance
    tokens, theirs = list(got.tokens[index]), list(want.tokens[other])
    if pair.bits:
        assert tokens == theirs, (label, index, tokens, theirs)
    parted = next((step for step, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
    # The logits up to the parting step's; the rows whose tokens both runs share (the prompt's, then the tokens
    # generated before the parting one).
    steps = len(tokens) if parted is None else parted + 1
    rows = None if parted is None else len(pair.tokenizer(PROMPTS[index]).input_ids) + parted
    pieces = [(got.logits[index][:steps], want.logits[other][:steps]),
              (got.harvest["layer_output"][index][:rows], want.harvest["layer_output"][other][:rows])]
    for mine, reference in pieces:
        if bits:
            assert torch.equal(mine, reference), (label, index)
        else:
            assert relative_error(mine, reference) <= tolerance, (label, index, relative_error(mine, reference))


def test_the_ops_sit_at_every_value_the_blocks_give_them(pair: Pair) -> None:
    """Every block's every value has an op, or is left to the hooks with the wiring's reason; both engines run as
    this device's suite asks (on a GPU the graph-op engine compiled, with CUDA graphs)."""
    state, layers = pair.state(), pair.graphed.num_layers
    for layer in range(layers):
        for value in VALUES:
            name = f"layers.{layer}.{value}"
            assert name in state["sites"] or state["skipped"].get(name), name
    assert set(state["harvest_sites"]) == set(state["sites"])
    values = {name.split(".", 2)[2] for name in state["sites"] + state["harvest_sites"]}
    lean = "layer_output" in values and values != {"layer_output"}  # a lean set: layer_output's ops, not all
    if precision.ON_GPU:
        assert state["mode"] != "NONE" and state["graph_mode"] != "NONE", (
            f"{pair.family}: the graph-op engine runs {state['mode']} with CUDA graphs {state['graph_mode']}: "
            "streamscope.load(..., graph_ops=True) must keep vLLM's compile and default graph mode (issue 39, item 3)")
        # What vLLM compiles is vLLM's choice (0.22 compiles no module of StableLM); the engine says which, and
        # warned at load where it is none (`Pair.load_warnings`).
        assert pair.graphed.compiled_modules == tuple(state["compiled"])
        warned = any("compiles no module" in str(warning.message) for warning in pair.load_warnings)
        assert warned == (not state["compiled"]), (pair.family, state["compiled"])
        # vLLM's graphs and, for each, the same batch's graph without the ops and with the layer_output sites' only
        # (`vllm_seam.keep_graph_sets`; no lean set where layer_output's are every site)
        assert state["idle_graphs_state"] == "kept" and state["idle_graphs"] == state["graphs"] > 0, state
        assert state["lean_graphs_state"] == ("kept" if lean else "off"), state
        assert state["lean_graphs"] == (state["graphs"] if lean else 0), state
    else:
        assert state["mode"] == "NONE"  # the CPU suite's engines run eagerly
        assert state["idle_graphs"] == state["graphs"] == state["lean_graphs"] == 0
        assert state["idle_graphs_state"].startswith("not kept: this engine captures no CUDA graph")
        assert state["lean_graphs_state"] == (state["idle_graphs_state"] if lean else "off")


@pytest.mark.parametrize("value", VALUES)
def test_every_operation_at_the_value_equals_the_hook_path_and_the_oracle(pair: Pair, value: str) -> None:
    layer = layer_of(pair, value)
    steers = steers_at(pair, value, layer)
    before = pair.state()["served"]
    got = pair.graphed.generate(PROMPTS, steer=steers, **run_of(pair))
    served = pair.state()["served"]
    # The ops ran every steer, and the harvest of every prompt (the dose check's harvests come on top).
    assert served["steers"] == before["steers"] + len(steers) and served["harvests"] >= before["harvests"] + len(PROMPTS)
    want = pair.hooked.generate(PROMPTS, steer=steers, **run_of(pair))
    idle = pair.state()["steps"]["idle"]
    # Nobody steers, nothing is harvested through the ops: every step idle (on a GPU, the graphs without the ops)
    plain = pair.graphed.generate(PROMPTS, **{**run_of(pair), "harvest": None})
    assert pair.state()["steps"]["idle"] >= idle + STEPS
    for index, (mode, norm_match) in enumerate(OPERATIONS):
        bits = pair.bits and mode in ("add", "set") and not norm_match
        agree(pair, got, want, index, bits, (value, mode, norm_match))
    harvested = pair.graphed.generate(PROMPTS, **run_of(pair))  # the harvest alone: marked steps, the ops' graphs
    for index in UNSTEERED:  # nobody's steer reaches a batchmate: its run in a batch nobody steers, every bit
        assert got.tokens[index] == plain.tokens[index] and torch.equal(got.logits[index], plain.logits[index])
        assert torch.equal(got.harvest["layer_output"][index], harvested.harvest["layer_output"][index])
        assert harvested.tokens[index] == plain.tokens[index]
        assert torch.equal(harvested.logits[index], plain.logits[index])
    check_oracle(pair, steers, got)
    state = pair.state()
    assert state["live"] == 0 and state["bank_live"] == 0  # every request left the plan


def check_oracle(pair: Pair, steers: list[streamscope.Steer], got: Any) -> None:
    """Each steered prompt's logits against transformers' float32 forward, its steer applied by plain hooks at the
    oracle's own module (tests/steer_checks.py), within the suite's tolerance for the bulk path's steers."""
    if pair.dtype != "float32":
        return  # a bfloat16 engine's distance to the float32 oracle is measured in tests/vllm/test_families.py
    for index, steer in enumerate(steers):
        ids = pair.tokenizer(PROMPTS[index]).input_ids
        expected = steer_checks.oracle_logits(pair.reference, pair.family, ids, list(got.tokens[index]), [steer])
        error = relative_error(got.logits[index], expected)
        assert error <= steer_checks.RELATIVE, (steer.value, steer.mode, steer.norm_match, error)


def test_concurrent_steers_each_equal_their_solo_run(pair: Pair) -> None:
    """The eight operations at one value, each on its own prompt in one batch, against each prompt run alone with
    its steer: the batch changes only how the engine's kernels tile the rows."""
    value = "layer_output"
    steers = steers_at(pair, value, layer_of(pair, value))
    together = pair.graphed.generate(PROMPTS, steer=steers, **run_of(pair))
    for index, steer in enumerate(steers):
        alone = pair.graphed.generate([PROMPTS[index]], steer=[replace(steer, prompts=None)], **run_of(pair))
        agree(pair, together, alone, index, False, ("solo", steer.mode, steer.norm_match), other=0)


def test_a_raw_call_after_a_steered_run_reads_no_stale_mark(pair: Pair) -> None:
    """vLLM called straight through ``model.vllm_entrypoint`` after a steered run whose last step marked rows (the
    index still holds them): every step of the call is idle (on a GPU, replayed from the idle graphs) and its
    logprobs are the bits of the same call before the run. Before `GraphOps.close_step`, such a call's rows were
    edited by the finished run's steers."""
    import vllm

    prompts = [{"prompt_token_ids": pair.tokenizer(PROMPTS[index]).input_ids} for index in UNSTEERED]
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=2, ignore_eos=True)

    def raw() -> list[Any]:
        outputs = pair.graphed.vllm_entrypoint.generate(prompts, params, use_tqdm=False)
        return [(list(output.outputs[0].token_ids),
                 [{token: item.logprob for token, item in step.items()} for step in output.outputs[0].logprobs])
                for output in outputs]

    before = raw()
    value = "layer_output"
    steers = [replace(steer, prompts=None) for steer in steers_at(pair, value, layer_of(pair, value))[:1]]
    pair.graphed.generate([PROMPTS[index] for index in UNSTEERED], steer=steers, max_tokens=STEPS, ignore_eos=True,
                          progress=False)
    state = pair.state()
    if not precision.ON_GPU:
        # the run's last step left its marks in the index; vLLM 0.22's GPU engine (an H100, 2026-12-07) left none
        # (marked_rows 0; why is not traced yet: tests/GPU.md), so there only the bits below are checked
        assert state["marked_rows"] > 0, state
    idle = state["steps"]["idle"]
    assert raw() == before
    assert pair.state()["steps"]["idle"] >= idle + STEPS
