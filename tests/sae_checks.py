"""SAEs built with SAELens itself (and dictionary_learning's file format), and plain-torch references on the oracle.

The SAEs are random (no hub): SAELens's own classes make them and SAELens's
own `encode` is the reference for their features, applied to transformers'
float32 values read with torch hooks (tests/oracle.py).
"""

from __future__ import annotations

import json

import torch

import oracle

HOOK = "blocks.1.hook_resid_post"
PROMPTS = ["Once upon a time there was a cat", "Rome is in Italy, Berlin is in Germany", "def add(a, b): return a"]


def sae_lens_sae(width: int, features: int, architecture: str = "standard", seed: int = 0, k: int = 8):
    """A random SAELens SAE on `HOOK` (weights scaled so that a fair share of features fire)."""
    from sae_lens import StandardSAE, StandardSAEConfig, TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(seed)
    metadata = SAEMetadata(hook_name=HOOK, model_name="tiny-llama")
    if architecture == "topk":
        sae = TopKSAE(TopKSAEConfig(d_in=width, d_sae=features, k=k, metadata=metadata))
    else:
        sae = StandardSAE(StandardSAEConfig(d_in=width, d_sae=features, metadata=metadata))
    with torch.no_grad():
        sae.W_enc.copy_(torch.randn(width, features) / width ** 0.5)
        sae.W_dec.copy_(torch.randn(features, width) / features ** 0.5)
        sae.b_enc.copy_(torch.randn(features) * 0.1)
        sae.b_dec.copy_(torch.randn(width) * 0.1)
    return sae.eval()


def write_dictionary_learning(folder, width: int, features: int, layer: int, seed: int = 1) -> dict:
    """An AutoEncoder as dictionary_learning saves one: ``ae.pt`` (its state dict) and ``config.json``."""
    generator = torch.Generator().manual_seed(seed)
    state = {"encoder.weight": torch.randn(features, width, generator=generator) / width ** 0.5,
             "encoder.bias": torch.randn(features, generator=generator) * 0.1,
             "decoder.weight": torch.randn(width, features, generator=generator) / features ** 0.5,
             "bias": torch.randn(width, generator=generator) * 0.1}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "ae.pt")
    (folder / "config.json").write_text(json.dumps({"trainer": {
        "dict_class": "AutoEncoder", "activation_dim": width, "dict_size": features, "layer": layer,
        "lm_name": "tiny-llama", "submodule_name": f"resid_post_layer_{layer}"}}))
    return state


def oracle_stream(reference, tokenizer, prompt: str, block: int = 1) -> torch.Tensor:
    """The oracle's layer_output of `block`, ``[tokens, hidden]``."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return oracle.values(reference, "llama", ids)["layer_output"][block][0]


@torch.no_grad()
def oracle_clamped_logits(reference, ids: list[int], block: int, encode, decode, feature: int, value: float):
    """The oracle's logits with block `block`'s output replaced by decode(f') + (x - decode(f)) at every position,
    f = encode(x) and f' = f with feature `feature` set to `value`: an SAE in the loop, in plain torch."""
    layer = reference.model.layers[block]

    def hook(_, args, output):
        stream = output[0] if isinstance(output, tuple) else output
        features = encode(stream)
        clamped = features.clone()
        clamped[..., feature] = value
        stream.copy_(decode(clamped) + (stream - decode(features)))

    handle = layer.register_forward_hook(hook)
    try:
        return reference(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
