"""``streamscope serve PATH [--taps ...] [vllm serve options]``: vLLM's own OpenAI-compatible server, steerable by name.

vLLM builds and runs everything a ``vllm serve`` user relies on (its engine
client, FastAPI app, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``--api-key``, metrics). streamscope adds three things through
what vLLM offers for it:

* the engine's worker extension (``--worker-extension-cls``,
  `streamscope.worker_extension`), on vLLM's own worker (nnsight's with
  ``--taps``; with ``--graph-ops`` vLLM's own that inserts the graph ops at
  load, `streamscope.serve.graph_workers`), whose `streamscope.serve.worker`
  applies each request's plan, installed on every worker as the server starts;
* an ASGI wrapper around vLLM's completion routes, inside every middleware
  vLLM installs (so ``--api-key`` is checked first), that checks a completion request's ``streamscope`` field and hands
  the plan to vLLM in its ``vllm_xargs``, with a prefix-cache salt; a request
  without the field passes through untouched;
* routes under ``/v1/streamscope/`` (guarded by ``--api-key`` as every ``/v1``
  route is): stored vectors and SAEs, harvest downloads, the default steer, info,
  and the JSON schema of the request's ``streamscope`` field (``schema``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Sequence

from fastapi import APIRouter, Request  # Request at module level: FastAPI reads the routes' annotations by name
from fastapi.responses import JSONResponse, Response
from vllm.platforms import current_platform

from ..bulk.schema import DOSE_ACTIONS, request_schema
from ..bulk.spec import ROOT_VALUES, locate
from ..errors import Unavailable, UnsupportedCheckpoint
from ..models import NAMED, UNRESOLVED, resolve
from ..vllm.graph_backend import GraphOptions, engine_config
from ..vllm.graph_wiring import graph_sites
from ..vllm.model import StandardizedVLLM, refuse_on_the_cpu_build
from ..vllm.taps import tap_locations
from . import host_time
from .forwarding import cache_salt, worker_payload
from .model_routes import add_model_routes
from .protocol import (FIELD, WARNINGS_HEADER, XARG, Checker, Limits, RequestError, needs_lengths, served_values,
                       unknown_sae)
from .refusals import TICKET, Guard, Refusals
from .storage import Harvests, SAEs, Vectors, read_upload, sae_from_bytes, unknown_vector
from .sweeps import add_sweep_routes, reduced
from .vllm_api import serve, server_api
from .worker import ENVIRONMENT, WORKER_EXTENSION, install_at_startup, worker_cls

COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
PREFIX = "/v1/streamscope"
#: The front end's threads that check requests needing their prompts' token counts (a harvest of every position).
CHECK_THREADS = 4


class Front:
    """The API server's streamscope state: the model's names (a meta copy), stored vectors, harvests, limits."""

    def __init__(self, model: Any, limits: Limits, folder: Path, taps: Sequence[str] = (),
                 sae_folder: Optional[Path] = None, harvest_prefix_cache: bool = False) -> None:
        self.model = model
        #: ``--harvest-prefix-cache``: a harvest of the last position only may read its prompt's prefix from
        #: vLLM's prefix cache (`protocol.cache_salt`).
        self.harvest_prefix_cache = harvest_prefix_cache
        self.limits = limits
        self.taps = list(taps)
        self.vectors = Vectors(limits)
        self.checker = Checker(model, self.vectors, limits)
        self.harvests = Harvests(folder, limits)
        #: The workers' refusals of requests, each request's by its ticket (`streamscope.serve.refusals`), in a
        #: folder of their own (the harvest folder holds harvests alone).
        self.refusals = Refusals(Path(tempfile.mkdtemp(prefix="streamscope-refusals-")))
        self.saes = SAEs(sae_folder or Path(tempfile.mkdtemp(prefix="streamscope-saes-")), limits)
        self.checker.saes = self.saes
        self.worker = ""  # the engine's worker class (vLLM's own without taps, nnsight's with them), extended
        #: The CUDA graph mode vLLM resolved for the engine, asked of a tapped engine's worker once (an eager
        #: engine's is ``NONE``; a tapped one's too where vLLM cannot capture the checkpoint's attention).
        self.graph_mode: Optional[str] = None if taps else "NONE"
        #: Where a request's check tokenizes its prompt: threads with a tokenizer each (`Checker.own_tokenizer`).
        self.checks = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="streamscope-check",
                                         initializer=self.checker.own_tokenizer)
        self._served: Optional[tuple[list[str], dict[str, str]]] = None
        #: ``--graph-ops``: the options the engine's worker inserted its graph ops with (None: no ops).
        self.graph_ops: Optional[GraphOptions] = None
        #: Whether the worker's hooks fire in a step (False: a compiled engine, ``--graph-ops`` on a GPU, where a
        #: request the ops cannot serve is refused, `graph_refusal`).
        self.hooks_fire = True
        self._graph_names: Optional[tuple[dict[Any, str], dict[Any, str]]] = None

    def store_sae(self, name: str, data: bytes, param: str = "body") -> dict[str, Any]:
        """Check an uploaded SAE (its layout, weights, width, site, a tap on a tapped server) and store it."""
        sae = sae_from_bytes(data, param)
        try:
            sae.check(self.model)
        except (ValueError, IndexError, Unavailable) as error:
            raise RequestError(400, param, f"{param}: {error}") from None
        self.checker.site(sae.value, sae.layer, param)  # on a tapped server, its site must be a tap
        self.saes.store(name, sae, data)
        return self.saes.listing()[[item["name"] for item in self.saes.listing()].index(name)]

    def served(self) -> tuple[list[str], dict[str, str]]:
        """The values this model's blocks serve (a block value where at least one block serves it), in
        `protocol.served_values`' order, and the others with the reason (the first block's), found once."""
        if self._served is None:
            served: list[str] = []
            unavailable: dict[str, str] = {}
            for value in served_values():
                layers: list[Optional[int]] = [None] if value in ROOT_VALUES else list(range(len(self.model.layers)))
                reasons = []
                for layer in layers:
                    try:
                        locate(self.model, value, layer)
                    except (Unavailable, ValueError, TypeError, IndexError) as refused:
                        reasons.append(str(refused))
                        continue
                    served.append(value)
                    break
                else:
                    unavailable[value] = reasons[0] if reasons else "no block"
            self._served = (served, unavailable)
        return self._served

    def info(self) -> dict[str, Any]:
        values, unavailable = self.served()
        return {"model_type": self.model.config.model_type, "layers": len(self.model.layers),
                "hidden_size": self.checker.hidden, "values": values, "unavailable": unavailable, "taps": self.taps,
                "default_steer": bool(self.checker.default), "vectors": sorted(self.vectors),
                "saes": sorted(self.saes), "worker": self.worker, "graph_mode": self.graph_mode,
                "limits": vars(self.limits)}

    async def graph_info(self, engine: Any) -> Optional[dict[str, Any]]:
        """``--graph-ops``: the options, whether hooks fire, and what the first worker's ops serve
        (`streamscope.serve.worker.ServeRPC.streamscope_serve_graph_ops`); None on a server without them."""
        if self.graph_ops is None:
            return None
        found = (await engine.collective_rpc("streamscope_serve_graph_ops"))[0] if engine is not None else None
        return {"options": self.graph_ops.config(), "hooks_fire": self.hooks_fire, **(found or {})}

    def graph_refusal(self, steers: list[dict[str, Any]], harvest: Optional[dict[str, Any]]) -> None:
        """On a server whose hooks do not fire (compiled graphs, ``--graph-ops`` on a GPU), refuse a request whose
        steers or harvest no graph op can serve, naming why and the fix: a conditional or SAE steer, a steer or
        harvest at a value without an op, more steers at one site than the ops' rounds, an SAE harvest. The worker
        routes what passes (`streamscope.vllm.graph_backend.GraphBackend`) and refuses the rest it cannot place
        (a full slot bank: 503; steers out of the ops' order at one module call: 400), which the request's answer
        then is (`streamscope.serve.refusals`): no request runs unsteered."""
        if self.hooks_fire or self.graph_ops is None:
            return
        edits, harvests = self._graph_sites()
        rounds = self.graph_ops.rounds
        fix = "send it to a server started with --graph-ops off or --enforce-eager (hooks then serve it)"
        counts: dict[Any, int] = {}
        for number, item in enumerate(steers):
            param = f"{FIELD}.steer[{number}]"
            if item.get("condition") is not None or item.get("mode") == "sae_clamp":
                raise RequestError(400, param, f"{param}: a conditional or SAE steer runs on hooks, which do not "
                                               f"fire in this server's compiled graphs: {fix}.")
            key = self._site_key(item["value"], item.get("layer"))
            if key not in edits:
                raise RequestError(400, param, f"{param}: no graph op edits {item['value']!r} at block "
                                               f"{item.get('layer')} on this server: {fix}.")
            counts[key] = counts.get(key, 0) + 1
            if counts[key] > rounds:
                raise RequestError(400, param, f"{param}: {counts[key]} steers at {edits[key]}; the graph ops take "
                                               f"{rounds} (--graph-ops '{{\"rounds\": {counts[key]}}}'), or {fix}.")
        if harvest is None:
            return
        keys = [self._site_key(value, layer) for value in harvest.get("values") or ()
                for layer in ([None] if value in ROOT_VALUES else harvest.get("layers") or ())]
        if "sae" in harvest or any(key not in harvests for key in keys):
            raise RequestError(400, f"{FIELD}.harvest", f"{FIELD}.harvest: an SAE harvest, or a value without a "
                                                        f"harvest op, runs on hooks, which do not fire in this "
                                                        f"server's compiled graphs: {fix}.")

    def _site_key(self, value: str, layer: Optional[int]) -> Any:
        """A value's module call and descriptor on the front's tree (the ops' sites' identity), None if none."""
        try:
            site = locate(self.model, value, layer)
        except (Unavailable, ValueError, TypeError, IndexError):
            return None
        return id(site.module), site.where, id(site.descriptor)

    def _graph_sites(self) -> tuple[dict[Any, str], dict[Any, str]]:
        """The sites of the edit ops and of the harvest ops (`graph_wiring.graph_sites` on the front's tree, as the
        worker finds them on its model), by `_site_key`, with their names; found once."""
        if self._graph_names is None:
            assert self.graph_ops is not None
            values, harvested = self.graph_ops.values, self.graph_ops.harvest
            sites, _ = graph_sites(self.model, values=tuple(dict.fromkeys(values + harvested)))
            keyed = {name: (id(site.module), site.where, id(site.descriptor)) for name, site in sites.items()}
            self._graph_names = ({key: name for name, key in keyed.items() if name.split(".", 2)[2] in values},
                                 {key: name for name, key in keyed.items() if name.split(".", 2)[2] in harvested})
        return self._graph_names

    async def read_graph_mode(self, engine: Any) -> None:
        """`graph_mode` as the engine's first worker resolved it (a tapped engine's worker answers
        ``streamscope_graph_mode``), once."""
        if self.graph_mode is None and engine is not None:
            self.graph_mode = (await engine.collective_rpc("streamscope_graph_mode"))[0]

    def extend(self, app: Any) -> Any:
        """Add streamscope's routes and request check to the app vLLM built; returns it."""
        app.include_router(self.router())
        install_at_startup(app)  # every worker's ServeState, before the server takes requests
        # Around the completion routes' own handlers: inside every middleware vLLM installed (its API key
        # check first of all), and without rebuilding its middleware stack (its metrics middleware is built once).
        wrapped = 0
        for route in app.routes:
            if getattr(route, "path", None) in COMPLETIONS:
                route.app = SteerMiddleware(route.app, self)
                wrapped += 1
        if wrapped != len(COMPLETIONS):
            raise RuntimeError(f"vLLM's app has {wrapped} of the routes {', '.join(COMPLETIONS)}: this vLLM "
                               f"release is not one streamscope serve knows.")
        return app

    def router(self) -> Any:
        """The routes under ``/v1/streamscope/``, by group: info and the request schema, stored vectors, stored
        SAEs, harvests, the default steer, and what a Client needs to stand in for a model."""
        router = APIRouter(prefix=PREFIX)
        self.add_info_routes(router)
        self.add_vector_routes(router)
        self.add_sae_routes(router)
        self.add_harvest_routes(router)
        self.add_default_steer_routes(router)

        add_model_routes(router, self)  # what a Client needs to stand in for a model (lens, cache, directions)

        add_sweep_routes(router, self)  # a patching sweep and running moments, run by the server in one request
        return router

    async def upload(self, request: Request, limit: Optional[int] = None, flag: str = "--max-upload-bytes") -> bytes:
        """An upload's body, refused (413, naming `flag`) past `limit` (the server's --max-upload-bytes if None)."""
        limit = self.limits.max_upload_bytes if limit is None else limit
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, "body", f"body: {declared} bytes; uploads are limited to {limit} ({flag}).")
        data = await request.body()
        if len(data) > limit:
            raise RequestError(413, "body", f"body: {len(data)} bytes; uploads are limited to {limit} ({flag}).")
        return data

    def add_info_routes(self, router: Any) -> None:
        """``GET info`` (the model, its values, the limits) and ``GET schema`` (the JSON schema of a request's
        ``streamscope`` field, from its one declaration, `streamscope.bulk.schema`)."""
        @router.get("/info")
        async def info(request: Request) -> Any:
            engine = getattr(request.app.state, "engine_client", None)
            await self.read_graph_mode(engine)
            return {**self.info(), "graph_ops": await self.graph_info(engine)}

        @router.get("/schema")
        async def schema() -> Any:
            return request_schema()

    def add_vector_routes(self, router: Any) -> None:
        """Stored vectors: list, store (PUT or POST), fetch, delete."""
        @router.get("/vectors")
        async def vectors() -> Any:
            return {"vectors": self.vectors.listing()}

        @router.put("/vectors/{name}")
        @router.post("/vectors/{name}")
        async def store(name: str, request: Request) -> Any:
            try:
                vector, carried = read_upload(await self.upload(request), request.headers.get("content-type", ""),
                                              self.checker)
                self.vectors.store(name, vector, carried)
            except RequestError as error:
                return refused(error)
            return self.vectors.entry(name)

        @router.get("/vectors/{name}")
        async def fetch(name: str) -> Any:
            if name not in self.vectors:
                return refused(unknown_vector(name))
            return Response(self.vectors.file(name), media_type="application/octet-stream")

        @router.delete("/vectors/{name}")
        async def delete(name: str) -> Any:
            if self.vectors.pop(name, None) is None:
                return refused(unknown_vector(name))
            return {"deleted": name}

    def add_sae_routes(self, router: Any) -> None:
        """Stored SAEs: list, store (safetensors bytes), delete."""
        @router.get("/saes")
        async def saes() -> Any:
            return {"saes": self.saes.listing()}

        @router.put("/saes/{name}")
        @router.post("/saes/{name}")
        async def store_sae(name: str, request: Request) -> Any:
            try:
                kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind not in ("application/octet-stream", "application/safetensors"):
                    raise RequestError(400, "Content-Type", f"Content-Type: {kind or 'none'} is not taken; send an "
                                                            f"SAE as safetensors bytes (application/octet-stream).")
                data = await self.upload(request, self.limits.max_sae_bytes, "--max-sae-bytes")
                return self.store_sae(name, data)
            except RequestError as error:
                return refused(error)

        @router.delete("/saes/{name}")
        async def delete_sae(name: str) -> Any:
            if not self.saes.delete(name):
                return refused(unknown_sae(name, self.saes))
            return {"deleted": name}

    def add_harvest_routes(self, router: Any) -> None:
        """Harvests waiting to be downloaded: list, download (reduced where the request asked), delete."""
        @router.get("/harvests")
        async def harvests() -> Any:
            return {"harvests": self.harvests.listing()}

        @router.get("/harvests/{harvest_id}")
        async def download(harvest_id: str, keep: bool = False) -> Any:
            try:
                data = await self.harvests.take(harvest_id, keep)
            except RequestError as error:
                return refused(error)

            return Response(reduced(data), media_type="application/octet-stream")

        @router.delete("/harvests/{harvest_id}")
        async def forget(harvest_id: str) -> Any:
            if not self.harvests.delete(harvest_id):
                return refused(RequestError(404, "id", f"id: no harvest {harvest_id!r} on this server."))
            return {"deleted": harvest_id}

    def add_default_steer_routes(self, router: Any) -> None:
        """The server-wide default steers: read, set (checked as a request's steers), clear."""
        @router.get("/default-steer")
        async def default() -> Any:
            return {"steer": self.checker.default}

        @router.put("/default-steer")
        async def set_default(request: Request) -> Any:
            try:
                data = await self.upload(request)
                try:
                    parsed = json.loads(data)
                except ValueError:
                    raise RequestError(400, "body", "body: not JSON; send {\"steer\": [...]}.") from None
                if not isinstance(parsed, dict) or set(parsed) != {"steer"}:
                    raise RequestError(400, "body", "body: send {\"steer\": [steers]} (the request field's form).")
                self.checker.default = self.checker.default_steers(parsed["steer"])
            except RequestError as error:
                return refused(error)
            return {"steer": len(self.checker.default)}

        @router.delete("/default-steer")
        async def clear_default() -> Any:
            self.checker.default = []
            return {"steer": 0}


