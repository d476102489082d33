"""SAELens SAEs from folders, in the layouts SAELens writes and releases are downloaded in, on transformers.

Every folder here is written by SAELens's own code (`save_model`,
`save_inference_model`, its trainer's `save_checkpoint`), except the pre-6.0
configs, which no installed SAELens writes any more: those are the flat
configs of SAELens 5 releases (keys as in e.g. the gpt2-small-res-jb
release), written beside weights SAELens saved. The reference in every case is
SAELens 6 itself: `SAE.load_from_disk` of the same folder (which converts a
pre-6.0 config its own way), its `encode` on the oracle's float32 values
(tests/oracle.py) and its `decode`; and SAELens's own release reader for the
sparsity.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import sae_checks
from access import relative_error
from sae_checks import HOOK, PROMPTS
import streamscope
from streamscope.sae import from_sae_lens, sae_lens_folders

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)
from sae_lens import SAE as SaeLensSAE
from sae_lens.saes.sae import SAEMetadata, get_sae_class, get_sae_training_class

RELATIVE = 1e-5


class Setup:
    def __init__(self, checkpoints):
        self.path = checkpoints("llama")
        self.model = streamscope.load(self.path)
        self.reference = attention_oracle.reference_model(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)


@pytest.fixture(scope="module")
def setup(checkpoints):
    return Setup(checkpoints)


def randomized(sae, seed: int = 0):
    """`sae` (any SAELens class) with random weights of uneven decoder norms, so that folds and thresholds matter."""
    generator = torch.Generator().manual_seed(seed)
    d_in, d_sae = sae.W_enc.shape
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5)
        scales = torch.rand(d_sae, 1, generator=generator) * 2 + 0.2
        sae.W_dec.copy_(torch.randn(d_sae, d_in, generator=generator) / d_in ** 0.5 * scales)
        sae.b_enc.copy_(torch.randn(d_sae, generator=generator) * 0.1)
        sae.b_dec.copy_(torch.randn(d_in, generator=generator) * 0.1)
        for name in ("threshold", "log_threshold"):
            if hasattr(sae, name):
                value = torch.rand(d_sae, generator=generator) * 0.3
                getattr(sae, name).copy_(value if name == "threshold" else value.log())
    return sae


def inference_sae(architecture: str, width: int, **options):
    classes = get_sae_class(architecture)
    metadata = SAEMetadata(hook_name=HOOK, model_name="tiny-llama")
    return randomized(classes[0](classes[1](d_in=width, d_sae=4 * width, metadata=metadata, **options)))


def training_sae(architecture: str, width: int, **options):
    classes = get_sae_training_class(architecture)
    metadata = SAEMetadata(hook_name=HOOK, model_name="tiny-llama")
    return randomized(classes[0](classes[1](d_in=width, d_sae=4 * width, metadata=metadata, **options)))


def check_against_sae_lens(setup, folder, expected_activation: str) -> None:
    """The folder's SAE on the map: its features harvested in the engine equal SAELens's own loading of the
    folder, encoding the oracle's values; its decode equals SAELens's."""
    model = setup.model
    sae = from_sae_lens(folder)
    reference = SaeLensSAE.load_from_disk(str(folder))
    assert (sae.value, sae.layer, sae.activation) == ("layer_output", 1, expected_activation)
    harvest = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)
    for index, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = reference.encode(sae_checks.oracle_stream(setup.reference, setup.tokenizer, prompt))
            got = harvest["sae_features"][index][0]
            assert (expected > 0).any()
            assert relative_error(got, expected) <= RELATIVE, (folder, index)
            assert relative_error(sae.decode(expected), reference.decode(expected)) <= RELATIVE


@pytest.mark.parametrize("architecture,options", [("standard", {}), ("jumprelu", {}), ("topk", {"k": 6}),
                                                  ("topk", {"k": 6, "rescale_acts_by_decoder_norm": True})],
                         ids=["standard", "jumprelu", "topk", "topk-rescaled"])
def test_an_inference_sae_saved_by_sae_lens_and_as_an_object(setup, tmp_path, architecture, options):
    original = inference_sae(architecture, setup.model.hidden_size, **options)
    original.save_model(tmp_path / "sae")
    check_against_sae_lens(setup, tmp_path / "sae", {"standard": "relu"}.get(architecture, architecture))
    # The object itself (what SAE.from_pretrained returns for any release SAELens converts): the same SAE.
    direct, loaded = from_sae_lens(original), from_sae_lens(tmp_path / "sae")
    for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold"):
        assert (getattr(direct, name) is None and getattr(loaded, name) is None) or torch.equal(
            getattr(direct, name), getattr(loaded, name)), name
    assert (direct.activation, direct.k, direct.value, direct.layer) == (loaded.activation, loaded.k, "layer_output", 1)


@pytest.mark.parametrize("architecture,options,activation", [
    ("standard", {}, "relu"), ("jumprelu", {}, "jumprelu"), ("topk", {"k": 6}, "topk"),
    ("batchtopk", {"k": 6}, "jumprelu")])
def test_a_training_sae_saved_for_inference_and_as_a_training_sae_object(setup, tmp_path, architecture, options,
                                                                        activation):
    # SAELens's own top-k training SAE ranks by decoder norm (rescale_acts_by_decoder_norm defaults on): folded.
    trained = training_sae(architecture, setup.model.hidden_size, **options)
    trained.save_inference_model(tmp_path / "sae")
    check_against_sae_lens(setup, tmp_path / "sae", activation)
    # The object itself, as SAETrainer.fit returns it: what it would save for inference.
    direct = from_sae_lens(trained)
    loaded = from_sae_lens(tmp_path / "sae")
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(direct, name), getattr(loaded, name)), name
    assert direct.activation == activation


def release(root, setup, architectures=("standard", "jumprelu")):
    """A release as SAELens's trainer checkpoints lay it out: one folder per SAE id, each with its sparsity."""
    from sae_lens import SAETrainer
    from sae_lens.config import SAETrainerConfig

    saes = {}
    for layer, architecture in enumerate(architectures):
        classes = get_sae_training_class(architecture)
        metadata = SAEMetadata(hook_name=f"blocks.{layer}.hook_resid_post", model_name="tiny-llama")
        sae = randomized(classes[0](classes[1](d_in=setup.model.hidden_size, d_sae=64, metadata=metadata)), layer)
        trainer = SAETrainer(SAETrainerConfig(total_training_samples=64, train_batch_size_samples=32, lr_end=3e-4),
                             sae, iter([]))
        trainer.act_freq_scores = torch.arange(64, dtype=torch.float32)  # feature i fired i times in 100 samples
        trainer.n_frac_active_samples = 100
        trainer.save_checkpoint(f"blocks.{layer}.hook_resid_post", base_path=root)
        saes[f"blocks.{layer}.hook_resid_post"] = sae
    return saes


