"""Conditional steering (CAST-style) on vLLM's bulk path, eager and tapped, against the oracle's hooked forward.

See tests/conditional_steer_checks.py: the same cases as on transformers, the
oracle being transformers' float32 forward of the same checkpoint gated by
plain torch hooks; a request whose rows never pass and a batchmate left bit
for bit as the plain run. The bulk suites' three block shapes run eagerly, and
Llama started with taps at the steered and conditioned values (on a GPU its
decode steps replay CUDA graphs: the conditions and steers run at the taps).
"""

from __future__ import annotations

import pytest
import torch

import conditional_steer_checks as checks
import bulk_engines
import precision
from bulk_checks import BULK_FAMILIES
import streamscope
from streamscope.bulk.spec import SteerError

TAPS = ["layers.*.layer_input", "layers.*.layer_output", "layers.*.mlp.mlp_output",
        "layers.*.self_attn.attention_output"]
ENGINES = [*BULK_FAMILIES, "llama-tapped"]


engine = bulk_engines.fixture("vllm", ENGINES, taps=TAPS)


CASES = ["row_earlier_block", "row_same_site_less", "row_cosine_mid", "request_cosine",
         "request_projection_with_a_plain_steer"]


@pytest.mark.parametrize("case", CASES)
def test_a_conditional_generation_equals_the_oracle_gated_by_plain_hooks(engine, case):
    checks.check_case(engine.model, engine.reference, engine.tokenizer, engine.family, case)


def test_never_passing_rows_and_batchmates_are_the_plain_run_bit_for_bit(engine):
    checks.check_never_passing_and_batchmates(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_a_conditional_harvest_reads_the_gated_stream(engine):
    checks.check_harvest(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_bad_conditions_are_refused_before_the_engine_runs_and_it_serves_on(engine):
    checks.check_bad_conditions(engine.model)


def test_a_request_scoped_condition_is_refused_by_an_engine_that_may_split_a_prompt(checkpoints):
    """An engine loaded with chunked prefill may run a prompt in pieces, and a request-scoped condition decides on
    the whole prompt in one step: refused before anything runs, naming the fix; a row-scoped one runs there."""
    model = streamscope.load(checkpoints("llama"), engine="vllm", enable_chunked_prefill=True,
                             **precision.engine_kwargs())
    try:
        direction = torch.ones(model.hidden_size)
        condition = streamscope.Condition("layer_output", 0, direction, 0.0, scope="request")
        steer = streamscope.Steer("layer_output", 1, direction, scale=2.0, condition=condition)
        with pytest.raises(SteerError, match="enable_chunked_prefill") as refused:
            model.generate(["Hello there"], max_tokens=2, steer=[steer])
        assert refused.value.field == "condition" and "scope='row'" in str(refused.value)
        row = streamscope.Steer("layer_output", 1, direction, scale=2.0,
                                condition=streamscope.Condition("layer_output", 0, direction, 0.0))
        assert len(model.generate(["Hello there"], max_tokens=2, steer=[row]).tokens[0]) == 2
    finally:
        model.close()
