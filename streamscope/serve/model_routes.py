"""The ``/v1/streamscope/`` routes that let a `streamscope.Client` stand in for a model in the toolbox.

* ``GET model``: what the workflows read of a model that is not its weights: sizes, the served checkpoint's
  config, every block's support table (each value, served or the reason not) and the values it serves as one
  tensor under several names, the root's table, which stream each block's norms read
  (`streamscope.workflows.cache.norm_inputs`), the family's facts a cache needs.
* ``GET tokenizer``: the served tokenizer, saved (``save_pretrained``) and zipped, so a client tokenizes and
  decodes locally exactly as the server does.
* ``POST head`` (safetensors ``rows [n, hidden]``; ``?normed=``, ``?top_k=``): the engine's own final norm and
  head applied to the rows in its worker (`streamscope.serve.head`), the logits or their top k back.
* ``GET head/parameters`` and ``POST head/rows`` (``{"ids": [...]}``): the final norm's and the head's small
  parameters, and chosen unembedding rows, read off the worker's modules (what a cache's norm scales and logit
  attributions need; never the whole unembedding).
"""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional

from fastapi import Request  # at module level: FastAPI reads the routes' annotations by name
from fastapi.responses import JSONResponse, Response

from ..errors import Unavailable
from ..families.logits import scaling_in_words
from ..workflows.cache import _location, norm_inputs
from .head import TOP_K_LIMIT, unpack
from .protocol import RequestError


def describe(model: Any, served: tuple[list[str], dict[str, str]]) -> dict[str, Any]:
    """The ``GET model`` answer for the front's meta model `model` (see the module's docstring)."""
    try:
        heads: Optional[int] = model.num_heads
    except Unavailable:
        heads = None
    spec = model.family_spec
    return {"shared": [_shared(model, index) for index in range(model.num_layers)],"config": json.loads(model.config.to_json_string(use_diff=False)),
            "num_layers": model.num_layers, "hidden_size": model.hidden_size, "vocab_size": model.vocab_size,
            "num_heads": heads,
            "blocks": [dict(model.layers[index].support().rows) for index in range(model.num_layers)],
            "kinds": [type(model.layers[index]).__name__ for index in range(model.num_layers)],
            "root": dict(model.support().root.rows),
            "norm_inputs": {str(index): found for index, found in norm_inputs(model).items()},
            "learned_positions": bool(spec.learned_positions), "gated_head_outputs": spec.gated_head_outputs,
            "logit_transform": scaling_in_words(model.config), "values": served[0], "unavailable": served[1]}


def _shared(model: Any, index: int) -> list[list[str]]:
    """Block `index`'s served values that are one tensor under several names (GPT-J's one norm is both norms'
    output), each group in the order the block lists them: a cache reads the first and keeps the others as it."""
    groups: dict[tuple, list[str]] = {}
    for full, reason in model.layers[index].support().rows.items():
        location = None if reason is not None else _location(model, index, full)
        if location is not None:
            groups.setdefault(location, []).append(full)
    return [names for names in groups.values() if len(names) > 1]


def tokenizer_zip(tokenizer: Any) -> bytes:
    """The tokenizer's ``save_pretrained`` files, zipped."""
    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="streamscope-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(Path(folder).iterdir()):
                archive.write(path, path.name)
    return buffer.getvalue()


async def _rpc(request: Request, method: str, *args: Any) -> bytes:
    """One head RPC on every worker; the answer of the first that has one, or a 400 with the worker's reason."""
    engine = getattr(request.app.state, "engine_client", None)
    if engine is None:
        raise RequestError(503, "engine", "the engine is not up yet: retry once /health answers.")
    answers = await engine.collective_rpc(method, args=args)
    found = [answer for answer in answers if isinstance(answer, (bytes, bytearray))]
    if found:
        return bytes(found[0])
    reasons = [answer for answer in answers if isinstance(answer, str)]
    raise RequestError(400, method, f"the engine cannot answer this: {reasons[0] if reasons else 'no worker did'}.")


def add_model_routes(router: Any, front: Any) -> None:
    """Add the routes above to the server's `router` (under ``/v1/streamscope``), over `front`'s model."""
    cached: dict[str, Any] = {}

    def refused(error: RequestError) -> Any:
        return JSONResponse(error.body(), status_code=error.status)

    @router.get("/model")
    async def model() -> Any:
        if "model" not in cached:
            cached["model"] = describe(front.model, front.served())
        return cached["model"]

    @router.get("/tokenizer")
    async def tokenizer() -> Any:
        if "tokenizer" not in cached:
            cached["tokenizer"] = tokenizer_zip(front.model.tokenizer)
        return Response(cached["tokenizer"], media_type="application/zip")

    @router.post("/head")
    async def head(request: Request, normed: bool = False, top_k: Optional[int] = None) -> Any:
        try:
            if top_k is not None and not 1 <= top_k <= min(TOP_K_LIMIT, front.model.vocab_size):
                raise RequestError(400, "top_k", f"top_k: 1 to {min(TOP_K_LIMIT, front.model.vocab_size)}, not "
                                                 f"{top_k}; leave it out for every token's logits.")
            limit = front.limits.max_harvest_bytes
            data = await request.body()
            if len(data) > limit:
                raise RequestError(413, "body", f"body: {len(data)} bytes of rows; one head request takes at most "
                                                f"{limit} (--max-harvest-bytes): send fewer rows at a time.")
            try:
                rows = unpack(data)[0]["rows"]
            except Exception:  # noqa: BLE001  (anything but the layout asked for)
                raise RequestError(400, "body", "body: safetensors bytes holding one tensor \"rows\" "
                                                "[n, hidden_size].") from None
            if rows.dim() != 2 or rows.shape[1] != front.model.hidden_size or not rows.is_floating_point():
                raise RequestError(400, "body", f"rows: [n, {front.model.hidden_size}] floats, not "
                                                f"{rows.dtype} {tuple(rows.shape)}.")
            return Response(await _rpc(request, "streamscope_serve_head", data, normed, top_k),
                            media_type="application/octet-stream")
        except RequestError as error:
            return refused(error)

    @router.get("/head/parameters")
    async def parameters(request: Request) -> Any:
        try:
            if "parameters" not in cached:
                cached["parameters"] = await _rpc(request, "streamscope_serve_head_parameters")
            return Response(cached["parameters"], media_type="application/octet-stream")
        except RequestError as error:
            return refused(error)

    @router.post("/head/rows")
    async def rows(request: Request) -> Any:
        try:
            try:
                ids = json.loads(await request.body())["ids"]
            except Exception:  # noqa: BLE001
                raise RequestError(400, "body", "body: {\"ids\": [token ids]}.") from None
            vocab = front.model.vocab_size
            if not isinstance(ids, list) or not all(isinstance(item, int) and not isinstance(item, bool)
                                                    and 0 <= item < vocab for item in ids):
                raise RequestError(400, "ids", f"ids: a list of token ids in 0..{vocab - 1}.")
            if len(ids) * front.model.hidden_size * 4 > front.limits.max_harvest_bytes:
                raise RequestError(413, "ids", f"ids: {len(ids)} rows pass --max-harvest-bytes; ask for fewer.")
            return Response(await _rpc(request, "streamscope_serve_unembedding_rows", ids),
                            media_type="application/octet-stream")
        except RequestError as error:
            return refused(error)
