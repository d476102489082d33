"""One padding and BOS convention on transformers (issue 38 items 3, 4 and 10).

Padding is on the left everywhere a batch is padded (`model.cache`, a trace of several prompts), so ``[:, -1]``
is every prompt's last token, and every real position's value is the one the prompt gives alone; the cache's
other side is ``padding_side="right"``, and `Cache.last` reads the last real token on either. Text is
tokenized by the tokenizer's own BOS rule everywhere (``tokenizer(text)``); ``prepend_bos=True`` is
TransformerLens's always-prepend. A trace takes text, lists of text, token ids and token tensors.

Two checkpoints shared by the module: a tiny Llama (rotary positions) whose tokenizer puts a BOS first, and a
tiny GPT-2 (learned positions) whose tokenizer adds none. The oracle is transformers' own float32 forward of
each prompt alone, read with torch hooks (`oracle.py`), and its eager attention weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attention_oracle
import oracle
from access import relative_error
import streamscope
from streamscope.testing.tokenizer import save_tokenizer
from streamscope import tl as tl_helpers

PROMPTS = ["The Eiffel Tower is in Paris, and the quick brown fox", "Rome is in Italy"]
RELATIVE = 1e-5  # float32 on CPU, the same ops: rounding only (tests/precision.py's CPU_FLOAT32)


class Tiny:
    """A streamscope model of one checkpoint, and the oracle's values of each prompt alone."""

    def __init__(self, family: str, path) -> None:
        self.family, self.path = family, path
        self.model = streamscope.load(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eager = AutoModelForCausalLM.from_pretrained(
            path, **attention_oracle.load_kwargs(family, "eager")).eval()
        self.ids = [self.tokenizer(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
        self.expected = [self.alone(ids) for ids in self.ids]

    def alone(self, ids: torch.Tensor) -> dict:
        """The oracle's values of one prompt's ids ``[1, seq]``, run alone."""
        return oracle.values(self.reference, self.family, ids)


@pytest.fixture(scope="module")
def tiny(checkpoints, tmp_path_factory):
    llama = Tiny("llama", checkpoints("llama"))
    # GPT-2's own tokenizer adds no BOS: the same checkpoint with a tokenizer that adds none.
    folder = tmp_path_factory.mktemp("no-bos") / "gpt2"
    shutil.copytree(checkpoints("gpt2"), folder)
    save_tokenizer(folder, vocab_size=llama.model.vocab_size, add_bos=False)
    return {"llama": llama, "gpt2": Tiny("gpt2", folder)}


FAMILIES = ["llama", "gpt2"]


def _real(value: torch.Tensor, row: int, length: int, axes=(1,)) -> torch.Tensor:
    """Row `row` of a left-padded batch, its position `axes` cut to the prompt's last `length` positions."""
    index: list = [slice(row, row + 1)] + [slice(None)] * (value.dim() - 1)
    for axis in axes:
        index[axis] = slice(value.shape[axis] - length, value.shape[axis])
    return value[tuple(index)]


# Item 3: one padding convention, left, with every real position the prompt's own.


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_pads_on_the_left_and_each_prompt_is_its_own(tiny, family):
    tiny = tiny[family]
    last = tiny.model.num_layers - 1
    cache = tiny.model.cache(PROMPTS, values=["layer_output", "pattern"], layers=[0, last])
    lengths = [ids.shape[1] for ids in tiny.ids]
    longest = max(lengths)
    assert cache.padding_side == "left"
    assert cache.mask.tolist() == [[position >= longest - length for position in range(longest)]
                                   for length in lengths]
    weights = [attention_oracle.eager_weights(tiny.eager, ids) for ids in tiny.ids]
    for row, (length, expected) in enumerate(zip(lengths, tiny.expected)):
        assert cache.tokens[row, longest - length:].tolist() == tiny.ids[row][0].tolist()
        # Position -1 is this prompt's last token: its logits are the prompt's own next-token logits.
        assert relative_error(cache.logits[row, -1], expected["logits"][0, -1]) <= RELATIVE
        assert relative_error(_real(cache.logits, row, length), expected["logits"]) <= RELATIVE
        assert relative_error(cache.last("logits")[row], expected["logits"][0, -1]) <= RELATIVE
        for block in (0, last):
            value = cache[f"layers.{block}.layer_output"]
            assert relative_error(_real(value, row, length), expected["layer_output"][block]) <= RELATIVE
            assert relative_error(cache.last(f"layers.{block}.layer_output")[row],
                                  expected["layer_output"][block][0, -1]) <= RELATIVE
            # A pattern is padded on both its query and its key axis; its real block is the prompt's alone.
            pattern = cache[f"layers.{block}.pattern"]
            assert relative_error(_real(pattern, row, length, (2, 3)), weights[row][block]) <= RELATIVE
            last_query = cache.last(("pattern", block))[row]  # [heads, keys]: the key axis stays, padded
            assert relative_error(last_query[:, -length:], weights[row][block][0, :, -1]) <= RELATIVE
    short = lengths.index(min(lengths))
    padded = longest - lengths[short]
    assert cache.logits[short, :padded].abs().max() == 0
    assert cache[f"layers.{last}.pattern"][short, :, :padded].abs().max() == 0
    assert cache[f"layers.{last}.pattern"][short, :, :, :padded].abs().max() == 0
    assert cache.last_positions.tolist() == [longest - 1] * len(PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_on_the_right_is_one_argument_away_and_last_reads_the_last_real_token(tiny, family):
    tiny = tiny[family]
    cache = tiny.model.cache(PROMPTS, values=["layer_output"], layers=[0], padding_side="right")
    lengths = [ids.shape[1] for ids in tiny.ids]
    assert cache.padding_side == "right" and cache.last_positions.tolist() == [length - 1 for length in lengths]
    for row, (length, expected) in enumerate(zip(lengths, tiny.expected)):
        assert relative_error(cache.logits[row:row + 1, :length], expected["logits"]) <= RELATIVE
        assert relative_error(cache.last("logits")[row], expected["logits"][0, -1]) <= RELATIVE
        assert relative_error(cache.last(cache["blocks.0.hook_resid_post"])[row],
                              expected["layer_output"][0][0, -1]) <= RELATIVE
    short = lengths.index(min(lengths))
    assert cache.logits[short, -1].abs().max() == 0  # the right side's padding, zeros: what cache.last is for
    # The TransformerLens ports' -1 is each prompt's last token on the default side.
    left = tiny.model.cache(PROMPTS, values=["layer_output"], layers=[0])
    assert torch.equal(left.logits[:, -1], left.last("logits"))
    assert torch.equal(left.last("logits"), torch.stack([cache.last("logits")[row] for row in range(len(PROMPTS))]))
    with pytest.raises(ValueError, match="padding_side='middle'.*\"left\".*\"right\""):
        tiny.model.cache(PROMPTS, padding_side="middle")
    with pytest.raises(ValueError, match="padding_side='middle'"):
        tiny.model.to_tokens(PROMPTS, padding_side="middle")
    assert relative_error(tiny.model.cache(PROMPTS[1]).logits, tiny.expected[1]["logits"]) <= RELATIVE


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trace_of_several_prompts_pads_left_with_each_prompts_own_positions(tiny, family):
    """Learned (GPT-2) and rotary (Llama) positions alike: position ids counted from each prompt's first token."""
    tiny = tiny[family]
    lengths = [ids.shape[1] for ids in tiny.ids]
    id_lists = [ids[0].tolist() for ids in tiny.ids]
    encoded = tiny.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    for inputs, kwargs in ((PROMPTS, {}), (id_lists, {}), (encoded["input_ids"], {"attention_mask": encoded["attention_mask"]}),
                           (dict(encoded), {})):
        with tiny.model.trace(inputs, **kwargs):
            mid = tiny.model.layers[0].layer_mid.save()
            logits = tiny.model.logits.save()
        assert logits.shape[:2] == (len(PROMPTS), max(lengths))
        for row, (length, expected) in enumerate(zip(lengths, tiny.expected)):
            assert relative_error(logits[row, -1], expected["logits"][0, -1]) <= RELATIVE, type(inputs)
            assert relative_error(_real(logits, row, length), expected["logits"]) <= RELATIVE
            assert relative_error(_real(mid, row, length), expected["layer_mid"][0]) <= RELATIVE


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trace_takes_token_tensors_and_lists_of_ids(tiny, family):
    tiny = tiny[family]
    ids = tiny.ids[1]
    expected = tiny.expected[1]["logits"]
    for inputs in (ids, ids[0], ids[0].tolist(), [ids[0].tolist()], tiny.model.to_tokens(PROMPTS[1])):
        with tiny.model.trace(inputs):
            logits = tiny.model.logits.save()
        assert relative_error(logits, expected) <= RELATIVE, inputs
    # A [batch, seq] tensor of prompts of one length needs no mask: every id is a token.
    same = torch.cat([ids, ids.flip(-1)])
    with tiny.model.trace(same):
        logits = tiny.model.logits.save()
    assert relative_error(logits[1:], tiny.alone(ids.flip(-1))["logits"]) <= RELATIVE


@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_token_tensor_without_its_mask_is_refused_with_the_fix(tiny, family):
    """Today the pads would run as tokens: the short prompt's values silently another prompt's."""
    tiny = tiny[family]
    for side in ("left", "right"):
        tokens = tiny.model.to_tokens(PROMPTS, padding_side=side)
        with pytest.raises(ValueError, match=r"looks padded.*attention_mask=mask"):
            with tiny.model.trace(tokens):
                tiny.model.logits.save()
    with pytest.raises(ValueError, match=r"\[seq\] or \[batch, seq\]"):
        with tiny.model.trace(tiny.ids[1].unsqueeze(0)):
            tiny.model.logits.save()
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        with tiny.model.trace([[0, 10**9]]):
            tiny.model.logits.save()
    # The next request is served.
    with tiny.model.trace(PROMPTS[1]):
        logits = tiny.model.logits.save()
    assert relative_error(logits, tiny.expected[1]["logits"]) <= RELATIVE


# Item 4: the tokenizer's own BOS rule everywhere; TransformerLens's always-prepend one argument away.


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_traces_and_token_helpers_agree_on_the_tokenizers_bos_rule(tiny, family, capsys):
    tiny = tiny[family]
    own = tiny.ids[1][0].tolist()
    bos = tiny.tokenizer.bos_token_id
    assert (own[0] == bos) == (family == "llama")  # one tokenizer adds a BOS, the other none
    assert tiny.model.to_tokens(PROMPTS[1]).tolist() == [own]
    assert tiny.model.to_str_tokens(PROMPTS[1]) == [tiny.tokenizer.decode([token]) for token in own]
    assert tiny.model.cache(PROMPTS[1], values=["layer_output"], layers=[0]).tokens.tolist() == [own]
    tl_helpers.test_prompt(PROMPTS[1], "Paris", tiny.model, top_k=1)
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == f"Tokenized prompt: {[tiny.tokenizer.decode([token]) for token in own]}"
    with tiny.model.trace(PROMPTS[1]):
        logits = tiny.model.logits.save()
    assert relative_error(logits, tiny.expected[1]["logits"]) <= RELATIVE


@pytest.mark.parametrize("family", FAMILIES)
def test_prepend_bos_true_and_false_on_every_route(tiny, family, capsys):
    tiny = tiny[family]
    bos = tiny.tokenizer.bos_token_id
    bare = [token for token in tiny.ids[1][0].tolist()]
    bare = bare[1:] if bare[0] == bos else bare
    for prepend_bos, ids in ((True, [bos, *bare]), (False, bare)):
        expected = tiny.alone(torch.tensor([ids]))
        assert tiny.model.to_tokens(PROMPTS[1], prepend_bos=prepend_bos).tolist() == [ids]
        assert tiny.model.to_str_tokens(PROMPTS[1], prepend_bos=prepend_bos) == [
            tiny.tokenizer.decode([token]) for token in ids]
        cache = tiny.model.cache(PROMPTS[1], values=["layer_output"], layers=[0], prepend_bos=prepend_bos)
        assert cache.tokens.tolist() == [ids]
        assert relative_error(cache.logits, expected["logits"]) <= RELATIVE
        with tiny.model.trace(PROMPTS[1], prepend_bos=prepend_bos):
            logits = tiny.model.logits.save()
        assert relative_error(logits, expected["logits"]) <= RELATIVE
        tl_helpers.test_prompt(PROMPTS[1], "Paris", tiny.model, top_k=1, prepend_bos=prepend_bos)
        assert capsys.readouterr().out.splitlines()[0] == (
            f"Tokenized prompt: {[tiny.tokenizer.decode([token]) for token in ids]}")
    with pytest.raises(ValueError, match="prepend_bos=True applies to text"):
        tiny.model.cache(tiny.ids[1], prepend_bos=True)
    with pytest.raises(ValueError, match="prepend_bos=True applies to text"):
        with tiny.model.trace(tiny.ids[1], prepend_bos=True):
            tiny.model.logits.save()
