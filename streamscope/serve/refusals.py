"""A request the worker refuses gets an error, never a completion: the worker's verdict carried to the front end.

The front end checks a request's plan before it reaches the engine, but only
the worker knows some of what can refuse it: on a server whose hooks do not
fire (``--graph-ops`` compiled on a GPU) a request whose steers the graph ops
cannot place at that moment (their slot bank full of other requests'
operations) or at all (steers out of the ops' order at one module call), and
on any server a plan the worker cannot build (an SAE file gone). Such a
request would otherwise run unsteered, a plausible and wrong completion.

So every request with a plan carries a ticket (`Refusals.ticket`, in its
worker payload). A worker that refuses the request writes its verdict (a
status and a message naming the fix) as ``<ticket>.json`` in the server's
folder of verdicts (`write`; a temporary folder of its own, passed to the
engine's processes with the harvest folder) while it takes the step's schedule in, before that
step runs. vLLM answers a request only after a step of it has run, so the
verdict, if any, is on disk before the first byte of the request's answer
exists. The front end (`Guard`) holds the response's start until its first
body bytes, reads the ticket's verdict then (`Refusals.verdict`), and sends
the error instead of the completion where there is one. It also watches for
the verdict while vLLM generates (`Refusals.future`: one poll of the folder
for every waiting request), so a refused request is answered at once and
aborted in the engine (its ASGI receive reports a disconnect, which vLLM
answers by aborting the request), not run to its last token.

A worker also aborts requests that already ran: where a hook fails mid-step
(or a step's plan cannot be made), every request with work in that step gets
a 500 verdict naming the failure (``aborted``: it ran, and was stopped rather
than served unsteered). Its verdict is on disk before that step's output
exists, but a streamed answer may have started: the `Guard` of a stream keeps
watching until the stream ends, checks for a verdict before each chunk it
passes, and on one ends the stream with an error event as vLLM's own streaming
errors take (``data: {"error": {...}}`` then ``data: [DONE]``: the openai client
raises on it), then has vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from .protocol import FIELD, RequestError
from .writer import valid_id

#: The key of a request's ticket in its worker payload.
TICKET = "ticket"
#: A verdict no request waits for any more (its client went away first) is deleted once this old, in seconds.
STALE = 600.0

Message = dict
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
DISCONNECT: Message = {"type": "http.disconnect"}


class RequestRefused(ValueError):
    """A worker's refusal of one request: the HTTP status its answer takes (400: the request cannot be served
    here; 503: not now, the engine's graph ops are busy with other requests) and the message naming the fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def write(folder: Optional[Path], ticket: Any, status: int, message: str, aborted: bool = False) -> None:
    """The worker's verdict on the request holding `ticket`, written aside then renamed (the front end never reads
    half of it); nothing where the request has no valid ticket. `aborted`: the request ran some steps and was
    stopped (a hook failed), rather than refused before it ran."""
    if folder is None or not valid_id(ticket):
        return
    aside = folder / f".{ticket}.{os.getpid()}.writing"  # (ranks of one engine may write the same verdict at once)
    aside.write_text(json.dumps({"status": status, "message": message, "aborted": aborted}))
    os.replace(aside, folder / f"{ticket}.json")


def ticket_of(payload: str) -> Any:
    """A worker payload's ticket (None where it has none): the front end writes it first
    (``{"ticket":"<32 hex digits>",...``), read from there without decoding the whole plan a second time."""
    head = f'{{"{TICKET}":"'
    if payload.startswith(head) and payload[len(head) + 32:len(head) + 34] == '",':
        return payload[len(head):len(head) + 32]
    return json.loads(payload).get(TICKET)