def test_a_release_folder_of_several_saes_with_their_sparsity(setup, tmp_path, monkeypatch):
    import sae_lens.loading.pretrained_sae_loaders as loaders

    root = tmp_path / "release"
    release(root, setup)
    assert list(sae_lens_folders(root)) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    with pytest.raises(FileNotFoundError, match="holds 2 SAELens SAEs.*sae_id=.*'blocks.0.hook_resid_post'"):
        from_sae_lens(root)
    with pytest.raises(FileNotFoundError, match="no SAE 'blocks.7.hook_resid_post' in it"):
        from_sae_lens(root, sae_id="blocks.7.hook_resid_post")
    check_against_sae_lens(setup, root / "blocks.1.hook_resid_post", "jumprelu")
    # SAELens's own reader of a release's SAE (from_pretrained's), pointed at this folder instead of the hub.
    monkeypatch.setattr(loaders, "hf_hub_download", lambda repo_id, filename, **_: str(root / filename))
    for sae_id in sae_lens_folders(root):
        config, weights, log_sparsity = loaders.sae_lens_huggingface_loader("local/release", sae_id)
        sae = from_sae_lens(root, sae_id=sae_id)
        assert (sae.value, sae.layer) == ("layer_output", int(sae_id.split(".")[1]))
        assert sae.log_sparsity is not None and torch.equal(sae.log_sparsity, log_sparsity)
        assert torch.allclose(10 ** sae.log_sparsity[1:], torch.arange(1, 64) / 100, rtol=1e-5)
        assert torch.equal(sae.W_enc, weights["W_enc"]) and torch.equal(sae.b_dec, weights["b_dec"])
        assert sae.source["model"] == config["metadata"]["model_name"] == "tiny-llama"
        assert sae.to(torch.float64).log_sparsity is sae.log_sparsity  # carried along, not a weight


