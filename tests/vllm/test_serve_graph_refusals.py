"""A ``--graph-ops`` server whose hooks do not fire answers every request its worker refuses with an error, never a
completion run unsteered, and serves the next request (issue 39; `streamscope.serve.refusals`).

A GPU server with ``--graph-ops`` runs vLLM's compiled graphs, where hooks do
not fire: a steer the graph ops cannot place there would run unsteered. This
CPU suite's engine is eager, so the server is started with
``STREAMSCOPE_SERVE_GRAPH_OPS_ONLY=1`` (`streamscope.serve.server.GRAPH_OPS_ONLY`),
which makes its front end and worker serve only what the ops serve and refuse
the rest, as the compiled server does, and with a slot bank of 2. Two streamed
requests with distinct vectors fill the bank; a request sharing one of their
vectors (and scale) shares its slot and is served; a third distinct vector is
refused with 503 naming the fix, streamed or not, and aborted in the engine;
once the streams close, the same request is served, steered as transformers'
float32 forward edited by a plain hook says. Requests that ablate (or clamp)
one stored direction at every block share one operation, hence one slot.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, Iterator
from unittest import mock

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

import attention_oracle
import oracle
import precision
import streamscope
from access import relative_error
from serve_process import KEY, running
from steer_checks import plain_operation
from streamscope.serve.server import GRAPH_OPS_ONLY
from streamscope.serve.storage import harvest_tensors
from streamscope.vllm.model import beside_engine

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the CPU build's server made to refuse as a compiled one "
                                "(STREAMSCOPE_SERVE_GRAPH_OPS_ONLY); a GPU server compiles and refuses by itself: "
                                "docs/graph-ops.md's item 5, not yet run")

PROMPT = "Once upon a time there was"
RELATIVE = precision.CPU_FLOAT32
LAYER = 1
#: Each request's generated tokens: enough that the bank stays full while others arrive.
TOKENS = 480
EVERY_BLOCK = {"values": ["layer_output"], "layers": None, "positions": "all"}


class Server:
    """The server, its model's name, and the oracle of its checkpoint."""

    def __init__(self, url: str, path: Any) -> None:
        self.url = url
        self.api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        self.model = self.api.models.list().data[0].id
        self.client = streamscope.Client(url, api_key=KEY)
        info = self.client.info()
        self.hidden, self.layers = info["hidden_size"], info["layers"]
        with beside_engine():
            self.reference = attention_oracle.reference_model(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def vector(self, seed: int) -> torch.Tensor:
        return torch.randn(self.hidden, generator=torch.Generator().manual_seed(seed))

    def steer(self, seed: int) -> dict[str, Any]:
        """An add at block `LAYER`'s output, every position, of vector `seed`."""
        return {"value": "layer_output", "layer": LAYER, "mode": "add", "scale": 2.0, "positions": "all",
                "vector": self.vector(seed).tolist()}

    def body(self, seed: int, **more: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": PROMPT, "temperature": 0, **more,
                "streamscope": {"steer": [self.steer(seed)]}}

    def oracle_stream(self, seed: Any) -> list[torch.Tensor]:
        """Transformers' float32 ``layer_output`` at every block and prompt position, ``[positions, hidden]``, with
        steer `seed` added by a plain hook (None: unsteered)."""
        steers = [] if seed is None else [streamscope.Steer("layer_output", LAYER, self.vector(seed), scale=2.0,
                                                            positions="all")]
        return self.oracle_of(steers)

    def oracle_of(self, steers: list[streamscope.Steer]) -> list[torch.Tensor]:
        """`oracle_stream` with `steers` (each at every prompt position of its block's ``layer_output``), each applied
        by a plain hook on transformers' float32 forward."""
        ids = torch.tensor([self.tokenizer(PROMPT).input_ids])
        length = ids.shape[1]
        with ExitStack() as stack, torch.no_grad():
            for steer in steers:
                module, where, factor = oracle.site(self.reference, "llama", "layer_output", steer.layer)
                assert factor is None and steer.positions == "all"

                def edit(tensor: torch.Tensor, steer: streamscope.Steer = steer) -> None:
                    stream = tensor.reshape(1, length, tensor.shape[-1])[0]
                    stream[:] = plain_operation(stream, steer)
                stack.enter_context(oracle.hooked(module, where, edit))
            found = oracle.values(self.reference, "llama", ids)["layer_output"]
        return [tensor.reshape(length, -1) for tensor in found]

    def create(self, seed: int, max_tokens: int, stream: bool = False) -> Any:
        """A completion steered by `seed` through the openai client."""
        return self.api.completions.create(model=self.model, prompt=PROMPT, temperature=0, max_tokens=max_tokens,
                                           stream=stream, extra_body={"streamscope": {"steer": [self.steer(seed)]}})

    def ops(self) -> dict[str, Any]:
        return self.client.info()["graph_ops"]


@pytest.fixture(scope="module")
def server(checkpoints: Any, tmp_path_factory: Any) -> Iterator[Server]:
    path = checkpoints("llama")
    log = tmp_path_factory.mktemp("serve-graph-refusals") / "server.log"
    with mock.patch.dict(os.environ, {GRAPH_OPS_ONLY: "1"}), \
            running(path, log, "--graph-ops", '{"slots": 2}') as url:
        yield Server(url, path)


def _generated(url: str) -> float:
    """vLLM's count of the tokens its requests generated (its Prometheus metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_the_server_refuses_as_a_compiled_one(server: Server) -> None:
    ops = server.ops()
    assert ops["hooks_fire"] is False and ops["slots"] == 2 and ops["live"] == 0


def _post(server: Server, seed: int, stream: bool) -> tuple[int, Any]:
    """A long completion steered by `seed` (with a harvest of every block where not streamed): its status, and its
    harvest's rows or its error's message (the body where it is neither)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    field = {"steer": [server.steer(seed)], **({} if stream else {"harvest": EVERY_BLOCK})}
    body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS, "ignore_eos": True,
            "stream": stream, "streamscope": field}
    with httpx.Client(timeout=300) as http, http.stream("POST", server.url + "/v1/completions", headers=headers,
                                                        json=body) as response:
        text = response.read().decode()
    if response.status_code != 200:
        return response.status_code, json.loads(text)["error"]["message"]
    if stream:
        return 200, text
    harvest = json.loads(text)["streamscope"]["harvest"]
    data = httpx.get(f"{server.url}/v1/streamscope/harvests/{harvest}", headers=headers, timeout=60).content
    return 200, harvest_tensors(data)[0]["layer_output"]  # [blocks, positions, hidden]


