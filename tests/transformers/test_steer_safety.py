"""Steering safety on transformers (issue 38 items 1, 2, 6, 11): the first token skipped by default, arguments a
mode does not use refused, absurd scales refused with the measured norm, bad positions refused as one type.

See tests/steer_safety_checks.py. One tiny Llama shared by the module; the oracle is transformers' float32
forward with plain torch hooks.
"""

from __future__ import annotations

import pytest
import torch

import steer_safety_checks as checks
from access import relative_error
import bulk_engines
from bulk_checks import PROMPTS, RELATIVE
import streamscope
from streamscope.bulk.spec import SteerError

FAMILY = "llama"


engine = bulk_engines.fixture("transformers", [FAMILY])


def test_a_default_steer_skips_the_first_token_and_matches_the_oracle(engine):
    checks.check_default_skips_the_first_token(engine.model, engine.reference, engine.tokenizer, FAMILY)


def test_a_trace_skips_the_first_token_by_default_as_the_bulk_path_does(engine):
    """`apply_steers` in a trace: the same default, so the prompt's logits equal the oracle edited at 1.. only."""
    model = engine.model
    vector = checks.direction(model, 4)
    unit = vector / vector.norm()
    steers = [streamscope.Steer("layer_output", block, vector, mode="ablate") for block in range(model.num_layers)]
    with model.trace(PROMPTS[0]):
        streamscope.apply_steers(model, steers, 0)
        logits = model.logits.save()
    ids = torch.tensor([engine.tokenizer(PROMPTS[0]).input_ids])
    expected = {}
    for first in (0, 1):
        edits = [("layer_output", block, "ablate", unit, 1.0) for block in range(model.num_layers)]
        expected[first] = checks.oracle_logits(engine.reference, FAMILY, ids[0].tolist(), [0], edits, first)
        # teacher-forced on the prompt alone: the last prompt position's logits
    got = logits[0, -1:]
    assert relative_error(got, expected[1]) <= RELATIVE
    assert relative_error(expected[0], expected[1]) > 100 * RELATIVE


def test_every_mode_refuses_the_arguments_it_does_not_use(engine):
    checks.check_unused_arguments_are_refused(engine.model)


def test_absurd_scales_are_refused_with_the_measured_norm(engine):
    checks.check_absurd_scales_are_refused(engine.model, engine.reference, engine.tokenizer, FAMILY)


def test_an_absurd_scale_in_a_trace_is_refused_before_the_edit(engine):
    model = engine.model
    steer = streamscope.Steer("layer_output", 1, checks.direction(model, 5), scale=1e30)
    with pytest.raises(SteerError, match=r"overflows.*\|\|h\|\| = "):
        with model.trace(PROMPTS[0]):
            steer.apply(model)
    with model.trace(PROMPTS[0]):  # the model traces on
        logits = model.logits.save()
    assert torch.isfinite(logits).all()


def test_bad_positions_are_refused_as_one_type_before_the_run(engine):
    checks.check_bad_positions_are_refused(engine.model)
