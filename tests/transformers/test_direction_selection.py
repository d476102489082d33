"""Direction selection by steering effect on transformers (issue 38, item 15): `sweep.best` follows the measured
effect, recomputed by the oracle (transformers' own float32 forward with a torch hook); the sample sizes are shown;
unreliable fits warn, reliable ones do not (`direction_selection_checks`)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import attention_oracle
import direction_selection_checks as checks
import streamscope


@pytest.fixture(scope="module")
def tiny(checkpoints):
    path = checkpoints("llama")
    return streamscope.load(path), attention_oracle.reference_model(path), AutoTokenizer.from_pretrained(path)


def test_best_follows_the_steering_effect_the_oracle_measures(tiny):
    model, reference, tokenizer = tiny
    checks.check_selection_follows_the_measured_effect(model, reference, tokenizer, "llama")


def test_unreliable_fits_warn_and_reliable_ones_do_not(tiny):
    checks.check_warnings_fire_where_a_fit_is_unreliable(tiny[0])


def test_a_bad_dose_is_refused_and_the_model_serves_on(tiny):
    model = tiny[0]
    for dose in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="dose="):
            streamscope.directions.find(model, checks.POSITIVE, checks.NEGATIVE, dose=dose, progress=False)
    assert model.generate(checks.NEGATIVE[:1], max_tokens=1, progress=False).tokens
