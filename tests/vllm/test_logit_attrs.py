"""`cache.logit_attrs`'s default inside a vLLM engine: the parts sum to the model's logit (issue 38, item 5).

One engine per family, shared by its tests: RMSNorm (llama), LayerNorm with biases (gpt2), a head that scales
(granite: vLLM's logits processor applies it) and one that soft-caps (gemma2, its cap made small enough to bend
the logits). The head's bias and scale are read in the worker (`Engine.head_parameters`); the oracle is
transformers' own float32 forward of the same checkpoint (`oracle.values`), checked by `logit_attr_checks`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle
import logit_attr_checks
import oracle
import precision
import streamscope
from streamscope.vllm.model import beside_engine

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
FAMILIES = ["llama", "gpt2", "granite", "gemma2"]
#: vLLM's CPU kernels against transformers' float32 forward (tests/precision.py); the GPU's where the suite runs there.
TOLERANCE = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else precision.CPU_FLOAT32


class Engine:
    def __init__(self, family: str, path):
        self.name = family
        self.model = streamscope.load(path, engine="vllm", **precision.engine_kwargs())
        implementation = attention_oracle.exact_implementation(family)
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(
                path, **attention_oracle.load_kwargs(family, implementation)).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [oracle.values(self.reference, family, ids) for ids in self.ids]
        self.cache = self.model.cache(PROMPTS)


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, checkpoints):
    overrides = logit_attr_checks.SMALL_CAP if request.param == "gemma2" else {}
    engine = Engine(request.param, checkpoints(request.param, **overrides))
    yield engine
    engine.model.close()


def test_default_parts_and_bias_row_sum_to_the_models_logit(engine):
    logit_attr_checks.check_sums_to_the_logit(engine.cache, engine.reference, engine.name, engine.ids,
                                              engine.expected, TOLERANCE)


def test_logit_differences_and_per_prompt_tokens_sum_to_the_models(engine):
    logit_attr_checks.check_differences_and_forms(engine.cache, engine.reference, engine.expected, TOLERANCE)


def test_transformer_lens_convention_is_one_argument_away_and_the_engine_serves_on(engine):
    logit_attr_checks.check_conventions(engine.cache)
    with engine.model.trace(PROMPTS[1], temperature=0.0, max_tokens=1):
        logits = engine.model.logits.save()
    assert torch.isfinite(logits).all()
