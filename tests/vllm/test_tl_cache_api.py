"""TransformerLens 4.3's ActivationCache API on vLLM, against TL 4.3 itself (tests/tl_cache_api_checks.py): TL's
``Slice`` and every slice form in every method, iteration and ``cache_dict``, ``cache.model``,
``toggle_autodiff``, ``model.cache(..., remove_batch_dim=, pos_slice=)`` as TL's ``run_with_cache``, and each of
TL 4.3's own ActivationCache test functions as a named case (tests/tl_own_cache_tests.py).

One engine a family (Llama, GPT-2, Gemma 2: pre-norm, learned positions, sandwich post-norms), shared by
the module's tests. TransformerLens runs the checkpoint through transformers, so the
bound is the parity's 1e-4 plus what this engine's values are held to against transformers (tests/precision.py:
the suite's float32 figure scaled by this machine's attention kernel), as in tests/vllm/test_transformer_lens.py.
"""

from __future__ import annotations

import pytest

import matrix
import precision
import tl_cache_api_checks as checks
import tl_own_cache_tests as own
import transformer_lens_parity as parity
import streamscope

GREEDY = {"temperature": 0.0, "max_tokens": 1}


@pytest.fixture(scope="module")
def transformer_lens():
    with parity.transformer_lens_4_3():
        yield


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma2"])
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


def test_every_slice_form_and_tl_slice_in_every_method(pair):
    checks.every_slice_form_in_every_method(pair)


def test_iteration_gives_keys_and_cache_dict_and_model_answer_as_tl(pair):
    checks.iteration_keys_cache_dict_and_model(pair)


def test_toggle_autodiff_sets_autograd_as_tl(pair):
    checks.toggle_autodiff_as_tl(pair)


def test_model_cache_remove_batch_dim_and_pos_slice_as_run_with_cache(pair):
    checks.run_with_cache_remove_batch_dim_and_pos_slice(pair)


@pytest.mark.parametrize("case", list(own.CASES), ids=[name.split("::")[-1] for name in own.CASES])
def test_transformer_lens_own_cache_test(pair, case):
    """Each of TransformerLens 4.3's own ActivationCache test functions, as the calls it makes (tl_own_cache_tests)."""
    own.run(case, pair)
