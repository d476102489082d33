"""Every family vLLM runs here, against the transformers values of the same checkpoint.

One engine per family, alive for this module's tests of it only. Values are
compared with the oracle (transformers' own forward read with torch hooks):
every served value, the sampled position's logits, edits made on both
engines, invokes batched together against the same prompts run alone, and
the support table against the transformers engine's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
from access import relative_error, value_of
import streamscope
from streamscope.vllm.model import beside_engine
from streamscope.testing import FAMILIES

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
RELATIVE = 1e-5  # float32 on CPU: vLLM's kernels and transformers' agree to about 1e-6

#: Families vLLM runs on this CPU: all but Mamba (no selective-scan kernel on CPU).
VLLM_FAMILIES = [family for family in FAMILIES if family != "mamba"]


class Case:
    """A family's checkpoint and engine settings for this suite, and the tolerance it is held to."""

    def __init__(self, family: str, overrides: dict | None = None, dtype: str | None = None,
                 tolerance: float = RELATIVE):
        self.family, self.overrides, self.dtype, self.tolerance = family, overrides or {}, dtype, tolerance


CASES = {family: Case(family) for family in VLLM_FAMILIES}
# vLLM's CPU attention kernel applies Gemma 2's attention logit soft cap in its compiled code,
# which agrees with torch.tanh to about 2e-4 relative: the same checkpoint without the soft cap
# agrees to 2e-7 (the case below), so the mapping is exact and the difference is the kernel's.
CASES["gemma2"] = Case("gemma2", tolerance=5e-4)
CASES["gemma2-no-softcap"] = Case("gemma2", {"attn_logit_softcapping": None})
# Qwen3-Next's CPU kernels run bfloat16 only (head dims of 64). Every token goes to every expert,
# so that bfloat16 rounding cannot flip a routing choice; the tolerance is then measured, not
# chosen: twice the distance transformers' own bfloat16 forward keeps from its float32 one.
CASES["qwen3_next"] = Case("qwen3_next", {"num_experts_per_tok": 4}, dtype="bfloat16", tolerance=None)


class Engines:
    def __init__(self, case: Case, path):
        family = self.name = case.family
        self.model = streamscope.load(path, engine="vllm", **({"dtype": case.dtype} if case.dtype else {}))
        self.transformers = streamscope.load(path)  # in this process beside the engine, as a user would
        with beside_engine():  # vLLM's Transformers backend patched the family's transformers classes
            self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.input_ids = self.tokenizer(PROMPT, return_tensors="pt").input_ids
        self.expected = oracle.values(self.reference, family, self.input_ids)
        self.tolerance = case.tolerance
        if self.tolerance is None:
            with beside_engine():
                low = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, case.dtype)).eval()
            self.tolerance = 2 * _largest_error(oracle.values(low, family, self.input_ids), self.expected)
        seen, self.order = set(), []
        for entry in self.expected["order"]:
            if entry not in seen and entry[0] != "logits":
                seen.add(entry)
                self.order.append(entry)

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

    def read_all(self, prompt=PROMPT):
        # The trace body runs in the engine's worker and ships back what it saved by name, so the
        # values (all [1, tokens, hidden]) come back stacked into one tensor. Only the model and plain
        # data may be named in the body.
        model, sites = self.model, [site for site in self.order if self.served(*site)]
        with model.trace(prompt, **GREEDY):
            values = [value_of(model, name, block) for name, block in sites]
            stacked = torch.stack(values).save()
            logits = model.logits.save()
        saved = {site: value for site, value in zip(sites, stacked)}
        saved[("logits", None)] = logits
        return saved


def _largest_error(values: dict, reference: dict) -> float:
    errors = []
    for name, value in values.items():
        if name == "order":
            continue
        pairs = zip(value, reference[name]) if isinstance(value, list) else [(value, reference[name])]
        errors += [relative_error(a, b) for a, b in pairs if a is not None]
    return max(errors)


