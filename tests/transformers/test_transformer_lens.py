"""streamscope's cache against TransformerLens 4.3's own ActivationCache, on transformers (see transformer_lens_parity).

Skipped where TransformerLens 4.3 is not installed (scripts/setup.sh puts it in .venv/transformer-lens-4.3).
Both on transformers' eager attention (TransformerLens forces it): the same kernel, so the values agree to ~1e-6
and every difference left is the methods' own arithmetic.
"""

from __future__ import annotations

import pytest

import transformer_lens_parity as parity
import streamscope


@pytest.fixture(scope="module")
def transformer_lens():
    with parity.transformer_lens_4_3():
        yield


@pytest.fixture(scope="module", params=parity.FAMILIES)
def pair(request, checkpoints, transformer_lens):
    path = checkpoints(request.param)
    return parity.Pair(request.param, path, streamscope.load(path, attn_implementation="eager"))


def test_every_hook_name_both_serve_holds_the_same_tensor(pair):
    parity.every_hook_name_both_serve_holds_the_same_tensor(pair)


def test_keys_name_both_conventions_and_values_are_the_tensors(pair):
    parity.keys_name_both_conventions_and_values_are_the_tensors(pair)


@pytest.mark.parametrize("apply_ln", [False, True])
def test_accumulated_resid_every_argument(pair, apply_ln):
    parity.accumulated_resid_every_argument(pair, apply_ln)


@pytest.mark.parametrize("apply_ln", [False, True])
def test_decompose_resid_every_argument(pair, apply_ln):
    parity.decompose_resid_every_argument(pair, apply_ln)


def test_apply_ln_to_stack_every_argument(pair):
    parity.apply_ln_to_stack_every_argument(pair)


def test_logit_attrs_every_token_form(pair):
    parity.logit_attrs_every_token_form(pair)


def test_stack_activation_batch_slices_and_devices(pair):
    parity.stack_activation_batch_slices_and_devices(pair)


def test_model_cache_takes_token_ids_names_filter_and_pos_slice(pair):
    parity.model_cache_takes_token_ids_names_filter_and_pos_slice(pair)


def test_head_results_stacks_and_full_decomposition(pair):
    parity.head_results(pair)


def test_neuron_results_stacks_and_expanded_decomposition(pair):
    parity.neuron_results(pair)


def test_token_helpers_and_test_prompt(pair, capsys):
    parity.tokens_and_test_prompt(pair, capsys)


def test_the_tl_demo_cache_section_prints_tl_numbers_on_smollm2(transformer_lens):
    """TransformerLens's exploratory-analysis demo, cache section (scripts/tl_notebook.py: the logit lens, per-layer,
    per-head and, after the neurons, per-neuron attribution), on SmolLM2-135M: the same calls on TL 4.3's cache and
    on streamscope's give the same numbers, to the parity's 1e-4."""
    from streamscope.models import smollm2

    path = smollm2(quiet=True)
    errors = parity.tl_notebook().compare(path, lambda: streamscope.load(path, attn_implementation="eager"))
    assert len(errors) == 10 and max(errors.values()) <= parity.TOLERANCE, errors

