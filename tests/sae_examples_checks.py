"""Top-activating SAE examples held to a brute force, and SAE folders held to SAELens's own loading, on either engine.

The brute force ranks every (prompt, position) of a dense harvest of the
whole SAE's features (the features themselves held to SAELens's `encode` on
the oracle's float32 values, tests/oracle.py) with the documented order:
largest activation first, ties by the earlier prompt, then position; only
activations > 0; special tokens left out where asked.
"""

from __future__ import annotations

import torch

import oracle
import precision
import sae_checks
from access import relative_error
from bulk_checks import PROMPTS, RELATIVE
from streamscope.display import token

#: The prompts: the bulk checks' own, one of them twice (bit-equal activations: the tie-break is exercised).
EXAMPLE_PROMPTS = [*PROMPTS, PROMPTS[0]]


def brute_force(features: list[torch.Tensor], ids: list[list[int]], chosen: list[int], k: int,
                special: set[int]) -> dict[int, list[tuple[float, int, int]]]:
    """{feature: [(activation, prompt, position), ...]}: the k largest positive activations, in the documented order."""
    found = {}
    for feature in chosen:
        candidates = [(float(features[prompt][position, feature]), prompt, position)
                      for prompt in range(len(ids)) for position in range(len(ids[prompt]))
                      if ids[prompt][position] not in special and float(features[prompt][position, feature]) > 0]
        found[feature] = sorted(candidates, key=lambda entry: (-entry[0], entry[1], entry[2]))[:k]
    return found


def dense_features(model, reference, tokenizer, family: str, original, prompts, **options) -> list[torch.Tensor]:
    """The whole SAE's features per prompt ``[positions, d_sae]``, harvested in the engine, each held to SAELens's
    `encode` on the oracle's block-1 output."""
    from streamscope.sae import from_sae_lens

    harvested = model.harvest(prompts, sae=from_sae_lens(original), positions="all", progress=False,
                              **options)["sae_features"]
    features = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        stream = oracle.values(reference, family, ids)["layer_output"][1][0]
        with torch.no_grad():
            expected = original.encode(stream)
        assert relative_error(harvested[index][0], expected) <= RELATIVE, (family, index)
        features.append(harvested[index][0].float())
    return features


def check_examples(examples, expected: dict, features: list[torch.Tensor], ids: list[list[int]], tokenizer,
                   context: tuple[int, int], exact: bool) -> None:
    """`examples` against the brute force `expected`: the same places in the same order where `exact` (the same
    computation, bit-equal on the CPU), else the same activations to `RELATIVE`; and each example's window."""
    assert examples.features == list(expected)
    for feature, wanted in expected.items():
        got = examples[feature]
        assert [example.rank for example in got] == list(range(len(got)))
        assert len(got) == len(wanted), (feature, len(got), len(wanted))
        if not wanted:
            continue
        scale = max(abs(entry[0]) for entry in wanted)
        if exact:
            assert [(e.activation, e.prompt, e.position) for e in got] == wanted, feature
        else:
            shown = torch.tensor([e.activation for e in got])
            assert (shown - torch.tensor([entry[0] for entry in wanted])).abs().max() <= RELATIVE * scale, feature
        for example in got:
            prompt, position = example.prompt, example.position
            assert abs(example.activation - float(features[prompt][position, feature])) <= RELATIVE * scale
            start, stop = max(0, position - context[0]), min(len(ids[prompt]), position + context[1] + 1)
            assert (example.start, example.ids) == (start, ids[prompt][start:stop])
            assert example.tokens == [tokenizer.decode([token_id]) for token_id in ids[prompt][start:stop]]
            assert example.token == tokenizer.decode([ids[prompt][position]])
            window = features[prompt][start:stop, feature]
            assert relative_error(torch.tensor(example.activations), window) <= RELATIVE or (
                window.abs().max() == 0 and max(map(abs, example.activations)) == 0)


