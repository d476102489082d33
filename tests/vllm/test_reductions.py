"""Reductions at the source on vLLM: ``reduce=`` applied in the engine's worker before a prompt's rows leave it,
`model.statistics`' running moments per label (bit for bit against reducing a full harvest of the same run), and
directions fit from the moments (against transformers' float32 forward, the oracle).

One engine a layout: Llama (fused blocks) and GPT-2 (the stream whole). The checks are tests/reduction_checks.py's,
shared with the transformers suite.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import precision
import reduction_checks
import streamscope
from streamscope.vllm.model import beside_engine

FAMILIES = ["llama", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, checkpoints):
    path = checkpoints(request.param)
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    with beside_engine():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield request.param, model, reference, AutoTokenizer.from_pretrained(path)
    model.close()


def test_a_reduced_harvest_is_the_full_harvest_reduced_bit_for_bit(engine, tmp_path):
    reduction_checks.check_reduced_harvests_equal_reducing_a_full_harvest(engine[1], tmp_path)


def test_statistics_are_the_moments_of_the_full_harvest_bit_for_bit(engine):
    reduction_checks.check_statistics_equal_the_moments_of_a_full_harvest(engine[1])


def test_directions_from_moments_equal_plain_torch_on_the_oracle(engine):
    family, model, reference, tokenizer = engine
    reduction_checks.check_directions_from_moments_equal_the_oracle(model, reference, family, tokenizer)


def test_bad_reductions_are_refused_and_the_engine_serves_on(engine):
    model = engine[1]
    reduction_checks.check_bad_reductions_are_refused_with_the_fix(model)
    assert len(model.harvest(["Rome is in Italy"], "layer_output", layers=[0], reduce="last", progress=False)) == 1
