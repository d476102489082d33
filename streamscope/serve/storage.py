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
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load, save

from ..bulk.dose import CARRIED, check_carried
from ..bulk.spec import SteerError
from ..sae import SAE
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
    return read_upload(data, content_type, checker, param)[0]


def read_upload(data: bytes, content_type: str, checker: Checker,
                param: str = "body") -> tuple[torch.Tensor, Optional[dict[str, Any]]]:
    """An uploaded vector and the stream norm it carries (`streamscope.bulk.dose.carried_entry`: ``{"value",
    "layer", "norm"}``, checked against the served model), or None.

    JSON: ``{"vector": [...], "stream_norm": {"value": ..., "layer": ..., "norm": ...}}`` (the norm optional).
    Safetensors: one tensor (or one named ``vector``); the norm in the file's metadata, under
    ``"streamscope.stream_norm"`` (as `streamscope.Client.store_vector` sends it) or in a direction file's
    ``"streamscope.direction"`` metadata (`streamscope.directions.Direction.save`: its value, layer and
    stream_norm). Nothing else is parsed.
    """
    kind = content_type.split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, param, f"{param}: not valid JSON; send {{\"vector\": [numbers]}}.") from None
        if not isinstance(body, dict) or "vector" not in body or not set(body) <= {"vector", CARRIED}:
            raise RequestError(400, param, f"{param}: send {{\"vector\": [{checker.hidden} numbers]}}, and "
                                           f"optionally \"{CARRIED}\": {{\"value\", \"layer\", \"norm\"}}.")
        if isinstance(body["vector"], str):
            raise RequestError(400, f"{param}.vector", f"{param}.vector: an upload holds the numbers themselves.")
        vector = checker.vector(body["vector"], f"{param}.vector")
        return vector, carried_upload(body.get(CARRIED), checker, f"{param}.{CARRIED}")
    if kind in ("application/octet-stream", "application/safetensors"):
        try:
            tensors = load(data)  # safetensors holds raw numbers and a JSON header: nothing in it can run
            size = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
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
        return checker.finite(tensor.to(torch.float32), param), carried_metadata(metadata, checker, param)
    raise RequestError(400, "Content-Type", f"Content-Type: {content_type or 'none'} is not taken; send "
                                            f"application/json ({{\"vector\": [...]}}) or application/octet-stream "
                                            f"(safetensors bytes).")


def carried_metadata(metadata: dict[str, Any], checker: Checker, param: str) -> Optional[dict[str, Any]]:
    """The stream norm a safetensors upload's metadata carries (see `read_upload`), or None."""
    try:
        if "streamscope.stream_norm" in metadata:
            return carried_upload(json.loads(metadata["streamscope.stream_norm"]), checker, f"{param}.{CARRIED}")
        if "streamscope.direction" in metadata:
            made = json.loads(metadata["streamscope.direction"])
            if not isinstance(made, dict) or made.get(CARRIED) is None:
                return None  # a direction file without its norm (made before directions carried one, or imported)
            entry = {"value": made.get("value"), "layer": made.get("layer"), "norm": made.get(CARRIED)}
            return carried_upload(entry, checker, f"{param}.{CARRIED}")
    except ValueError:
        raise RequestError(400, param, f"{param}: the file's streamscope metadata is not JSON.") from None
    return None


def carried_upload(raw: Any, checker: Checker, param: str) -> Optional[dict[str, Any]]:
    """A carried stream norm sent with a vector, checked: its value and block served by this model (the block
    counted from the start), its norm a positive finite number; None where none is sent."""
    if raw is None:
        return None
    try:
        entry = dict(check_carried(raw, param))
    except SteerError as error:
        raise RequestError(400, param, str(error)) from None
    checker.site(entry["value"], entry["layer"], param)
    if entry["layer"] is not None:
        entry["layer"] %= len(checker.model.layers)
    entry["norm"] = float(entry["norm"])
    return entry


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise RequestError(400, "name", f"name: {name!r} is not a vector name: use 1-64 letters, digits, '_', '.' "
                                        f"or '-'.")
    return name


