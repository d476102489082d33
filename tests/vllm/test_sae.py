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
    clamped = model.generate(PROMPTS, steer=[sae.clamp(active, 12.0, positions="all")], **options)
    unchanged = model.generate(PROMPTS, steer=[sae.clamp(0, 0.0)], **options)
    for index, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            expected = sae_checks.oracle_clamped_logits(reference, ids + list(clamped.tokens[index][:-1]), 1,
                                                        original.encode, original.decode, active, 12.0)
        assert relative_error(clamped.logits[index], expected[len(ids) - 1:len(ids) - 1 + STEPS]) <= RELATIVE
        assert (clamped.logits[index] - plain.logits[index]).abs().max() > 1e-3
        assert torch.equal(unchanged.logits[index], plain.logits[index])


class BeginPayloads:
    """The size of each bulk run's plan as the client sends it to the engine's workers."""

    def __init__(self, model, monkeypatch):
        self.sizes: list[int] = []
        entry = model.vllm_entrypoint
        original = entry.collective_rpc

        def spy(method, *args, **kwargs):
            if method == "streamscope_bulk_begin":
                self.sizes.append(len(kwargs["args"][0]))
            return original(method, *args, **kwargs)

        monkeypatch.setattr(entry, "collective_rpc", spy)


def held_keys(model) -> list[str]:
    return model.vllm_entrypoint.collective_rpc("streamscope_held_saes")[0]


def test_an_sae_crosses_to_the_worker_once_and_later_runs_name_it_by_key(engine, monkeypatch):
    from streamscope.vllm import held

    model, _, _ = engine
    model.release_saes()
    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 16 * model.hidden_size))
    weights = sum(tensor.numel() * 4 for tensor in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec))
    payloads = BeginPayloads(model, monkeypatch)
    first = model.harvest(PROMPTS, sae=sae, top_k=4, progress=False)
    second = model.harvest(PROMPTS, sae=sae, top_k=4, progress=False)
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    clamped = [model.generate(PROMPTS, steer=[sae.clamp(1, 6.0)], **options) for _ in range(2)]
    assert payloads.sizes[0] > weights
    assert max(payloads.sizes[1:]) < 16_384 < weights  # the key and the run's settings, not the weights
    assert len(held_keys(model)) == 1
    for index in range(len(PROMPTS)):
        assert torch.equal(first["sae_values"][index], second["sae_values"][index])
        assert torch.equal(first["sae_indices"][index], second["sae_indices"][index])
        assert torch.equal(clamped[0].logits[index], clamped[1].logits[index])
    # An SAE edited in place is sent again: the worker's copy would be stale.
    with torch.no_grad():
        sae.W_dec[1] *= 2.0
    edited = model.generate(PROMPTS, steer=[sae.clamp(1, 6.0)], **options)
    assert payloads.sizes[-1] > weights
    assert (edited.logits[0] - clamped[0].logits[0]).abs().max() > 1e-3
    # Released, the workers hold nothing, and the next run sends the weights again.
    model.release_saes(sae)
    assert held_keys(model) == []
    model.harvest(PROMPTS, sae=sae, top_k=4, progress=False)
    assert payloads.sizes[-1] > weights
    # The workers hold at most CAPACITY SAEs: the least recently used goes first.
    others = [from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 2 * model.hidden_size, seed=seed))
              for seed in range(held.CAPACITY)]
    for other in others:
        model.harvest(PROMPTS[:1], sae=other, top_k=2, progress=False)
    assert len(held_keys(model)) == held.CAPACITY
    model.harvest(PROMPTS[:1], sae=sae, top_k=2, progress=False)
    assert payloads.sizes[-1] > weights  # it was the one let go of
    model.release_saes()
    assert held_keys(model) == []
