"""`streamscope.serve.refusals`: a request its worker refused is answered with the refusal, never with vLLM's answer,
and vLLM is told the client left (so it aborts the request); an answer without a verdict passes untouched.

The ASGI app here stands in for vLLM's: it reads the request's body, then
either answers at once or generates while listening for a disconnect, as
vLLM's routes do (``with_cancellation``, Starlette's ``StreamingResponse``).
The server test (tests/vllm/test_serve_graph_refusals.py) holds the whole path.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from streamscope.serve.refusals import Guard, Refusals, ticket_of, write

START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def chunk(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


class Client:
    """What reaches the client, and the client's side of receive (it never leaves by itself)."""

    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []

    async def send(self, message: dict[str, Any]) -> None:
        self.got.append(message)

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # a client that stays until the answer ends
        return {"type": "http.disconnect"}

    def status(self) -> int:
        return self.got[0]["status"]

    def body(self) -> bytes:
        return b"".join(message.get("body", b"") for message in self.got[1:])


def run(folder: Path, app: Any, verdict_after: Any = None, status: int = 503,
        aborted: bool = False) -> tuple[Client, Any]:
    """`app(guard_receive, guard_send)` behind a `Guard`; the worker's verdict written after `verdict_after`
    seconds (None: never); `aborted`: a verdict on a request that ran (a hook failed), rather than a refusal."""
    refusals = Refusals(folder, interval=0.001)
    ticket = refusals.ticket()
    client = Client()

    async def main() -> Any:
        guard = Guard(refusals, ticket, b'{"prompt": "x"}', client.send, client.receive)

        async def worker() -> None:
            await asyncio.sleep(verdict_after)
            message = "the hook at layers.1.layer_output failed" if aborted else "the slot bank is full: start with more slots"
            write(folder, ticket, status, message, aborted=aborted)

        task = asyncio.ensure_future(worker()) if verdict_after is not None else None
        try:
            return await app(guard.receive, guard.send)
        finally:
            refusals.forget(ticket)
            if task is not None:
                await task

    return client, asyncio.run(main())


def test_a_verdict_written_before_the_answer_is_the_answer(tmp_path: Path) -> None:
    async def app(receive: Any, send: Any) -> None:
        assert (await receive())["body"] == b'{"prompt": "x"}'
        await asyncio.sleep(0.05)  # a step ran (the verdict was written before it)
        await send(START)
        await send(chunk(b'data: {"choices": [{"text": "unsteered"}]}\n\n'))
        await send(chunk(b"data: [DONE]\n\n", more=False))

    client, _ = run(tmp_path, app, verdict_after=0.0)
    assert client.status() == 503 and b"unsteered" not in client.body()
    error = json.loads(client.body())["error"]
    assert "refused this request, which did not run: the slot bank is full" in error["message"]
    assert error["param"] == "streamscope" and error["code"] == 503
    assert not list(tmp_path.iterdir())  # the verdict deleted once answered


def test_a_verdict_while_generating_answers_at_once_and_tells_vllm_the_client_left(tmp_path: Path) -> None:
    seen: list[str] = []

    async def app(receive: Any, send: Any) -> str:
        await receive()
        generating = asyncio.ensure_future(asyncio.sleep(30))  # a long non-streamed completion
        listening = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({generating, listening}, return_when=asyncio.FIRST_COMPLETED)
        generating.cancel()  # vLLM's with_cancellation: the request aborted
        seen.append(listening.result()["type"] if listening in done else "finished")
        await send({**START, "headers": [(b"content-type", b"application/json")]})  # the handler's None, answered
        await send(chunk(b"null", more=False))
        return "aborted"

    client, result = run(tmp_path, app, verdict_after=0.05, status=400)
    assert result == "aborted" and seen == ["http.disconnect"]
    assert client.status() == 400 and len(client.got) == 2 and b"null" not in client.body()


def test_an_answer_without_a_verdict_passes_as_vllm_made_it(tmp_path: Path) -> None:
    sent = [START, chunk(b": keep-alive\n\n"), chunk(b'data: {"choices": []}\n\n'), chunk(b"data: [DONE]\n\n", False)]

    async def app(receive: Any, send: Any) -> None:
        await receive()
        for message in sent:
            await send(message)

    client, _ = run(tmp_path, app)
    assert client.got == sent


def test_a_keep_alive_before_the_first_step_does_not_settle_the_answer(tmp_path: Path) -> None:
    async def app(receive: Any, send: Any) -> None:
        await receive()
        await send(START)
        await send(chunk(b": keep-alive\n\n"))  # vLLM's keep-alive, while the request waits for its first step
        await asyncio.sleep(0.05)  # the worker refuses it in that step
        await send(chunk(b'data: {"choices": [{"text": "unsteered"}]}\n\n'))

    client, _ = run(tmp_path, app, verdict_after=0.02)
    assert client.status() == 503 and b"unsteered" not in client.body() and b"keep-alive" not in client.body()


def test_the_worker_writes_only_for_a_ticket_the_front_end_makes(tmp_path: Path) -> None:
    write(tmp_path, "../escape", 400, "no")
    write(None, "0" * 32, 400, "no")
    write(tmp_path, "0" * 32, 400, "the reason")
    assert [path.name for path in tmp_path.iterdir()] == ["0" * 32 + ".json"]
    error = Refusals(tmp_path).verdict("0" * 32)
    assert error is not None and error.status == 400 and error.message.endswith("did not run: the reason")


def _events(body: bytes) -> list[Any]:
    """A server-sent-event stream's data lines, JSON decoded (``[DONE]`` kept as the string)."""
    found = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


