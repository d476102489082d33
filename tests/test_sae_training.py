"""`streamscope.sae.train` on transformers: a harvest, SAELens's own trainer, and a folder SAELens loads back.

References: SAELens's own `SAE.load_from_disk` of the folder `train` wrote
(its `encode` on the oracle's float32 values, tests/oracle.py), the
activations SAELens trained on (the cached-activations folder) against the
oracle's values, and a fresh SAE of the same seed for what training bought.
The vLLM engine's run of the same path is in tests/vllm/test_sae_examples.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import oracle
import sae_checks
from access import relative_error
from sae_checks import HOOK, PROMPTS
import streamscope

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)
from sae_lens import SAE as SaeLensSAE
from sae_lens.saes.sae import get_sae_training_class

RELATIVE = 1e-5
CONTEXT = 16


class Setup:
    def __init__(self, checkpoints):
        self.path = checkpoints("llama")
        self.model = streamscope.load(self.path)
        self.reference = attention_oracle.reference_model(self.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        generator = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(3, self.model.vocab_size, (64,), generator=generator).tolist()
                        for _ in range(48)]


@pytest.fixture(scope="module")
def setup(checkpoints):
    return Setup(checkpoints)


def unexplained(encode, decode, streams: list[torch.Tensor]) -> float:
    """The fraction of the streams' variance the reconstruction leaves."""
    sample = torch.cat(streams)
    with torch.no_grad():
        error = (decode(encode(sample)) - sample).pow(2).sum()
    return float(error / (sample - sample.mean(0)).pow(2).sum())


@pytest.mark.parametrize("architecture,options", [("standard", {"l1_coefficient": 1e-3}), ("topk", {"k": 8})])
def test_train_writes_a_folder_sae_lens_loads_and_the_engine_runs(setup, tmp_path, architecture, options):
    import datasets

    model = setup.model
    out, cache = tmp_path / "sae", tmp_path / "cache"
    sae = streamscope.sae.train(model, setup.prompts, HOOK, out, d_sae=2 * model.hidden_size,
                                architecture=architecture, steps=300, batch_size=32, context_size=CONTEXT, lr=3e-3,
                                cache=cache, progress=False, **options)
    assert sorted(path.name for path in out.iterdir()) == ["cfg.json", "sae_weights.safetensors",
                                                          "sparsity.safetensors"]
    reference = SaeLensSAE.load_from_disk(str(out))
    assert reference.cfg.metadata.hook_name == HOOK and reference.cfg.metadata.model_name == str(setup.path)
    assert (sae.value, sae.layer, sae.d_sae) == ("layer_output", 1, 2 * model.hidden_size)
    assert sae.activation == ("relu" if architecture == "standard" else "topk")
    # What SAELens trained on: each prompt's block-1 output, cut into contexts of CONTEXT tokens.
    rows = datasets.load_from_disk(str(cache)).with_format("torch")
    assert len(rows) == 48 * 64 // CONTEXT
    for index in (0, 47):
        ids = torch.tensor([setup.prompts[index]])
        stream = oracle.values(setup.reference, "llama", ids)["layer_output"][1][0]
        cached = torch.cat([rows[4 * index + part][HOOK] for part in range(64 // CONTEXT)])
        assert relative_error(cached, stream) <= RELATIVE, index
        assert rows[4 * index]["token_ids"].tolist() == setup.prompts[index][:CONTEXT]
    # The SAE on the map: its features in the engine equal SAELens's own loading of the folder, on the oracle.
    harvest = model.harvest(PROMPTS, sae=sae, positions="all", progress=False)
    streams = [sae_checks.oracle_stream(setup.reference, setup.tokenizer, prompt) for prompt in PROMPTS]
    for index, stream in enumerate(streams):
        with torch.no_grad():
            expected = reference.encode(stream)
        assert relative_error(harvest["sae_features"][index][0], expected) <= RELATIVE, index
    # Training bought something: against a fresh SAE of the same seed (train's starting point).
    classes = get_sae_training_class(architecture)
    torch.manual_seed(0)
    fresh = classes[0](classes[1](d_in=model.hidden_size, d_sae=2 * model.hidden_size, **options))
    before = unexplained(fresh.encode, fresh.decode, streams)
    after = unexplained(sae.encode, sae.decode, streams)
    assert after < 0.5 * before, (before, after)
    from safetensors.torch import load_file

    assert sae.log_sparsity is not None and sae.log_sparsity.shape == (sae.d_sae,)
    assert torch.equal(sae.log_sparsity, load_file(str(out / "sparsity.safetensors"))["sparsity"])


def test_train_refuses_what_it_cannot_do_before_anything_runs(setup, tmp_path):
    model = setup.model
    with pytest.raises(ValueError, match="architecture='gated'.*standard, topk, jumprelu, batchtopk"):
        streamscope.sae.train(model, setup.prompts, HOOK, tmp_path / "a", d_sae=16, architecture="gated")
    with pytest.raises(ValueError, match="attn.hook_q.*reads no value of the residual stream's width"):
        streamscope.sae.train(model, setup.prompts, "blocks.1.attn.hook_q", tmp_path / "b", d_sae=16)
    with pytest.raises(ValueError, match="context_size=65: no prompt has that many tokens"):
        streamscope.sae.train(model, setup.prompts, HOOK, tmp_path / "c", d_sae=16, context_size=65)
    with pytest.raises(ValueError, match="less than one batch of 4096"):
        streamscope.sae.train(model, setup.prompts[:2], HOOK, tmp_path / "d", d_sae=16)
    with pytest.raises(ValueError, match="less than one batch of 4096"):  # steps= asks for more than the cache holds
        streamscope.sae.train(model, setup.prompts[:2], HOOK, tmp_path / "d", d_sae=16, steps=20)
    assert not any((tmp_path / name).exists() for name in "abcd")
