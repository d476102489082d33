"""benchmarks/graph_serve.py (issue 39's benchmark), the parts a device call cannot afford to find wrong: each
workload's request body is one the server's schema takes (or hotwire's spec format), and the per-request bodies go
through the request function vLLM's load generator reads. The servers themselves run on this CPU by hand
(benchmarks/README.md); this checks the rest in seconds."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import graph_serve  # noqa: E402

from streamscope.bulk.schema import RequestJSON, validate_fields  # noqa: E402

LAYERS = 32


def test_every_streamscope_body_is_a_request_the_server_schema_takes():
    for work in graph_serve.workloads(LAYERS, "all"):
        for index in (0, 1, 255, 256, 1000):
            body = work.body(index)
            if body is None or "streamscope" not in body:
                continue
            checked, field, message = validate_fields(RequestJSON, body["streamscope"])
            assert checked is not None, (work.name, field, message)


def test_the_k_sweep_bodies_hold_k_distinct_vectors_and_every_block():
    every = {work.name: work for work in graph_serve.workloads(LAYERS, "all")}
    for k in graph_serve.KS:
        for name, blocks in ((f"steer-one-{k}", [LAYERS // 2]), (f"steer-every-{k}", list(range(LAYERS)))):
            steers = [every[name].body(index)["streamscope"]["steer"] for index in range(2 * max(graph_serve.KS))]
            assert {steer["vector"] for request in steers for steer in request} == {f"b{i}" for i in range(k)}
            assert all([steer["layer"] for steer in request] == blocks for request in steers)
            assert all(len({steer["vector"] for steer in request}) == 1 for request in steers)
    harvest = every["harvest-4-all"].body(0)["streamscope"]["harvest"]
    assert harvest["layers"] == [4, 12, 20, 28] and harvest["positions"] == "all"
    assert every["ablate-every"].body(3)["streamscope"]["steer"][0]["mode"] == "ablate"


def test_the_hotwire_bodies_are_its_spec_strings():
    every = {work.name: work for work in graph_serve.workloads(LAYERS, "all")}
    for k in (1, 256):
        ids = set()
        for index in range(512):
            spec = json.loads(every[f"hotwire-one-{k}"].body(index)["vllm_xargs"]["hotwire"])
            assert set(spec) == {"id", "layer", "scale"} and spec["layer"] == LAYERS // 2
            ids.add(spec["id"])
        assert ids == {f"b{i}" for i in range(k)}


def test_only_picks_groups_prefixes_and_whole_names_and_always_plain_vllm():
    every = graph_serve.workloads(LAYERS, "all")
    names = [(work.server, work.name) for work in graph_serve.chosen(every, "steer-one-1", control=True)]
    assert names == [("plain", "plain"), ("streamscope", "steer-one-1")]
    one = {work.name for work in graph_serve.chosen(every, "k-one", control=True)}
    assert one == {"plain", "steer-one-1", "steer-one-16", "steer-one-256", "hotwire-plain", "hotwire-one-1",
                   "hotwire-one-256"}
    servers = {work.server for work in graph_serve.chosen(every, "k-every", control=False)}
    assert servers == {"plain", "streamscope"}
    with pytest.raises(SystemExit, match="no workload is named"):
        graph_serve.chosen(every, "steer-sideways", control=True)


def test_the_bodies_go_through_the_request_function_vllm_benchmark_reads():
    from vllm.benchmarks import serve
    from vllm.benchmarks.lib import endpoint_request_func as functions

    assert serve.ASYNC_REQUEST_FUNCS is functions.ASYNC_REQUEST_FUNCS  # the dict the benchmark looks up
    sent = []

    async def recorder(request_func_input, session=None, pbar=None):
        sent.append(request_func_input.extra_body)
        return "done"

    real = functions.ASYNC_REQUEST_FUNCS["vllm"]
    functions.ASYNC_REQUEST_FUNCS["vllm"] = recorder
    try:
        with graph_serve.bodies(lambda index: None if index == 1 else {"n": index}):
            wrapped = serve.ASYNC_REQUEST_FUNCS["vllm"]
            for _ in range(3):
                assert asyncio.run(wrapped(SimpleNamespace(extra_body={"kept": True}), None, None)) == "done"
        assert functions.ASYNC_REQUEST_FUNCS["vllm"] is recorder  # put back
    finally:
        functions.ASYNC_REQUEST_FUNCS["vllm"] = real
    assert sent == [{"kept": True, "n": 0}, {"kept": True}, {"kept": True, "n": 2}]
