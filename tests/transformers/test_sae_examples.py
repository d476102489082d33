"""Top-activating SAE examples on transformers, per family: held to a brute force over the harvested features
(themselves held to SAELens's `encode` on the oracle's float32 values), and the page in headless Chromium."""

from __future__ import annotations

import pytest

import sae_checks
import sae_examples_checks
import bulk_engines
from bulk_checks import BULK_FAMILIES, PROMPTS
import streamscope
from streamscope.sae import from_sae_lens

import sae_lens  # noqa: F401  (the test extra installs it: a missing install fails here)


engine = bulk_engines.fixture("transformers", BULK_FAMILIES)


def test_top_examples_equal_a_brute_force_over_the_harvested_features(engine):
    sae_examples_checks.check_top_examples(engine.model, engine.reference, engine.tokenizer, engine.family, batch_size=1)


def test_bad_requests_are_refused_with_the_fix(engine):
    sae_examples_checks.check_refusals(engine.model)


def test_the_examples_table_rows_and_view(engine, tmp_path):
    model = engine.model
    sae = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size))
    dead = from_sae_lens(sae_checks.sae_lens_sae(model.hidden_size, 4 * model.hidden_size))
    dead.b_enc[1] = -1e4  # a feature that never fires
    examples = streamscope.sae.top_examples(model, PROMPTS, dead, features=[1, 7, 9], k=3)
    assert examples[1] == [] and "never fires" in examples.table()
    assert len(examples[7]) == 3 and len(examples.rows) == len(examples[7]) + len(examples[9])
    first = examples.rows[0]
    assert (first["feature"], first["rank"], first["activation"]) == (7, 0, examples[7][0].activation)
    assert first["before"] + first["token"] + first["after"] == "".join(examples[7][0].tokens)
    assert list(examples.to_pandas()["activation"]) == [row["activation"] for row in examples.rows]
    assert "<table>" in examples._repr_html_() and "FeatureExamples(3 features" in repr(examples)
    with pytest.raises(KeyError, match="feature 4 was not asked for"):
        examples[4]
    sae_examples_checks.check_view(streamscope.sae.top_examples(model, PROMPTS, sae, features=[3, 0], k=4),
                                   tmp_path / "features.html")
