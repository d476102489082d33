"""The dose guard's actions on transformers' bulk path: refuse (the default), clamp and warn (tests/dose_guard_checks.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import attention_oracle
import carried_norm_checks
import dose_guard_checks as checks
from bulk_checks import BULK_FAMILIES
import streamscope


class Engine:
    def __init__(self, family: str, path):
        self.family = family
        self.model = streamscope.load(path)
        self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=BULK_FAMILIES)
def engine(request, checkpoints):
    return Engine(request.param, checkpoints(request.param))


def test_a_dose_past_the_limit_clamps_to_it_on_request(engine):
    checks.check_clamp(engine.model, engine.reference, engine.tokenizer, engine.family, batch_size=2)


def test_warn_runs_as_given_and_refuse_stays_the_default(engine):
    checks.check_warn_and_refuse(engine.model, batch_size=2)


def test_model_norms_are_the_oracles_and_the_dose_checks(engine):
    checks.check_norms(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_a_directions_carried_norm_is_the_oracles_and_the_dose_checks(engine):
    carried_norm_checks.check_carried_norm(engine.model, engine.reference, engine.tokenizer, engine.family, batch_size=2)
