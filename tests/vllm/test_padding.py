"""One padding and BOS convention inside a vLLM engine (issue 38 items 3, 4 and 10).

A vLLM request is one prompt, unpadded (its values are ``[1, tokens, ...]``); `model.cache` pads the prompts'
values on the left afterwards, as on transformers, so ``[:, -1]`` is every prompt's last token. Text is
tokenized by the tokenizer's own BOS rule (``prepend_bos=True`` for TransformerLens's). A trace takes a token
tensor ``[seq]`` or ``[1, seq]`` and a list of ids as one prompt; several prompts in one input are refused with
the way to run them (an invoke each), and the engine serves the next request.

One engine shared by the module: a tiny GPT-2 (learned positions) whose tokenizer adds no BOS, as GPT-2's own.
The oracle is transformers' own float32 forward of each prompt alone, read with torch hooks (`oracle.py`).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oracle
import precision
from access import relative_error
import streamscope
from streamscope.testing.tokenizer import save_tokenizer
from streamscope.vllm.model import beside_engine

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
#: float32 on CPU: vLLM's kernels agree with transformers' to about 1e-6 (tests/precision.py on a GPU).
TOLERANCE = precision.GPU_ENGINE_TOLERANCE[precision.DTYPE] if precision.ON_GPU else precision.CPU_FLOAT32
GREEDY = {"temperature": 0.0, "max_tokens": 1}


class Engine:
    def __init__(self, path) -> None:
        self.path = path
        self.model = streamscope.load(str(path), engine="vllm", **precision.engine_kwargs())
        with beside_engine():
            self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [self.alone(ids) for ids in self.ids]

    def alone(self, ids: torch.Tensor) -> dict:
        return oracle.values(self.reference, "gpt2", ids)


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no-bos") / "gpt2"
    shutil.copytree(checkpoints("gpt2"), folder)
    save_tokenizer(folder, add_bos=False)
    engine = Engine(folder)
    yield engine
    engine.model.close()


def _serves_the_next_request(engine: Engine) -> None:
    with engine.model.trace(PROMPTS[1], **GREEDY):
        logits = engine.model.logits.save()
    assert relative_error(logits[0], engine.expected[1]["logits"][0, -1]) <= TOLERANCE


# Item 3: the cache pads on the left; each prompt's values are its own.


def test_cache_pads_on_the_left_and_each_prompt_is_its_own(engine):
    model = engine.model
    last = model.num_layers - 1
    cache = model.cache(PROMPTS, values=["layer_output", "pattern"], layers=[last])
    lengths = [ids.shape[1] for ids in engine.ids]
    longest = max(lengths)
    assert cache.mask.tolist() == [[position >= longest - length for position in range(longest)]
                                   for length in lengths]
    for row, (length, expected) in enumerate(zip(lengths, engine.expected)):
        assert cache.tokens[row, longest - length:].tolist() == engine.ids[row][0].tolist()
        assert relative_error(cache.logits[row, -1], expected["logits"][0, -1]) <= TOLERANCE
        assert relative_error(cache.logits[row, longest - length:], expected["logits"][0]) <= TOLERANCE
        stream = cache[f"layers.{last}.layer_output"]
        assert relative_error(stream[row, longest - length:], expected["layer_output"][last][0]) <= TOLERANCE
        assert relative_error(cache.last("logits")[row], expected["logits"][0, -1]) <= TOLERANCE
    short = lengths.index(min(lengths))
    padded = longest - lengths[short]
    pattern = cache[f"layers.{last}.pattern"]
    assert pattern[short, :, :padded].abs().max() == 0 and pattern[short, :, :, :padded].abs().max() == 0
    # A pattern's rows are softmax weights over the prompt's own keys: each real query's sums to 1.
    sums = pattern[short, :, padded:, padded:].sum(-1)
    assert (sums - 1).abs().max() <= TOLERANCE
    right = model.cache(PROMPTS, values=["layer_output"], layers=[last], padding_side="right")
    assert right.last_positions.tolist() == [length - 1 for length in lengths]
    assert torch.equal(right.last("logits"), cache.logits[:, -1])


# Item 10: token tensors and lists of ids; several prompts refused with the fix.


def test_a_trace_takes_a_token_tensor_and_lists_of_ids(engine):
    """Today model.trace(model.to_tokens(p)) raises vLLM's raw TypeError."""
    model = engine.model
    ids = engine.ids[1]
    expected = engine.expected[1]
    for inputs in (model.to_tokens(PROMPTS[1]), ids[0], ids[0].tolist(), [ids[0].tolist()],
                   {"input_ids": ids, "attention_mask": torch.ones_like(ids)}):
        with model.trace(inputs, **GREEDY):
            mid = model.layers[0].layer_mid.save()
            logits = model.prompt_logits.save()
        assert relative_error(logits, expected["logits"]) <= TOLERANCE, type(inputs)
        assert relative_error(mid, expected["layer_mid"][0]) <= TOLERANCE
    with model.trace(**GREEDY) as tracer:
        with tracer.invoke(model.to_tokens(PROMPTS[0])):
            first = model.prompt_logits.save()
        with tracer.invoke(ids[0]):
            second = model.prompt_logits.save()
    assert relative_error(first, engine.expected[0]["logits"]) <= TOLERANCE
    assert relative_error(second, expected["logits"]) <= TOLERANCE


