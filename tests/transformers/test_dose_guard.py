"""The dose guard's actions on transformers' bulk path: refuse (the default), clamp and warn (tests/dose_guard_checks.py)."""

from __future__ import annotations


import carried_norm_checks
import dose_guard_checks as checks
import bulk_engines
from bulk_checks import BULK_FAMILIES


engine = bulk_engines.fixture("transformers", BULK_FAMILIES)


def test_a_dose_past_the_limit_clamps_to_it_on_request(engine):
    checks.check_clamp(engine.model, engine.reference, engine.tokenizer, engine.family, batch_size=2)


def test_warn_runs_as_given_and_refuse_stays_the_default(engine):
    checks.check_warn_and_refuse(engine.model, batch_size=2)


def test_model_norms_are_the_oracles_and_the_dose_checks(engine):
    checks.check_norms(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_a_directions_carried_norm_is_the_oracles_and_the_dose_checks(engine):
    carried_norm_checks.check_carried_norm(engine.model, engine.reference, engine.tokenizer, engine.family, batch_size=2)
