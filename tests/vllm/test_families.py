"""Every family vLLM runs, against the transformers values of the same checkpoint: the value x family matrix.

One engine per family, alive for this module's tests of it only. `test_value`
is the matrix: for every value a support table can list (tests/matrix.py) and
every family, each block that serves it gives the oracle's tensor
(transformers' own forward read with torch hooks, its attention kernels'
tensors and eager weights), and each block that does not raises Unavailable
with support()'s reason. Then: edits made on both engines, invokes batched
together against the same prompts run alone, and the support table against
the transformers engine's. Where and in which dtype it runs, and every
tolerance: tests/precision.py.
"""

from __future__ import annotations

from functools import cached_property

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import matrix
import oracle
import precision
from access import relative_error, value_of
import streamscope
from streamscope.vllm.model import beside_engine
from streamscope.families import FAMILIES, VLLM

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
PROMPTS = [
    "Once upon a time",
    "Rome is in Italy, Berlin is in Germany, Madrid is in Spain",
    "def add(a, b):",
    "Water boils at one hundred degrees Celsius at sea level, and",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the garden",
    "Numbers",
    "She opened the door, looked at the garden",
    "Attention heads move information between positions; the MLP writes features into the stream",
]
GREEDY = {"temperature": 0.0, "max_tokens": 1}

#: Families vLLM runs here: every model type with a vLLM module, on a CPU those its CPU build can run (not Mamba's).
VLLM_FAMILIES = [family.name for family in FAMILIES if VLLM in family.engines and family.model_type
                 and (precision.ON_GPU or family.not_on_vllm_cpu is None)]


class Case:
    """A family's checkpoint and engine settings for this suite, and the tolerances it is held to on CPU float32
    (None: measured, see tests/precision.py; on a GPU or in bfloat16 every tolerance is measured)."""

    def __init__(self, family: str, overrides: dict | None = None, dtype: str | None = None,
                 tolerance: float | None = precision.CPU_FLOAT32):
        self.family, self.overrides, self.dtype, self.tolerance = family, overrides or {}, dtype, tolerance


