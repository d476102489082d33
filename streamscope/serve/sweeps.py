"""Sweeps and statistics the server runs in one HTTP request: a patching grid with its noise floor, running moments.

Two routes under ``/v1/streamscope/`` (behind ``--api-key`` as every ``/v1`` route):

* ``POST patch``: activation patching of `value` over blocks x positions::

      {"clean": "text" or [ids], "corrupted": ..., "value": "layer_output", "layers": [..] or null,
       "positions": [..] or null, "metric": {"logit_difference": [answer, wrong]} | {"logit": id} |
       {"logprob": id}, "repeats": 3}

  The front end sends the engine, concurrently (so the engine batches them into its steps): one request
  harvesting the clean prompt's `value` at the blocks and positions; one request a (block, position) on the
  corrupted prompt with a ``set`` steer of the clean row there (prompt only), harvesting the normed final
  row of its last position; and `repeats` unpatched requests of each prompt. The engine's own final norm's
  output then goes through its own head in the worker (`streamscope.serve.head`) and the metric is taken of
  the logits. The answer: ``effects`` ``[blocks, positions]``, the clean and corrupted metric (their first
  run) and each repeat's, and ``noise``: the standard deviation of the corrupted prompt's repeats (the
  spread of one unpatched request's metric under the engine's batching; 0 where the engine is
  deterministic). The sweep runs on the unsteered model: no default steer.
* ``POST statistics``: running moments per label of one value (`streamscope.bulk.moments`)::

      {"prompts": [...], "labels": [...], "value": "layer_output", "layers": [..] or null, "positions": "last",
       "reduce": "mean", "second": false, "pairs": [[0, 1], ...] or null}

  One harvest request a prompt, at most ``concurrency`` (`CONCURRENCY`) at a time (1: one prompt an engine
  step, whose rows equal an in-process harvest of one prompt a run bit for bit); each prompt's rows are reduced as they
  come and added in prompt order (the arithmetic of `streamscope.bulk.moments`, so equal bit for bit to the
  moments of the same rows in process). The answer is the moments as safetensors (`Moments.tensors`): a
  direction over a million prompts ships ``labels x layers x hidden`` float64 numbers.

`client_patch` and `client_statistics` are what `streamscope.patch(client, ...)` and
`streamscope.Client.statistics` call.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors.torch import load

from ..bulk.moments import Accumulator, Moments, _label_list, _pair_list, check_reduce, empty_moments, reduce_positions
from ..bulk.positions import prompt_positions
from ..bulk.schema import ONE_FORWARD
from ..bulk.sites import ROOT_VALUES, layer_list
from ..directions import identity
from ..input_checks import one_prompt
from ..workflows.patching import HEAD_VALUES, Patching, _full_name, _token_id
from .head import pack, unpack
from .protocol import XARG, RequestError, positions_rule, rule_json, vector_bytes

#: Engine requests a statistics or patch route keeps in flight at once.
CONCURRENCY = 256
#: Rows a head call turns into logits at once (the logits of 64 rows of a 128k vocabulary: 32 MiB).
HEAD_ROWS = 64
#: The metrics a patch request may name.
METRICS = ("logit_difference", "logit", "logprob")
#: The most repeats a patch request may ask for.
MAX_REPEATS = 64


def _bad(param: str, message: str, status: int = 400) -> RequestError:
    return RequestError(status, param, f"{param}: {message}")


def _token(raw: Any, vocab: int, param: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < vocab:
        raise _bad(param, f"a token id in 0..{vocab - 1}, not {raw!r}.")
    return raw


def check_metric(raw: Any, vocab: int) -> dict[str, Any]:
    """A metric as JSON, checked: ``{"logit_difference": [answer, wrong]}``, ``{"logit": id}``, ``{"logprob": id}``."""
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in METRICS:
        raise _bad("metric", "one of {\"logit_difference\": [answer id, wrong id]}, {\"logit\": id}, {\"logprob\": "
                             "id}: a function of the last position's logits the server computes.")
    kind, argument = next(iter(raw.items()))
    if kind == "logit_difference":
        if not isinstance(argument, list) or len(argument) != 2:
            raise _bad("metric.logit_difference", "[answer id, wrong id].")
        return {kind: [_token(item, vocab, f"metric.{kind}") for item in argument]}
    return {kind: _token(argument, vocab, f"metric.{kind}")}


def metric_values(metric: dict[str, Any], logits: torch.Tensor) -> torch.Tensor:
    """The metric of each row of `logits` ``[n, vocab]`` (float32): ``[n]``."""
    kind, argument = next(iter(metric.items()))
    if kind == "logit_difference":
        return logits[:, argument[0]] - logits[:, argument[1]]
    if kind == "logit":
        return logits[:, argument]
    return logits.log_softmax(-1)[:, argument]


# ---------------------------------------------------------------- in the server's front end


def reduced(data: bytes) -> bytes:
    """A harvest file as it is downloaded: where its request asked ``reduce`` (the file's metadata says which),
    each value's positions reduced (`streamscope.bulk.moments.reduce_positions`: the arithmetic of an in-process
    ``model.harvest(reduce=...)``), so one row a block crosses HTTP; any other file as it is."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    reduce = json.loads(metadata.get("reduce", "null"))
    if reduce is None:
        return data

    tensors, _ = unpack(data)
    return pack({name: reduce_positions(tensor, reduce) for name, tensor in tensors.items()}, metadata)



