"""Reductions at the source on transformers: ``reduce=`` on `model.harvest`, `model.statistics`' running moments
per label (bit for bit against reducing a full harvest), and directions fit from the moments (against the oracle).

Two tiny checkpoints, one a layout: Llama (pre-norm, rotary) and GPT-2 (learned positions). The checks are
tests/reduction_checks.py's, shared with the vLLM suite.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import reduction_checks
import streamscope

FAMILIES = ["llama", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, checkpoints):
    path = checkpoints(request.param)
    return (request.param, streamscope.load(path), attention_oracle.reference_model(path),
            AutoTokenizer.from_pretrained(path))


def test_a_reduced_harvest_is_the_full_harvest_reduced_bit_for_bit(tiny, tmp_path):
    _, model, _, _ = tiny
    reduction_checks.check_reduced_harvests_equal_reducing_a_full_harvest(model, tmp_path)


def test_statistics_are_the_moments_of_the_full_harvest_bit_for_bit(tiny):
    _, model, _, _ = tiny
    reduction_checks.check_statistics_equal_the_moments_of_a_full_harvest(model)


def test_directions_from_moments_equal_plain_torch_on_the_oracle(tiny):
    family, model, reference, tokenizer = tiny
    reduction_checks.check_directions_from_moments_equal_the_oracle(model, reference, family, tokenizer)


def test_bad_reductions_are_refused_with_the_fix(tiny):
    reduction_checks.check_bad_reductions_are_refused_with_the_fix(tiny[1])


def test_a_bfloat16_mean_keeps_float32(tiny):
    from streamscope.bulk.moments import reduce_positions

    rows = torch.randn(2, 5, 8).to(torch.bfloat16)
    mean = reduce_positions(rows, "mean")
    assert mean.dtype == torch.float32 and mean.shape == (2, 1, 8)
    assert torch.equal(mean, (rows.double().sum(-2, keepdim=True) / 5).float())
