"""Steering operations on vLLM, eager and tapped engines: the bulk path and traces against the oracle.

See tests/steer_checks.py. One engine at a time: the bulk suites' three
block shapes eagerly, and Llama started with taps at the steered values
(on a GPU its decode steps replay CUDA graphs, the steers run at the taps;
on this CPU it runs eagerly but serves only its taps).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import precision
import steer_checks
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS
from steer_checks import CASES, STEPS
import streamscope
from streamscope.vllm.model import beside_engine

TAPS = ["layers.*.layer_input", "layers.*.layer_output", "layers.*.mlp.mlp_output",
        "layers.*.self_attn.attention_output"]
ENGINES = [*BULK_FAMILIES, "llama-tapped"]


class Engine:
    def __init__(self, name: str, path):
        self.family = name.split("-")[0]
        taps = {"taps": TAPS} if name.endswith("tapped") else {}
        self.model = streamscope.load(path, engine="vllm", **taps, **precision.engine_kwargs())
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, checkpoints):
    engine = Engine(request.param, checkpoints(request.param.split("-")[0]))
    yield engine
    engine.model.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_steered_generation_equals_the_oracle_edited_by_plain_hooks(engine, case):
    steer_checks.check_case(engine.model, engine.reference, engine.tokenizer, engine.family, case)


def traced_logits(model, prompt: str, steers, steps: int) -> torch.Tensor:
    """A trace that applies the steers at every step with `streamscope.apply_steers`."""
    with model.trace(prompt, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        logits = list().save()
        for step in tracer.iter[:steps]:
            streamscope.apply_steers(model, steers, step)
            logits.append(model.logits[0].clone())
    return torch.stack(list(logits)).cpu()


@pytest.mark.parametrize("case", ["ablate_half_from_step_2", "clamp_norm_match_generated_only",
                                  "set_norm_match_prompt_positions", "several_blocks"])
def test_a_trace_applying_the_steers_equals_the_bulk_path(engine, case):
    model = engine.model
    steers = CASES[case](model)
    result = model.generate(PROMPTS[1:2], max_tokens=STEPS, steer=steers, return_logits=True, ignore_eos=True,
                            progress=False)
    traced = traced_logits(model, PROMPTS[1], steers, STEPS)
    assert relative_error(traced, result.logits[0]) <= 1e-6


def test_bad_steers_are_refused_before_the_engine_runs_and_it_serves_on(engine):
    steer_checks.check_bad_steers(engine.model)


def test_a_harvest_reads_the_values_under_steers(engine):
    steer_checks.check_harvest_under_steers(engine.model)