#: A SAELens 5 release's flat config (the gpt2-small-res-jb release's keys), for this model's width and hook.
PRE_6_CONFIG = {"model_name": "tiny-llama", "hook_point": HOOK, "hook_point_layer": 1, "hook_point_head_index": None,
                "dataset_path": "Skylion007/openwebtext", "is_dataset_tokenized": False, "context_size": 128,
                "use_cached_activations": False, "d_in": 64, "d_sae": 256, "b_dec_init_method": "geometric_median",
                "expansion_factor": 4, "activation_fn_str": "relu", "apply_b_dec_to_input": True,
                "l1_coefficient": 8e-05, "lr": 0.0004, "train_batch_size": 4096, "device": "cpu", "seed": 42,
                "dtype": "torch.float32", "prepend_bos": True, "normalize_activations": False,
                "finetuning_scaling_factor": False, "sae_lens_training_version": "3.13.0"}


@pytest.mark.parametrize("kind", ["relu", "topk", "unit-scaling-factor"])
def test_a_release_in_sae_lens_5s_flat_config(setup, tmp_path, kind):
    from safetensors.torch import load_file, save_file

    width = setup.model.hidden_size
    folder = tmp_path / "sae"
    architecture = "topk" if kind == "topk" else "standard"
    inference_sae(architecture, width, **({"k": 6} if kind == "topk" else {})).save_model(folder)
    config = {**PRE_6_CONFIG, "d_in": width, "d_sae": 4 * width}
    if kind == "topk":
        config.update(activation_fn_str="topk", activation_fn_kwargs={"k": 6})
    if kind == "unit-scaling-factor":  # SAELens 4 saved a scaling factor of ones beside the weights
        weights = load_file(str(folder / "sae_weights.safetensors"))
        save_file({**weights, "scaling_factor": torch.ones(4 * width)}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(config))
    check_against_sae_lens(setup, folder, "topk" if kind == "topk" else "relu")
    assert from_sae_lens(folder).source["hook_name"] == HOOK


def test_what_streamscope_cannot_run_is_refused_with_the_reason(setup, tmp_path):
    width = setup.model.hidden_size
    gated = get_sae_class("gated")
    gated[0](gated[1](d_in=width, d_sae=4 * width, metadata=SAEMetadata(hook_name=HOOK))).save_model(tmp_path / "gated")
    with pytest.raises(ValueError, match="architecture 'gated'.*standard, jumprelu and topk"):
        from_sae_lens(tmp_path / "gated")
    inference_sae("standard", width, normalize_activations="expected_average_only_in").save_model(tmp_path / "norm")
    with pytest.raises(ValueError, match="normalizes its input.*normalize_activations='none'"):
        from_sae_lens(tmp_path / "norm")
    config = {**PRE_6_CONFIG, "d_in": width, "d_sae": 4 * width, "activation_fn_str": "tanh-relu"}
    inference_sae("standard", width).save_model(tmp_path / "tanh")
    (tmp_path / "tanh" / "cfg.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation 'tanh-relu'"):
        from_sae_lens(tmp_path / "tanh")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "cfg.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no sae_weights.safetensors.*download is incomplete"):
        from_sae_lens(tmp_path / "partial")
    with pytest.raises(FileNotFoundError, match="holds no SAELens SAE"):
        from_sae_lens(tmp_path / "nothing-here")
    with pytest.raises(TypeError, match="sae_id= names an SAE's folder"):
        from_sae_lens(inference_sae("standard", width), sae_id="x")
