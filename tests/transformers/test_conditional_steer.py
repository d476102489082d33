"""Conditional steering (CAST-style) on transformers' bulk path against the oracle's hooked forward.

See tests/conditional_steer_checks.py: row and request scopes, projection and
cosine, a condition at an earlier block, an earlier value of the same block
and the steered value itself, on the bulk suites' families; a request whose
rows never pass and a batchmate left bit for bit as the plain run.
"""

from __future__ import annotations

import pytest

import conditional_steer_checks as checks
import bulk_engines
from bulk_checks import BULK_FAMILIES, PROMPTS
from streamscope.bulk.spec import SteerError


engine = bulk_engines.fixture("transformers", BULK_FAMILIES)


CASES = ["row_earlier_block", "row_same_site_less", "row_cosine_mid", "request_cosine",
         "request_projection_with_a_plain_steer"]


@pytest.mark.parametrize("case", CASES)
def test_a_conditional_generation_equals_the_oracle_gated_by_plain_hooks(engine, case):
    checks.check_case(engine.model, engine.reference, engine.tokenizer, engine.family, case, batch_size=2)


def test_never_passing_rows_and_batchmates_are_the_plain_run_bit_for_bit(engine):
    checks.check_never_passing_and_batchmates(engine.model, engine.reference, engine.tokenizer, engine.family,
                                              batch_size=2)


def test_a_conditional_harvest_reads_the_gated_stream(engine):
    checks.check_harvest(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_bad_conditions_are_refused_before_the_run(engine):
    checks.check_bad_conditions(engine.model)


def test_a_trace_refuses_a_conditional_steer_naming_the_bulk_path(engine):
    model = engine.model
    steer = checks.cases(model, engine.reference, engine.tokenizer, engine.family)["row_earlier_block"][0]
    checks.round_trip(steer)
    with pytest.raises(SteerError, match="model.generate") as raised:
        with model.trace(PROMPTS[0]):
            steer.apply(model, 0)
    assert raised.value.field == "condition"
