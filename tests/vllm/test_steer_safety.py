"""Steering safety on in-process vLLM (issue 38 items 1, 2, 6, 11): the first token skipped by default, arguments
a mode does not use refused, absurd scales refused with the measured norm, and a bad steer refused as one type,
before it reaches the worker, and an error in the worker handed back as itself, without the worker's log lines.

See tests/steer_safety_checks.py. One engine shared by the module; the oracle is transformers' float32 forward
with plain torch hooks.
"""

from __future__ import annotations

import logging

import pytest

import bulk_engines
import steer_safety_checks as checks
from bulk_checks import PROMPTS
import streamscope
from streamscope.bulk.spec import SteerError, token_ids

FAMILY = "llama"


engine = bulk_engines.fixture("vllm", [FAMILY])


def test_a_default_steer_skips_the_first_token_and_matches_the_oracle(engine):
    checks.check_default_skips_the_first_token(engine.model, engine.reference, engine.tokenizer, FAMILY)


def test_every_mode_refuses_the_arguments_it_does_not_use(engine):
    checks.check_unused_arguments_are_refused(engine.model)


def test_absurd_scales_are_refused_with_the_measured_norm(engine):
    checks.check_absurd_scales_are_refused(engine.model, engine.reference, engine.tokenizer, FAMILY)


def test_bad_positions_are_refused_as_one_type_before_the_run(engine, capfd):
    checks.check_bad_positions_are_refused(engine.model)
    captured = capfd.readouterr()
    assert "collective_rpc" not in captured.err + captured.out


def test_an_error_in_the_worker_comes_back_as_itself_without_log_spam(engine, caplog, capfd):
    """A steer changed after its checks (positions no rule) reaches the worker: the worker's SteerError comes back
    to the caller as a SteerError with its message, no 'collective_rpc method failed', no ERROR lines; the
    engine serves the next request."""
    from streamscope.vllm.bulk import _run

    model = engine.model
    steer = streamscope.Steer("layer_output", 0, checks.direction(model, 6))
    steer.positions = "first"  # past every client-side check: _run is what model.generate calls after them
    ids = token_ids(model, PROMPTS[:1])
    with caplog.at_level(logging.ERROR), pytest.raises(SteerError, match="positions='first'"):
        _run(model, ids, [0], {"max_tokens": 1, "temperature": 0.0}, None, [steer], False)
    captured = capfd.readouterr()
    assert "collective_rpc" not in captured.err + captured.out + caplog.text
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text
    after = model.generate(PROMPTS[:1], max_tokens=1, steer=[streamscope.Steer("layer_output", 0, steer.vector)],
                           progress=False)
    assert len(after.tokens[0]) == 1
