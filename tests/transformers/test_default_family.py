"""The default family, for a model type with no module, against the oracle.

Checkpoints of known families are loaded with ``family="default"``, as a model
type streamscope has no module for would be: what the default maps must equal
transformers' own values, and what it cannot map must be named in the warning
at load and be unavailable with the reason `support()` gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import oracle
from access import relative_error, row, value_of
import attention_oracle
import streamscope
from streamscope.transformers.families import default

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
RELATIVE = 1e-5
NAMES = (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS)


class Defaulted:
    """A family's tiny checkpoint loaded with the default family, and the oracle's values for it."""

    def __init__(self, family: str, path, family_override=default):
        self.name = family
        with pytest.warns(UserWarning, match="default family reads this") as record:
            self.model = streamscope.load(path, family=family_override)
        self.warning = next(str(w.message) for w in record if "default family reads" in str(w.message))
        self.reference = attention_oracle.reference_model(path)
        self.input_ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
        self.expected = oracle.values(self.reference, family, self.input_ids)
        self.support = self.model.support()

    def computed(self, name: str, block):
        found = self.expected.get(name)
        return found is not None and (block is None or found[block] is not None)

    def served(self, name: str, block) -> bool:
        return block is None or row(self.support, name, block) is None

    def read_served(self):
        """Every value the oracle computed that the default serves, read in the order the model computes them."""
        saved = {}
        with self.model.trace(PROMPT):
            for name, block in self.expected["order"]:
                if (name, block) not in saved and self.served(name, block):
                    saved[(name, block)] = value_of(self.model, name, block).save()
        return saved


@pytest.fixture(scope="module", params=["llama", "gpt2", "gpt_neox", "gptj", "mamba"])
def defaulted(request, checkpoints):
    return Defaulted(request.param, checkpoints(request.param))


def test_what_the_default_serves_equals_the_oracle(defaulted):
    saved = defaulted.read_served()
    assert ("layer_output", 0) in saved and ("logits", None) in saved
    for (name, block), value in saved.items():
        assert defaulted.computed(name, block), (name, block)
        reference = defaulted.expected[name] if block is None else defaulted.expected[name][block]
        assert value.shape == reference.shape, (name, block)
        assert relative_error(value, reference) <= RELATIVE, (name, block, relative_error(value, reference))


def test_what_the_default_does_not_serve_is_unavailable_with_the_reason_support_gives(defaulted):
    assert defaulted.support.root.served() == ["token_embeddings", "final_norm_output", "logits", "prompt_logits"]
    for block in range(defaulted.model.num_layers):
        for name in NAMES:
            reason = row(defaulted.support, name, block)
            if reason is None:
                continue
            with pytest.raises(streamscope.Unavailable) as raised:
                with defaulted.model.trace(PROMPT):
                    value_of(defaulted.model, name, block).save()
            assert raised.value.reason == reason, (name, block)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_on_a_llama_like_tree_the_default_serves_everything_the_oracle_computes(checkpoints, family):
    defaulted = Defaulted(family, checkpoints(family))
    for block in range(defaulted.model.num_layers):
        for name in NAMES:
            assert defaulted.served(name, block) == defaulted.computed(name, block), (name, block)
    assert "Could not map" not in defaulted.warning


def test_the_warning_names_what_was_not_mapped(checkpoints):
    mamba = Defaulted("mamba", checkpoints("mamba"))
    assert "'mamba'" in mamba.warning
    for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert f"{name} on every block" in mamba.warning
    assert "norm, mixer" in mamba.warning  # the block's own modules, which the default does not read
    assert row(mamba.support, "attention_norm_output", 0) == "no input_layernorm module on this block"
    assert row(mamba.support, "mlp_output", 0) == "no mlp module on this block"


def test_an_edit_and_skip_match_the_oracle(defaulted):
    block = 1
    vector = torch.linspace(-1.0, 1.0, defaulted.model.hidden_size)
    expected_vector = torch.zeros(defaulted.input_ids.shape[1], defaulted.model.hidden_size)
    expected_vector[-1] = vector
    with defaulted.model.trace(PROMPT):
        defaulted.model.layers[block].layer_input[:, -1] += vector
        logits = defaulted.model.logits.save()
    expected = oracle.logits_with_addition(defaulted.reference, defaulted.name, defaulted.input_ids,
                                           "layer_input", block, expected_vector)
    assert relative_error(logits, expected) <= RELATIVE
    with defaulted.model.trace(PROMPT):  # a tuple block (GPT-J) gets its stream packed as it returns it
        layer = defaulted.model.layers[block]
        layer.skip(layer.layer_input)
        logits = defaulted.model.logits.save()
    expected = oracle.logits_with_identity_block(defaulted.reference, defaulted.name, defaulted.input_ids, block)
    assert relative_error(logits, expected) <= RELATIVE


def test_a_family_may_be_named_by_model_type(checkpoints):
    path = checkpoints("llama")
    with pytest.warns(UserWarning, match="The default family reads this 'llama' model, as asked"):
        model = streamscope.load(path, family="default")
    assert model.family is default
    assert streamscope.load(path).family.__name__.endswith(".llama")
