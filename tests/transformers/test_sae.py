"""SAEs on the map, on transformers: loaded from SAELens and dictionary_learning, features harvested, steered,
clamped in the loop, and a harvest SAELens trains on.

References: SAELens's own `encode` on transformers' float32 values read with
torch hooks (tests/oracle.py); the clamp as plain torch in an oracle hook.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import sae_checks
from access import relative_error
from sae_checks import HOOK, PROMPTS
import attention_oracle
import streamscope
from streamscope.errors import Unavailable
from streamscope.sae import from_dictionary_learning, from_sae_lens, value_of_hook

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)
RELATIVE = 1e-5
STEPS = 3


class Setup:
    def __init__(self, checkpoints):
        self.path = checkpoints("llama")
        self.model = streamscope.load(self.path)
        self.reference = attention_oracle.reference_model(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)


@pytest.fixture(scope="module")
def setup(checkpoints):
    return Setup(checkpoints)


def test_hook_names_map_to_streamscope_values():
    assert value_of_hook("blocks.5.hook_resid_post") == ("layer_output", 5)
    assert value_of_hook("blocks.0.hook_resid_pre") == ("layer_input", 0)
    assert value_of_hook("blocks.2.hook_mlp_out") == ("mlp_output", 2)
    assert value_of_hook("blocks.2.ln2.hook_out") == ("mlp_norm_output", 2)
    # TransformerLens 4.3's hook_normalized is the norm's input normalized before its weight: not the norm's
    # output, so an SAE trained there reads no value streamscope serves (the cache computes it, the engine not)
    with pytest.raises(ValueError, match="ln2.hook_normalized.*reads no value of the residual stream's width"):
        value_of_hook("blocks.2.ln2.hook_normalized")
    assert value_of_hook("hook_embed") == ("token_embeddings", None)
    with pytest.raises(ValueError, match="attn.hook_q.*reads no value of the residual stream's width"):
        value_of_hook("blocks.1.attn.hook_q")


@pytest.mark.parametrize("architecture", ["standard", "topk"])
def test_features_harvested_from_a_sae_lens_folder_equal_sae_lens_on_the_oracle(setup, architecture, tmp_path):
    model = setup.model
    original = sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size, architecture)
    original.save_model(tmp_path / "sae")
    sae = from_sae_lens(tmp_path / "sae")
    assert (sae.value, sae.layer, sae.d_in, sae.d_sae) == ("layer_output", 1, model.hidden_size, 4 * model.hidden_size)
    assert sae.activation == ("topk" if architecture == "topk" else "relu")
    dense = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)
    top = model.harvest(PROMPTS, sae=sae, positions="all", top_k=5, progress=False)
    for index, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = original.encode(sae_checks.oracle_stream(setup.reference, setup.tokenizer, prompt))
        got = dense["sae_features"][index]
        assert got.shape == (1, expected.shape[0], sae.d_sae)
        assert relative_error(got[0], expected) <= RELATIVE
        assert (got[0] > 0).any()
        values, indices = top["sae_values"][index][0], top["sae_indices"][index][0]
        assert indices.dtype == torch.long and values.shape == indices.shape == (expected.shape[0], 5)
        assert relative_error(values, expected.topk(5, dim=-1).values) <= RELATIVE
        assert torch.equal(torch.gather(got[0], -1, indices), values)


def test_a_dictionary_learning_autoencoder_reads_its_submodule(setup, tmp_path):
    model = setup.model
    state = sae_checks.write_dictionary_learning(tmp_path / "ae", model.hidden_size, 3 * model.hidden_size, layer=1)
    sae = from_dictionary_learning(tmp_path / "ae")
    assert (sae.value, sae.layer, sae.activation) == ("layer_output", 1, "relu")
    harvest = model.harvest(PROMPTS[:2], sae=sae, positions="all", progress=False)
    for index, prompt in enumerate(PROMPTS[:2]):
        stream = sae_checks.oracle_stream(setup.reference, setup.tokenizer, prompt)
        expected = torch.relu((stream - state["bias"]) @ state["encoder.weight"].T + state["encoder.bias"])
        assert relative_error(harvest["sae_features"][index][0], expected) <= RELATIVE
        # decode(encode(x)) in dictionary_learning's form: decoder(f) + bias
        assert relative_error(sae.decode(expected), expected @ state["decoder.weight"].T + state["bias"]) <= RELATIVE


def test_an_sae_for_another_site_or_width_is_refused_before_anything_runs(setup, tmp_path, checkpoints):
    model = setup.model
    wide = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size * 2, 16))
    with pytest.raises(ValueError, match=f"{model.hidden_size * 2} wide.*stream is {model.hidden_size}.*another model"):
        model.harvest(PROMPTS, sae=wide, progress=False)
    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 16))
    with pytest.raises(ValueError, match="reads layer_output at block 1.*edits layer_output at block 0"):
        bad = sae.clamp(3, 1.0)
        bad.layer = 0
        model.generate(PROMPTS[:1], max_tokens=1, steer=[bad], progress=False)
    far = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 16), value="layer_output", layer=40)
    with pytest.raises(ValueError, match="block 40.*3 blocks"):
        model.harvest(PROMPTS, sae=far, progress=False)
    with pytest.raises(IndexError, match="feature 16 is out of range"):
        sae.clamp(16, 1.0)
    gptj = streamscope.load(checkpoints("gptj"))
    mid = from_sae_lens(sae_checks.sae_lens_sae(gptj.hidden_size, 16), value="layer_mid", layer=1)
    with pytest.raises(Unavailable, match="parallel block"):
        gptj.harvest(PROMPTS, sae=mid, progress=False)


def test_steering_by_a_feature_adds_its_decoder_direction(setup):
    model = setup.model
    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 32))
    steer = sae.steer(feature=7, scale=5.0)
    direct = streamscope.Steer("layer_output", 1, sae.W_dec[7].clone(), scale=5.0)
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    by_feature = model.generate(PROMPTS, steer=[steer], **options)
    by_vector = model.generate(PROMPTS, steer=[direct], **options)
    for index in range(len(PROMPTS)):
        assert torch.equal(by_feature.logits[index], by_vector.logits[index])
    direction = sae.feature(7, model)
    assert direction.method == "sae_feature" and torch.equal(direction.vector, sae.W_dec[7])


def test_clamping_a_feature_in_the_loop_equals_plain_torch_and_an_unclamped_sae_changes_nothing(setup):
    model = setup.model
    original = sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size)
    dead = 0
    with torch.no_grad():
        original.b_enc[dead] = -1e4  # a feature that never fires, on any token
    sae = from_sae_lens(original)
    stream = sae_checks.oracle_stream(setup.reference, setup.tokenizer, PROMPTS[0])
    with torch.no_grad():
        features = original.encode(stream)
    active = int(features.mean(0).argmax())
    options = {"max_tokens": STEPS, "return_logits": True, "ignore_eos": True, "progress": False}
    plain = model.generate(PROMPTS, harvest={"values": "layer_output", "layers": [0]}, **options)
    for feature, value in ((active, 0.0), (active, 12.0)):
        clamped = model.generate(PROMPTS, steer=[sae.clamp(feature, value, positions="all")], **options)
        for index, prompt in enumerate(PROMPTS):
            ids = setup.tokenizer(prompt).input_ids
            sequence = ids + list(clamped.tokens[index][:-1])
            with torch.no_grad():
                expected = sae_checks.oracle_clamped_logits(setup.reference, sequence, 1, original.encode,
                                                            original.decode, feature, value)
            expected = expected[len(ids) - 1:len(ids) - 1 + STEPS]
            assert relative_error(clamped.logits[index], expected) <= RELATIVE, (feature, value, index)
            assert (clamped.logits[index] - plain.logits[index]).abs().max() > 1e-3
    # An SAE in the loop that changes no feature: the error term keeps the run as it was, bit for bit (the SAE's
    # reconstruction alone would not: decode(encode(x)) != x).
    unchanged = model.generate(PROMPTS, steer=[sae.clamp(dead, 0.0)], **options)
    for index in range(len(PROMPTS)):
        assert torch.equal(unchanged.logits[index], plain.logits[index])
    with torch.no_grad():
        assert (original.decode(features) - stream).abs().max() > 1e-2
    # In a trace, the same steer by Steer.apply.
    steer = sae.clamp(active, 12.0)
    with model.generate(PROMPTS[1], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False) as tracer:
        logits = list().save()
        for step in tracer.iter[:STEPS]:
            steer.apply(model, step)
            logits.append(model.logits[0, -1].clone())
    bulk = model.generate(PROMPTS[1:2], steer=[steer], batch_size=1, **options)
    assert relative_error(torch.stack(list(logits)), bulk.logits[0]) <= 1e-6


def test_sae_lens_trains_an_sae_on_a_harvest(setup, tmp_path):
    """A harvest written in SAELens's cached-activations layout, read by SAELens's ActivationsStore, trains a
    StandardTrainingSAE with SAELens's SAETrainer for 300 steps from random init; the trained SAE then runs on
    the map: its features harvested in the engine equal its own encode on the oracle's values."""
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore

    model = setup.model
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (64,), generator=generator).tolist() for _ in range(48)]
    context = 16
    folder = streamscope.sae.harvest_for_sae_lens(model, prompts, tmp_path / "cache", HOOK, context, progress=False)
    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=HOOK, hook_head_index=None,
                             context_size=context, d_in=model.hidden_size, n_batches_in_buffer=4,
                             total_training_tokens=48 * 64, store_batch_size_prompts=8, train_batch_size_tokens=32,
                             prepend_bos=False, normalize_activations="none", device=torch.device("cpu"),
                             dtype="float32", cached_activations_path=str(folder))
    first = next(iter(store))
    assert first.shape == (32, model.hidden_size)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=model.hidden_size, d_sae=2 * model.hidden_size,
                                                        l1_coefficient=1e-3))
    steps = 300
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=steps * 32, train_batch_size_samples=32, lr=3e-3,
                                          lr_end=3e-3,
                                          n_batches_for_norm_estimate=4), sae, store)
    harvest = model.harvest(PROMPTS, "layer_output", layers=[1], positions="all", progress=False)
    sample = torch.cat([tensor[0] for tensor in harvest["layer_output"]])
    with torch.no_grad():
        before = (sae.decode(sae.encode(sample)) - sample).pow(2).sum(-1).mean() / sample.pow(2).sum(-1).mean()
    trained = trainer.fit()
    assert trainer.n_training_steps == steps
    with torch.no_grad():
        after = (trained.decode(trained.encode(sample)) - sample).pow(2).sum(-1).mean() / sample.pow(2).sum(-1).mean()
    assert after < 0.5 * before and after < 0.2, (float(before), float(after))
    loaded = from_sae_lens(trained, value="layer_output", layer=1)
    features = model.harvest(PROMPTS[:1], sae=loaded, positions="all", progress=False)["sae_features"][0][0]
    with torch.no_grad():
        expected = trained.encode(sae_checks.oracle_stream(setup.reference, setup.tokenizer, PROMPTS[0]))
    assert relative_error(features, expected) <= RELATIVE
