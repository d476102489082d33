"""The server's front end tokenizes a request's text prompt only where its check needs the prompt's length.

A steer at "all", "last" or "none" and a last-position harvest fit any prompt, and are checked without it; a steer
at indices or a slice, and a harvest of more positions than the last, are checked against the prompt's token
count, tokenized as vLLM will (`streamscope.serve.protocol.Checker.prompt_lengths`). The server runs a check that
tokenizes in a thread of its own, off the event loop (`streamscope.serve.server.SteerMiddleware`); the refusals
themselves are held to the real server in `test_serve.py`.
"""

from __future__ import annotations

import pytest
import torch

from streamscope.serve.protocol import Checker, Limits, RequestError, needs_lengths
from streamscope.serve.storage import Vectors

HIDDEN = 64


@pytest.fixture(scope="module")
def checker(checkpoints):
    from streamscope.vllm.model import StandardizedVLLM

    model = StandardizedVLLM(str(checkpoints("llama")), dispatch=False, dtype="float32")
    limits = Limits()
    return Checker(model, Vectors(limits), limits)


class Counting:
    """The tokenizer, counting its calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def steer(positions=None) -> dict:
    item = {"value": "layer_output", "layer": 1, "vector": torch.ones(HIDDEN).tolist()}
    return item if positions is None else {**item, "positions": positions}


@pytest.mark.parametrize("field, needed", [
    ({"steer": [steer()]}, False),
    ({"steer": [steer("all"), steer("last"), steer("none")]}, False),
    ({"steer": steer("last")}, False),
    ({"harvest": {"values": "layer_output"}}, False),
    ({"harvest": {"values": "layer_output", "positions": "last"}, "steer": [steer()]}, False),
    ({"harvest": {"sae": "relu", "top_k": 4}}, False),
    ({"default_steer": False}, False),
    ({"steer": [steer("all"), steer([0, -1])]}, True),
    ({"steer": [steer({"slice": [1, 3]})]}, True),
    ({"harvest": {"values": "layer_output", "positions": "all"}}, True),
    ({"harvest": {"values": "layer_output", "positions": [0]}}, True),
    ({"steer": "not a list"}, True),
    ({"steer": [3]}, True),
    ({"harvest": ["layer_output"]}, True),
    ("not an object", True),
])
def test_which_fields_need_the_prompts_lengths(field, needed):
    assert needs_lengths(field) is needed


def test_a_check_tokenizes_a_text_prompt_only_where_a_rule_needs_its_length(checker, monkeypatch):
    counting = Counting(checker.model.tokenizer)
    monkeypatch.setattr(checker.model, "tokenizer", counting)
    prompt = "Rome is in Italy, Berlin is in Germany"
    length = len(counting.tokenizer(prompt)["input_ids"])
    blocks = checker.model.num_layers

    checked = checker.check({"prompt": prompt, "streamscope": {"steer": [steer("all")],
                                                               "harvest": {"values": "layer_output"}}}, chat=False)
    assert counting.calls == 0 and checked.harvest["bytes"] == blocks * HIDDEN * 4  # 1 position, float32

    checked = checker.check({"prompt": prompt, "streamscope": {"harvest": {"values": "layer_output",
                                                                           "positions": "all"}}}, chat=False)
    assert counting.calls == 1 and checked.harvest["bytes"] == blocks * length * HIDDEN * 4

    with pytest.raises(RequestError, match="out of range for prompt"):
        checker.check({"prompt": prompt, "streamscope": {"steer": [steer([length])]}}, chat=False)
    assert counting.calls == 2
    checker.check({"prompt": prompt, "streamscope": {"steer": [steer([length - 1])]}}, chat=False)
    assert counting.calls == 3


def test_the_checking_threads_each_tokenize_with_their_own_copy(checker):
    """The server checks requests that need their prompts' lengths on several threads (`server.CHECK_THREADS`), each
    with a tokenizer of its own (a fast tokenizer is not shared between threads): 64 checks at once give each
    prompt the length the model's own tokenizer gives, each on its thread's copy, never the shared one."""
    from concurrent.futures import ThreadPoolExecutor

    from streamscope.serve.server import CHECK_THREADS

    prompts = [" ".join(["Rome is in Italy"] * (1 + number % 7)) + f" {number}" for number in range(64)]
    expected = [len(checker.model.tokenizer(prompt)["input_ids"]) for prompt in prompts]

    def check(prompt):
        field = {"harvest": {"values": "layer_output", "positions": "all"}}
        return checker.check({"prompt": prompt, "streamscope": field}, chat=False).length, checker._thread.tokenizer

    with ThreadPoolExecutor(CHECK_THREADS, initializer=checker.own_tokenizer) as pool:
        found = list(pool.map(check, prompts))
    assert [length for length, _ in found] == expected and CHECK_THREADS > 1
    tokenizers = {id(tokenizer) for _, tokenizer in found}
    assert id(checker.model.tokenizer) not in tokenizers and len(tokenizers) <= CHECK_THREADS


def test_a_tokenizer_that_cannot_be_copied_is_shared_in_turns(checker, monkeypatch):
    """Where the tokenizer cannot be copied, the checking threads start anyway and take turns with the model's."""
    from concurrent.futures import ThreadPoolExecutor

    from streamscope.serve import protocol

    def refuse(_):
        raise TypeError("cannot copy this tokenizer")
    monkeypatch.setattr(protocol.copy, "deepcopy", refuse)
    prompts = [f"Rome is in Italy {number}" for number in range(16)]
    expected = [len(checker.model.tokenizer(prompt)["input_ids"]) for prompt in prompts]
    field = {"harvest": {"values": "layer_output", "positions": "all"}}
    with ThreadPoolExecutor(4, initializer=checker.own_tokenizer) as pool:
        found = list(pool.map(lambda prompt: checker.check({"prompt": prompt, "streamscope": field}, False).length,
                              prompts))
    assert found == expected