def test_several_prompts_in_one_input_are_refused_with_the_fix(engine):
    model = engine.model
    several = (PROMPTS, [ids[0].tolist() for ids in engine.ids], torch.cat([engine.ids[1], engine.ids[1]]),
               model.tokenizer(PROMPTS, padding=True, return_tensors="pt"))
    for inputs in several:
        with pytest.raises(ValueError, match=r"(?s)holds 2 prompts.*tracer\.invoke\(prompt_1\).*model\.cache\(prompts\)"):
            with model.trace(inputs, **GREEDY):
                model.logits.save()
    # A padded tensor without its mask is refused first: which rows are padding, it cannot say.
    with pytest.raises(ValueError, match=r"looks padded.*attention_mask=mask"):
        with model.trace(model.to_tokens(PROMPTS), **GREEDY):
            model.logits.save()
    with pytest.raises(ValueError, match=r"(?s)holds 2 prompts.*tracer\.invoke"):
        with model.trace(**GREEDY) as tracer:
            with tracer.invoke(torch.cat([engine.ids[1], engine.ids[1]])):
                model.logits.save()
    _serves_the_next_request(engine)


# Item 4: the tokenizer's own BOS rule everywhere; TransformerLens's always-prepend one argument away.


def test_bos_is_the_tokenizers_rule_and_prepend_bos_is_one_argument_away(engine):
    model = engine.model
    own = engine.ids[1][0].tolist()
    bos = engine.tokenizer.bos_token_id
    assert own[0] != bos  # this tokenizer adds none, as GPT-2's
    assert model.to_tokens(PROMPTS[1]).tolist() == [own]
    assert model.cache(PROMPTS[1], values=["layer_output"], layers=[0]).tokens.tolist() == [own]
    with_bos = [bos, *own]
    expected = engine.alone(torch.tensor([with_bos]))
    assert model.to_tokens(PROMPTS[1], prepend_bos=True).tolist() == [with_bos]
    cache = model.cache(PROMPTS[1], values=["layer_output"], layers=[0], prepend_bos=True)
    assert cache.tokens.tolist() == [with_bos]
    assert relative_error(cache.logits, expected["logits"]) <= TOLERANCE
    with model.trace(PROMPTS[1], prepend_bos=True, **GREEDY):
        logits = model.prompt_logits.save()
    assert relative_error(logits, expected["logits"]) <= TOLERANCE
    with pytest.raises(ValueError, match="prepend_bos=True applies to text"):
        with model.trace(engine.ids[1], prepend_bos=True, **GREEDY):
            model.logits.save()
    _serves_the_next_request(engine)