@dataclass
class SweepContext:
    """What a route needs of the server: its checker (model, limits), harvest store and engine client."""

    checker: Any
    harvests: Any
    engine: Any


async def engine_harvest(front: SweepContext, ids: list[int], harvest: dict[str, Any], steers: list[dict[str, Any]],
                         size: int) -> torch.Tensor:
    """One engine request on `ids` with the worker payload's `steers` and `harvest`: its harvested tensor."""
    from vllm import SamplingParams

    harvest_id = front.harvests.reserve(size)
    payload = json.dumps({"steer": steers, "harvest": {**harvest, "id": harvest_id}}, separators=(",", ":"))
    params = SamplingParams(**ONE_FORWARD, extra_args={XARG: payload})
    name = f"streamscope-sweep-{harvest_id}"
    try:
        # Its own cache salt: every position the harvest or the steer touches runs (no prefix reused).
        async for _ in front.engine.generate({"prompt_token_ids": ids, "cache_salt": name}, params, name):
            pass
        tensors = load(await front.harvests.take(harvest_id, keep=False))
    finally:
        front.harvests.delete(harvest_id)
    return next(iter(tensors.values()))


async def head_logits(front: SweepContext, rows: torch.Tensor) -> torch.Tensor:
    """The engine's head on normed final rows ``[n, hidden]`` in its worker: ``[n, vocab]`` float32."""
    parts = []
    for start in range(0, rows.shape[0], HEAD_ROWS):
        data = pack({"rows": rows[start:start + HEAD_ROWS]})
        answers = await front.engine.collective_rpc("streamscope_serve_head", args=(data, True, None))
        found = [answer for answer in answers if isinstance(answer, (bytes, bytearray))]
        if not found:
            reasons = [answer for answer in answers if isinstance(answer, str)]
            raise RequestError(400, "metric", f"the engine's head could not run: {reasons[0] if reasons else '?'}.")
        parts.append(unpack(bytes(found[0]))[0]["logits"].float())
    return torch.cat(parts)


def _prompt_ids(front: SweepContext, raw: Any, param: str) -> list[int]:
    vocab = front.checker.model.vocab_size
    if isinstance(raw, str):
        return list(front.checker.model.tokenizer(raw)["input_ids"])
    if isinstance(raw, list) and raw and all(isinstance(item, int) and not isinstance(item, bool) and 0 <= item < vocab
                                             for item in raw):
        return list(raw)
    raise _bad(param, f"a prompt: a string, or a non-empty list of token ids in 0..{vocab - 1}.")


def _indices(raw: Any, count: int, param: str, what: str) -> list[int]:
    if raw is None:
        return list(range(count))
    if not isinstance(raw, list) or not raw or not all(isinstance(item, int) and not isinstance(item, bool)
                                                       and -count <= item < count for item in raw):
        raise _bad(param, f"a non-empty list of {what} indices in {-count}..{count - 1} (negative from the end), or "
                          f"null for every one.")
    found = [item % count for item in raw]
    if len(set(found)) != len(found):
        raise _bad(param, f"{found} names a {what} twice: list each once.")
    return found


