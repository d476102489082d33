"""Direction selection by steering effect inside a vLLM engine (issue 38, item 15): the engine's bulk generate
runs the steers `find` measures with; `sweep.best` follows the effect, recomputed by the oracle (transformers' own
float32 forward of the same checkpoint with a torch hook); unreliable fits warn (`direction_selection_checks`).
One engine, a tiny Llama, shared by the module's tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import direction_selection_checks as checks
import precision
import streamscope
from streamscope.vllm.model import beside_engine


@pytest.fixture(scope="module")
def engine(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    with beside_engine():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield model, reference, AutoTokenizer.from_pretrained(path)
    model.close()


def test_best_follows_the_steering_effect_the_oracle_measures(engine):
    model, reference, tokenizer = engine
    checks.check_selection_follows_the_measured_effect(model, reference, tokenizer, "llama")


def test_unreliable_fits_warn_and_reliable_ones_do_not(engine):
    checks.check_warnings_fire_where_a_fit_is_unreliable(engine[0])


def test_a_bad_dose_is_refused_and_the_engine_serves_on(engine):
    model = engine[0]
    with pytest.raises(ValueError, match="dose="):
        streamscope.directions.find(model, checks.POSITIVE, checks.NEGATIVE, dose=-1.0, progress=False)
    assert model.generate(checks.NEGATIVE[:1], max_tokens=1, progress=False).tokens
