"""streamscope.directions on vLLM: the same directions as on the oracle, and steering with them moves the stream.

One tiny Llama engine for the module. A direction found from prompts in the
engine's worker equals the one computed with plain torch on transformers'
float32 forward (tests/oracle.py); adding it moves each prompt's projection
on it by its length, and ablating it leaves none.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import direction_checks
import precision
from access import relative_error
from bulk_checks import RELATIVE
from direction_checks import NEGATIVE, POSITIVE
import streamscope
from streamscope.directions import find
from streamscope.vllm.model import beside_engine


@pytest.fixture(scope="module")
def engine(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    with beside_engine():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    yield model, reference, tokenizer
    model.close()


def test_directions_found_in_the_engine_equal_plain_torch_on_the_oracle(engine):
    model, reference, tokenizer = engine
    positive = direction_checks.oracle_last_positions(reference, "llama", tokenizer, POSITIVE)
    negative = direction_checks.oracle_last_positions(reference, "llama", tokenizer, NEGATIVE)
    means = find(model, POSITIVE, NEGATIVE, method="mean_difference", progress=False)
    components = find(model, POSITIVE, NEGATIVE, method="pca", progress=False)
    for block in range(model.num_layers):
        assert relative_error(means[block].vector, positive[block].mean(0) - negative[block].mean(0)) <= RELATIVE
        component = torch.tensor(direction_checks.numpy_pca_component(positive[block], negative[block]))
        found = components[block].vector.double()
        assert abs(abs(float(found @ component / found.norm())) - 1) <= 1e-5, block


def test_adding_and_ablating_a_found_direction_in_the_engine(engine):
    model, _, _ = engine
    block = 1
    found = find(model, POSITIVE, NEGATIVE, layers=[block], progress=False)[block]
    harvest = {"values": "layer_output", "layers": [block]}
    base = model.generate(NEGATIVE, max_tokens=1, harvest=harvest, progress=False)
    added = model.generate(NEGATIVE, max_tokens=1, steer=[found.steer(positions="last")], harvest=harvest,
                           progress=False)
    before = found.project(base.harvest.stacked("layer_output")[:, 0, 0])
    after = found.project(added.harvest.stacked("layer_output")[:, 0, 0])
    length = float(found.vector.norm())
    assert float((after - before - length).abs().max()) <= 1e-4 * length
    ablated = model.generate(POSITIVE, max_tokens=1, steer=[found.steer(mode="ablate", positions="last")],
                             harvest=harvest, progress=False)
    stream = ablated.harvest.stacked("layer_output")[:, 0, 0]
    assert float(found.project(stream).abs().max()) <= 1e-5 * float(stream.abs().max())
