"""SAE workflows on vLLM, per family: top-activating examples against a brute force over the harvested features
(themselves held to SAELens's `encode` on the transformers oracle's float32 values), the page in headless
Chromium, `streamscope.sae.train` on the engine's harvest, and a SAELens folder whose top-k SAE ranks by
decoder norm (folded at load) against SAELens's own loading."""

from __future__ import annotations

import torch

import oracle
import bulk_engines
import sae_checks
import sae_examples_checks
from access import relative_error
from bulk_checks import BULK_FAMILIES, PROMPTS, RELATIVE
import streamscope
from streamscope.sae import from_sae_lens

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)
from sae_lens import SAE as SaeLensSAE
from sae_lens.saes.sae import SAEMetadata, get_sae_class

HOOK = "blocks.1.hook_resid_post"


engine = bulk_engines.fixture("vllm", BULK_FAMILIES)


def test_top_examples_equal_a_brute_force_over_the_harvested_features(engine):
    sae_examples_checks.check_top_examples(engine.model, engine.reference, engine.tokenizer, engine.family)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine):
    sae_examples_checks.check_refusals(engine.model)
    assert engine.model.harvest(PROMPTS[:1], "layer_output", layers=[1], progress=False)["layer_output"][0].numel()


def test_the_view_of_the_engines_examples(engine, tmp_path):
    model = engine.model
    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size))
    examples = streamscope.sae.top_examples(model, PROMPTS, sae, features=[3, 0, 11], k=3)
    assert any(examples[feature] for feature in examples)
    sae_examples_checks.check_view(examples, tmp_path / "features.html")


def test_train_on_the_engines_harvest(engine, tmp_path):
    """`train` on vLLM: SAELens trains on the engine's activations (equal to the oracle's), writes a folder that
    SAELens loads, and the trained SAE's features in the engine equal SAELens's encode on the oracle."""
    import datasets

    model = engine.model
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (32,), generator=generator).tolist() for _ in range(8)]
    sae = streamscope.sae.train(model, prompts, HOOK, tmp_path / "sae", d_sae=2 * model.hidden_size, steps=20,
                                batch_size=32, context_size=16, cache=tmp_path / "cache", progress=False,
                                l1_coefficient=1e-3)
    rows = datasets.load_from_disk(str(tmp_path / "cache")).with_format("torch")
    for index in (0, 7):
        stream = oracle.values(engine.reference, engine.family, torch.tensor([prompts[index]]))["layer_output"][1][0]
        cached = torch.cat([rows[2 * index][HOOK], rows[2 * index + 1][HOOK]])
        assert relative_error(cached, stream) <= RELATIVE, index
    reference = SaeLensSAE.load_from_disk(str(tmp_path / "sae"))
    assert reference.cfg.metadata.hook_name == HOOK
    features = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)["sae_features"]
    for index, prompt in enumerate(PROMPTS):
        stream = oracle.values(engine.reference, engine.family, engine.tokenizer(prompt, return_tensors="pt").input_ids)
        with torch.no_grad():
            expected = reference.encode(stream["layer_output"][1][0])
        assert relative_error(features[index][0], expected) <= RELATIVE, index


def test_a_sae_lens_folder_of_a_top_k_sae_ranking_by_decoder_norm(engine, tmp_path):
    model = engine.model
    classes = get_sae_class("topk")
    original = classes[0](classes[1](d_in=model.hidden_size, d_sae=4 * model.hidden_size, k=6,
                                     rescale_acts_by_decoder_norm=True, metadata=SAEMetadata(hook_name=HOOK)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        original.W_enc.copy_(torch.randn(original.W_enc.shape, generator=generator) / model.hidden_size ** 0.5)
        original.W_dec.copy_(torch.randn(original.W_dec.shape, generator=generator)
                             * (torch.rand(4 * model.hidden_size, 1, generator=generator) * 2 + 0.2))
    original.save_model(tmp_path / "sae")
    reference = SaeLensSAE.load_from_disk(str(tmp_path / "sae"))
    sae = from_sae_lens(tmp_path / "sae")
    features = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)["sae_features"]
    for index, prompt in enumerate(PROMPTS):
        stream = oracle.values(engine.reference, engine.family, engine.tokenizer(prompt, return_tensors="pt").input_ids)
        with torch.no_grad():
            expected = reference.encode(stream["layer_output"][1][0])
        assert (expected > 0).any()
        assert relative_error(features[index][0], expected) <= RELATIVE, index
