"""What a checked request becomes in vLLM's own request: the worker's payload and the prefix-cache salt.

The front end's check (`streamscope.serve.protocol.Checker`) gives a `Checked`
plan; the server puts `worker_payload` in the request's ``vllm_xargs`` (the
worker reads it from ``SamplingParams.extra_args``) and `cache_salt` in its
``cache_salt`` (vLLM shares KV blocks only between requests of one salt).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, Optional

from ..bulk.schema import WORKER_HARVEST_FIELDS
from ..bulk.spec import SKIP_FIRST

Checked = Any  # a `streamscope.serve.protocol.Checked` (not imported: protocol imports this module)


def uniform(steers: list[dict[str, Any]]) -> bool:
    """Whether every steer edits every position, prompt and generated, alike (its edit does not depend on where a
    prompt ends): at every position, or at every one but the first (the default), which is the same position in
    every prompt, so a shared prefix is edited the same way whichever prompt it starts."""
    return all(item["positions"] in ("all", SKIP_FIRST) and item["generated"] and not item.get("from_step")
               for item in steers)


def worker_payload(checked: Checked, harvest_id: Optional[str]) -> str:
    """The JSON the worker reads from the request's ``extra_args``: steers and harvest, no prompt.

    Each distinct vector goes once, in ``vectors`` (its digest -> its base64), and a steer names it by the digest:
    a request steering every block with one vector carries its 22 KB (at 4,096 numbers) once, not once a block,
    and the worker keys what it keeps of a vector (`ServeState.shared`) by a 71-character name.
    """
    steers, vectors = [], {}
    for item in checked.steer_payload:
        if isinstance(item.get("vector"), str):
            reference = "sha256:" + _digest(item["vector"])  # (':' is not base64's: never taken for a vector)
            vectors[reference] = item["vector"]
            item = {**item, "vector": reference}
        steers.append(item)
    payload: dict[str, Any] = {"steer": steers, **({"vectors": vectors} if vectors else {})}
    if checked.harvest is not None:
        payload["harvest"] = {key: checked.harvest[key] for key in WORKER_HARVEST_FIELDS if key in checked.harvest}
        payload["harvest"]["id"] = harvest_id
    return json.dumps(payload, separators=(",", ":"))


#: Each encoded vector's digest, by the string's identity (`protocol.vector_bytes` hands out one string per stored
#: vector): the salt hashes a vector once, not its 22 KB of base64 (at 4,096 numbers) again for every request.
_DIGESTS: dict[int, tuple[str, str]] = {}


def _digest(text: str) -> str:
    found = _DIGESTS.get(id(text))
    if found is not None and found[0] is text:
        return found[1]
    digest = hashlib.sha256(text.encode()).hexdigest()
    if len(_DIGESTS) >= 1024:
        _DIGESTS.clear()
    _DIGESTS[id(text)] = (text, digest)
    return digest


def cache_salt(checked: Checked, body: dict[str, Any], harvest_id: Optional[str],
               harvest_prefix_cache: bool = False) -> Optional[str]:
    """vLLM's per-request prefix-cache salt: KV blocks are shared only between requests steered alike.

    A harvest gets a salt of its own (every position it reads must run), as
    does a request with a request-scoped condition (it decides on every
    prompt position),
    except, with `harvest_prefix_cache` (``--harvest-prefix-cache``), one of
    the last position only: vLLM runs a prompt's last token whatever its cache
    holds, so that harvest takes its steers' salt (none without steers) and
    reads the prefix other requests left. A steer that edits every position,
    prompt and generated, changes the KV of any prefix the same way, so
    requests with the same steers share blocks; any other steer (``"last"``,
    some indices, ``generated: false``) depends on where the prompt ends, so
    its salt also holds the prompt.
    """
    if harvest_id is not None and not (harvest_prefix_cache and checked.harvest is not None
                                       and checked.harvest.get("positions") == "last"):
        return f"streamscope-harvest-{harvest_id}"
    if any((item.get("condition") or {}).get("scope") == "request" for item in checked.steer_payload):
        return f"streamscope-decides-{uuid.uuid4().hex}"  # its decision reads every prompt position: none cached
    if not checked.steer_payload:
        return None
    steers = json.dumps([{**item, "vector": _digest(item["vector"])} if isinstance(item.get("vector"), str) else item
                         for item in checked.steer_payload], sort_keys=True)
    prompt = "" if uniform(checked.steer_payload) else json.dumps([body.get("prompt"), body.get("messages")], sort_keys=True, default=str)
    return "streamscope-" + hashlib.sha256((steers + "|" + prompt).encode()).hexdigest()


__all__ = ["cache_salt", "uniform", "worker_payload"]