def _steered(server: Server, rows: torch.Tensor, seed: int) -> None:
    """`rows` (a harvest of every block) are the oracle's stream under steer `seed`, which moved it."""
    expected, plain = server.oracle_stream(seed), server.oracle_stream(None)
    for block in range(server.layers):
        assert relative_error(rows[block].reshape(expected[block].shape), expected[block]) <= RELATIVE, (seed, block)
    assert relative_error(expected[-1], plain[-1]) > 10 * RELATIVE  # the steer moved what the oracle reads


def test_what_the_full_slot_bank_cannot_place_is_refused_and_the_server_serves_on(server: Server) -> None:
    """Eight long requests with distinct vectors at once on a bank of two: each is served steered (its harvest the
    oracle's) or refused with 503 naming the fix and aborted in the engine, never run unsteered; at least one
    is refused. Then the server serves the next request, steered."""
    seeds = list(range(10, 18))
    before = _generated(server.url)
    with ThreadPoolExecutor(len(seeds)) as pool:
        answers = list(pool.map(lambda seed: _post(server, seed, stream=seed % 2 == 1), seeds))
    refused = [seed for seed, (status, _) in zip(seeds, answers) if status != 200]
    assert refused and len(refused) < len(seeds), answers  # the bank filled, and served what it held
    for seed, (status, found) in zip(seeds, answers):
        if status == 200:
            if isinstance(found, torch.Tensor):
                _steered(server, found, seed)
            else:
                assert found.rstrip().endswith("data: [DONE]"), found[-200:]
            continue
        assert status == 503, (seed, status, found)
        assert "slot bank holds 2 distinct steer operations" in found and "'{\"slots\": 4}'" in found, found
    # each refused request aborted in the engine, not run to its last token: the tokens generated are the served
    # requests' and a few of each refused one's (those of the steps before its abort)
    served = len(seeds) - len(refused)
    generated = _generated(server.url) - before
    assert TOKENS * served <= generated < TOKENS * served + TOKENS // 2 * len(refused) / 4, (generated, refused)
    assert server.ops()["live"] == 0
    status, rows = _post(server, 10, stream=False)  # the next request: served, steered
    assert status == 200, rows
    _steered(server, rows, 10)
    # a vector and scale another live request steers with share its slot (one operation): served beside it
    steers = server.ops()["served"]["steers"]
    with ThreadPoolExecutor(3) as pool:
        shared = list(pool.map(lambda seed: _post(server, seed, stream=False), [20, 20, 20]))
    assert [status for status, _ in shared] == [200] * 3 and server.ops()["served"]["steers"] == steers + 3
    for _, rows in shared:
        _steered(server, rows, 20)


