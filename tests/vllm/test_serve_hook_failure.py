"""A hook that fails mid-step on ``streamscope serve`` aborts the requests it steered, each answered with the error,
never with a completion run unsteered; its batchmates and the next requests are served (`ServeState.hook_failed`,
`streamscope.serve.refusals`).

The server is started with the test-only fault `FAIL_HOOK_AT` at block 1's
``layer_output``: its hook raises in every step where it edits a request's
rows. A request steered there gets HTTP 500 naming the failure (not
streamed: its body comes at the end); a streamed one whose steer starts at
its fifth generated token has its stream started when the hook fails, and
the stream ends with vLLM's streaming error event, which the openai client
raises, and the engine aborts it. An unsteered request run beside it is the
same as its run alone, and requests steered elsewhere are served after.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator
from unittest import mock

import httpx
import openai
import pytest
import torch

import precision
import streamscope
from serve_process import KEY, running
from streamscope.serve.worker import FAIL_HOOK_AT

pytestmark = pytest.mark.skipif(precision.ON_GPU, reason="the hooks' failure path is the same code on every device; "
                                "its server starts on the CPU build (tests/serve_process.py)")

PROMPT = "Once upon a time there was"
OTHER = "The capital of France is"
LAYER = 1
#: The failing request's tokens: enough that its abort shows in the engine's count of generated tokens.
TOKENS = 300
#: The unsteered batchmate's tokens: it generates through the failing request's steps.
BESIDE = 160


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        self.model = self.api.models.list().data[0].id
        self.hidden = streamscope.Client(url, api_key=KEY).info()["hidden_size"]

    def steer(self, layer: int = LAYER, **more: Any) -> dict[str, Any]:
        vector = torch.randn(self.hidden, generator=torch.Generator().manual_seed(layer))
        return {"value": "layer_output", "layer": layer, "mode": "add", "scale": 4.0, "positions": "all",
                "vector": vector.tolist(), **more}

    def plain(self, prompt: str, tokens: int) -> list[str]:
        """An unsteered greedy completion's tokens."""
        found = self.api.completions.create(model=self.model, prompt=prompt, temperature=0, max_tokens=tokens,
                                            logprobs=0, extra_body={"ignore_eos": True})
        assert found.choices[0].logprobs is not None
        return list(found.choices[0].logprobs.tokens or [])


@pytest.fixture(scope="module")
def server(checkpoints: Any, tmp_path_factory: Any) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-hook-failure") / "server.log"
    with mock.patch.dict(os.environ, {FAIL_HOOK_AT: f"layers.{LAYER}.layer_output"}), \
            running(checkpoints("llama"), log) as url:
        yield Server(url)


def _generated(url: str) -> float:
    """vLLM's count of the tokens its requests generated (its Prometheus metrics)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(value) for value in re.findall(r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def _names_the_failure(message: str) -> None:
    assert f"the hook at layers.{LAYER}.layer_output failed" in message, message
    assert f"RuntimeError: the fault {FAIL_HOOK_AT}=layers.{LAYER}.layer_output injected" in message, message
    assert "worker aborted this request rather than serve it unsteered or unread: the hook" in message, message


def test_a_failed_hook_answers_its_request_with_500_and_serves_on(server: Server) -> None:
    """Not streamed: the hook fails in the prompt's step; the client gets 500 naming the failure, and the server
    serves the next requests (steered elsewhere, and plain)."""
    body = {"model": server.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 8,
            "streamscope": {"steer": [server.steer()]}}
    response = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=300)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError" and error["param"] == "streamscope"
    _names_the_failure(error["message"])
    with pytest.raises(openai.InternalServerError, match="aborted this request rather than serve it unsteered"):
        server.api.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                      extra_body={"streamscope": {"steer": [server.steer()]}})
    steered = server.api.completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=8,
                                            extra_body={"streamscope": {"steer": [server.steer(0)]}})
    assert steered.choices[0].finish_reason == "length"
    assert len(server.plain(PROMPT, 8)) == 8


def test_a_started_stream_ends_with_the_error_its_batchmate_is_served_as_alone(server: Server) -> None:
    """Streamed, its steer from the fifth generated token: the stream has started when the hook fails. The openai
    client raises on the stream's error event; the engine aborted the request (it generated far fewer than its
    tokens); an unsteered stream generating through that step is token for token its run alone."""
    alone = server.api.completions.create(model=server.model, prompt=OTHER, temperature=0, max_tokens=BESIDE,
                                          extra_body={"ignore_eos": True}).choices[0].text
    before = _generated(server.url)
    beside_started = threading.Event()
    beside: list[str] = []
    failing: list[str] = []
    seen_beside: list[int] = []  # the batchmate's tokens when the failing stream raised

    def unsteered() -> str:
        stream = server.api.completions.create(model=server.model, prompt=OTHER, temperature=0, max_tokens=BESIDE,
                                               stream=True, extra_body={"ignore_eos": True})
        for event in stream:
            beside.append(event.choices[0].text)
            beside_started.set()
        return "".join(beside)

    def steered() -> BaseException:
        stream = server.api.completions.create(
            model=server.model, prompt=PROMPT, temperature=0, max_tokens=TOKENS, stream=True,
            extra_body={"ignore_eos": True,
                        "streamscope": {"steer": [server.steer(positions="none", from_step=4)]}})
        try:
            for event in stream:
                failing.append(event.choices[0].text)
        except openai.APIError as error:
            seen_beside.append(len(beside))
            return error
        raise AssertionError(f"the stream ended without its error: {failing}")

    with ThreadPoolExecutor(2) as pool:
        served = pool.submit(unsteered)
        assert beside_started.wait(120)
        raised = pool.submit(steered).result()
        got = served.result()
    assert failing and len(failing) < TOKENS // 2, failing  # its stream had started; it stopped at the failure
    _names_the_failure(str(raised))
    assert 0 < seen_beside[0] < BESIDE, seen_beside  # the batchmate generated through the failing step
    assert got == alone
    # the engine aborted the failing request rather than running it to its last token
    assert _generated(server.url) - before < TOKENS // 2 + BESIDE, _generated(server.url) - before
    assert len(server.plain(PROMPT, 4)) == 4  # and serves on
