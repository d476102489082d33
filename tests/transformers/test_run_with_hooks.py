"""TransformerLens's run_with_hooks and run_with_cache on transformers (issue 41): hooks by TL and streamscope names
that edit the model, TL's loss (mean, per token, both), filters, TL layouts, refusals (tests/run_with_hooks_checks.py).

The oracle is transformers' own float32 forward of each prompt alone with plain torch hooks doing the same edits, and
torch's cross_entropy. One family of each kind the map bends for: a pre-norm rotary Llama, GPT-2 (learned
positions, its own module names), Gemma 2 (sandwich norms, a logit soft cap). One engine per family, shared by the
module's tests.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import attention_oracle
import run_with_hooks_checks as checks
import streamscope

FAMILIES = ["llama", "gpt2", "gemma2"]
#: float32 on CPU, the same ops as the oracle's: rounding (tests/precision.py's CPU_FLOAT32).
RELATIVE = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, checkpoints):
    path = checkpoints(request.param)
    return checks.Pair(request.param, streamscope.load(path), attention_oracle.reference_model(path),
                       AutoTokenizer.from_pretrained(path), RELATIVE)


def test_hooks_by_tl_and_streamscope_names_edit_the_model_as_torch_hooks_do(pair):
    checks.edits_reach_the_model(pair)


def test_a_batch_of_one_prompt_per_run_gives_the_same(pair):
    checks.edits_reach_the_model(pair, batch_size=1)


def test_the_loss_is_tls_mean_next_token_cross_entropy_over_real_tokens(pair):
    checks.loss_is_tl_cross_entropy(pair)


def test_filters_hook_names_and_tl_head_layouts(pair):
    checks.filters_names_and_layouts(pair, in_process=True)


def test_refusals_name_the_fix_and_the_model_runs_on(pair):
    checks.refusals_name_the_fix(pair)


def test_run_with_cache_returns_the_output_and_the_cache_as_tl(pair):
    checks.run_with_cache_as_tl(pair)