class Vectors(dict):
    """Stored vectors, name -> ``[hidden_size]`` float32, bounded by ``--max-stored-vectors``; beside them, the
    stream norm a vector carries (`carried`: name -> ``{"value", "layer", "norm"}``), which the dose check of a
    steer by that name at that value and block uses over any the engine measured."""

    def __init__(self, limits: Limits) -> None:
        super().__init__()
        self.limits = limits
        self.carried: dict[str, dict[str, Any]] = {}

    def store(self, name: str, vector: torch.Tensor, stream_norm: Optional[dict[str, Any]] = None) -> None:
        check_name(name)
        if name not in self and len(self) >= self.limits.max_stored_vectors:
            raise RequestError(413, "name", f"name: the server holds {len(self)} vectors, its limit "
                                            f"(--max-stored-vectors); delete one first (DELETE "
                                            f"/v1/streamscope/vectors/NAME).")
        self[name] = vector.detach().to(torch.float32).clone()
        self.carried.pop(name, None)
        if stream_norm is not None:
            self.carried[name] = dict(stream_norm)

    def pop(self, name: Any, *default: Any) -> Any:
        self.carried.pop(name, None)
        return super().pop(name, *default)

    def listing(self) -> list[dict[str, Any]]:
        """Each stored vector: its name, size, length (``norm``) and the stream norm it carries (or null)."""
        return [self.entry(name) for name in sorted(self)]

    def entry(self, name: str) -> dict[str, Any]:
        vector = self[name]
        return {"name": name, "size": int(vector.numel()), "norm": float(vector.norm()),
                CARRIED: self.carried.get(name)}

    def file(self, name: str) -> bytes:
        """The stored vector as safetensors bytes, with the stream norm it carries in the metadata (as uploaded)."""
        carried = self.carried.get(name)
        metadata = {"streamscope.stream_norm": json.dumps(carried)} if carried is not None else None
        return save({"vector": self[name]}, metadata=metadata)


def unknown_vector(name: str) -> RequestError:
    return RequestError(404, "name", f"name: no stored vector is named {name!r}; GET /v1/streamscope/vectors lists "
                                     f"them.")


