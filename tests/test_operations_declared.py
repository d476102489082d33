"""Every steering operation on every path, against the one declaration (issue 40, item 4).

The declaration is `streamscope.bulk.operations.MODES` (with each mode's numbers in
`streamscope.bulk.steer.MODE_USES`), and the steer's fields are `streamscope.bulk.schema.SteerJSON`'s. From each
path the set of modes it really runs is derived by running it: a mode is on a path where a steer of that mode
goes through the path's own code (its checks, its encoding and decoding) and edits rows as this file's oracle
says, the arithmetic written here in float64 from the formulas of docs/adding-an-operation.md, not streamscope's.

The paths: the trace (`Steer.apply`'s operation), the bulk run (its operation and its dose,
`streamscope.bulk.dose.edit_size`), the server (the declared JSON check, the front end's plan item and the
worker's reading of it), the client (`streamscope.serve.client.steer_request`, read back by the server's check)
and the graph op (`streamscope.vllm.graph_ops.edit_stream`, through `SlotBank`'s mode table). A mode declared and
missing anywhere fails `test_every_operation_is_on_every_path`; the planted checks show the derivation catches a
mode declared without its arithmetic, and one the paths do not know.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

import pytest
import torch

import precision
import streamscope
from streamscope.bulk import operations, schema
from streamscope.bulk import steer as steer_module
from streamscope.bulk.conditions import Condition
from streamscope.bulk.dose import edit_size
from streamscope.bulk.operations import MODES, Operation
from streamscope.sae import SAE
from streamscope.serve.client import steer_request
from streamscope.serve.protocol import vector_from_bytes, worker_item, worker_steer

HIDDEN = 16
ROWS = 5
FEATURE = 3
TOLERANCE = precision.CPU_FLOAT32


def _rows() -> torch.Tensor:
    return torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3


def _vector() -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(2))


def _sae() -> SAE:
    generator, features = torch.Generator().manual_seed(3), 8
    return SAE(torch.randn(HIDDEN, features, generator=generator) / HIDDEN ** 0.5,
               torch.randn(features, generator=generator) * 0.1,
               torch.randn(features, HIDDEN, generator=generator) / features ** 0.5,
               torch.randn(HIDDEN, generator=generator) * 0.1, "layer_output", 1, "relu")


def _unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm()


def _sae_clamp(x: torch.Tensor, steer: Any) -> torch.Tensor:
    sae = steer.sae
    features = torch.relu((x - sae.b_dec.double()) @ sae.W_enc.double() + sae.b_enc.double())
    return x + (steer.projection - features[:, FEATURE]).unsqueeze(-1) * sae.W_dec[FEATURE].double()


#: Each operation's rows in float64, from its formula: ``x`` the rows, ``v`` the vector, ``d`` its unit direction.
ORACLES: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "add": lambda x, s: x + s.scale * s.vector.double(),
    "set": lambda x, s: (s.scale * s.vector.double()).expand_as(x),
    "ablate": lambda x, s: x - s.scale * (x @ _unit(s.vector.double())).unsqueeze(-1) * _unit(s.vector.double()),
    "clamp": lambda x, s: x + (s.projection - x @ _unit(s.vector.double())).unsqueeze(-1) * _unit(s.vector.double()),
    "sae_clamp": _sae_clamp,
}
#: Each operation's dose numerator, ``|edit|``, from its definition (`Steer.max_dose`), with ``h`` the stream's norm.
DOSES: dict[str, Callable[[Any, float], float]] = {
    "add": lambda s, h: abs(s.scale) * float(s.vector.norm()),
    "set": lambda s, h: abs(s.scale) * float(s.vector.norm()),
    "ablate": lambda s, h: abs(s.scale) * h,
    "clamp": lambda s, h: abs(s.projection),
    "sae_clamp": lambda s, h: abs(s.projection) * float(s.vector.norm()),
}


def steer_of(mode: str) -> Optional[streamscope.Steer]:
    """A steer of `mode` with its numbers set (None where the declaration refuses the mode)."""
    numbers = {name: 0.7 if name == "scale" else 1.5 for name in steer_module.MODE_USES.get(mode, {})}
    try:
        if mode == "sae_clamp":
            sae = _sae()
            return streamscope.Steer("layer_output", 1, sae.W_dec[FEATURE].clone(), mode=mode, sae=sae,
                                     feature=FEATURE, **numbers)
        return streamscope.Steer("layer_output", 1, _vector(), mode=mode, **numbers)
    except ValueError:
        return None


def edits_right(steer: Optional[streamscope.Steer], mode: str, sent: Optional[streamscope.Steer] = None) -> bool:
    """Whether `steer` (of `mode`) edits rows through its own operation as `mode`'s oracle says of the steer that
    was `sent` (`steer` itself where None: a steer read back from JSON is held to the one written)."""
    if steer is None or mode not in ORACLES:
        return False
    rows = _rows()
    edited = steer.operation(torch.float32, "cpu")(rows.clone())
    expected = ORACLES[mode](rows.double(), steer if sent is None else sent)
    return bool((edited.double() - expected).abs().max() <= TOLERANCE * max(1.0, float(expected.abs().max())))


def on_trace(mode: str) -> bool:
    return edits_right(steer_of(mode), mode)


def on_bulk(mode: str) -> bool:
    steer = steer_of(mode)
    if steer is None or mode not in DOSES:
        return False
    size, _ = edit_size(steer, 10.0)
    return edits_right(steer, mode) and abs(size - DOSES[mode](steer, 10.0)) <= 1e-6 * max(1.0, size)


def on_server(mode: str) -> bool:
    """The front end's declared check of the steer's JSON, its plan item, and the worker's steer from that item."""
    steer = steer_of(mode)
    if steer is None or schema.validate_field(schema.SteerJSON, "mode", mode) is not None:
        return False
    data = {key: item for key, item in steer_request(steer, "stored-sae").items() if item is not None}
    data.setdefault("vector", steer.vector.tolist())  # the server takes an SAE steer's vector from its SAE
    checked, _, _ = schema.validate_fields(schema.SteerJSON, data)
    if checked is None:
        return False
    item = json.loads(json.dumps(worker_item(steer, steer.layer, steer.vector)))
    decoded = worker_steer(item)
    if mode == "sae_clamp":  # the worker's own copy of the stored SAE
        decoded.sae, decoded.feature = steer.sae, FEATURE
    return torch.equal(vector_from_bytes(item["vector"]), steer.vector) and edits_right(decoded, mode, steer)


