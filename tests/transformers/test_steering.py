"""Steering operations on transformers: the bulk path and traces against the oracle's edited forward.

See tests/steer_checks.py: every operation (add, set, ablate, clamp, each
norm-matched), several steers at several blocks, prompt positions or
generated tokens from a step on, for the bulk suites' families.
"""

from __future__ import annotations

import pytest
import torch

import steer_checks
from access import relative_error
import bulk_engines
from bulk_checks import BULK_FAMILIES, PROMPTS
from steer_checks import CASES, STEPS
import streamscope


engine = bulk_engines.fixture("transformers", BULK_FAMILIES)


@pytest.mark.parametrize("case", list(CASES))
def test_a_steered_generation_equals_the_oracle_edited_by_plain_hooks(engine, case):
    steer_checks.check_case(engine.model, engine.reference, engine.tokenizer, engine.family, case, batch_size=2)


def traced_logits(model, prompt: str, steers, steps: int) -> torch.Tensor:
    """A trace of generate that applies each steer at every step with `Steer.apply`."""
    with model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False) as tracer:
        logits = list().save()
        for step in tracer.iter[:steps]:
            streamscope.apply_steers(model, steers, step)
            logits.append(model.logits[0, -1].clone())
    return torch.stack(list(logits))


@pytest.mark.parametrize("case", ["ablate_half_from_step_2", "clamp_norm_match_generated_only",
                                  "set_norm_match_prompt_positions", "several_blocks"])
def test_a_trace_applying_the_steers_equals_the_bulk_path(engine, case):
    model = engine.model
    steers = CASES[case](model)
    result = model.generate(PROMPTS[1:2], max_tokens=STEPS, steer=steers, return_logits=True, ignore_eos=True,
                            batch_size=1, progress=False)
    traced = traced_logits(model, PROMPTS[1], steers, STEPS)
    assert relative_error(traced, result.logits[0]) <= 1e-6


def test_bad_steers_are_refused_before_the_model_runs(engine):
    steer_checks.check_bad_steers(engine.model)
    steer = streamscope.Steer("layer_output", 0, torch.ones(engine.model.hidden_size))
    steer.vector = torch.full((engine.model.hidden_size,), float("inf"))  # changed after it was built
    with pytest.raises(ValueError, match="NaN or inf"):
        with engine.model.trace(PROMPTS[0]):
            steer.apply(engine.model)


def test_a_harvest_reads_the_values_under_steers(engine):
    steer_checks.check_harvest_under_steers(engine.model)


def test_a_steer_travels_as_json_and_steers_the_same(engine):
    import json

    model = engine.model
    for case in ("clamp_norm_match_generated_only", "set_norm_match_prompt_positions", "several_blocks"):
        steers = CASES[case](model)
        again = [streamscope.Steer.from_dict(json.loads(json.dumps(steer.to_dict()))) for steer in steers]
        options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
        first = model.generate(PROMPTS[:2], steer=steers, **options)
        second = model.generate(PROMPTS[:2], steer=again, **options)
        assert all(torch.equal(a, b) for a, b in zip(first.logits, second.logits)), case
    sliced = streamscope.Steer("layer_output", 0, torch.ones(model.hidden_size), positions=slice(1, 3))
    assert streamscope.Steer.from_dict(json.loads(json.dumps(sliced.to_dict()))).positions == slice(1, 3)
    with pytest.raises(ValueError, match="a steer has no strength"):
        streamscope.Steer.from_dict({**sliced.to_dict(), "strength": 2})