@pytest.mark.parametrize("mode", ["ablate", "clamp"])
def test_one_direction_at_every_block_takes_one_slot_for_every_request(server: Server, mode: str) -> None:
    """Three long requests at once, each ablating (or clamping) one stored direction at every block: the requests
    and blocks share one operation, so the bank of two holds them all (one slot each would need three times the
    blocks), and each request's harvest is transformers' stream with the direction edited at every block."""
    direction = server.vector(40)
    server.client.store_vector(f"every-{mode}", direction)
    steers = [{"value": "layer_output", "layer": block, "mode": mode, "vector": f"every-{mode}", "positions": "all",
               **({"projection": 0.5} if mode == "clamp" else {})} for block in range(server.layers)]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS // 4, "ignore_eos": True,
            "streamscope": {"steer": steers, "harvest": EVERY_BLOCK}}

    def post(_: int) -> tuple[int, Any]:
        response = httpx.post(server.url + "/v1/completions", headers=headers, json=body, timeout=300)
        return response.status_code, response.json()

    served = server.ops()["served"]["steers"]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(post, range(3)))
    assert [status for status, _ in answers] == [200] * 3, answers
    assert server.ops()["served"]["steers"] == served + 3 * server.layers and server.ops()["live"] == 0
    expected = server.oracle_of([streamscope.Steer("layer_output", block, direction, mode=mode, positions="all",
                                                   projection=0.5 if mode == "clamp" else None)
                                 for block in range(server.layers)])
    plain = server.oracle_stream(None)
    assert relative_error(expected[-1], plain[-1]) > 10 * RELATIVE  # the edits moved what the oracle reads
    for _, answer in answers:
        harvest = answer["streamscope"]["harvest"]
        data = httpx.get(f"{server.url}/v1/streamscope/harvests/{harvest}", headers=headers, timeout=60).content
        rows = harvest_tensors(data)[0]["layer_output"]
        for block in range(server.layers):
            assert relative_error(rows[block].reshape(expected[block].shape), expected[block]) <= RELATIVE, block


def test_an_add_and_a_set_of_one_stored_vector_at_once_each_do_their_own(server: Server) -> None:
    """The worker hands both requests one ``scale * vector`` tensor (one vector, one scale): the set, running beside
    the add, still sets, and the add still adds, each as transformers' forward edited by a plain hook says."""
    vector = server.vector(50)
    server.client.store_vector("add-and-set", vector)
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(mode: str) -> Any:
        steer = {"value": "layer_output", "layer": LAYER, "mode": mode, "scale": 2.0, "vector": "add-and-set",
                 "positions": "all"}
        body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": TOKENS // 4,
                "ignore_eos": True, "streamscope": {"steer": [steer], "harvest": EVERY_BLOCK}}
        response = httpx.post(server.url + "/v1/completions", headers=headers, json=body, timeout=300)
        assert response.status_code == 200, response.text
        harvest = response.json()["streamscope"]["harvest"]
        data = httpx.get(f"{server.url}/v1/streamscope/harvests/{harvest}", headers=headers, timeout=60).content
        return harvest_tensors(data)[0]["layer_output"]

    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(post, ["add", "set", "add", "set"]))
    for mode, rows in zip(["add", "set", "add", "set"], found):
        expected = server.oracle_of([streamscope.Steer("layer_output", LAYER, vector, mode=mode, scale=2.0,
                                                       positions="all")])
        for block in range(server.layers):
            assert relative_error(rows[block].reshape(expected[block].shape), expected[block]) <= RELATIVE, \
                (mode, block)


def test_an_unserved_steer_is_refused_by_the_front_end_before_the_engine(server: Server) -> None:
    """What no op serves (a value without one) is refused before the engine with 400 naming the fix."""
    steer = {**server.steer(4), "value": "attention_norm_output"}
    with pytest.raises(openai.BadRequestError, match="no graph op edits 'attention_norm_output'.*--enforce-eager"):
        server.api.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                      extra_body={"streamscope": {"steer": [steer]}})
    assert server.create(4, 2).choices[0].finish_reason == "length" and server.ops()["live"] == 0  # and serves on