def on_client(mode: str) -> bool:
    """The client's request JSON: declared, and carrying the steer's own fields."""
    steer = steer_of(mode)
    if steer is None:
        return False
    data = steer_request(steer, "stored-sae")
    checked, _, _ = schema.validate_fields(schema.SteerJSON, {**data, "vector": data.get("vector", [0.0])})
    return checked is not None and all(getattr(checked, name) == getattr(steer, name)
                                       for name in schema.PLAIN_FIELDS)


def graph_modes(modes: tuple[str, ...]) -> set[str]:
    """The modes the graph op runs as their oracle says, through `SlotBank`'s mode table (`MODE_CODES`)."""
    from streamscope.vllm import graph_ops
    from streamscope.vllm.graph_plan import SlotBank

    found = set()
    for mode in modes:
        steer = steer_of(mode)
        if steer is None or mode not in ORACLES:
            continue
        operation = steer.operation(torch.float32, "cpu")
        bank = SlotBank(1, HIDDEN, torch.float32, "cpu")
        try:
            bank.acquire("key", operation)
        except ValueError:
            continue
        rows = _rows()
        edited = rows.clone()
        graph_ops.edit_stream(edited, None, torch.zeros(ROWS, dtype=torch.int64), *bank.buffers)
        expected = ORACLES[mode](rows.double(), steer)
        if float((edited.double() - expected).abs().max()) <= TOLERANCE * max(1.0, float(expected.abs().max())):
            found.add(mode)
    return found


def hook_only(modes: tuple[str, ...]) -> set[str]:
    """The modes whose operation is their own object, not an `Operation`: the hook path runs them (an SAE's feature
    clamp encodes the rows), and the graph op does not."""
    found = set()
    for mode in modes:
        steer = steer_of(mode)
        if steer is not None and not isinstance(steer.operation(torch.float32, "cpu"), Operation):
            found.add(mode)
    return found


PATHS: dict[str, Callable[[str], bool]] = {"trace": on_trace, "bulk": on_bulk, "server": on_server,
                                           "client": on_client}


def missing(modes: tuple[str, ...]) -> dict[str, list[str]]:
    """Each path's modes of `modes` it does not run, by path (only paths that miss one)."""
    found = {path: [mode for mode in modes if not runs(mode)] for path, runs in PATHS.items()}
    graph = graph_modes(modes)
    found["graph op"] = [mode for mode in modes if mode not in graph and mode not in hook_only(modes)]
    return {path: modes for path, modes in found.items() if modes}


def test_every_operation_is_on_every_path():
    assert missing(MODES) == {}


def test_the_declaration_is_one():
    """The modes and the steer's fields are stated once: the schema's enum, `MODE_USES` and the graph op's table
    come from `MODES` (or cover it), and `Steer` and `Condition` have the declared fields."""
    from streamscope.vllm.graph_ops import MODE_CODES

    enum = schema.request_schema()["$defs"]["SteerJSON"]["properties"]["mode"]["enum"]
    assert tuple(enum) == MODES and set(steer_module.MODE_USES) == set(MODES)
    assert set(MODE_CODES) == set(MODES) - hook_only(MODES)
    assert tuple(field.name for field in dataclasses.fields(streamscope.Steer)) == schema.STEER_FIELDS
    assert tuple(field.name for field in dataclasses.fields(Condition)) == schema.CONDITION_FIELDS


