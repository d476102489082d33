"""One padding and BOS convention inside a vLLM engine (issue 38 items 3, 4 and 10).

A vLLM request is one prompt, unpadded (its values are ``[1, tokens, ...]``); `model.cache` pads the prompts'
values on the left afterwards, as on transformers, so ``[:, -1]`` is every prompt's last token. Text is
tokenized by the tokenizer's own BOS rule (``prepend_bos=True`` for TransformerLens's). A trace takes a token
tensor ``[seq]`` or ``[1, seq]`` and a list of ids as one prompt. Several prompts given to a trace (a list of
strings or of id lists, a ``[batch, seq]`` tensor with its mask) run its body once per prompt, an invoke (a
request) each, unpadded: a name saved there comes back as a list, one ``[1, tokens, ...]`` value per prompt.
Several prompts in one ``tracer.invoke`` stay refused with the fix, and the engine serves the next request.

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


# Item 10: token tensors and lists of ids; several prompts in a trace, an invoke each.


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


#: Three prompts of different lengths, none a prefix of another.
THREE = [*PROMPTS, "Madrid is a city"]


@torch.no_grad()
def _logits_with_last_position_edit(engine: Engine, ids: torch.Tensor, block: int, vector: torch.Tensor) -> torch.Tensor:
    """The reference's logits for `ids` alone with `vector` added to block `block`'s output at the last position
    (transformers' module, a torch hook: the oracle's site of ``layer_output``)."""
    module, where, factor = oracle.site(engine.reference, "gpt2", "layer_output", block)

    def add_at_last(tensor: torch.Tensor) -> None:
        tensor[:, -1] += vector / factor if factor is not None else vector

    with oracle.hooked(module, where, add_at_last):
        return engine.reference(ids).logits


def _ids(engine: Engine, prompts: list[str]) -> list[torch.Tensor]:
    return [engine.tokenizer(prompt, return_tensors="pt").input_ids for prompt in prompts]


def test_a_trace_of_several_prompts_runs_its_body_once_per_prompt(engine):
    """Today a vLLM trace refuses a list of prompts (transformers runs it as one left-padded batch)."""
    model = engine.model
    block = 1
    ids = _ids(engine, THREE)
    assert len({row.shape[1] for row in ids}) == len(THREE)
    expected = [engine.alone(row) for row in ids]
    padded = engine.tokenizer(THREE, padding=True, return_tensors="pt")
    forms = {"text": THREE, "id lists": [row[0].tolist() for row in ids], "tokenizer output": padded,
             "tensor and mask": padded["input_ids"]}
    for form, inputs in forms.items():
        mask = {"attention_mask": padded["attention_mask"]} if form == "tensor and mask" else {}
        with model.trace(inputs, **mask, **GREEDY):
            stream = model.layers[block].layer_output.save()
            prompt_logits = model.prompt_logits.save()
            logits = model.logits.save()
        assert isinstance(stream, list) and len(stream) == len(THREE), form
        for index, (row, alone) in enumerate(zip(ids, expected)):
            assert stream[index].shape == (1, row.shape[1], model.hidden_size), form
            assert relative_error(stream[index], alone["layer_output"][block]) <= TOLERANCE, (form, index)
            assert relative_error(prompt_logits[index], alone["logits"]) <= TOLERANCE, (form, index)
            assert logits[index].shape == (1, model.vocab_size)
            assert relative_error(logits[index][0], alone["logits"][0, -1]) <= TOLERANCE, (form, index)
    # An unpadded [batch, seq] tensor (rows of one length) is its rows, one prompt each.
    same = torch.cat([ids[1], ids[1]])
    with model.trace(same, **GREEDY):
        logits = model.prompt_logits.save()
    assert len(logits) == 2
    assert all(relative_error(each, expected[1]["logits"]) <= TOLERANCE for each in logits)
    # A list of one prompt is that prompt: its names come back as values, as from one invoke.
    with model.trace([THREE[2]], **GREEDY):
        logits = model.prompt_logits.save()
    assert isinstance(logits, torch.Tensor) and relative_error(logits, expected[2]["logits"]) <= TOLERANCE
    _serves_the_next_request(engine)


def test_a_trace_of_several_prompts_steps_through_each_prompts_own_tokens(engine):
    """A body that names its tracer (`tracer.iter`, `tracer.result`) runs per prompt too, decode steps included;
    the traces after it, of one prompt or several, run as before."""
    model = engine.model
    block = 1
    prompts = THREE[1:]
    with model.trace(prompts, temperature=0.0, max_tokens=2) as tracer:
        steps = list().save()
        for step in tracer.iter[:2]:
            steps.append(model.layers[block].layer_output[:, -1:].clone())
        result = tracer.result.save()
    assert len(steps) == len(result) == len(prompts)
    for prompt, found, output in zip(prompts, steps, result):
        ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
        assert list(output.prompt_token_ids) == ids[0].tolist()
        first = output.outputs[0].token_ids[0]
        expected = engine.alone(torch.cat([ids, torch.tensor([[first]])], dim=1))["layer_output"][block]
        assert [tuple(value.shape) for value in found] == [(1, 1, model.hidden_size)] * 2
        assert relative_error(found[0][0, -1], expected[0, -2]) <= TOLERANCE
        assert relative_error(found[1][0, -1], expected[0, -1]) <= TOLERANCE
    _serves_the_next_request(engine)
    with model.trace(prompts, **GREEDY):
        logits = model.prompt_logits.save()
    assert len(logits) == len(prompts)


def test_an_edit_in_a_trace_of_several_prompts_reaches_each_prompt_alone(engine):
    model = engine.model
    block = 0
    ids = _ids(engine, THREE)
    vector = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(38)) * 4
    with model.trace(THREE, **GREEDY):
        model.layers[block].layer_output[:, -1] += vector
        edited = model.layers[block].layer_output.save()
        logits = model.prompt_logits.save()
    for index, row in enumerate(ids):
        expected = _logits_with_last_position_edit(engine, row, block, vector)
        assert relative_error(logits[index], expected) <= TOLERANCE, index
        plain = engine.alone(row)
        # The edit reached the last position only: the logits elsewhere are the prompt's own.
        assert relative_error(logits[index][:, :-1], plain["logits"][:, :-1]) <= TOLERANCE, index
        assert relative_error(logits[index][:, -1], plain["logits"][:, -1]) > 1e3 * TOLERANCE, index
        assert relative_error(edited[index][0, -1], plain["layer_output"][block][0, -1] + vector) <= TOLERANCE
    _serves_the_next_request(engine)


def test_several_prompts_in_one_invoke_are_refused_with_the_fix(engine):
    model = engine.model
    pair = torch.cat([engine.ids[1], engine.ids[1]])
    with pytest.raises(ValueError, match=r"(?s)holds 2 prompts.*model\.trace\(prompts.*tracer\.invoke\(prompt_1\)"):
        with model.trace(**GREEDY) as tracer:
            with tracer.invoke(pair):
                model.logits.save()
    # nnsight's own refusal, before any request is made.
    with pytest.raises(ValueError, match=r"prompts per invoke.*separate tracer\.invoke"):
        with model.trace(**GREEDY) as tracer:
            with tracer.invoke(PROMPTS):
                model.logits.save()
    # A padded tensor without its mask is refused: which positions are padding, it cannot say.
    with pytest.raises(ValueError, match=r"looks padded.*attention_mask=mask"):
        with model.trace(model.to_tokens(PROMPTS), **GREEDY):
            model.logits.save()
    _serves_the_next_request(engine)
    # generate called with several prompts is the bulk path, one completion each.
    generation = model.generate(PROMPTS, max_tokens=2, temperature=0.0)
    assert len(generation.texts) == len(PROMPTS)


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
