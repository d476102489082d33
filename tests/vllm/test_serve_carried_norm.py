"""A vector stored on the server carries the stream norm it was made against; the front end's dose check uses it.

Checked on the front end's own `Checker` and `Vectors` (the server's model as a meta copy, no engine): an upload
as JSON, as a streamscope direction file, or as `streamscope.Client.store_vector` sends it, keeps its norm (listed,
and in the file a download returns); a steer by that name at that value and block, or one whose origin carries a
norm there, is dose-checked against it (over any norm the engine measured), needs no calibration request, and its
message (the response's warning) says which norm it used. The same over a real server: tests/vllm/
test_client_toolbox.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from streamscope.bulk.dose import CARRIED, carried_entry
from streamscope.directions import Direction, identity
from streamscope.serve.protocol import Checker, Limits, RequestError
from streamscope.serve.storage import Vectors, read_upload


@pytest.fixture(scope="module")
def model(checkpoints):
    from streamscope.vllm.model import StandardizedVLLM

    return StandardizedVLLM(str(checkpoints("llama")), dispatch=False, dtype="float32")


@pytest.fixture
def checker(model):
    limits = Limits()
    return Checker(model, Vectors(limits), limits)


def vector(model, seed: int) -> torch.Tensor:
    return torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_each_upload_form_keeps_the_norm_and_a_download_returns_it(model, checker, tmp_path):
    last = model.num_layers - 1
    v = vector(model, 1)
    sent = json.dumps({"vector": v.tolist(), CARRIED: {"value": "layer_output", "layer": -1, "norm": 5}}).encode()
    got, entry = read_upload(sent, "application/json", checker)
    assert torch.equal(got, v) and entry == {"value": "layer_output", "layer": last, "norm": 5.0}
    direction = Direction(v, "mlp_output", 1, "mean_difference", identity(model), stream_norm=7.25)
    path = direction.save(tmp_path / "happy")
    assert read_upload(path.read_bytes(), "application/octet-stream", checker)[1] == \
        {"value": "mlp_output", "layer": 1, "norm": 7.25}
    older = Direction(v, "mlp_output", 1, "mean_difference", identity(model)).save(tmp_path / "older")
    assert read_upload(older.read_bytes(), "application/octet-stream", checker)[1] is None
    client_form = save({"vector": v}, metadata={"streamscope.stream_norm": json.dumps(carried_entry("layer_output",
                                                                                                      0, 3.5))})
    assert read_upload(client_form, "application/octet-stream", checker)[1] == \
        {"value": "layer_output", "layer": 0, "norm": 3.5}
    assert read_upload(save({"vector": v}), "application/octet-stream", checker)[1] is None
    stored = checker.vectors
    stored.store("happy", v, entry)
    assert stored.listing() == [{"name": "happy", "size": model.hidden_size, "norm": float(v.norm()),
                                 CARRIED: entry}]
    again = read_upload(stored.file("happy"), "application/octet-stream", checker)
    assert torch.equal(again[0], v) and again[1] == entry
    stored.store("happy", v)  # stored again without a norm: it carries none
    assert stored.listing()[0][CARRIED] is None
    stored.store("happy", v, entry)
    assert stored.pop("happy") is not None and stored.carried == {}


@pytest.mark.parametrize("carried, param", [
    ({"value": "layer_output", "layer": 1, "norm": 0}, "body.stream_norm"),
    ({"value": "layer_output", "layer": 1}, "body.stream_norm"),
    ({"value": "no_such_value", "layer": 1, "norm": 2.0}, "body.stream_norm.value"),
    ({"value": "layer_output", "layer": 999, "norm": 2.0}, "body.stream_norm.layer"),
])
def test_a_bad_carried_norm_is_refused_naming_the_field(model, checker, carried, param):
    sent = json.dumps({"vector": vector(model, 2).tolist(), CARRIED: carried}).encode()
    with pytest.raises(RequestError) as raised:
        read_upload(sent, "application/json", checker)
    assert raised.value.status == 400 and raised.value.param == param, (raised.value.param, raised.value.message)
    with pytest.raises(RequestError, match="optionally"):
        read_upload(json.dumps({"vector": [1.0], "norm": 3}).encode(), "application/json", checker)


def request(steer: dict) -> dict:
    return {"prompt": "Once upon a time", "streamscope": {"steer": [steer]}}


def test_a_steer_by_a_stored_name_is_checked_against_the_norm_it_carries(model, checker):
    last = model.num_layers - 1
    v = vector(model, 3)
    norm = 6.0
    checker.vectors.store("carried", v, {"value": "layer_output", "layer": last, "norm": norm})
    given = 1000 * norm / float(v.norm())
    item = {"value": "layer_output", "layer": last, "vector": "carried", "scale": given, "on_dose": "clamp"}
    assert checker.steered_sites({"steer": [item]}) == []  # nothing to measure: the vector carries it
    assert checker.steered_sites({"steer": [{**item, "layer": 0}]}) == [("layer_output", 0)]
    checked = checker.check(request(item), chat=False)
    assert len(checked.warnings) == 1 and "carried by stored vector 'carried'" in checked.warnings[0]
    assert "dose 1000 = " in checked.warnings[0] and "limit is max_dose=100" in checked.warnings[0]
    assert abs(checked.steers[0].scale - given / 10) <= 1e-9 * given
    # Once the engine has measured a norm there, the stored vector's own norm is still its check's (a request's
    # check does not depend on what earlier ones measured); the same vector sent inline takes the measured one.
    checker.norms[("layer_output", last)] = 2 * norm
    checked = checker.check(request(item), chat=False)
    assert "carried by stored vector 'carried'" in checked.warnings[0] and "dose 1000 = " in checked.warnings[0]
    checked = checker.check(request({**item, "vector": v.tolist()}), chat=False)
    assert "measured by the server's engine" in checked.warnings[0] and "dose 500 = " in checked.warnings[0]
    assert abs(checked.steers[0].scale - given / 5) <= 1e-9 * given
    # At a block where it carries none and none is measured, only an overflow would be refused.
    assert checker.check(request({**item, "layer": 0}), chat=False).warnings == []


def test_a_steer_whose_origin_carries_a_norm_is_checked_against_it(model, checker):
    v = vector(model, 4)
    norm = 3.0
    origin = {**{key: value for key, value in identity(model).items() if key != "name"},
              CARRIED: carried_entry("mlp_output", 1, norm)}
    item = {"value": "mlp_output", "layer": 1, "vector": v.tolist(), "scale": 300 * norm / float(v.norm()),
            "on_dose": "clamp", "origin": origin}
    assert checker.steered_sites({"steer": [item]}) == []
    checked = checker.check(request(item), chat=False)
    assert "dose 300 = " in checked.warnings[0] and "carried by the steer's vector (origin)" in checked.warnings[0]
    bad = {**item, "origin": {**origin, CARRIED: {"value": "mlp_output", "layer": 1, "norm": -3.0}}}
    with pytest.raises(RequestError) as raised:
        checker.check(request(bad), chat=False)
    assert raised.value.param == "streamscope.steer[0].origin" and "positive finite" in raised.value.message
