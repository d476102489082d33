"""Every family on transformers against the oracle: transformers' own forward read with torch hooks.

For each family's tiny checkpoint: every served value equals the oracle's
tensor, the stream identity holds, reads change nothing, edits match the
oracle's hooked edits, skip matches an identity block, and every value the
block cannot serve says why, the same way in `support()`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
from access import relative_error, set_value, value_of
import streamscope
from streamscope.testing import FAMILIES

PROMPT = "The Eiffel Tower is in Paris, and the quick brown fox"
RELATIVE = 1e-5  # float32 on CPU: the same ops in the same order agree to rounding


class Family:
    def __init__(self, name: str, path):
        self.name = name
        self.model = streamscope.load(path)
        self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.input_ids = self.tokenizer(PROMPT, return_tensors="pt").input_ids
        self.expected = oracle.values(self.reference, name, self.input_ids)
        self.order = [entry for entry in self.expected["order"]]

    def read_all(self):
        """Every value the oracle computed, read through streamscope in the order the model computes them."""
        seen = set()
        saved = {}
        with self.model.trace(PROMPT):
            for name, block in self.order:
                if (name, block) in seen:
                    continue
                seen.add((name, block))
                saved[(name, block)] = value_of(self.model, name, block).save()
        return saved


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoints):
    return Family(request.param, checkpoints(request.param))


def test_every_served_value_equals_the_oracle(family):
    saved = family.read_all()
    assert ("layer_output", 0) in saved
    for (name, block), value in saved.items():
        reference = family.expected[name] if block is None else family.expected[name][block]
        assert value.shape == reference.shape, (name, block)
        assert relative_error(value, reference) <= RELATIVE, (name, block, relative_error(value, reference))


def test_values_the_oracle_lacks_are_unavailable_with_the_reason_support_gives(family):
    support = family.model.support()
    layers = family.model.num_layers
    for block in range(layers):
        for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS):
            if family.expected.get(name) is not None and family.expected[name][block] is not None:
                continue
            with pytest.raises(streamscope.Unavailable) as raised:
                with family.model.trace(PROMPT):
                    value_of(family.model, name, block).save()
            reason = raised.value.reason
            rows = support[block].rows
            qualified = [key for key in rows if key == name or key.endswith("." + name)]
            assert any(rows[key] == reason for key in qualified), (name, block, reason, rows)


def test_support_marks_served_exactly_what_the_oracle_computes(family):
    support = family.model.support()
    for block in range(family.model.num_layers):
        rows = support[block].rows
        for name in oracle.BOUNDARIES:
            served = family.expected.get(name) is not None and family.expected[name][block] is not None
            assert (rows[name] is None) == served, (name, block, rows[name])
    assert support.root.served() == ["token_embeddings", "final_norm_output", "logits", "prompt_logits"]
    assert "model.layers[0" in str(support)


def test_the_stream_identity_holds_on_every_block(family):
    saved = family.read_all()
    for block in range(family.model.num_layers):
        contributions = [saved.get((name, block)) for name in oracle.CONTRIBUTIONS]
        if all(c is not None for c in contributions):
            total = saved[("layer_input", block)] + contributions[0] + contributions[1]
            assert relative_error(total, saved[("layer_output", block)]) <= RELATIVE, block
        if block + 1 < family.model.num_layers:
            assert torch.equal(saved[("layer_output", block)], saved[("layer_input", block + 1)])


def test_reading_every_value_changes_nothing(family):
    with family.model.trace(PROMPT):
        plain = family.model.logits.save()
    saved = family.read_all()
    assert torch.equal(saved[("logits", None)], plain)
    assert relative_error(plain, family.expected["logits"]) <= RELATIVE


def _edit_sites(family):
    block = min(1, family.model.num_layers - 1)
    sites = [(name, None) for name in ("token_embeddings", "final_norm_output")]
    for name in (*oracle.BOUNDARIES, *oracle.CONTRIBUTIONS):
        if family.expected.get(name) is not None and family.expected[name][block] is not None:
            sites.append((name, block))
    return sites


def test_adding_a_vector_anywhere_matches_the_oracle(family):
    vector = torch.linspace(-1.0, 1.0, family.model.hidden_size)
    for name, block in _edit_sites(family):
        with family.model.trace(PROMPT):
            value_of(family.model, name, block)[:, -1] += vector
            logits = family.model.logits.save()
        expected_vector = torch.zeros(family.input_ids.shape[1], family.model.hidden_size)
        expected_vector[-1] = vector
        expected = oracle.logits_with_addition(family.reference, family.name, family.input_ids, name, block,
                                               expected_vector)
        assert not torch.allclose(expected, family.expected["logits"]), (name, block)
        assert relative_error(logits, expected) <= RELATIVE, (name, block, relative_error(logits, expected))


def test_in_place_edit_assignment_and_read_twice_edit_once_agree(family):
    block = min(1, family.model.num_layers - 1)
    vector = torch.linspace(-1.0, 1.0, family.model.hidden_size)
    for name, block in [("layer_input", block), ("layer_output", block), ("mlp_output", block)]:
        if family.expected.get(name) is None or family.expected[name][block] is None:
            continue
        with family.model.trace(PROMPT):
            value_of(family.model, name, block)[:, -1] += vector
            in_place = family.model.logits.save()
        with family.model.trace(PROMPT):
            edited = value_of(family.model, name, block).clone()
            edited[:, -1] += vector
            set_value(family.model, name, block, edited)
            assigned = family.model.logits.save()
        with family.model.trace(PROMPT):
            first = value_of(family.model, name, block)
            second = value_of(family.model, name, block)
            second[:, -1] += vector
            twice = family.model.logits.save()
        assert torch.equal(in_place, assigned), name
        assert torch.equal(in_place, twice), name


def test_skip_gives_the_logits_of_an_identity_block(family):
    block = min(1, family.model.num_layers - 1)
    with family.model.trace(PROMPT):
        layer = family.model.layers[block]
        layer.skip(layer.layer_input)
        logits = family.model.logits.save()
    expected = oracle.logits_with_identity_block(family.reference, family.name, family.input_ids, block)
    assert relative_error(logits, expected) <= RELATIVE


def test_a_wrong_shape_write_is_refused_with_the_value_both_shapes_and_the_block(family):
    block = min(1, family.model.num_layers - 1)
    tokens = family.input_ids.shape[1]
    wrong = torch.zeros(1, tokens + 2, family.model.hidden_size)
    with pytest.raises(ValueError) as raised:
        with family.model.trace(PROMPT):
            family.model.layers[block].layer_output = wrong
    message = str(raised.value)
    assert f"model.layers[{block}].layer_output" in message
    assert str((1, tokens + 2, family.model.hidden_size)) in message
    assert str((1, tokens, family.model.hidden_size)) in message
    with family.model.trace(PROMPT):
        after = family.model.logits.save()
    assert relative_error(after, family.expected["logits"]) <= RELATIVE
    with pytest.raises(ValueError, match="skip takes"):
        with family.model.trace(PROMPT):
            family.model.layers[block].skip(wrong)
