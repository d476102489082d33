"""`cache.logit_attrs`'s default on transformers: the parts sum to the model's logit (issue 38, item 5).

One tiny checkpoint per family: RMSNorm (llama), LayerNorm with biases (gpt2), a head with a bias (gptj), heads
that scale (cohere, granite) and one that soft-caps (gemma2, its cap made small enough to bend the logits). The oracle is transformers' own float32 forward
(`oracle.values`), checked by `logit_attr_checks`.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import attention_oracle
import logit_attr_checks
import oracle
import streamscope

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
FAMILIES = ["llama", "gpt2", "gptj", "cohere", "granite", "gemma2"]


class Family:
    def __init__(self, name: str, path):
        self.name = name
        self.model = streamscope.load(path)
        implementation = attention_oracle.exact_implementation(name)
        from transformers import AutoModelForCausalLM

        self.reference = AutoModelForCausalLM.from_pretrained(
            path, **attention_oracle.load_kwargs(name, implementation)).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, name, ids) for ids in self.ids]
        self.cache = self.model.cache(PROMPTS)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoints):
    overrides = logit_attr_checks.SMALL_CAP if request.param == "gemma2" else {}
    return Family(request.param, checkpoints(request.param, **overrides))


def test_default_parts_and_bias_row_sum_to_the_models_logit(family):
    logit_attr_checks.check_sums_to_the_logit(family.cache, family.reference, family.name, family.ids,
                                              family.expected)


def test_logit_differences_and_per_prompt_tokens_sum_to_the_models(family):
    logit_attr_checks.check_differences_and_forms(family.cache, family.reference, family.expected)


def test_transformer_lens_convention_is_one_argument_away(family):
    logit_attr_checks.check_conventions(family.cache)