def check_top_examples(model, reference, tokenizer, family: str, **options) -> None:
    """`top_examples` of a ReLU SAE (every feature; a few, computed alone) and of a top-k SAE, to the brute force.

    With `options` that run each prompt alone (transformers' ``batch_size=1``) every harvest computes the same,
    bit for bit on the CPU, and the examples must be the brute force's exactly, ties included; otherwise (vLLM's
    batches of other sizes) their activations to `RELATIVE`."""
    import streamscope
    from streamscope.sae import from_sae_lens

    ids = [tokenizer(prompt).input_ids for prompt in EXAMPLE_PROMPTS]
    special = set(tokenizer.all_special_ids)
    exact = bool(options) and not precision.ON_GPU
    for architecture in ("standard", "topk"):
        original = sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size, architecture)
        sae = from_sae_lens(original)
        features = dense_features(model, reference, tokenizer, family, original, EXAMPLE_PROMPTS, **options)
        # every feature, the prompts in chunks of two (a chunk boundary inside the repeated prompts' ties)
        every = streamscope.sae.top_examples(model, EXAMPLE_PROMPTS, sae, k=3, chunk=2, **options)
        check_examples(every, brute_force(features, ids, list(range(sae.d_sae)), 3, special), features, ids,
                       tokenizer, (8, 4), exact)
        # a few features (a ReLU SAE computes just those), special tokens kept, another window
        chosen = [5, 0, 2 * model.hidden_size + 1]
        few = streamscope.sae.top_examples(model, EXAMPLE_PROMPTS, sae, features=chosen, k=4, context=(2, 0),
                                           skip_special_tokens=False, **options)
        check_examples(few, brute_force(features, ids, chosen, 4, set()), features, ids, tokenizer, (2, 0),
                       exact and architecture == "topk")


def check_refusals(model) -> None:
    import pytest

    import streamscope
    from streamscope.sae import from_sae_lens

    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 16))
    with pytest.raises(IndexError, match="feature 16 is out of range.*0-15"):
        streamscope.sae.top_examples(model, PROMPTS, sae, features=[16])
    with pytest.raises(ValueError, match="names a feature twice"):
        streamscope.sae.top_examples(model, PROMPTS, sae, features=[3, 3])
    with pytest.raises(ValueError, match="k=0"):
        streamscope.sae.top_examples(model, PROMPTS, sae, features=3, k=0)
    with pytest.raises(ValueError, match="context="):
        streamscope.sae.top_examples(model, PROMPTS, sae, features=3, context=(-1, 2))
    with pytest.raises(TypeError, match="not a StandardSAE: load it with streamscope.sae.from_sae_lens"):
        streamscope.sae.top_examples(model, PROMPTS, sae_checks.sae_lens_sae(model.hidden_size, 16))
    wide = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size * 2, 16))
    with pytest.raises(ValueError, match="another model"):
        streamscope.sae.top_examples(model, PROMPTS, wide)


def check_view(examples, path) -> None:
    """The page in headless Chromium: per feature its examples in rank order; hovering an example's own token
    shows its activation (three decimals) and token; the page asks for nothing but its own file."""
    from browser import page_of

    examples.view(path)
    with page_of(path) as (page, requests):
        for feature in examples.features:
            shown = page.locator(f"section[data-feature='{feature}'] .example")
            assert shown.count() == len(examples[feature])
            ranks = [int(rank) for rank in
                     page.eval_on_selector_all(f"section[data-feature='{feature}'] .example",
                                               "els => els.map(el => el.dataset.rank)")]
            assert ranks == list(range(len(examples[feature])))
            for rank, example in enumerate(examples[feature]):
                row = page.locator(f"section[data-feature='{feature}'] .example[data-rank='{rank}']")
                row.locator(".tok.active").hover()
                assert page.text_content("#feature") == str(feature)
                assert page.text_content("#position") == str(example.position)
                assert page.text_content("#token") == token(example.token)
                assert abs(float(page.text_content("#activation")) - example.activation) <= 5e-4 + 1e-6
                texts = row.locator(".tok").all_text_contents()
                assert texts == [token(text) for text in example.tokens]
        assert all(url.startswith("file://") for url in requests), requests