def _generating_stream(seen: list[str], verdict: Any = None) -> Any:
    """An app streaming a token every 10 ms until vLLM would abort it (a disconnect), as vLLM's streaming routes do;
    `verdict()` is called (the worker's hook failing) just before its third token is sent."""
    async def app(receive: Any, send: Any) -> str:
        await receive()
        listening = asyncio.ensure_future(receive())
        await send(START)
        for token in range(200):
            if listening.done():
                seen.append(listening.result()["type"])
                return "aborted"
            if token == 2 and verdict is not None:
                verdict()
            await send(chunk(json.dumps({"choices": [{"text": f"t{token}"}]}).encode().join([b"data: ", b"\n\n"])))
            await asyncio.sleep(0.01)
        await send(chunk(b"data: [DONE]\n\n", more=False))
        seen.append("finished")
        return "finished"
    return app


def _ends_with_the_error(client: Client, first_tokens: int) -> None:
    """The stream the client got: 200, its first tokens, then vLLM's streaming error event and the stream's end."""
    assert client.status() == 200
    events = _events(client.body())
    assert [event["choices"][0]["text"] for event in events[:-2]] == [f"t{n}" for n in range(first_tokens)], events
    error = events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500, error
    assert error["type"] == "InternalServerError" and error["param"] == "streamscope"
    assert "aborted this request rather than serve it unsteered or unread: the hook at layers.1.layer_output " \
           "failed" in error["message"], error
    assert events[-1] == "[DONE]" and client.got[-1]["more_body"] is False


def test_a_verdict_after_a_stream_started_ends_it_with_an_error_event_and_aborts_the_request(tmp_path: Path) -> None:
    """A hook fails while the stream runs: the client's stream ends with the error at once (the poll sees the
    verdict), vLLM gets a disconnect (it aborts the request), and nothing vLLM sends after reaches the client."""
    seen: list[str] = []
    client, result = run(tmp_path, _generating_stream(seen), verdict_after=0.05, status=500, aborted=True)
    assert result == "aborted" and seen == ["http.disconnect"]
    tokens = len(_events(client.body())) - 2
    assert 1 <= tokens < 20, client.got
    _ends_with_the_error(client, tokens)
    assert not list(tmp_path.iterdir())  # the verdict deleted once answered


def test_a_chunk_sent_after_the_verdict_never_reaches_the_client(tmp_path: Path) -> None:
    """The step that failed makes a token after the verdict is on disk, before any poll: the chunk is checked
    against the verdict as it passes, so the client gets the error in its place."""
    seen: list[str] = []
    refusals = Refusals(tmp_path, interval=3600.0)  # a poll that never comes in time: only the check on send
    ticket = refusals.ticket()
    client = Client()

    async def main() -> Any:
        guard = Guard(refusals, ticket, b'{"prompt": "x"}', client.send, client.receive)
        app = _generating_stream(seen, lambda: write(tmp_path, ticket, 500, "the hook at layers.1.layer_output "
                                                                              "failed", aborted=True))
        try:
            return await app(guard.receive, guard.send)
        finally:
            guard.close()
            refusals.forget(ticket)
            if refusals.poller is not None:
                refusals.poller.cancel()

    assert asyncio.run(main()) == "aborted" and seen == ["http.disconnect"]
    _ends_with_the_error(client, 2)


def test_a_finished_stream_stops_being_watched(tmp_path: Path) -> None:
    """A verdict after a stream's last chunk changes nothing: the client has the whole answer."""
    seen: list[str] = []

    async def app(receive: Any, send: Any) -> None:
        await receive()
        await send(START)
        await send(chunk(b'data: {"choices": [{"text": "t0"}]}\n\n'))
        await send(chunk(b"data: [DONE]\n\n", more=False))
        await asyncio.sleep(0.05)  # the verdict comes (a later step of nothing), the app waits on the client
        listening = asyncio.ensure_future(receive())
        await asyncio.sleep(0.05)
        seen.append("listening" if not listening.done() else listening.result()["type"])
        listening.cancel()

    client, _ = run(tmp_path, app, verdict_after=0.02, status=500, aborted=True)
    assert seen == ["listening"] and client.status() == 200 and _events(client.body())[-1] == "[DONE]"
    assert not any("error" in event for event in _events(client.body()) if isinstance(event, dict))


def test_a_non_streamed_answer_of_an_aborted_request_is_the_error(tmp_path: Path) -> None:
    """A hook failed in a step of a non-streamed request: its body comes at the end, and the error replaces it."""
    async def app(receive: Any, send: Any) -> None:
        await receive()
        await asyncio.sleep(0.05)  # the request's steps ran, one of them failed
        await send({**START, "headers": [(b"content-type", b"application/json")]})
        await send(chunk(b'{"choices": [{"text": "half steered"}]}', more=False))

    client, _ = run(tmp_path, app, verdict_after=0.0, status=500, aborted=True)
    error = json.loads(client.body())["error"]
    assert client.status() == 500 and error["code"] == 500 and error["type"] == "InternalServerError"
    assert "aborted this request rather than serve it unsteered or unread: the hook at" in error["message"]


def test_a_payloads_ticket_is_read_where_the_front_end_puts_it() -> None:
    ticket = "ab" * 16
    assert ticket_of(f'{{"ticket":"{ticket}","steer":[]}}') == ticket
    assert ticket_of(json.dumps({"steer": [], "ticket": ticket})) == ticket  # elsewhere in the plan: decoded
    assert ticket_of('{"steer":[]}') is None
