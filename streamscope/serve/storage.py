"""What the server holds between requests: stored vectors by name, and harvests waiting to be downloaded.

Harvests live in one folder as ``<id>.safetensors``, written by the engine's
worker (`streamscope.serve.worker`), each tensor named by its value with the
blocks and positions in the file's metadata. The front end reserves a
harvest's bytes when it admits the request (refusing one that would pass
``--max-stored-harvest-bytes``), hands the file out once, deletes it after the
download unless asked to keep it, and deletes any left longer than
``--harvest-ttl`` seconds. Ids are random (128 bits): knowing one is what
entitles a caller, beside the API key, to its tensors.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import stages
from .protocol import NAME, Checker, Limits, RequestError


@dataclass
class Entry:
    bytes: int
    created: float
    downloaded: bool = False


class Harvests:
    """The harvest folder's ledger: reservations, expiry, downloads."""

    def __init__(self, folder: Path, limits: Limits) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limits = limits
        self.entries: dict[str, Entry] = {}

    def held(self) -> int:
        return sum(entry.bytes for entry in self.entries.values())

    def reserve(self, size: int) -> str:
        """A new harvest's id, once its bytes fit under the server's total."""
        self.expire()
        held = self.held()
        if held + size > self.limits.max_stored_harvest_bytes:
            raise RequestError(413, "streamscope.harvest",
                               f"streamscope.harvest: the server holds {held} bytes of harvests not yet downloaded "
                               f"and this one needs {size}; the limit is {self.limits.max_stored_harvest_bytes} "
                               f"(--max-stored-harvest-bytes). Download (GET /v1/streamscope/harvests/ID) or delete "
                               f"earlier harvests, or wait for them to expire ({self.limits.harvest_ttl:g} s).")
        harvest_id = secrets.token_hex(16)
        self.entries[harvest_id] = Entry(size, time.monotonic())
        return harvest_id

    def cancel(self, harvest_id: str) -> None:
        self.delete(harvest_id)

    def path(self, harvest_id: str) -> Path:
        return self.folder / f"{harvest_id}.safetensors"

    def expire(self) -> None:
        now = time.monotonic()
        for harvest_id in [key for key, entry in self.entries.items() if now - entry.created > self.limits.harvest_ttl]:
            self.delete(harvest_id)

    def delete(self, harvest_id: str) -> bool:
        found = self.entries.pop(harvest_id, None) is not None
        for path in (self.path(harvest_id), self.folder / f"{harvest_id}.error", *stages.parts(self.folder, harvest_id)):
            path.unlink(missing_ok=True)
        return found

    def listing(self) -> list[dict[str, Any]]:
        self.expire()
        now = time.monotonic()
        return [{"id": key, "bytes": entry.bytes, "ready": self.path(key).exists() or stages.merge(self.folder, key),
                 "expires_in": round(self.limits.harvest_ttl - (now - entry.created), 1)}
                for key, entry in self.entries.items()]

    async def take(self, harvest_id: str, keep: bool, wait: float = 60.0) -> bytes:
        """The harvest's safetensors bytes (waiting for the worker to write them), deleted after unless `keep`."""
        self.expire()
        if not isinstance(harvest_id, str) or harvest_id not in self.entries:
            raise RequestError(404, "id", f"id: no harvest {harvest_id!r} on this server: it was downloaded "
                                          f"already (ask with ?keep=true to download twice), deleted, or expired "
                                          f"after {self.limits.harvest_ttl:g} s (--harvest-ttl).")
        path, failed = self.path(harvest_id), self.folder / f"{harvest_id}.error"
        deadline = time.monotonic() + wait
        while not path.exists() and not stages.merge(self.folder, harvest_id):  # pipeline stages write parts
            if failed.exists():
                message = failed.read_text()
                self.delete(harvest_id)
                raise RequestError(400, "streamscope.harvest", f"streamscope.harvest: the engine could not harvest "
                                                               f"this request: {message}")
            if time.monotonic() > deadline:
                raise RequestError(404, "id", f"id: harvest {harvest_id} is not written yet: its request has not "
                                              f"finished its prompt. Ask again once the completion has returned.")
            await asyncio.sleep(0.01)
        data = path.read_bytes()
        if not keep:
            self.delete(harvest_id)
        return data


def read_vector(data: bytes, content_type: str, checker: Checker, param: str = "body") -> torch.Tensor:
    """An uploaded vector: JSON ``{"vector": [...]}`` or safetensors bytes holding one tensor. Nothing else is parsed."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, param, f"{param}: not valid JSON; send {{\"vector\": [numbers]}}.") from None
        if not isinstance(body, dict) or set(body) != {"vector"}:
            raise RequestError(400, param, f"{param}: send {{\"vector\": [{checker.hidden} numbers]}}.")
        if isinstance(body["vector"], str):
            raise RequestError(400, f"{param}.vector", f"{param}.vector: an upload holds the numbers themselves.")
        return checker.vector(body["vector"], f"{param}.vector")
    if kind in ("application/octet-stream", "application/safetensors"):
        from safetensors.torch import load

        try:
            tensors = load(data)  # safetensors holds raw numbers and a JSON header: nothing in it can run
        except Exception:  # noqa: BLE001  (any malformed upload: pickles, torch.save files, garbage)
            raise RequestError(400, param, f"{param}: not a safetensors file. The server reads vectors as "
                                           f"safetensors or JSON only (never pickles or torch.save files): save "
                                           f"with safetensors.torch.save({{'vector': v}}).") from None
        if len(tensors) != 1 and "vector" not in tensors:
            raise RequestError(400, param, f"{param}: the file holds {len(tensors)} tensors ({', '.join(tensors)}); "
                                           f"send one, or name the one to store 'vector'.")
        tensor = tensors.get("vector", next(iter(tensors.values())))
        if tensor.is_floating_point() is False:
            raise RequestError(400, param, f"{param}: the vector is {tensor.dtype}; send floating-point numbers.")
        return checker.finite(tensor.to(torch.float32), param)
    raise RequestError(400, "Content-Type", f"Content-Type: {content_type or 'none'} is not taken; send "
                                            f"application/json ({{\"vector\": [...]}}) or application/octet-stream "
                                            f"(safetensors bytes).")


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise RequestError(400, "name", f"name: {name!r} is not a vector name: use 1-64 letters, digits, '_', '.' "
                                        f"or '-'.")
    return name


class Vectors(dict):
    """Stored vectors, name -> ``[hidden_size]`` float32, bounded by ``--max-stored-vectors``."""

    def __init__(self, limits: Limits) -> None:
        super().__init__()
        self.limits = limits

    def store(self, name: str, vector: torch.Tensor) -> None:
        check_name(name)
        if name not in self and len(self) >= self.limits.max_stored_vectors:
            raise RequestError(413, "name", f"name: the server holds {len(self)} vectors, its limit "
                                            f"(--max-stored-vectors); delete one first (DELETE "
                                            f"/v1/streamscope/vectors/NAME).")
        self[name] = vector.detach().to(torch.float32).clone()

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": name, "size": int(vector.numel()), "norm": float(vector.norm())}
                for name, vector in sorted(self.items())]


def unknown_vector(name: str) -> RequestError:
    return RequestError(404, "name", f"name: no stored vector is named {name!r}; GET /v1/streamscope/vectors lists "
                                     f"them.")


def harvest_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A downloaded harvest: its tensors by value, and its values, layers and positions (the file's metadata)."""
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    return load(data), {key: json.loads(value) for key, value in metadata.items()}


__all__ = ["Harvests", "Vectors", "read_vector", "harvest_tensors"]