def test_a_planted_mode_without_its_arithmetic_is_missing_from_every_path(monkeypatch):
    """A mode declared (in `MODES` and `MODE_USES`) and nothing else: `prepare` builds it an `Operation` that runs
    another mode's arithmetic. Every path is reported missing it."""
    planted = (*MODES, "scale_down")
    monkeypatch.setattr(operations, "MODES", planted)
    monkeypatch.setattr(steer_module, "MODES", planted)
    monkeypatch.setitem(steer_module.MODE_USES, "scale_down", {"scale": 1.0})
    assert steer_of("scale_down") is not None  # declared: a steer of it is built
    found = missing(planted)
    assert {path: modes for path, modes in found.items()} == {path: ["scale_down"] for path in
                                                             (*PATHS, "graph op")}, found


def test_a_mode_the_paths_do_not_know_is_missing_from_each():
    assert missing((*MODES, "multiply")) == {path: ["multiply"] for path in (*PATHS, "graph op")}


@pytest.mark.parametrize("mode", MODES)
def test_a_steer_travels_as_data_and_back(mode):
    """`Steer.to_dict` / `from_dict` carry every declared field but an SAE (weights, not data)."""
    steer = steer_of(mode)
    assert steer is not None
    if mode == "sae_clamp":
        with pytest.raises(ValueError, match="SAE"):
            steer.to_dict()
        return
    steer.condition = Condition("layer_output", 0, _vector(), 0.5, scope="request")
    data = json.loads(json.dumps(steer.to_dict()))
    assert set(data) == set(schema.STEER_FIELDS) - {"sae"}
    assert schema.validate_fields(schema.SteerJSON, data)[0] is not None
    back = streamscope.Steer.from_dict(data)
    assert back.to_dict() == data


@pytest.mark.parametrize("field, raw, path, words", [
    ("norm_match", "yes", "norm_match", "valid boolean"),
    ("from_step", -1, "from_step", "greater than or equal to 0"),
    ("positions", "first", "positions", "not a positions rule"),
    ("mode", "multiply", "mode", "not one of 'add'"),
    ("scale", float("inf"), "scale", "finite"),
    ("condition", {"value": "layer_output", "vector": [1.0], "threshold": 0.0, "scope": "all"}, "condition.scope",
     "not one of 'row', 'request'"),
    ("condition", {"value": "layer_output", "vector": [1.0]}, "condition.threshold", "needs 'threshold'"),
])
def test_a_declared_refusal_names_the_field_path(field, raw, path, words):
    checked, where, message = schema.validate_fields(schema.SteerJSON, {"value": "layer_output", "vector": [1.0],
                                                                        field: raw})
    assert checked is None and where == path and words in message, (where, message)


def test_harvest_declaration():
    assert schema.validate_fields(schema.HarvestJSON, {"values": "layer_output", "reduce": "max"})[1] == "reduce"
    assert schema.validate_fields(schema.HarvestJSON, {"values": "layer_output", "layers": [0, "1"]})[1] == "layers"
    checked = schema.validate_fields(schema.HarvestJSON, {"values": ["layer_output"]})[0]
    assert checked is not None and checked.positions == schema.HARVEST_POSITIONS
    assert set(schema.request_schema()["properties"]) == set(schema.REQUEST_FIELDS)


def test_compute_order_is_the_steerable_block_values_in_order():
    """`COMPUTE_ORDER` (the order a trace applies steers in one block, and a condition's "no later than" check) holds
    every block value a steer may edit, each once, and the stream's boundaries in the order a block computes
    them (`streamscope.bulk.sites.BOUNDARIES`); a value added to the blocks' lists and not placed here fails."""
    from streamscope.bulk.conditions import COMPUTE_ORDER
    from streamscope.bulk.sites import BOUNDARIES, HEAD_RESULTS_VALUE, NEURONS, ROOT_VALUES, value_names

    steerable = [value for value in value_names() if value not in ROOT_VALUES and value != HEAD_RESULTS_VALUE
                 and value.split(".")[-1] not in NEURONS]
    assert sorted(COMPUTE_ORDER) == sorted(steerable) and len(set(COMPUTE_ORDER)) == len(COMPUTE_ORDER)
    assert [value for value in COMPUTE_ORDER if value in BOUNDARIES] == list(BOUNDARIES)


def test_one_forward_is_one_setting():
    """The one-forward sampling (a harvest's, a calibration's, the vLLM trace's) is spelled in bulk/schema.py only."""
    import re
    from pathlib import Path

    import streamscope
    from streamscope.vllm import engine

    assert engine.ONE_FORWARD is schema.ONE_FORWARD
    # The pair as settings (a dict or keywords); a user's example of a trace call in a docstring is not a setting.
    spelled = re.compile(r"temperature\W+0\.0\W+max_tokens\W+1\b|max_tokens\W+1\W+temperature\W+0\.0")
    package = Path(streamscope.__file__).parent
    found = [f"{path.relative_to(package)}:{number}" for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if spelled.search(line) and "model.trace(" not in line]
    assert len(found) == 1 and found[0].startswith("bulk/schema.py:"), found
