"""What the server's front end remembers between requests (each steered request's check runs on the event loop every
stream shares): every remembered answer is the answer a fresh check gives, and none outlives what it was about."""

import base64

import pytest
import torch

from streamscope.bulk.schema import SteerJSON, _VERDICTS, validate_field
from streamscope.bulk.steer import Steer, SteerError
from streamscope.serve.forwarding import cache_salt
from streamscope.serve.protocol import Checked, vector_bytes, vector_from_bytes


def fresh(name, raw):
    _VERDICTS.clear()
    return validate_field(SteerJSON, name, raw)


@pytest.mark.parametrize("name, raw", [("generated", True), ("generated", 1), ("generated", "yes"),
                                       ("from_step", 0), ("from_step", -1), ("from_step", True),
                                       ("on_dose", "refuse"), ("on_dose", "explode"), ("max_dose", 2.5),
                                       ("max_dose", -1.0), ("max_dose", None), ("norm_match", False)])
def test_a_remembered_field_verdict_is_the_fresh_one(name, raw):
    expected = fresh(name, raw)
    assert validate_field(SteerJSON, name, raw) == expected  # from the memo
    assert (SteerJSON, name, type(raw), raw) in _VERDICTS


def test_equal_values_of_other_types_keep_their_own_verdicts():
    """True == 1 in Python: the memo keys on the type too, so an integer from_step never answers for a boolean."""
    _VERDICTS.clear()
    assert validate_field(SteerJSON, "from_step", 1) is None
    assert validate_field(SteerJSON, "from_step", True) == fresh("from_step", True)
    assert validate_field(SteerJSON, "from_step", 1) is None


def test_a_stored_vector_is_encoded_once_and_again_after_a_write():
    vector = torch.arange(8, dtype=torch.float32)
    first = vector_bytes(vector)
    assert vector_bytes(vector) is first  # remembered
    vector[3] = 100.0  # a write in place: the encoding follows it
    assert torch.equal(vector_from_bytes(vector_bytes(vector)), vector)


def test_a_new_tensor_at_a_dead_ones_address_is_encoded_anew():
    found = set()
    for number in range(50):  # CPython reuses a freed tensor's id at once, more often than not
        vector = torch.full((8,), float(number))
        found.add(vector_from_bytes(vector_bytes(vector))[0].item())
        del vector
    assert found == {float(number) for number in range(50)}


def test_the_salt_hashes_the_vectors_numbers_not_their_string():
    """Equal steers share a salt whether their vectors' base64 is one string or two equal ones; a vector that differs
    in one number gets another salt."""
    text = vector_bytes(torch.ones(16))
    same = "".join(list(text))  # an equal string, another object
    other = base64.b64encode(torch.cat([torch.ones(15), torch.zeros(1)]).numpy().tobytes()).decode("ascii")

    def salt(encoded):
        item = {"value": "layer_output", "layer": 1, "vector": encoded, "mode": "add", "positions": "all",
                "generated": True, "from_step": 0}
        return cache_salt(Checked(steer_payload=[item]), {"prompt": "a"}, None)

    assert same is not text and salt(text) == salt(same)
    assert salt(text) != salt(other)


def test_a_vector_found_finite_then_written_with_nan_is_refused():
    vector = torch.ones(8)
    Steer("layer_output", 0, vector)  # checked, and remembered finite
    vector[2] = float("nan")
    with pytest.raises(SteerError, match="finite"):
        Steer("layer_output", 0, vector)


def test_an_inference_tensor_is_checked_and_encoded_each_time():
    """A tensor made in inference mode (an engine's read) keeps no version: nothing of it is remembered, and a write
    to it in inference mode is seen."""
    with torch.inference_mode():
        vector = torch.ones(8)
    Steer("layer_output", 0, vector)
    first = vector_bytes(vector)
    with torch.inference_mode():
        vector[2] = float("nan")
    assert vector_bytes(vector) != first
    with pytest.raises(SteerError, match="finite"):
        Steer("layer_output", 0, vector)