def harvest_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A downloaded harvest: its tensors by value, and its values, layers and positions (the file's metadata)."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    return load(data), {key: json.loads(value) for key, value in metadata.items()}




# ---------------------------------------------------------------- SAEs

SAE_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


def sae_bytes(sae: Any) -> bytes:
    """An `streamscope.sae.SAE` as the safetensors bytes the server stores: its weights, and its site and
    activation in the file's metadata (``value``, ``layer``, ``activation``, ``k``, ``apply_b_dec_to_input``)."""
    tensors = {name: getattr(sae, name).detach().to(torch.float32).contiguous().cpu() for name in SAE_TENSORS
               if getattr(sae, name) is not None}
    metadata = {"value": sae.value, "layer": json.dumps(sae.layer), "activation": sae.activation,
                "k": json.dumps(sae.k), "apply_b_dec_to_input": json.dumps(bool(sae.apply_b_dec_to_input))}
    return save(tensors, metadata=metadata)


def sae_from_bytes(data: bytes, param: str = "body") -> Any:
    """An `SAE` from `sae_bytes`'s layout; anything else is refused naming what is wrong. Nothing in it can run."""
    try:
        tensors = load(data)
        size = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    except Exception:  # noqa: BLE001  (pickles, torch.save files, garbage)
        raise RequestError(400, param, f"{param}: not a safetensors file. The server reads an SAE as safetensors "
                                       f"only (never pickles): send streamscope.serve.storage.sae_bytes(sae), or "
                                       f"use streamscope.Client.store_sae.") from None
    missing = [name for name in SAE_TENSORS[:4] + ("value", "activation") if name not in tensors and
               name not in metadata]
    unknown = sorted(set(tensors) - set(SAE_TENSORS))
    if missing or unknown:
        raise RequestError(400, param, f"{param}: an SAE file holds the tensors W_enc, b_enc, W_dec, b_dec (and "
                                       f"threshold for JumpReLU) and the metadata value, layer, activation, k, "
                                       f"apply_b_dec_to_input; "
                                       f"{'missing ' + ', '.join(missing) if missing else ''}"
                                       f"{'; unknown tensors ' + ', '.join(unknown) if unknown else ''}.")
    try:
        layer = json.loads(metadata.get("layer", "null"))
        k = json.loads(metadata.get("k", "null"))
        apply = json.loads(metadata.get("apply_b_dec_to_input", "true"))
        if layer is not None and not isinstance(layer, int) or k is not None and not isinstance(k, int) \
                or not isinstance(apply, bool):
            raise ValueError("layer and k are ints or null; apply_b_dec_to_input is true or false")
        if any(not tensor.is_floating_point() for tensor in tensors.values()):
            raise ValueError("the weights are floating-point numbers")
        return SAE(*(tensors[name].to(torch.float32) for name in SAE_TENSORS[:4]), value=metadata["value"],
                   layer=layer, activation=metadata["activation"],
                   threshold=tensors["threshold"].to(torch.float32) if "threshold" in tensors else None, k=k,
                   apply_b_dec_to_input=apply, source={"format": "streamscope serve"})
    except (ValueError, TypeError) as error:
        raise RequestError(400, param, f"{param}: {error}.") from None


@dataclass
class StoredSAE:
    """An SAE the server holds: its file (which the engine's worker loads by name) and what checks need."""

    file: str  # the file's stem in the SAE folder: the name and a random part, new at every upload
    value: str
    layer: Any
    d_in: int
    d_sae: int
    activation: str
    bytes: int


class SAEs(dict):
    """Stored SAEs, name -> `StoredSAE`, their files in one folder, bounded by ``--max-stored-saes``."""

    def __init__(self, folder: Path, limits: Limits) -> None:
        super().__init__()
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limits = limits

    def store(self, name: str, sae: Any, data: bytes) -> StoredSAE:
        check_name(name)
        if name not in self and len(self) >= self.limits.max_stored_saes:
            raise RequestError(413, "name", f"name: the server holds {len(self)} SAEs, its limit "
                                            f"(--max-stored-saes); delete one first (DELETE /v1/streamscope/saes/NAME).")
        stem = f"{name}-{secrets.token_hex(8)}"
        aside = self.folder / f".{stem}.writing"
        aside.write_bytes(data)
        aside.replace(self.folder / f"{stem}.safetensors")
        self.delete(name)
        self[name] = StoredSAE(stem, sae.value, sae.layer, sae.d_in, sae.d_sae, sae.activation, len(data))
        return self[name]

    def delete(self, name: str) -> bool:
        stored = self.pop(name, None)
        if stored is None:
            return False
        # A request admitted before may still load it: the worker keeps the SAEs it loaded, so the file can go.
        (self.folder / f"{stored.file}.safetensors").unlink(missing_ok=True)
        return True

    def decoder_row(self, name: str, feature: int) -> torch.Tensor:
        """Feature `feature`'s decoder direction ``[d_in]`` float32, read from the file alone."""
        with safe_open(str(self.folder / f"{self[name].file}.safetensors"), framework="pt") as handle:
            return handle.get_slice("W_dec")[feature:feature + 1].reshape(-1).to(torch.float32)

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": name, "value": item.value, "layer": item.layer, "d_in": item.d_in, "d_sae": item.d_sae,
                 "activation": item.activation, "bytes": item.bytes} for name, item in sorted(self.items())]



__all__ = ["Harvests", "Vectors", "SAEs", "read_vector", "read_upload", "harvest_tensors", "sae_bytes", "sae_from_bytes"]
