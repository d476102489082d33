"""streamscope's cache on vLLM against TransformerLens 4.3's own ActivationCache (see transformer_lens_parity).

One engine per family, shared by the module's tests of it. TransformerLens runs the checkpoint through
transformers, so the bound is the parity's 1e-4 plus what this engine's values are held to against
transformers (tests/precision.py: the suite's float32 figure scaled by this machine's attention kernel).
"""

from __future__ import annotations

import pytest

import matrix
import precision
import transformer_lens_parity as parity
import streamscope

FAMILIES = ["llama", "gpt2", "gptj", "gemma2"]
GREEDY = {"temperature": 0.0, "max_tokens": 1}


@pytest.fixture(scope="module")
def transformer_lens():
    with parity.transformer_lens_4_3():
        yield


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, checkpoints, transformer_lens):
    path = checkpoints(request.param)
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    try:
        if precision.ON_GPU:
            engine = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE]
        else:
            attention = matrix.read(model, matrix.attention_steps(model), parity.PROMPTS[0], **GREEDY)
            engine = precision.cpu_float32(matrix.attention_kernel_error(model, attention))
        parity.LIMIT[0] = parity.TOLERANCE + engine
        yield parity.Pair(request.param, path, model)
    finally:
        parity.LIMIT[0] = parity.TOLERANCE
        model.close()


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
    """TransformerLens's exploratory-analysis demo, cache section (scripts/tl_notebook.py), on SmolLM2-135M with
    the engine in place of TL 4.3's bridge: the same numbers, to the parity's 1e-4 plus what this engine's attention
    kernel measures on the model (as the parity's other tests are held)."""
    from streamscope.models import smollm2

    path = smollm2(quiet=True)
    limit = []

    def load():
        model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
        if precision.ON_GPU:
            limit.append(precision.GPU_ENGINE_TOLERANCE[precision.DTYPE])
        else:
            attention = matrix.read(model, matrix.attention_steps(model), parity.PROMPTS[0], **GREEDY)
            limit.append(precision.cpu_float32(matrix.attention_kernel_error(model, attention)))
        return model

    errors = parity.tl_notebook().compare(path, load)
    assert len(errors) == 10 and max(errors.values()) <= parity.TOLERANCE + limit[0], (errors, limit)