def refused(error: RequestError) -> Any:
    """A refused request's response: vLLM's error layout, with its status."""
    return JSONResponse(error.body(), status_code=error.status)


Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class SteerMiddleware:
    """Checks a completion request's ``streamscope`` field and passes its plan to vLLM in ``vllm_xargs``.

    Any other request, and a completion request without the field (on a
    server with no default steer), reaches vLLM byte for byte as sent. A
    steer dose the check clamped or let run past its limit is said in the
    response's ``x-streamscope-warnings`` header (`protocol.WARNINGS_HEADER`),
    streamed or not, which `streamscope.Client` raises as `DoseWarning`.
    """

    def __init__(self, app: Any, front: Front) -> None:
        self.app = app
        self.front = front
        #: Each request's time here and to its first bytes, for a load generator (`host_time.FrontTime`).
        self.clock = host_time.FrontTime() if host_time.wanted() else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else ""
        if path not in COMPLETIONS or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(b"", receive, message), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        forged = isinstance(body, dict) and isinstance(body.get("vllm_xargs"), dict) and XARG in body["vllm_xargs"]
        if forged:  # the worker trusts this key: only a plan checked here may carry it
            error = RequestError(400, "vllm_xargs", f"vllm_xargs: the key {XARG!r} is streamscope's; send steers "
                                                    f"and harvests in the {FIELD!r} field.")
            await _answer(send, error.status, error.body())
            return
        if not isinstance(body, dict) or (FIELD not in body and not self.front.checker.default):
            if self.clock is not None:
                send = self.clock.handed("plain", arrived, send)
            await self.app(scope, _replay(raw, receive), send)  # vLLM's own answer, to vLLM's request
            return
        harvest_id: Optional[str] = None
        ticket: Optional[str] = None  # a request with a plan: its worker's refusal, if any, is its answer
        said: list[str] = []  # the dose warnings of the steers checked here: the response carries them
        try:
            if len(json.dumps(body.get(FIELD))) > self.front.limits.max_upload_bytes:
                raise RequestError(413, FIELD, f"{FIELD}: larger than {self.front.limits.max_upload_bytes} bytes "
                                               f"(--max-upload-bytes): store large vectors once "
                                               f"(POST {PREFIX}/vectors/NAME) and steer by name.")
            # The dose check's stream norms, measured by the engine once per (value, block) a steer names.
            await self.front.checker.calibrate(body.get(FIELD), getattr(getattr(scope.get("app"), "state", None),
                                                                        "engine_client", None), self.front.harvests)
            check = functools.partial(self.front.checker.check, body, chat=path.endswith("chat/completions"))
            if needs_lengths(body.get(FIELD)):
                # Tokenizing a text prompt holds the interpreter a while: in the front end's own thread, while the
                # event loop goes on serving every other request.
                checked = await asyncio.get_running_loop().run_in_executor(self.front.checks, check)
            else:
                checked = check()
            self.front.graph_refusal(checked.steer_payload, checked.harvest)
            body.pop(FIELD, None)
            said = checked.warnings
            if not checked.empty:
                xargs = body.get("vllm_xargs") or {}
                if not isinstance(xargs, dict):
                    raise RequestError(400, "vllm_xargs", "vllm_xargs: a JSON object of vLLM's extra arguments.")
                if checked.harvest is not None:
                    harvest_id = self.front.harvests.reserve(checked.harvest["bytes"])
                ticket = self.front.refusals.ticket()
                payload = worker_payload(checked, harvest_id)  # a JSON object: the ticket goes first in it
                body["vllm_xargs"] = {**xargs, XARG: f'{{"{TICKET}":"{ticket}",{payload[1:]}'}
                salt = cache_salt(checked, body, harvest_id, self.front.harvest_prefix_cache)
                if salt is not None:
                    if isinstance(body.get("cache_salt"), str) and body["cache_salt"]:  # the caller's salt, kept
                        salt = "streamscope-" + hashlib.sha256(f"{body['cache_salt']}|{salt}".encode()).hexdigest()
                    body["cache_salt"] = salt  # vLLM takes at most 128 characters
        except RequestError as error:
            await _answer(send, error.status, error.body())
            return
        data = json.dumps(body).encode()
        scope = dict(scope)
        scope["headers"] = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-length"]
        scope["headers"].append((b"content-length", str(len(data)).encode()))
        if said:
            send = _with_warnings(send, said)
        if harvest_id is not None:
            send = _with_harvest(send, harvest_id, self.front.harvests)
        if self.clock is not None:
            send = self.clock.handed("streamscope", arrived, send)
        await self.forward(scope, data, receive, send, ticket)

    async def forward(self, scope: Scope, data: bytes, receive: Receive, send: Send, ticket: Optional[str]) -> None:
        """Hand vLLM the checked request (`data`, its body); with a `ticket` (a plan the worker reads), behind a
        `refusals.Guard`, so that a refusal of the worker's is the answer and vLLM aborts the request."""
        if ticket is None:
            await self.app(scope, _replay(data, receive), send)
            return
        guard = Guard(self.front.refusals, ticket, data, send, receive)
        try:
            await self.app(scope, guard.receive, guard.send)
        finally:
            guard.close()
            self.front.refusals.forget(ticket)


