"""A direction carries the stream norm it was made against, through its file and its steer, to the dose check.

No model is needed here: the norm's measurement (`model.norms` on the prompts a direction is fit on, held to the
oracle) is tested per engine in tests/dose_guard_checks.py, and over a server in tests/vllm/test_client_toolbox.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import streamscope
from streamscope.bulk.dose import (CARRIED, MEASURED, carried_entry, carried_how, carried_norm, check_dose,
                                   judge_dose)
from streamscope.bulk.spec import MAX_DOSE, SteerError
from streamscope.directions import Direction

MODEL = {"model_type": "llama", "hidden_size": 8, "num_layers": 4, "vocab_size": 100, "name": "tiny"}


def made(stream_norm=None) -> Direction:
    vector = torch.arange(1.0, 9.0)
    return Direction(vector, "layer_output", 2, "mean_difference", dict(MODEL), scores={"accuracy": 1.0},
                     stream_norm=stream_norm)


def test_a_saved_direction_loads_with_its_stream_norm(tmp_path):
    direction = made(12.5)
    path = direction.save(tmp_path / "happy")
    loaded = Direction.load(tmp_path / "happy")
    assert loaded.stream_norm == 12.5 and torch.equal(loaded.vector, direction.vector)
    assert json.loads((tmp_path / "happy.json").read_text())[CARRIED] == 12.5
    # The safetensors file's own metadata holds it too: a server reads the file alone (serve/storage.py).
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        assert json.loads(handle.metadata()["streamscope.direction"])[CARRIED] == 12.5
    assert Direction.load(made().save(tmp_path / "none")).stream_norm is None


def test_a_file_written_before_directions_carried_a_norm_still_loads(tmp_path):
    """The format is version 1 either way: an older file has no stream_norm key, and loads with None."""
    metadata = made().as_dict()
    del metadata[CARRIED]
    save_file({"vector": torch.arange(1.0, 9.0)}, str(tmp_path / "old.safetensors"),
              metadata={"streamscope.direction": json.dumps(metadata)})
    (tmp_path / "old.json").write_text(json.dumps(metadata))
    loaded = Direction.load(tmp_path / "old")
    assert loaded.stream_norm is None and loaded.layer == 2
    assert CARRIED not in loaded.steer(scale=1.0).origin
    assert torch.equal(load_file(str(tmp_path / "old.safetensors"))["vector"], loaded.vector)


def test_a_directions_steer_carries_its_norm_for_its_own_site_only():
    steer = made(12.5).steer(scale=3.0)
    assert steer.origin[CARRIED] == {"value": "layer_output", "layer": 2, "norm": 12.5}
    assert steer.origin["hidden_size"] == 8  # the model's shape is still what origin checks
    assert carried_norm(steer, 2, 4) == 12.5
    assert carried_norm(steer, 3, 4) is None  # another block's stream: not this norm
    moved = streamscope.Steer("mlp_output", 2, steer.vector, scale=3.0, origin=steer.origin)
    assert carried_norm(moved, 2, 4) is None
    counted_back = streamscope.Steer("layer_output", -2, steer.vector, scale=3.0,
                                     origin={CARRIED: carried_entry("layer_output", -2, 7.0)})
    assert carried_norm(counted_back, 2, 4) == 7.0
    # It crosses as data: a Client sends origin with every steer.
    again = streamscope.Steer.from_dict(json.loads(json.dumps(steer.to_dict())))
    assert carried_norm(again, 2, 4) == 12.5


@pytest.mark.parametrize("entry, named", [
    ({"value": "layer_output", "layer": 2, "norm": -1.0}, "positive finite"),
    ({"value": "layer_output", "layer": 2, "norm": math.inf}, "positive finite"),
    ({"value": "layer_output", "layer": 2, "norm": True}, "positive finite"),
    ({"value": "layer_output", "layer": "2", "norm": 3.0}, "block"),
    ({"value": "layer_output", "norm": 3.0}, "'value': str"),
    (4.0, "'value': str"),
])
def test_a_malformed_carried_norm_is_refused_naming_origin(entry, named):
    steer = streamscope.Steer("layer_output", 2, torch.ones(8), scale=1.0, origin={CARRIED: entry})
    with pytest.raises(SteerError, match=named) as raised:
        carried_norm(steer, 2, 4)
    assert raised.value.field == "origin"


def test_the_dose_check_says_which_norm_it_used():
    """A clamp against a carried norm names it; the clamped scale is the given one times max_dose over the dose
    computed from that norm; without the warning (the server's form) the same steer and message come back."""
    vector = torch.ones(8)
    norm = 4.0
    scale = 1000 * norm / float(vector.norm())
    steer = streamscope.Steer("layer_output", 2, vector, scale=scale, on_dose="clamp")
    how = carried_how("the steer's vector (origin)")
    with pytest.warns(streamscope.DoseWarning, match=r"dose 1000 = .*\|\|h\|\| = 4 at layers\[2\].layer_output "
                                                     r"\(carried by the steer's vector \(origin\)") as caught:
        clamped = check_dose(steer, norm, torch.float32, "layers[2].layer_output", how)
    assert abs(clamped.scale - scale * MAX_DOSE / 1000) <= 1e-12 * scale
    again, message = judge_dose(steer, norm, torch.float32, "layers[2].layer_output", how)
    assert again.scale == clamped.scale and message == str(caught[0].message)
    _, measured = judge_dose(steer, norm, torch.float32, "layers[2].layer_output", MEASURED)
    assert measured is not None and "calibration text" in measured and "carried" not in measured
    assert judge_dose(streamscope.Steer("layer_output", 2, vector, scale=1.0), norm, torch.float32, "here",
                      how)[1] is None