CASES = {family: Case(family) for family in VLLM_FAMILIES}
# OPT-350m's layout: post-LN blocks, no final norm, the stream projected down to a narrower embedding width.
CASES["opt-post-ln"] = Case("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32})
# Falcon's sequential layout with biases (Falcon-RW's, but rotary): vLLM adds the biases in the block.
CASES["falcon-sequential-bias"] = Case("falcon", {"new_decoder_architecture": False, "parallel_attn": False,
                                                  "bias": True})
# Falcon-RW's layout: that, with ALiBi in place of rotary and a kv head per head.
CASES["falcon-rw"] = Case("falcon", {**CASES["falcon-sequential-bias"].overrides, "alibi": True,
                                     "multi_query": False, "num_kv_heads": 2})
# Soft caps the tiny model's attention logits and logits reach (the config's 50 and 30 they do not).
CASES["gemma2-capped"] = Case("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0})
# Qwen3-Next's CPU kernels run bfloat16 only (head dims of 64): its tolerance is measured.
CASES["qwen3_next"] = Case("qwen3_next", precision.every_expert("qwen3_next"), dtype="bfloat16", tolerance=None)
if precision.measured():  # GPU runs (TF32 rounding can flip a routing choice too) and bfloat16: pin routing
    for _family in precision.MOE_FAMILIES:
        CASES[_family] = Case(_family, precision.every_expert(_family), dtype=CASES[_family].dtype, tolerance=None)


class Engines:
    def __init__(self, case: Case, path):
        family = self.name = case.family
        self.model = streamscope.load(path, engine="vllm", **precision.engine_kwargs(case.dtype))
        # vLLM computes the family's own function: where transformers' sdpa forward computes another (Gemma 2's
        # drops its attention soft cap), both references are the eager forward.
        implementation = attention_oracle.exact_implementation(family)
        # in this process beside the engine, as a user would
        self.transformers = streamscope.load(path, attn_implementation=attention_oracle.load_kwargs(
            family, implementation)["attn_implementation"])
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.input_ids = self.tokenizer(PROMPT, return_tensors="pt").input_ids.to(precision.DEVICE)
        self.oracle = matrix.Reference(path, family, self.input_ids, device=precision.DEVICE, build=beside_engine,
                                       implementation=implementation)
        self.reference, self.expected = self.oracle.model, self.oracle.stream
        if precision.measured(case.dtype) or case.tolerance is None:
            low = matrix.Reference(path, family, self.input_ids, dtype=precision.low_precision_dtype(case.dtype),
                                   device=precision.DEVICE, build=beside_engine, implementation=implementation,
                                   context=lambda: precision.low_precision(case.dtype),
                                   experts=precision.low_precision_experts(family, case.dtype))
            self.tolerances = matrix.Tolerances.measured(low, self.oracle, precision.MEASURED_FACTOR)
        else:
            # the suite's float32 figure, scaled by what this machine's attention kernel measures (precision.py)
            kernel = matrix.attention_kernel_error(self.model, self.saved)
            self.tolerances = matrix.Tolerances(precision.cpu_float32(kernel), precision.PATTERN)
        self.tolerance = self.tolerances.relative
        self.support = self.model.support()

    @cached_property
    def saved(self) -> dict:
        """Every value the engine serves and the oracle computes, read in one trace, with the sampled logits."""
        steps = matrix.plan(self.model, self.oracle, prompt_logits_after="final_norm_output")
        return matrix.read(self.model, steps, PROMPT, **GREEDY)

    def served(self, name, block) -> bool:
        if block is None:
            return True
        layer = self.model.layers[block]
        rows = layer.support().rows
        if name == "attention_output":  # the mixer value_of reads (a hybrid's linear_attn on its blocks)
            key = f"{'self_attn' if 'self_attn' in layer.__dict__ else 'linear_attn'}.{name}"
        else:
            key = next(k for k in rows if k == name or k.endswith("." + name))
        return rows[key] is None


@pytest.fixture(scope="module", params=list(precision.selected(CASES)))
def engines(request, checkpoints):
    case = CASES[request.param]
    engines = Engines(case, checkpoints(case.family, **case.overrides))
    engines.case_id = request.param
    yield engines
    engines.model.close()


@pytest.mark.parametrize("value", matrix.VALUES)
def test_value(engines, value):
    """One cell of the matrix: `value` on this family, every block that serves it against the oracle, every
    block that does not raising Unavailable with the reason support() gives."""
    where = matrix.rows(engines.support, value)
    if not where:
        pytest.skip(f"{engines.name} has no {value} on any block")
    for block, reason in where.items():
        if reason is None:
            assert (value, block) in engines.saved, f"{value} on block {block} is served, but the oracle has none"
            error = matrix.check(value, engines.saved[(value, block)], engines.oracle, block, engines.tolerances,
                                 sampled=True)
            matrix.record("vllm", engines.case_id, value, error, engines.tolerances.of(value))
    model = engines.model
    for reason, block in {reason: block for block, reason in where.items() if reason is not None}.items():
        with pytest.raises(streamscope.Unavailable) as raised:
            with model.trace(PROMPT, **GREEDY):
                matrix.reach(model, value, block).save()
        assert raised.value.reason == reason, (value, block)


def test_an_edit_of_head_results_matches_the_oracle_scaling_that_heads_result(engines):
    if not any(reason is None for reason in matrix.rows(engines.support, "self_attn.head_results").values()):
        pytest.skip(f"{engines.name}: every block refuses head_results (test_value holds each refusal to its "
                    "reason), so there is no edit to check")
    error = matrix.head_results_edit_error(engines.model, engines.oracle, PROMPT, engines.tolerances.relative,
                                           sampled=True, **GREEDY)
    matrix.record("vllm", engines.case_id, "head_results edit", error, engines.tolerances.relative)


def test_a_harvest_of_head_results_equals_the_oracle(engines):
    if not matrix.rows(engines.support, "self_attn.head_results"):
        pytest.skip(f"{engines.name} has no attention block, so no self_attn.head_results row to harvest")
    tolerance = engines.tolerances.of("self_attn.head_results")
    error = matrix.head_results_harvest_error(engines.model, engines.oracle, PROMPT, tolerance)
    matrix.record("vllm", engines.case_id, "head_results harvest", error, tolerance)


@pytest.mark.parametrize("positions", ["last", [0, -2]])
def test_a_harvest_of_the_stream_equals_the_traces_reads_bit_for_bit(engines, positions):
    """Every block's stream at the prompts' last or scattered positions: a harvest reads only those rows of vLLM's
    flattened batch (`Summed.stream_rows` on a fused block), and must give what the trace reads there."""
    model = engines.model
    names = [name for name in ("layer_input", "layer_mid", "layer_output")
             if (served := matrix.rows(engines.support, name)) and all(reason is None for reason in served.values())]
    prompts = PROMPTS[:3]
    harvest = model.harvest(prompts, names, positions=positions, progress=False)
    with model.trace(**GREEDY) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                traced = torch.stack([getattr(layer, name)[0] for layer in model.layers for name in names]).save()
    picked = [-1] if positions == "last" else positions
    for index in range(len(prompts)):
        for block in range(model.num_layers):
            for slot, name in enumerate(names):
                expected = traced[index][block * len(names) + slot].cpu()[picked]
                assert torch.equal(harvest[name][index][block], expected), (index, block, name)


def test_prompt_logits_are_served_on_every_layout(engines):
    """Every model unembeds something, so prompt_logits are served everywhere (test_value holds them to the
    oracle), a layout without a final norm too (OPT-350m's)."""
    assert engines.support.root.rows["prompt_logits"] is None


def test_every_row_of_the_support_table_is_a_value_the_matrix_checks(engines):
    support = engines.support
    listed = set(support.root.rows).union(*(table.rows for table in support.blocks))
    assert listed <= set(matrix.VALUES), listed - set(matrix.VALUES)
    model = engines.model  # (a trace body ships what it names to the engine's worker: the model, plain data)
    with model.trace(PROMPT, **GREEDY):
        logits = model.logits.save()
    assert relative_error(logits, engines.expected["logits"][:, -1]) <= engines.tolerance  # the engine serves on


def test_the_identity_holds_and_reads_change_nothing(engines):
    saved = engines.saved
    for block in range(engines.model.num_layers):
        mixer = "self_attn" if ("self_attn.attention_output", block) in saved else "linear_attn"
        parts = [saved.get((name, block)) for name in
                 ("layer_input", f"{mixer}.attention_output", "mlp.mlp_output", "layer_output")]
        if all(part is not None for part in parts):
            total = parts[0] + parts[1] + parts[2]
            assert relative_error(total, parts[3]) <= engines.tolerance, block
    model = engines.model
    with model.trace(PROMPT, **GREEDY):
        plain = model.logits.save()
    assert torch.equal(saved[("logits", None)].cpu(), plain.float().cpu())
    generate = {"temperature": 0.0, "max_tokens": 4}
    with model.trace(PROMPT, **generate) as tracer:
        tokens = tracer.result.save()
    with model.trace(PROMPT, **generate) as tracer:
        for layer in model.layers:
            layer.layer_output.save()
        tokens_read = tracer.result.save()
    assert tokens.outputs[0].token_ids == tokens_read.outputs[0].token_ids


def _edits(engines):
    block = min(1, engines.model.num_layers - 1)
    return [(name, block) for name in ("layer_input", "layer_mid", "mlp_norm_output", "layer_output",
                                       "attention_output", "mlp_output", *oracle.NEURONS)
            if engines.served(name, block)
            and engines.expected.get(name) is not None and engines.expected[name][block] is not None]


def test_the_same_edit_gives_the_same_logits_on_both_engines(engines):
    model, reference = engines.model, engines.transformers
    for name, block in _edits(engines):
        vector = torch.linspace(-1.0, 1.0, engines.expected[name][block].shape[-1])  # intermediate_size: neurons
        with model.trace(PROMPT, **GREEDY):
            value = value_of(model, name, block)
            value[:, -1] += vector.to(value)
            logits = model.logits.save()
        with reference.trace(PROMPT):
            value_of(reference, name, block)[:, -1] += vector
            expected = reference.logits.save()
        assert not torch.allclose(expected[:, -1], engines.expected["logits"][:, -1].to(expected.device)), name
        assert relative_error(logits, expected[:, -1]) <= engines.tolerance, (name, block)


def test_in_place_assignment_and_read_twice_edit_once_agree(engines):
    model = engines.model
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    for name, block in [site for site in _edits(engines) if site[0] in oracle.BOUNDARIES][:3]:
        with model.trace(PROMPT, **GREEDY):
            value = value_of(model, name, block)
            value[:, -1] += vector.to(value)
            in_place = model.logits.save()
        with model.trace(PROMPT, **GREEDY):
            edited = value_of(model, name, block).clone()
            edited[:, -1] += vector.to(edited)
            setattr(model.layers[block], name, edited)
            assigned = model.logits.save()
        with model.trace(PROMPT, **GREEDY):
            _first = value_of(model, name, block)  # a read the edit below must not undo
            second = value_of(model, name, block)
            second[:, -1] += vector.to(second)
            twice = model.logits.save()
        assert torch.equal(in_place, assigned), name
        assert torch.equal(in_place, twice), name


def test_a_wrong_shape_write_fails_its_request_and_the_next_is_exact(engines):
    model, tokens = engines.model, engines.input_ids.shape[1]
    wrong = torch.zeros(1, tokens + 1, model.hidden_size)
    with pytest.raises(ValueError) as raised:
        with model.trace(PROMPT, **GREEDY):
            model.layers[0].layer_output = wrong
    assert "model.layers[0].layer_output" in str(raised.value)
    assert str((1, tokens + 1, model.hidden_size)) in str(raised.value)
    with model.trace(PROMPT, **GREEDY):
        logits = model.logits.save()
    assert relative_error(logits, engines.expected["logits"][:, -1]) <= engines.tolerance


def _solo(engines, prompt):
    model, block = engines.model, engines.model.num_layers // 2
    with model.trace(prompt, **GREEDY):
        output = model.layers[block].layer_output.save()
        logits = model.logits.save()
    return output, logits


@pytest.mark.parametrize("count", [2, 8])
def test_invokes_batched_together_equal_their_solo_runs(engines, count):
    model, prompts, block = engines.model, PROMPTS[:count], engines.model.num_layers // 2
    # Saves come back by name, one value per invoke that saved it, in invoke order.
    with model.trace(**GREEDY) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                output = model.layers[block].layer_output.save()
                logits = model.logits.save()
    assert len(output) == len(logits) == count
    for index, prompt in enumerate(prompts):
        solo_output, solo_logits = _solo(engines, prompt)
        assert output[index].shape == solo_output.shape
        assert relative_error(output[index], solo_output) <= engines.tolerance, index
        assert relative_error(logits[index], solo_logits) <= engines.tolerance, index


def test_a_skip_in_one_invoke_leaves_the_others_exact(engines):
    model, block = engines.model, min(1, engines.model.num_layers - 1)
    first, second = PROMPTS[1], PROMPTS[4]
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(first):
            layer = model.layers[block]
            layer.skip(layer.layer_input)
            skipped = model.logits.save()
        with tracer.invoke(second):
            other = model.logits.save()
    assert relative_error(other, _solo(engines, PROMPTS[4])[1]) <= engines.tolerance
    ids = engines.tokenizer(PROMPTS[1], return_tensors="pt").input_ids.to(precision.DEVICE)
    expected = oracle.logits_with_identity_block(engines.reference, engines.name, ids, block)[:, -1]
    assert relative_error(skipped, expected) <= engines.tolerance


def test_the_support_table_matches_transformers_except_where_vllm_hides_a_value(engines):
    on_vllm, on_transformers = engines.model.support(), engines.transformers.support()
    assert on_vllm.root.rows == on_transformers.root.rows
    for block in range(engines.model.num_layers):
        for name, reason in on_transformers[block].rows.items():
            vllm_reason = on_vllm[block].rows.get(name)
            if vllm_reason != reason:
                assert reason is None and vllm_reason is not None and "vLLM" in vllm_reason, (block, name)


def test_a_mixture_of_experts_says_why_vllm_serves_no_routing_values(engines):
    """vLLM's fused MoE layer routes inside one call and calls the shared expert itself: each of those values
    says so, with "vLLM" in its reason; a dense block's MLP has no router, as on transformers."""
    support = engines.model.support()
    moe = [block for block in range(engines.model.num_layers)
           if engines.model.layers[block].__dict__.get("mlp") is not None and hasattr(engines.model.layers[block].mlp._module, "experts")]
    if not moe:
        pytest.skip("no mixture of experts")
    for block in range(engines.model.num_layers):
        rows = support[block].rows
        for name in ("router_logits", "chosen_experts", "routing_weights"):
            reason = rows[f"mlp.{name}"]
            assert reason is not None and ("vLLM" in reason if block in moe else reason == "a dense MLP: no router")
        assert rows["mlp.mlp_output"] is None
        if "mlp.shared_experts.mlp_output" in rows:
            assert block in moe and "vLLM" in rows["mlp.shared_experts.mlp_output"]
    if engines.name in ("llama4_text", "qwen3_next"):
        assert all("mlp.shared_experts.mlp_output" in support[block].rows for block in moe)