@pytest.fixture(scope="module", params=list(CASES))
def engines(request, checkpoints):
    case = CASES[request.param]
    engines = Engines(case, checkpoints(case.family, **case.overrides))
    yield engines
    engines.model.close()


def test_every_served_value_and_the_logits_equal_transformers(engines):
    saved = engines.read_all()
    assert ("layer_output", 0) in saved
    for (name, block), value in saved.items():
        if name == "logits":
            reference = engines.expected["logits"][:, -1]
        else:
            reference = engines.expected[name] if block is None else engines.expected[name][block]
        assert value.shape == reference.shape, (name, block, value.shape, reference.shape)
        error = relative_error(value, reference)
        assert error <= engines.tolerance, (name, block, error)


def test_the_identity_holds_and_reads_change_nothing(engines):
    saved = engines.read_all()
    for block in range(engines.model.num_layers):
        parts = [saved.get((name, block)) for name in ("layer_input", *oracle.CONTRIBUTIONS, "layer_output")]
        if all(part is not None for part in parts):
            total = parts[0] + parts[1] + parts[2]
            assert relative_error(total, parts[3]) <= engines.tolerance, block
    model = engines.model
    with model.trace(PROMPT, **GREEDY):
        plain = model.logits.save()
    assert torch.equal(saved[("logits", None)], plain)
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
                                       "attention_output", "mlp_output")
            if engines.served(name, block)
            and engines.expected.get(name) is not None and engines.expected[name][block] is not None]


def test_the_same_edit_gives_the_same_logits_on_both_engines(engines):
    model, reference = engines.model, engines.transformers
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    for name, block in _edits(engines):
        with model.trace(PROMPT, **GREEDY):
            value = value_of(model, name, block)
            value[:, -1] += vector.to(value.dtype)
            logits = model.logits.save()
        with reference.trace(PROMPT):
            value_of(reference, name, block)[:, -1] += vector
            expected = reference.logits.save()
        assert not torch.allclose(expected[:, -1], engines.expected["logits"][:, -1]), name
        assert relative_error(logits, expected[:, -1]) <= engines.tolerance, (name, block)


def test_in_place_assignment_and_read_twice_edit_once_agree(engines):
    model = engines.model
    vector = torch.linspace(-1.0, 1.0, model.hidden_size)
    for name, block in [site for site in _edits(engines) if site[0] in oracle.BOUNDARIES][:3]:
        with model.trace(PROMPT, **GREEDY):
            value = value_of(model, name, block)
            value[:, -1] += vector.to(value.dtype)
            in_place = model.logits.save()
        with model.trace(PROMPT, **GREEDY):
            edited = value_of(model, name, block).clone()
            edited[:, -1] += vector.to(edited.dtype)
            setattr(model.layers[block], name, edited)
            assigned = model.logits.save()
        with model.trace(PROMPT, **GREEDY):
            first = value_of(model, name, block)
            second = value_of(model, name, block)
            second[:, -1] += vector.to(second.dtype)
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
    ids = engines.tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    expected = oracle.logits_with_identity_block(engines.reference, engines.name, ids, block)[:, -1]
    assert relative_error(skipped, expected) <= engines.tolerance


def test_every_unserved_value_raises_unavailable_with_the_reason_support_gives(engines):
    model = engines.model
    rows = model.layers[0].support().rows
    unserved = [name for name, reason in rows.items() if reason is not None and "." not in name]
    for name in unserved:
        with pytest.raises(streamscope.Unavailable) as raised:
            with model.trace(PROMPT, **GREEDY):
                getattr(model.layers[0], name).save()
        assert raised.value.reason == rows[name], name
        assert raised.value.where == "model.layers[0]"
    with model.trace(PROMPT, **GREEDY):
        logits = model.logits.save()
    assert relative_error(logits, engines.expected["logits"][:, -1]) <= engines.tolerance


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
           if hasattr(engines.model.layers[block].mlp._module, "experts")]
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
