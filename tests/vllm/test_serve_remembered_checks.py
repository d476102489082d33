"""The front end remembers a steer's check by a stored vector (`Checker.remembered`) and where a harvest's values and
blocks are, and the worker's payload carries each distinct vector once (`forwarding.worker_payload`): what is
remembered is what a fresh check answers, and nothing outlives what it was about (the stored numbers, the vector
stored under the name, its carried norm, a stream norm measured since, the prompt's length); a refusal and a clamped
dose are checked, and told, every time.

A request steering every block of an 8B model with one stored vector checked 32 steers of 22 KB each on the event
loop (11 ms a request on the H100 host, which spread a wave of 64 requests over two thirds of a second) and carried
the vector 32 times to the engine; benchmarks/RESULTS.md has the figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from streamscope.serve.forwarding import worker_payload
from streamscope.serve.protocol import Checked, Checker, Limits, RequestError, vector_from_bytes
from streamscope.serve.storage import Vectors


@pytest.fixture(scope="module")
def model(checkpoints):
    from streamscope.vllm.model import StandardizedVLLM

    return StandardizedVLLM(str(checkpoints("llama")), dispatch=False, dtype="float32")


@pytest.fixture
def checker(model):
    limits = Limits(max_steers=64)
    checker = Checker(model, Vectors(limits), limits)
    checker.vectors.store("v", torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(0)))
    return checker


def steer(block: int, mode: str = "add", **more) -> dict:
    return {"value": "layer_output", "layer": block, "vector": "v", "mode": mode, "positions": "all",
            **({"projection": 0.5} if mode == "clamp" else {}), **more}


def body(*steers: dict) -> dict:
    return {"prompt": "hello there", "streamscope": {"steer": list(steers)}}


def fresh(checker: Checker, request: dict) -> Checked:
    checker._remembered.clear()
    return checker.check(request, False)


def same(found: Checked, expected: Checked) -> None:
    assert found.steer_payload == expected.steer_payload and found.warnings == expected.warnings
    for mine, theirs in zip(found.steers, expected.steers):
        assert repr(mine) == repr(theirs) and torch.equal(mine.vector, theirs.vector)


@pytest.mark.parametrize("mode", ["add", "ablate", "clamp"])
def test_a_remembered_check_is_the_fresh_one(checker, model, mode):
    request = body(*[steer(block, mode) for block in range(len(model.layers))])
    expected = fresh(checker, request)
    first = checker.check(request, False)
    again = checker.check(request, False)
    same(again, expected)
    assert all(a is b for a, b in zip(again.steers, first.steers))  # remembered, not checked anew


def test_a_write_to_the_stored_vector_is_seen(checker):
    request = body(steer(0))
    before = checker.check(request, False)
    checker.vectors["v"].mul_(2.0)  # in place: its version moves
    after = checker.check(request, False)
    assert torch.equal(vector_from_bytes(after.steer_payload[0]["vector"]), checker.vectors["v"])
    assert after.steer_payload[0]["vector"] != before.steer_payload[0]["vector"]
    same(after, fresh(checker, request))


def test_a_vector_stored_anew_under_the_name_is_seen_and_a_deleted_one_refused(checker, model):
    request = body(steer(0))
    checker.check(request, False)
    checker.vectors.store("v", torch.ones(model.hidden_size))
    assert torch.equal(vector_from_bytes(checker.check(request, False).steer_payload[0]["vector"]),
                       torch.ones(model.hidden_size))
    checker.vectors.pop("v")
    with pytest.raises(RequestError, match="no stored vector is named 'v'"):
        checker.check(request, False)


def test_a_stream_norm_measured_since_is_used(checker, model):
    """A dose the check passed without a norm (only an overflow is refused then) is refused once the engine has
    measured the stream's norm there: the remembered pass does not outlive the measurement."""
    request = body(steer(0, scale=1000.0))
    checker.check(request, False)
    checker.check(request, False)
    checker.norms[("layer_output", 0)] = 1.0
    with pytest.raises(RequestError, match="dose"):
        checker.check(request, False)


def test_a_carried_norm_stored_since_is_used(checker, model):
    request = body(steer(0, scale=1000.0))
    checker.check(request, False)
    checker.vectors.carried["v"] = {"value": "layer_output", "layer": 0, "norm": 1.0}
    with pytest.raises(RequestError, match="dose"):
        checker.check(request, False)


def test_a_clamped_dose_is_told_every_time(checker):
    checker.norms[("layer_output", 0)] = 1.0
    request = body(steer(0, scale=1000.0, on_dose="clamp"))
    first, second = checker.check(request, False), checker.check(request, False)
    assert first.warnings and second.warnings == first.warnings


def test_a_refusal_is_checked_every_time(checker, model):
    request = body(steer(len(model.layers) + 5))
    for _ in range(2):
        with pytest.raises(RequestError, match="layer"):
            checker.check(request, False)


def test_the_prompt_length_is_part_of_what_is_remembered(checker):
    """A steer at a position the prompt must hold: remembered for one prompt, refused for a shorter one."""
    long = {"prompt": "one two three four five six seven eight", "streamscope": {"steer": [steer(0, positions=[5])]}}
    short = {**long, "prompt": "one"}
    checker.check(long, False)
    checker.check(long, False)
    with pytest.raises(RequestError, match="positions"):
        checker.check(short, False)


def test_the_payload_carries_each_vector_once_and_names_it_by_its_digest(checker, model):
    # seeded apart from "v": the global RNG may stand where a test before seeded it, giving "v"'s own numbers
    other = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    checker.vectors.store("w", other)
    checked = checker.check(body(steer(0), steer(1, "ablate"), {**steer(1), "vector": "w"}), False)
    payload = json.loads(worker_payload(checked, None))
    references = [item["vector"] for item in payload["steer"]]
    assert references[0] == references[1] != references[2] and all(ref.startswith("sha256:") for ref in references)
    assert sorted(payload["vectors"]) == sorted(set(references))
    assert torch.equal(vector_from_bytes(payload["vectors"][references[0]]), checker.vectors["v"])
    assert torch.equal(vector_from_bytes(payload["vectors"][references[2]]), other)
    rest = [{key: value for key, value in item.items() if key != "vector"} for item in payload["steer"]]
    assert rest == [{key: value for key, value in item.items() if key != "vector"} for item in checked.steer_payload]


def test_a_harvest_s_values_and_blocks_are_found_once_and_answer_as_fresh(checker, model):
    """A harvest's values and blocks are located on the tree once for every request naming them; the answer is the
    fresh check's, each request gets lists of its own, and a block out of range is refused every time."""
    request = {"prompt": "hello there", "streamscope": {"harvest": {"values": ["layer_output", "layer_mid"],
                                                                    "layers": [0, -1], "positions": "last"}}}
    first = checker.check(request, False).harvest
    checker._harvested.clear()
    fresh_one = checker.check(request, False).harvest
    first["layers"].append(99)  # a caller's change to its answer reaches no later one
    again = checker.check(request, False).harvest
    assert again == fresh_one and len(checker._harvested) == 1
    assert again["layers"] == [0, len(model.layers) - 1]
    wrong = {"prompt": "hello there", "streamscope": {"harvest": {"values": "layer_output",
                                                                  "layers": [len(model.layers) + 3]}}}
    for _ in range(2):
        with pytest.raises(RequestError, match="layers"):
            checker.check(wrong, False)
