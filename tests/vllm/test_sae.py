"""SAEs on vLLM: features computed in the engine's worker, and a feature clamped in the loop, against the oracle.

One tiny Llama engine. References: SAELens's own `encode` on transformers'
float32 values read with torch hooks (tests/oracle.py), and the clamp as
plain torch in an oracle hook (decode(f') + x - decode(f)).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import precision
import sae_checks
from access import relative_error
from bulk_checks import RELATIVE
from sae_checks import PROMPTS
import streamscope
from streamscope.sae import from_sae_lens
from streamscope.vllm.model import beside_engine

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)
STEPS = 3


@pytest.fixture(scope="module")
def engine(checkpoints):
    path = checkpoints("llama")
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    with beside_engine():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield model, reference, AutoTokenizer.from_pretrained(path)
    model.close()


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_features_computed_in_the_worker_equal_sae_lens_on_the_oracle(engine, architecture):
    model, reference, tokenizer = engine
    original = sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size, architecture)
    sae = from_sae_lens(original)
    dense = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)
    top = model.harvest(PROMPTS, sae=sae, positions="all", top_k=4, progress=False)
    for index, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = original.encode(sae_checks.oracle_stream(reference, tokenizer, prompt))
        assert relative_error(dense["sae_features"][index][0], expected) <= RELATIVE
        assert relative_error(top["sae_values"][index][0], expected.topk(4, dim=-1).values) <= RELATIVE
        assert torch.equal(torch.gather(dense["sae_features"][index][0], -1, top["sae_indices"][index][0]),
                           top["sae_values"][index][0])


def test_a_feature_clamped_in_the_loop_equals_plain_torch_and_an_unclamped_sae_changes_nothing(engine):
    model, reference, tokenizer = engine
    original = sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size)
    with torch.no_grad():
        original.b_enc[0] = -1e4  # feature 0 never fires
    sae = from_sae_lens(original)
    with torch.no_grad():
        active = int(original.encode(sae_checks.oracle_stream(reference, tokenizer, PROMPTS[0])).mean(0).argmax())
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    plain = model.generate(PROMPTS, harvest={"values": "layer_output", "layers": [0]}, **options)
    clamped = model.generate(PROMPTS, steer=[sae.clamp(active, 12.0)], **options)
    unchanged = model.generate(PROMPTS, steer=[sae.clamp(0, 0.0)], **options)
    for index, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            expected = sae_checks.oracle_clamped_logits(reference, ids + list(clamped.tokens[index][:-1]), 1,
                                                        original.encode, original.decode, active, 12.0)
        assert relative_error(clamped.logits[index], expected[len(ids) - 1:len(ids) - 1 + STEPS]) <= RELATIVE
        assert (clamped.logits[index] - plain.logits[index]).abs().max() > 1e-3
        assert torch.equal(unchanged.logits[index], plain.logits[index])
