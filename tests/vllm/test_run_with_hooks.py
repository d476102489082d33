"""TransformerLens's run_with_hooks and run_with_cache inside a vLLM engine (issue 41), against transformers' float32
forward of the same checkpoint with plain torch hooks doing the same edits (tests/run_with_hooks_checks.py).

Each prompt is its own request, so a hook runs once per prompt on ``[1, tokens, ...]``; the logits and the losses
come back padded on the left as on transformers. The loss is checked against torch's cross_entropy on the
transformers logits, and against vLLM's own prompt log-probabilities (``prompt_logprobs``) of the same request.
Attribution patching needs gradients, which vLLM keeps none of: it is refused with the fix, before anything runs,
and the engine serves the next request. One engine per family, shared by the module's tests; the bound is the
suite's float32 figure scaled by this machine's attention kernel (tests/precision.py), as in test_tl_cache_api.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import matrix
import precision
import run_with_hooks_checks as checks
import streamscope
from streamscope.vllm.model import beside_engine

FAMILIES = ["llama", "gpt2", "gemma2"]
GREEDY = {"temperature": 0.0, "max_tokens": 1}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, checkpoints):
    path = checkpoints(request.param)
    model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
    try:
        if precision.ON_GPU:
            tolerance = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE]
        else:
            attention = matrix.read(model, matrix.attention_steps(model), checks.PROMPTS[0], **GREEDY)
            tolerance = precision.cpu_float32(matrix.attention_kernel_error(model, attention))
        with beside_engine():
            reference = attention_oracle.reference_model(path)
        yield checks.Pair(request.param, model, reference, AutoTokenizer.from_pretrained(path), tolerance)
    finally:
        model.close()


def test_hooks_by_tl_and_streamscope_names_edit_the_engine_as_torch_hooks_do(pair):
    checks.edits_reach_the_model(pair)


def test_the_loss_is_tls_mean_next_token_cross_entropy_over_real_tokens(pair):
    checks.loss_is_tl_cross_entropy(pair)


def test_the_loss_per_token_is_vllms_own_prompt_logprobs(pair):
    model = pair.model
    per_token = model.run_with_hooks(checks.PROMPTS, return_type="loss", loss_per_token=True)
    with model.trace(prompt_logprobs=0, **GREEDY) as tracer:  # 0: each prompt token's own log-probability
        with tracer.invoke(checks.PROMPTS[0]):
            first = tracer.result.save()
        with tracer.invoke(checks.PROMPTS[1]):
            second = tracer.result.save()
    results = [first, second]
    longest = per_token.shape[1] + 1
    for row, result in enumerate(results):
        ids = result.prompt_token_ids
        engine = torch.tensor([-entry[token].logprob for entry, token in zip(result.prompt_logprobs[1:], ids[1:])])
        start = longest - len(ids)
        assert torch.allclose(per_token[row, start:], engine, rtol=0, atol=2 * pair.tolerance * float(engine.max()))


def test_filters_hook_names_and_tl_head_layouts(pair):
    checks.filters_names_and_layouts(pair, in_process=False)


def test_refusals_name_the_fix_and_the_engine_serves_on(pair):
    checks.refusals_name_the_fix(pair)


def test_run_with_cache_returns_the_output_and_the_cache_as_tl(pair):
    checks.run_with_cache_as_tl(pair)


def test_attribution_patching_is_refused_with_the_fix_and_the_engine_serves_on(pair):
    model = pair.model
    with pytest.raises(ValueError, match=r"method=\"attribution\".*inference_mode.*engine=\\?\"transformers\\?\""):
        streamscope.patch(model, "Paris is the capital of France", "Rome is the capital of Italy",
                          metric=lambda logits: logits[5] - logits[7], method="attribution")
    with pytest.raises(ValueError, match="method='gradient'"):
        streamscope.patch(model, "Paris is the capital of France", "Rome is the capital of Italy",
                          metric=lambda logits: logits[5] - logits[7], method="gradient")
    checks.edits_reach_the_model(pair)