class Refusals:
    """The front end's side: tickets handed out, each request's verdict read or waited for."""

    def __init__(self, folder: Path, interval: float = 0.005) -> None:
        self.folder = folder  # where the workers write their verdicts, ``<ticket>.json``
        self.folder.mkdir(parents=True, exist_ok=True)
        self.interval = interval  # seconds between two polls of the folder, while any request waits
        self.waiting: dict[str, asyncio.Future] = {}
        self.poller: Optional[asyncio.Task] = None

    def ticket(self) -> str:
        """A new request's ticket (32 hex digits, as a harvest's id: `writer.valid_id`)."""
        return secrets.token_hex(16)

    def verdict(self, ticket: str) -> Optional[RequestError]:
        """The worker's refusal of `ticket`'s request as the error its answer is, or None where it has none."""
        path = os.path.join(self.folder, ticket + ".json")
        # A streamed answer asks before each chunk, and nearly always finds nothing: a stat of a string path costs a
        # fifth of a failed open through pathlib (3 against 16 us here), on the event loop every stream shares.
        if not os.path.exists(path):
            return None
        try:
            with open(path) as handle:
                found = json.loads(handle.read())
        except FileNotFoundError:
            return None
        if found.get("aborted"):
            said = "aborted this request rather than serve it unsteered or unread"
        else:
            said = "refused this request, which did not run"
        return RequestError(int(found["status"]), FIELD, f"{FIELD}: the engine's worker {said}: {found['message']}")

    def future(self, ticket: str) -> asyncio.Future:
        """A future that takes `ticket`'s refusal (`verdict`) once its worker writes one; the folder is polled, once
        for every waiting request, while any waits. `forget` cancels it."""
        found = self.waiting.get(ticket)
        if found is None:
            found = self.waiting[ticket] = asyncio.get_running_loop().create_future()
            if self.poller is None or self.poller.done():
                self.poller = asyncio.get_running_loop().create_task(self._poll())
        return found

    async def _poll(self) -> None:
        while self.waiting:
            with os.scandir(self.folder) as entries:
                names = [entry.name for entry in entries if entry.name.endswith(".json")]
            for name in names:
                ticket = name[:-len(".json")]
                waiter = self.waiting.get(ticket)
                if waiter is not None and not waiter.done():
                    error = self.verdict(ticket)
                    if error is not None:
                        waiter.set_result(error)
                elif waiter is None:
                    self._expire(self.folder / name)
            await asyncio.sleep(self.interval)

    @staticmethod
    def _expire(path: Path) -> None:
        try:
            if time.time() - path.stat().st_mtime > STALE:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            pass

    def forget(self, ticket: str) -> None:
        """`ticket`'s request is answered: stop waiting for its verdict and delete it, if written."""
        waiter = self.waiting.pop(ticket, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        (self.folder / f"{ticket}.json").unlink(missing_ok=True)


class Guard:
    """One request's ASGI send and receive between vLLM's app and the client, so that the client gets the worker's
    refusal (`Refusals`) and never a completion of a refused request.

    `send` holds the response's start until its first body bytes and reads
    the verdict then: none, and the response passes as vLLM made it; one, and
    the client gets the error instead. `receive` gives vLLM the request's
    body, then waits for the client's next message or the verdict, whichever
    comes first; on a verdict the client gets the error at once, and vLLM a
    disconnect, on which it aborts the request. A started stream (an
    ``text/event-stream`` answer) is watched until it ends, for a verdict
    that aborts a request mid-generation (a hook failed): each chunk passes
    only where no verdict is on disk, and on one the stream ends with an error
    event (`stream_error`) and vLLM gets the disconnect.
    """

    def __init__(self, refusals: Refusals, ticket: str, body: bytes, send: Send, receive: Receive) -> None:
        self.refusals, self.ticket = refusals, ticket
        self.body: Optional[bytes] = body
        self.downstream, self.upstream = send, receive
        self.start: Optional[Message] = None  # the response's start, held until its first body bytes
        self.held: list[Message] = []  # keep-alive comments of a stream, held with the start
        self.settled = False  # the first body bytes went to the client: an error can no longer replace the answer
        self.streaming = False  # the answer is a server-sent-event stream: watched for a verdict until it ends
        self.ended = False  # the answer's last body bytes went to the client
        self.refused = False  # the client got the refusal: nothing of vLLM's answer goes to it
        self.client: Optional[asyncio.Future] = None  # the client's next message, asked once, kept across calls
        self.stopped: Optional[asyncio.Future] = None  # done once the client got an error: `receive` tells vLLM

    async def send(self, message: Message) -> None:
        if self.refused:
            return
        if not self.settled:
            if message["type"] == "http.response.start":
                self.start = message
                self.streaming = _event_stream(message)
                return
            if message["type"] == "http.response.body":
                if message.get("more_body", False) and _comment(message.get("body", b"")):
                    self.held.append(message)  # vLLM's keep-alive (--sse-keep-alive...): no step has to have run
                    return
                error = self.refusals.verdict(self.ticket)
                if error is not None:
                    await self.refuse(error)
                    return
                self.settled = True
                if not self.streaming:
                    self.refusals.forget(self.ticket)  # the whole answer: no step of it runs any more
                held, self.held = ([self.start] if self.start is not None else []) + self.held, []
                self.start = None
                for earlier in held:
                    await self.downstream(earlier)
        elif self.streaming and message["type"] == "http.response.body" and not self.ended:
            # a chunk of a step after a hook failed must not reach the client: the verdict is on disk before it
            error = self.refusals.verdict(self.ticket)
            if error is not None:
                await self.stream_error(error)
                return
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self.downstream(message)

    def watching(self) -> bool:
        """Whether a verdict can still change what the client gets: before the answer starts, or while a started
        stream goes on."""
        return not self.refused and (not self.settled or self.streaming and not self.ended)

    async def receive(self) -> Message:
        if self.body is not None:
            data, self.body = self.body, None
            return {"type": "http.request", "body": data, "more_body": False}
        while True:
            if self.refused:
                return DISCONNECT
            if self.client is None:
                self.client = asyncio.ensure_future(self.upstream())
            if self.stopped is None:
                self.stopped = asyncio.get_running_loop().create_future()
            waits: set[asyncio.Future] = {self.client, self.stopped}
            if self.watching():
                waits.add(self.refusals.future(self.ticket))
            # (not cancelled with this call: a message the client sent is kept for the next call)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self.client in done:
                message, self.client = self.client.result(), None
                return message
            verdict = next(iter(done))
            if verdict is self.stopped or verdict.cancelled() or not self.watching():
                continue  # the answer went out first (`forget`): only the client's messages matter now
            if self.settled:
                await self.stream_error(verdict.result())
            else:
                await self.refuse(verdict.result())

    def close(self) -> None:
        """The exchange is over: the client's next message, if still asked for, is not waited for any more."""
        if self.client is not None and not self.client.done():
            self.client.cancel()

    async def refuse(self, error: RequestError) -> None:
        """Answer the client with `error` in place of vLLM's answer (once)."""
        if self.refused or self.settled:
            return
        self._stop()
        data = json.dumps(error_body(error)).encode()
        await self.downstream({"type": "http.response.start", "status": error.status,
                               "headers": [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(data)).encode())]})
        await self.downstream({"type": "http.response.body", "body": data, "more_body": False})

    def _stop(self) -> None:
        """Nothing more of vLLM's answer goes to the client, and vLLM is told it left (`receive`)."""
        self.refused = True
        if self.stopped is not None and not self.stopped.done():
            self.stopped.set_result(None)

    async def stream_error(self, error: RequestError) -> None:
        """End a started stream with `error` (once): vLLM's streaming error event, then its end of stream."""
        if self.refused or self.ended:
            return
        self._stop()
        self.ended = True
        data = f"data: {json.dumps(error_body(error))}\n\ndata: [DONE]\n\n".encode()
        await self.downstream({"type": "http.response.body", "body": data, "more_body": False})


def error_body(error: RequestError) -> dict[str, Any]:
    """`error` in vLLM's error layout (`RequestError.body`), its type named for a server's fault where it is one
    (500: ``InternalServerError``, 503: ``ServiceUnavailableError``)."""
    body = error.body()
    server_kinds = {500: "InternalServerError", 503: "ServiceUnavailableError"}
    body["error"]["type"] = server_kinds.get(error.status, body["error"]["type"])
    return body


def _event_stream(start: Message) -> bool:
    """Whether the response `start` begins is a server-sent-event stream."""
    return any(name.lower() == b"content-type" and value.split(b";")[0].strip().lower() == b"text/event-stream"
               for name, value in start.get("headers", ()))


def _comment(body: bytes) -> bool:
    """Whether `body` is nothing but server-sent-event comments (lines starting with a colon), or empty."""
    return all(line.startswith(b":") for line in body.splitlines() if line.strip())