def _replay(data: bytes, receive: Receive, first: Optional[dict] = None) -> Receive:
    """A receive that gives the (rewritten) body once, then the client's own messages (a disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if first is not None and not sent:
            sent = True
            return first
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()

    return replay


def _with_warnings(send: Send, said: list[str]) -> Send:
    """A send whose response start carries `said` in `WARNINGS_HEADER`, a JSON list (ASCII: a header's bytes), on a
    streamed response as on any: the check has finished before vLLM answers, so they are known at its start."""
    value = json.dumps(said, ensure_ascii=True).encode("ascii")

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers", [])) + [(WARNINGS_HEADER.encode(), value)]}
        await send(message)

    return sending


def _with_harvest(send: Send, harvest_id: str, harvests: Harvests) -> Send:
    """A send that names the harvest: header ``x-streamscope-harvest``, and ``streamscope.harvest`` in a JSON body."""
    state: dict[str, Any] = {"start": None, "chunks": []}

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", [])) + [(b"x-streamscope-harvest", harvest_id.encode())]
            kind = dict((name.lower(), value) for name, value in headers).get(b"content-type", b"")
            if message.get("status") != 200:
                harvests.cancel(harvest_id)
            if b"json" not in kind or message.get("status") != 200:
                state["start"] = False
                await send({**message, "headers": headers})
                return
            state["start"] = {**message, "headers": headers}
            return
        if message["type"] != "http.response.body" or state["start"] is False:
            await send(message)
            return
        state["chunks"].append(message.get("body", b""))
        if message.get("more_body", False):
            return
        data = b"".join(state["chunks"])
        try:
            parsed = json.loads(data)
            parsed[FIELD] = {"harvest": harvest_id}
            data = json.dumps(parsed).encode()
        except (ValueError, TypeError):
            pass
        start = state["start"]
        start["headers"] = [(name, value) for name, value in start["headers"] if name.lower() != b"content-length"]
        start["headers"].append((b"content-length", str(len(data)).encode()))
        await send(start)
        await send({"type": "http.response.body", "body": data, "more_body": False})

    return sending


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


# ---------------------------------------------------------------- the command


def add_arguments(parser: Any) -> None:
    """streamscope's own options, beside every ``vllm serve`` option."""
    group = parser.add_argument_group("streamscope")
    defaults = Limits()
    group.add_argument("--taps", nargs="+", default=[],
                       help="serve only these values, with CUDA graphs broken at them (as streamscope.load(..., "
                            "taps=...)): 'layers.16.layer_output' 'layers.*.layer_output'. Default: the graph ops on a GPU (see "
                            "--graph-ops), eager on a CPU.")
    group.add_argument("--graph-ops", nargs="?", const="true", default=None, metavar="JSON|off",
                       help="run the steers and harvests the graph ops serve (add, set, ablate, clamp and reads at "
                            "every block's stream boundaries and sublayer outputs) as ops inside vLLM's compiled "
                            "graph, the rest on hooks (as streamscope.load(..., graph_ops=True)); optionally a JSON "
                            "object of streamscope.vllm.graph_backend.GraphOptions' fields ('{\"slots\": 512, "
                            "\"rounds\": 3}'). The default on a GPU without --taps or --enforce-eager: the engine "
                            "keeps vLLM's compile and CUDA graphs, and a request the ops cannot serve is refused "
                            "(400, naming the fix; 503 while the slot bank is full of other requests' vectors). "
                            "'off', or --enforce-eager, serves every value on hooks, eagerly. On a CPU the server runs "
                            "eagerly on hooks unless --graph-ops is given. Not with --taps.")
    group.add_argument("--default-steer", help="a JSON file: steers (the request field's form) applied to every "
                                               "request that does not send default_steer: false")
    group.add_argument("--vectors", help="a folder of NAME.safetensors files (one tensor each) stored at start")
    group.add_argument("--harvest-dir", help="where harvests wait to be downloaded (default: a temporary folder)")
    group.add_argument("--harvest-prefix-cache", action="store_true",
                       help="let a harvest of the last position only read its prompt's prefix from vLLM's prefix "
                            "cache (vLLM always runs a prompt's last token): its values then agree with a fresh "
                            "run within float rounding, not bit for bit. Default: every harvest runs its whole "
                            "prompt, under a cache salt of its own.")
    group.add_argument("--max-steers-per-request", type=int, default=defaults.max_steers)
    group.add_argument("--max-harvest-bytes", type=int, default=defaults.max_harvest_bytes,
                       help="one request's harvest, in bytes")
    group.add_argument("--max-stored-harvest-bytes", type=int, default=defaults.max_stored_harvest_bytes,
                       help="all harvests not yet downloaded, in bytes")
    group.add_argument("--harvest-ttl", type=float, default=defaults.harvest_ttl,
                       help="seconds a harvest waits to be downloaded before it is deleted")
    group.add_argument("--max-stored-vectors", type=int, default=defaults.max_stored_vectors)
    group.add_argument("--max-upload-bytes", type=int, default=defaults.max_upload_bytes,
                       help="a vector upload or a request's streamscope field, in bytes")
    group.add_argument("--saes", help="a folder of NAME.safetensors SAE files (streamscope.serve.storage.sae_bytes's "
                                      "layout) stored at start")
    group.add_argument("--max-stored-saes", type=int, default=defaults.max_stored_saes)
    group.add_argument("--max-sae-bytes", type=int, default=defaults.max_sae_bytes, help="one SAE upload, in bytes")
    group.add_argument("--max-steer-dose", type=float, default=defaults.max_steer_dose,
                       help="the largest dose a steer may have: its edit's size over the stream's norm at its value "
                            "and block, measured by the engine on a calibration text")
    group.add_argument("--steer-dose-action", choices=DOSE_ACTIONS, default=defaults.steer_dose_action,
                       help="what a steer's dose past its limit does where the request does not say (its on_dose): "
                            "refuse it (a 400), clamp its scale to the limit, or run it as sent and log a warning")


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(args.max_steers_per_request, args.max_harvest_bytes, args.max_stored_harvest_bytes,
                  args.harvest_ttl, args.max_stored_vectors, args.max_upload_bytes, args.max_stored_saes,
                  args.max_sae_bytes, args.max_steer_dose, args.steer_dose_action)


def _given(argv: Sequence[str], *flags: str) -> bool:
    return any(item == flag or item.startswith(flag + "=") for item in argv for flag in flags)


def graph_options(args: argparse.Namespace, on_cpu: bool = True, tapped: bool = False) -> Optional[GraphOptions]:
    """``--graph-ops [JSON|off]`` as options, or None for no graph ops; a bad value exits naming the flag and the fix.

    Without the flag a GPU server that has no taps and is not forced eager
    gets the default options: vLLM's compile and CUDA graphs stay on, and
    the steers and harvests run inside them. A CPU server, a tapped one and
    an eager one serve every value on hooks.
    """
    value = args.graph_ops
    if value == "off":
        return None
    if value is None:
        if on_cpu or tapped or getattr(args, "enforce_eager", False):
            return None
        value = "true"
    try:
        return GraphOptions.of(True if value == "true" else json.loads(value))
    except (ValueError, TypeError) as error:
        raise SystemExit(f"streamscope serve: --graph-ops {value}: {error} (give no value for the defaults, 'off' "
                         f"for none, or a JSON object of GraphOptions' fields: slots, rounds, values, harvest, "
                         f"harvest_pool, join).") from None


#: ``STREAMSCOPE_SERVE_GRAPH_OPS_ONLY=1``: an eager ``--graph-ops`` server (a CPU's) serves only what its graph ops
#: serve and refuses the rest, front end and worker, as a compiled server (a GPU's, whose hooks do not fire) does:
#: how a test holds a compiled server's refusals on the CPU.
GRAPH_OPS_ONLY = "STREAMSCOPE_SERVE_GRAPH_OPS_ONLY"


def graph_ops_only() -> bool:
    """Whether `GRAPH_OPS_ONLY` asks this server to run as a compiled one would (only what its graph ops serve)."""
    return os.environ.get(GRAPH_OPS_ONLY, "") not in ("", "0")


def engine_settings(args: argparse.Namespace, argv: Sequence[str], on_cpu: bool, locations: Sequence[str],
                    graph: Optional[GraphOptions] = None) -> bool:
    """The engine options streamscope needs, over what the caller passed: its worker, eager or graphs at the taps,
    or with `graph` (``--graph-ops``) the ops' options in ``additional_config`` and vLLM's own compile and graphs
    on a GPU. Whether the worker's hooks fire in a step (an eager engine, or graphs broken at the taps)."""
    if _given(argv, "--worker-cls", "--worker-extension-cls"):
        raise SystemExit("streamscope serve runs its own worker class and extension; drop --worker-cls and "
                         "--worker-extension-cls.")
    args.worker_cls = worker_cls(on_cpu, bool(locations), graph is not None)
    args.worker_extension_cls = WORKER_EXTENSION
    if graph is not None:
        if locations:
            raise SystemExit("streamscope serve: --graph-ops with --taps is not served yet (the taps replay graphs "
                             "nnsight's way, the ops run inside vLLM's own): drop --taps, or --graph-ops.")
        args.additional_config = engine_config(graph, args.additional_config)  # the options, and the cache's salt
        if on_cpu:
            args.enforce_eager = True  # the CPU suite's engine: its compile takes minutes (docs/graph-ops.md)
        # on a GPU vLLM's defaults: compile, its own CUDA graph mode
        return bool(on_cpu or args.enforce_eager) and not graph_ops_only()
    if graph_ops_only():
        raise SystemExit(f"streamscope serve: {GRAPH_OPS_ONLY} asks a --graph-ops server to serve only what its graph "
                         f"ops serve; pass --graph-ops, or unset {GRAPH_OPS_ONLY}.")
    if not locations or on_cpu:
        if _given(argv, "--no-enforce-eager") or _given(argv, "-cc", "--compilation-config") and not locations:
            print("streamscope serve: an untapped server runs eagerly (hooks do not fire inside compiled graphs); "
                  "pass --taps to replay CUDA graphs.", file=sys.stderr)
        args.enforce_eager = True  # no graphs on a CPU; an untapped GPU engine serves every value eagerly
    else:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
        args.enforce_eager = False
        if not _given(argv, "-cc", "--compilation-config"):
            args.compilation_config = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    if locations:
        args.additional_config = {**(args.additional_config or {}), "nnsight_taps": list(locations)}
    return True


def front_model(args: argparse.Namespace, on_cpu: bool) -> Any:
    """streamscope's names for the served checkpoint: the model's envoy tree on meta tensors, no weights, no engine."""
    options: dict[str, Any] = {"dispatch": False}
    if args.dtype and args.dtype != "auto":
        options["dtype"] = args.dtype
    elif on_cpu:
        args.dtype = "float32"  # as streamscope.load on a CPU: exact against transformers
        options["dtype"] = "float32"
    for name in ("trust_remote_code", "max_model_len", "tokenizer"):
        if getattr(args, name, None):
            options[name] = getattr(args, name)
    model = StandardizedVLLM(args.model, **options)
    template = getattr(args, "chat_template", None)
    if template:  # the server's chat template, so a chat prompt's length is counted as vLLM renders it
        model.tokenizer.chat_template = Path(template).read_text() if Path(template).is_file() else template
    return model


def served_name(asked: str) -> str:
    """The model id a server answers to for the PATH it was started with: an alias as typed (``smollm2``), a folder's
    own name, a ``.gguf`` file's name without the suffix, a hub repository id as given; never a machine's path."""
    local = Path(asked).expanduser()
    if asked.lower() in NAMED and not local.exists():
        return asked.lower()
    if local.exists():
        resolved = local.resolve()
        return resolved.stem if resolved.suffix.lower() == ".gguf" else resolved.name
    return asked


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``streamscope serve PATH [options]``: parse vLLM's and streamscope's options, then run vLLM's server."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--model", argv[0], *argv[1:]]
    api = server_api()
    api.env_setup()
    parser = api.make_arg_parser(api.parser_class(prog="streamscope serve", description=__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter))
    add_arguments(parser)
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag

    asked = args.model
    try:
        args.model = str(resolve(asked))  # as every command and streamscope.load: a folder, "smollm2", a .gguf, a hub id
    except UNRESOLVED as refused:
        print(f"streamscope serve: {refused}", file=sys.stderr)
        return 2
    if not args.served_model_name:
        args.served_model_name = [served_name(asked)]
    print(f"streamscope serve: serving {args.model} as {args.served_model_name[0]!r} (the requests' \"model\"; "
          f"--served-model-name sets another)", file=sys.stderr, flush=True)
    api.validate(args)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    on_cpu = current_platform.is_cpu()

    try:
        model = front_model(args, on_cpu)
        if on_cpu:  # the front model is a meta tree (dispatch=False): nothing refused the engine yet
            refuse_on_the_cpu_build(args.model, model.family)
    except UnsupportedCheckpoint as refused:
        print(f"streamscope serve: {refused}", file=sys.stderr)
        return 2
    locations: list[str] = []
    if args.taps:
        locations = tap_locations(model, args.taps)
        object.__setattr__(model, "tapped", frozenset(locations))
    folder = Path(args.harvest_dir) if args.harvest_dir else Path(tempfile.mkdtemp(prefix="streamscope-harvests-"))
    front = Front(model, limits_of(args), folder, args.taps, harvest_prefix_cache=args.harvest_prefix_cache)
    # vLLM runs a prompt in pieces unless told not to (its default, on every platform streamscope serves on)
    front.checker.prompts_split = getattr(args, "enable_chunked_prefill", None) is not False
    if args.vectors:
        for path in sorted(Path(args.vectors).glob("*.safetensors")):
            front.vectors.store(path.stem, *read_upload(path.read_bytes(), "application/octet-stream", front.checker,
                                                        str(path)))
    if args.saes:
        for path in sorted(Path(args.saes).glob("*.safetensors")):
            front.store_sae(path.stem, path.read_bytes(), str(path))
    if args.default_steer:
        front.checker.default = front.checker.default_steers(json.loads(Path(args.default_steer).read_text()))
    front.graph_ops = graph_options(args, on_cpu, bool(locations))
    front.hooks_fire = engine_settings(args, argv, on_cpu, locations, front.graph_ops)
    if front.graph_ops is not None and not on_cpu:
        front.graph_mode = None  # vLLM's own choice, asked of the worker (`read_graph_mode`)
    os.environ[ENVIRONMENT] = json.dumps({"harvests": str(folder), "refusals": str(front.refusals.folder),
                                          "saes": str(front.saes.folder),
                                          "sae_cache": max(1, min(4, args.max_stored_saes)),
                                          "hooks_fire": front.hooks_fire})
    front.worker = args.worker_cls
    serve(api, args, front.extend)
    return 0