def _fields(body: Any, allowed: Sequence[str], required: Sequence[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad("body", f"a JSON object with {', '.join(allowed)}.")
    unknown = [key for key in body if key not in allowed]
    if unknown:
        raise _bad(unknown[0], f"not a field of this route; it takes {', '.join(allowed)}.")
    for key in required:
        if key not in body:
            raise _bad(key, "required.")
    return body


PATCH_FIELDS = ("clean", "corrupted", "value", "layers", "positions", "metric", "repeats")


def check_patch(front: SweepContext, body: Any) -> dict[str, Any]:
    """A patch request checked before anything runs: prompts' ids, the value's sites, the grid, the metric."""
    body = _fields(body, PATCH_FIELDS, ("clean", "corrupted", "metric"))
    model = front.checker.model
    clean, corrupted = _prompt_ids(front, body["clean"], "clean"), _prompt_ids(front, body["corrupted"], "corrupted")
    if len(clean) != len(corrupted):
        raise _bad("corrupted", f"the clean and corrupted prompts must have the same number of tokens to patch "
                                f"position by position: {len(clean)} and {len(corrupted)}. Reword one of them.")
    value = body.get("value", "layer_output")
    layers = _indices(body.get("layers"), model.num_layers, "layers", "block")
    positions = _indices(body.get("positions"), len(clean), "positions", "position")
    if not isinstance(value, str):
        raise _bad("value", f"a block value's name (\"layer_output\", \"attention_output\", ...), not {value!r}.")
    if value in HEAD_VALUES:
        raise _bad("value", f"{value} is patched one head at a time inside a forward, which a server does not run "
                            f"over HTTP: load the model in process (streamscope.load) to patch heads.")
    names = {layer: _full_name(model, layer, value) for layer in layers}
    if len(set(names.values())) != 1:
        raise _bad("value", f"{value} is {sorted(set(names.values()))} on these blocks: sweep one kind at a time.")
    value = names[layers[0]]
    for layer in layers:
        front.checker.site(value, layer, "value")  # served, and a tap on a tapped server
    front.checker.site("final_norm_output", None, "metric")
    repeats = body.get("repeats", 3)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= MAX_REPEATS:
        raise _bad("repeats", f"how many times each unpatched prompt runs to measure the noise floor: 1 to "
                              f"{MAX_REPEATS}, not {repeats!r}.")
    patches = len(layers) * len(positions) + 2 * repeats
    bytes_needed = (len(layers) * len(positions) + patches) * model.hidden_size * 4
    if bytes_needed > front.checker.limits.max_stored_harvest_bytes:
        raise _bad("positions", f"this sweep holds {bytes_needed} bytes of rows at once, past the server's "
                                f"{front.checker.limits.max_stored_harvest_bytes} (--max-stored-harvest-bytes): "
                                f"sweep fewer blocks or positions per request.", 413)
    return {"clean": clean, "corrupted": corrupted, "value": value, "layers": layers, "positions": positions,
            "metric": check_metric(body["metric"], model.vocab_size), "repeats": repeats}


async def run_patch(front: SweepContext, plan: dict[str, Any]) -> dict[str, Any]:
    """The sweep of `check_patch`'s `plan` on the engine (see the module's docstring): its JSON answer."""
    hidden = front.checker.model.hidden_size
    layers, positions, value = plan["layers"], plan["positions"], plan["value"]
    limit = asyncio.Semaphore(CONCURRENCY)
    last = {"values": ["final_norm_output"], "layers": [], "positions": "last"}

    async def bounded(ids: list[int], harvest: dict[str, Any], steers: list[dict[str, Any]], size: int) -> Any:
        async with limit:
            return await engine_harvest(front, ids, harvest, steers, size)

    # The clean rows are read in block and position order (the worker's harvest of a descending list of either
    # fails: a view with negative strides) and put in the grid's order.
    blocks, ordered = sorted(layers), sorted(positions)
    clean_rows = await bounded(plan["clean"], {"values": [value], "layers": blocks, "positions": ordered}, [],
                               len(layers) * len(positions) * hidden * 4)
    clean_rows = clean_rows.reshape(len(layers), len(positions), hidden)[[blocks.index(b) for b in layers]]
    clean_rows = clean_rows[:, [ordered.index(p) for p in positions]]
    requests = []
    for row, layer in enumerate(layers):
        for column, position in enumerate(positions):
            steer = {"value": value, "layer": layer, "vector": vector_bytes(clean_rows[row, column]), "scale": 1.0,
                     "positions": rule_json([position]), "mode": "set", "generated": False, "projection": None,
                     "norm_match": False, "from_step": 0}
            requests.append(bounded(plan["corrupted"], last, [steer], hidden * 4))
    for ids in (plan["clean"], plan["corrupted"]):
        requests.extend(bounded(ids, last, [], hidden * 4) for _ in range(plan["repeats"]))
    rows = torch.stack([found.reshape(-1)[-hidden:] for found in await asyncio.gather(*requests)])
    metrics = metric_values(plan["metric"], await head_logits(front, rows)).tolist()
    grid = len(layers) * len(positions)
    clean_runs = metrics[grid:grid + plan["repeats"]]
    corrupted_runs = metrics[grid + plan["repeats"]:]
    return {"effects": [metrics[row * len(positions):(row + 1) * len(positions)] for row in range(len(layers))],
            "layers": layers, "positions": positions, "value": value, "metric": plan["metric"],
            "clean": clean_runs[0], "corrupted": corrupted_runs[0], "clean_runs": clean_runs,
            "corrupted_runs": corrupted_runs, "noise": _spread(corrupted_runs), "clean_noise": _spread(clean_runs)}


def _spread(runs: list[float]) -> float:
    """The runs' standard deviation (population; 0 for one run)."""
    mean = sum(runs) / len(runs)
    return math.sqrt(sum((run - mean) ** 2 for run in runs) / len(runs))


STATISTICS_FIELDS = ("prompts", "labels", "value", "layers", "positions", "reduce", "second", "pairs", "concurrency")


def check_statistics(front: SweepContext, body: Any) -> dict[str, Any]:
    """A statistics request checked before anything runs (the in-process `statistics`' checks, and the sizes)."""
    body = _fields(body, STATISTICS_FIELDS, ("prompts", "labels"))
    model = front.checker.model
    raw = body["prompts"]
    if not isinstance(raw, list) or not raw:
        raise _bad("prompts", "a non-empty list of prompts (strings or lists of token ids).")
    prompts = [_prompt_ids(front, item, f"prompts[{index}]") for index, item in enumerate(raw)]
    value = body.get("value", "layer_output")
    if not isinstance(value, str):
        raise _bad("value", f"one value's name (\"layer_output\", ...), not {value!r}.")
    try:
        reduce = check_reduce(body.get("reduce", "mean"))
        labels = _label_list(body["labels"], len(prompts))
        pairs = _pair_list(body.get("pairs"), len(prompts), reduce)
        blocks = [None] if value in ROOT_VALUES else list(layer_list(model, body.get("layers")))
    except (TypeError, ValueError, IndexError) as error:
        raise _bad("body", str(error)) from None
    for layer in blocks:
        front.checker.site(value, layer, "value")
    positions = positions_rule(body.get("positions", "last"), "positions")
    second = body.get("second", False)
    if not isinstance(second, bool):
        raise _bad("second", f"true or false, not {second!r}.")
    concurrency = body.get("concurrency", CONCURRENCY)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= CONCURRENCY:
        raise _bad("concurrency", f"how many prompts run at once, 1 to {CONCURRENCY}, not {concurrency!r}.")
    return {"prompts": prompts, "labels": labels, "pairs": pairs, "value": value, "layers": blocks,
            "positions": positions, "reduce": reduce, "second": second, "concurrency": concurrency}


async def run_statistics(front: SweepContext, plan: dict[str, Any]) -> bytes:
    """The moments of `check_statistics`' `plan` (see the module's docstring), as safetensors bytes."""
    hidden, layers = front.checker.model.hidden_size, plan["layers"]
    moments = empty_moments(plan["value"], layers, plan["second"], plan["reduce"], rule_json(plan["positions"]),
                            identity(front.checker.model))
    accumulator = Accumulator(moments, plan["labels"], plan["pairs"], plan["reduce"])
    # Blocks and positions are read in ascending order (the worker's harvest of a descending list fails) and put
    # back in the asked order before any arithmetic, so the reduction sums them as the in-process run does.
    blocks = sorted(layer for layer in layers if layer is not None)
    block_order = [blocks.index(layer) for layer in layers] if blocks else [0]
    limit = asyncio.Semaphore(plan["concurrency"])

    async def one(index: int) -> torch.Tensor:
        ids = plan["prompts"][index]
        chosen = prompt_positions(plan["positions"], len(ids), index)
        ordered = sorted(chosen)
        harvest = {"values": [plan["value"]], "layers": blocks, "positions": ordered}
        async with limit:
            rows = await engine_harvest(front, ids, harvest, [], max(1, len(layers)) * len(chosen) * hidden * 4)
        rows = rows.reshape(len(layers), len(chosen), hidden)[block_order]
        return rows[:, [ordered.index(position) for position in chosen]]

    # Prompts finish in any order; they are added in prompt order (the stated arithmetic), a window at a time.
    for start in range(0, len(plan["prompts"]), CONCURRENCY):
        indices = list(range(start, min(start + CONCURRENCY, len(plan["prompts"]))))
        rows = await asyncio.gather(*(one(index) for index in indices))
        accumulator.add_part(_Rows(plan["value"], rows, plan["layers"] == [None]), indices)
    tensors, meta = moments.tensors()
    return pack(tensors, {"moments": json.dumps(meta)})


class _Rows:
    """Harvested rows ``[layers, positions, hidden]`` a prompt, shaped as a `Harvest` for the `Accumulator`."""

    reduce = None

    def __init__(self, value: str, rows: list[torch.Tensor], root: bool) -> None:
        self.values = {value: [row[0] if root else row for row in rows]}

    def __getitem__(self, value: str) -> list[torch.Tensor]:
        return self.values[value]


def add_sweep_routes(router: Any, server: Any) -> None:
    """Add ``POST patch`` and ``POST statistics`` to the server's `router` (under ``/v1/streamscope``)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    def front(request: Request) -> SweepContext:
        engine = getattr(request.app.state, "engine_client", None)
        if engine is None:
            raise RequestError(503, "engine", "the engine is not up yet: retry once /health answers.")
        return SweepContext(server.checker, server.harvests, engine)

    async def parsed(request: Request) -> Any:
        data = await request.body()
        if len(data) > server.limits.max_upload_bytes:
            raise RequestError(413, "body", f"body: {len(data)} bytes; a request body is limited to "
                                            f"{server.limits.max_upload_bytes} (--max-upload-bytes).")
        try:
            return json.loads(data)
        except ValueError:
            raise RequestError(400, "body", "body: not JSON.") from None

    async def patch(request: Request) -> Any:
        try:
            where = front(request)
            return await run_patch(where, check_patch(where, await parsed(request)))
        except RequestError as error:
            return JSONResponse(error.body(), status_code=error.status)

    async def statistics(request: Request) -> Any:
        try:
            where = front(request)
            data = await run_statistics(where, check_statistics(where, await parsed(request)))
            return Response(data, media_type="application/octet-stream")
        except RequestError as error:
            return JSONResponse(error.body(), status_code=error.status)

    # FastAPI reads a route's annotations by name in its module, where Request is not imported (a client imports
    # this module without FastAPI): the class itself, so the request is injected and not taken for a query field.
    for route, path in ((patch, "/patch"), (statistics, "/statistics")):
        route.__annotations__["request"] = Request
        router.post(path)(route)


# ---------------------------------------------------------------- the client's side


def _metric_json(model: Any, metric: Any, answer: Any, wrong: Any) -> dict[str, Any]:
    if metric is not None:
        spec = getattr(metric, "metric_json", None) if not isinstance(metric, dict) else metric
        if spec is None:
            raise TypeError("over HTTP the server computes the metric: give answer= and wrong= (their logit "
                            "difference), or metric={\"logit\": id} / {\"logprob\": id} / "
                            "{\"logit_difference\": [answer, wrong]} (streamscope.serve.sweeps.token_logit, "
                            "token_logprob): a Python function cannot cross to the server.")
        return dict(spec)
    if answer is None or wrong is None:
        raise ValueError("give a metric, or answer= and wrong= for their logit difference")
    tokenizer = model.tokenizer
    return {"logit_difference": [_token_id(tokenizer, answer), _token_id(tokenizer, wrong)]}


def token_logit(token: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: the last position's logit of `token`; in process a function, over HTTP its JSON."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[..., token]
    metric.__name__ = "logit"
    metric.metric_json = {"logit": token}  # type: ignore[attr-defined]
    return metric


def token_logprob(token: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: the last position's log-probability of `token`; in process a function, over HTTP its JSON."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits.float().log_softmax(-1)[..., token]
    metric.__name__ = "logprob"
    metric.metric_json = {"logprob": token}  # type: ignore[attr-defined]
    return metric


@dataclass(repr=False)
class RemotePatching(Patching):
    """A `Patching` a server ran, with its noise floor.

    Attributes:
        noise: The standard deviation of the corrupted prompt's metric over `corrupted_runs`: an effect
            within a few of these of `corrupted` is not told apart from the engine's own spread.
        corrupted_runs, clean_runs: The metric of each unpatched repeat (``repeats`` of each).
    """

    noise: float = 0.0
    corrupted_runs: list = field(default_factory=list)
    clean_runs: list = field(default_factory=list)

    def __repr__(self) -> str:
        return Patching.__repr__(self)[:-1] + f", noise {self.noise:.3g} over {len(self.corrupted_runs)} runs)"


def _index_list(asked: Any) -> Optional[list[int]]:
    """Blocks or positions as `streamscope.patch` takes them (None, an int, a sequence) as JSON's list or null."""
    if asked is None:
        return None
    return [int(asked)] if isinstance(asked, int) else [int(item) for item in asked]


def client_patch(client: Any, clean: Any, corrupted: Any, metric: Any = None, *, answer: Any = None,
                 wrong: Any = None, value: str = "layer_output", layers: Optional[Sequence[int]] = None,
                 positions: Optional[Sequence[int]] = None, repeats: int = 3, **ignored: Any) -> Any:
    """`streamscope.patch` over a `streamscope.Client`: the server runs the sweep (``POST patch``).

    Returns a `RemotePatching`: a `streamscope.workflows.patching.Patching` with the noise floor.
    """
    unknown = [key for key, given in ignored.items() if given is not None and key not in ("batch_size", "progress")]
    if unknown:
        raise TypeError(f"patch over a server takes no {', '.join(unknown)}.")
    several = "Patch each pair of prompts with its own call."
    clean, corrupted = (one_prompt(prompt, "streamscope.patch", several) for prompt in (clean, corrupted))
    body = {"clean": clean, "corrupted": corrupted, "value": value, "metric": _metric_json(client, metric, answer, wrong),
            "layers": _index_list(layers), "positions": _index_list(positions),
            "repeats": repeats}
    answer_json = client._route("POST", "patch", json=body).json()
    ids = client.tokenizer(corrupted)["input_ids"] if isinstance(corrupted, str) else list(corrupted)
    labels = [client.tokenizer.decode([ids[position]]) for position in answer_json["positions"]]
    kind = next(iter(answer_json["metric"]))
    return RemotePatching(torch.tensor(answer_json["effects"]), float(answer_json["clean"]),
                          float(answer_json["corrupted"]), answer_json["layers"], answer_json["positions"], labels,
                          value, kind.replace("_", " "), (str(clean), str(corrupted)), float(answer_json["noise"]),
                          answer_json["corrupted_runs"], answer_json["clean_runs"])


def client_statistics(client: Any, prompts: Sequence[Any], labels: Sequence[Any], value: str = "layer_output",
                      layers: Any = None, positions: Any = "last", *, reduce: Optional[str] = "mean",
                      second: bool = False, pairs: Optional[Sequence[tuple[int, int]]] = None,
                      concurrency: int = CONCURRENCY) -> Any:
    """`model.statistics` over a `streamscope.Client`: the server harvests and reduces, and sends the moments."""
    if isinstance(prompts, str):
        raise TypeError("statistics takes a list of prompts; wrap a single prompt in a list.")
    body = {"prompts": list(prompts), "labels": list(labels), "value": value,
            "layers": [layers] if isinstance(layers, int) else None if layers is None else list(layers),
            "positions": rule_json(positions), "reduce": reduce, "second": second,
            "pairs": None if pairs is None else [list(pair) for pair in pairs], "concurrency": concurrency}
    response = client._route("POST", "statistics", json=body)
    tensors, metadata = unpack(response.content)
    return Moments.from_tensors(tensors, json.loads(metadata["moments"]))
