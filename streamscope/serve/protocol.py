"""What a request may ask of the server, as declarative JSON, checked before vLLM sees it.

A completion or chat request carries streamscope's part in one body field (the
``openai`` client sends it unchanged through ``extra_body``)::

    "streamscope": {
        "steer": [{"value": "layer_output", "layer": 1, "vector": [0.1, ...] or "stored-name",
                   "scale": 4.0, "positions": "all", "mode": "add", "generated": true,
                   "projection": 0.0, "norm_match": false, "from_step": 0, "origin": null}],
        "harvest": {"values": ["layer_output"], "layers": [0, 1], "positions": "last", "keep": false},
        "default_steer": true
    }

Every field is a string, a number, a boolean or a list of them: nothing names
code, a module or a pickle. Each field's type, default and range are declared
once, in `streamscope.bulk.schema` (whose JSON schema the server publishes at
``GET /v1/streamscope/schema``), and checked from that declaration before the
checks that need the model. `Checker.check` turns it into a `Checked` plan (the
steers as `streamscope.Steer`, the harvest's sites resolved on the server's own
envoy tree) or raises `RequestError`: an HTTP status, the field, and the fix.
The plan travels to the engine's worker as a JSON string in vLLM's own
``vllm_xargs`` (`worker_payload`), where `streamscope.serve.worker` applies it
to the request's token rows.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import re
import secrets
import sys
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy
import torch
from safetensors.torch import load

from .. import nnsight_seam as seam
from ..blocks.head_results import HEAD_RESULTS
from ..bulk.conditions import Condition, ConditionError
from ..bulk.dose import CARRIED, carried_how, carried_norm, judge_dose
from ..bulk.operations import DIRECTIONAL, per_tensor
from ..bulk.schema import (CONDITION_FIELDS, DOSE_ACTIONS, HARVEST_FIELDS, HARVEST_POSITIONS,
                           MAX_DOSE, NULL_IS_LEFT_OUT, ONE_FORWARD, PLAIN_FIELDS, REQUEST_FIELDS, SERVED_STEER_FIELDS,
                           STEER_REQUIRED, HarvestJSON, RequestJSON, SteerJSON, positions_from_json, rule_json,
                           validate_field, validate_fields)
from ..bulk.spec import (CALIBRATION_TEXT, ROOT_VALUES, RULES, SKIP_FIRST, Positions, Steer, SteerError, check_steer,
                         harvest_spec, locate, prompt_positions, value_names)
from ..errors import Unavailable, untapped
from .forwarding import uniform

#: Where a clamped or warned steer dose is logged (and printed to the server's stderr, which its log holds).
dose_logger = logging.getLogger("streamscope.serve")
#: The body field that carries a request's steers and harvest.
FIELD = "streamscope"
#: The response header that carries a checked request's dose warnings to its caller: a JSON list of the messages
#: (`streamscope.Client` warns each as a `streamscope.DoseWarning`, as a run in process does).
WARNINGS_HEADER = "x-streamscope-warnings"
#: vLLM's ``vllm_xargs`` key (the request's ``SamplingParams.extra_args``) under which the plan reaches the worker.
XARG = "streamscope"
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class RequestError(Exception):
    """A refused request: the HTTP status (400, 404, 413), the body field at fault, and a message with the fix."""

    def __init__(self, status: int, param: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message

    def body(self) -> dict[str, Any]:
        """vLLM's own error layout, which the ``openai`` client raises as ``BadRequestError`` and friends."""
        kinds = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}
        return {"error": {"message": self.message, "type": kinds.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}


@dataclass
class Limits:
    """What one request and the server as a whole may hold; each has a ``streamscope serve`` flag."""

    max_steers: int = 16                       # --max-steers-per-request
    max_harvest_bytes: int = 64 * 2**20        # --max-harvest-bytes (one request's harvest)
    max_stored_harvest_bytes: int = 2**30      # --max-stored-harvest-bytes (all harvests not yet downloaded)
    harvest_ttl: float = 600.0                 # --harvest-ttl (seconds a harvest waits to be downloaded)
    max_stored_vectors: int = 256              # --max-stored-vectors
    max_upload_bytes: int = 16 * 2**20         # --max-upload-bytes (a vector upload, a request's streamscope field)
    max_stored_saes: int = 8                   # --max-stored-saes
    max_sae_bytes: int = 2**31                 # --max-sae-bytes (one SAE upload)
    #: --max-steer-dose: the largest dose a steer may have, its edit over the stream's norm at its value and block
    #: (`streamscope.bulk.spec.check_dose`), measured by the engine on a calibration text; a steer may ask for less.
    max_steer_dose: Optional[float] = MAX_DOSE
    #: --steer-dose-action: what a dose past a steer's limit does where the request does not say (its ``on_dose``):
    #: "refuse" (a 400), "clamp" (run at the limit) or "warn" (run as sent); a clamp or a warning is logged and
    #: sent to the caller in the response's `WARNINGS_HEADER`. Past the server's
    #: own limit a request may ask to refuse or clamp, and to warn only where this is "warn".
    steer_dose_action: str = "refuse"


@dataclass
class Checked:
    """A request's checked plan: steers (the default's first), the harvest, and what the worker is sent."""

    steers: list[Steer] = field(default_factory=list)
    steer_payload: list[dict[str, Any]] = field(default_factory=list)
    harvest: Optional[dict[str, Any]] = None  # values, layers, positions (a JSON rule), keep, bytes
    length: Optional[int] = None
    #: What each clamped or warned steer dose says (a `streamscope.DoseWarning`'s message): the response carries
    #: them to the caller in its `WARNINGS_HEADER`.
    warnings: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.steer_payload and self.harvest is None


#: How many steers' checks a server remembers (`Checker.remembered`) before it starts again: enough for requests
#: steering every block of a 32-block model with 256 stored vectors at once (8,192 steers; at 4,096 the H100's
#: run of them cleared the memory every 128 requests and checked each steer anew, 7.6 ms a request).
REMEMBERED = 16384
#: The fields of a steer whose check is never remembered: a condition and an SAE's are checked each time.
CHECKED_EACH_TIME = frozenset({"condition", "sae", "feature"})


def _encoded(tensor: torch.Tensor) -> str:
    """A float32 vector as base64: exact, and a quarter of its JSON size."""
    return base64.b64encode(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).decode("ascii")


#: `_encoded`, once for each stored vector, not for every request that steers by its name.
vector_bytes = per_tensor(_encoded)


def vector_from_bytes(text: str) -> torch.Tensor:
    return torch.from_numpy(numpy.frombuffer(base64.b64decode(text), dtype=numpy.float32).copy())


def unknown_sae(name: Any, stored: Any) -> RequestError:
    """The 404 for an SAE name the server does not hold, listing the ones it does."""
    known = ", ".join(sorted(stored)[:20]) or "none yet"
    return RequestError(404, "sae", f"sae: no stored SAE is named {name!r} (stored: {known}); upload it with PUT "
                                    f"/v1/streamscope/saes/NAME (streamscope.Client.store_sae).")


NO_HEAD_RESULTS = ("self_attn.head_results ([heads, hidden_size] a position) is not served by the server, whose "
                   "harvests and steers hold one hidden_size vector a position: harvest it in process "
                   "(model.harvest(prompts, 'self_attn.head_results')), or edit it in a trace.")


def served_values() -> list[str]:
    """The bulk values the server harvests and steers: every one `model.harvest` takes but head_results (a row of
    ``[heads, hidden_size]``; the server's buffers hold one vector a row)."""
    return [value for value in value_names() if value.split(".")[-1] != HEAD_RESULTS]


def _bad(param: str, message: str, status: int = 400) -> RequestError:
    return RequestError(status, param, f"{param}: {message}")


def positions_rule(raw: Any, param: str) -> Positions:
    """A JSON positions rule (`streamscope.bulk.schema.positions_from_json`); a 400 naming `param` otherwise."""
    try:
        return positions_from_json(raw)
    except ValueError as error:
        raise _bad(param, str(error)) from None


def declared(model: Any, raw: dict[str, Any], param: str) -> Any:
    """`raw` checked against its declaration (`streamscope.bulk.schema`): the model's instance, or a 400 naming the
    field's path under `param` and what the field takes."""
    checked, where, message = validate_fields(model, raw)
    if checked is None:
        raise _bad(f"{param}.{where}" if where else param, message)
    return checked


def worker_item(steer: Steer, layer: Optional[int], vector: torch.Tensor) -> dict[str, Any]:
    """A checked steer as its worker's plan item (`worker_steer` reads it back): the fields the worker reads as they
    are (`PLAIN_FIELDS`), `layer` as the request gave it, the vector as float32 base64 and the positions as a JSON
    rule; `Checker.steer` adds a condition and an SAE's name and feature."""
    return {**{name: getattr(steer, name) for name in PLAIN_FIELDS}, "layer": layer, "vector": vector_bytes(vector),
            "positions": rule_json(steer.positions)}


def worker_steer(item: dict[str, Any]) -> Steer:
    """The steer a worker's plan item holds (`Checker.steer`'s payload, checked by the front end, whose dose check it
    passed: no limit here); an ``sae_clamp`` steer's SAE and feature, and a condition, are the worker's to add."""
    return Steer(**{name: item[name] for name in PLAIN_FIELDS if name in item},
                 vector=vector_from_bytes(item["vector"]), positions=positions_rule(item["positions"], "positions"),
                 max_dose=None)


def _fields(raw: Any, allowed: tuple[str, ...], param: str, hint: str = "") -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _bad(param, f"expected a JSON object with {', '.join(allowed)}; got {type(raw).__name__}.")
    unknown = [key for key in raw if key not in allowed]
    if unknown:
        raise _bad(param, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                          f"the fields are {', '.join(allowed)}.{hint}")
    return raw


class Checker:
    """Checks requests against the server's model: its envoy tree (a meta copy, no weights), tokenizer and taps.

    Args:
        model: streamscope's vLLM model built with ``dispatch=False`` (the same names the engine's worker serves).
        vectors: The stored vectors, name -> ``[hidden_size]`` float32.
        limits: The server's `Limits`.
    """

    def __init__(self, model: Any, vectors: dict[str, torch.Tensor], limits: Limits) -> None:
        self.model = model
        self.vectors = vectors
        self.limits = limits
        self.hidden = int(model.hidden_size)
        parameter = next(seam.module_of(model).parameters(), None)
        self.element_bytes = parameter.element_size() if parameter is not None else 4
        self.default: list[dict[str, Any]] = []  # the server-wide default steers, as checked JSON
        self.dtype = parameter.dtype if parameter is not None else torch.float32
        #: ``||h||`` of each (value, block) a steer has named, measured by the engine (`calibrate`): the dose check's.
        self.norms: dict[tuple[str, Optional[int]], float] = {}
        self._calibrating: Any = None  # an asyncio lock, made in the event loop
        self.saes: dict[str, Any] = {}  # the stored SAEs (`streamscope.serve.storage.SAEs`), set by the server
        #: Whether the engine may run a prompt in pieces (chunked prefill, vLLM's default), set by the server: a
        #: request-scoped condition, which decides on the whole prompt in the step that runs it, is then refused.
        self.prompts_split = False
        #: The checks of steers by stored vectors (`remembered`): JSON -> (the tensor, its state, the answer).
        self._remembered: dict[str, tuple[Any, tuple[Any, ...], tuple[Steer, dict[str, Any]]]] = {}
        #: The harvests' values and blocks as found on the tree (`harvest`), by what a request named.
        self._harvested: dict[tuple[Any, ...], Any] = {}
        self._thread = threading.local()  # a checking thread's own tokenizer (`own_tokenizer`)
        self._tokenizing = threading.Lock()  # the model's tokenizer, for a thread without its own

    def own_tokenizer(self) -> None:
        """Give the calling thread a copy of the tokenizer for its checks' prompt lengths: a fast tokenizer is not
        shared between threads (its truncation settings are the call's state), so each of the server's checking
        threads tokenizes with its own, and a wave of requests that need their lengths is not checked one by one."""
        try:
            self._thread.tokenizer = copy.deepcopy(self.model.tokenizer)
        except Exception:  # noqa: BLE001  (a tokenizer that cannot be copied: the threads take turns with the model's)
            logging.getLogger("streamscope.serve").warning("streamscope serve: the tokenizer could not be copied for "
                                                           "each checking thread; they take turns with one")

    # ---------------------------------------------------------------- pieces

    def vector(self, raw: Any, param: str) -> torch.Tensor:
        """A steer's vector: an inline list of ``hidden_size`` finite numbers, or a stored vector's name."""
        if isinstance(raw, str):
            if raw not in self.vectors:
                known = ", ".join(sorted(self.vectors)[:20]) or "none yet"
                raise _bad(param, f"no stored vector is named {raw!r} (stored: {known}); upload it with "
                                  f"POST /v1/streamscope/vectors/{raw}, or send the vector inline.", 404)
            return self.vectors[raw]
        if not isinstance(raw, list):
            raise _bad(param, f"a vector is a list of {self.hidden} numbers or a stored vector's name, "
                              f"not a {type(raw).__name__}.")
        if len(raw) != self.hidden:
            raise _bad(param, f"the vector has {len(raw)} numbers; this model's hidden size is {self.hidden}.")
        if not all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in raw):
            raise _bad(param, "every element of a vector is a number.")
        return self.finite(torch.tensor(raw, dtype=torch.float32), param)

    def finite(self, tensor: torch.Tensor, param: str) -> torch.Tensor:
        tensor = tensor.to(torch.float32).reshape(-1) if tensor.dim() <= 1 else tensor
        if tuple(tensor.shape) != (self.hidden,):
            raise _bad(param, f"a vector has shape ({self.hidden},) on this model, not {tuple(tensor.shape)}.")
        if not bool(torch.isfinite(tensor).all()):
            raise _bad(param, "the vector holds NaN or inf: send finite numbers.")
        return tensor

    def site(self, value: Any, layer: Any, param: str) -> Any:
        """The value's `Site` on the server's tree; refusals name the field and, on a tapped server, the tap."""
        if not isinstance(value, str):
            raise _bad(f"{param}.value", f"a value is named by a string ({', '.join(served_values())}).")
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise _bad(f"{param}.layer", f"a block index is an int (or null for a root value), not {layer!r}.")
        if value.split(".")[-1] == HEAD_RESULTS:
            raise _bad(f"{param}.value", NO_HEAD_RESULTS)
        try:
            site = locate(self.model, value, layer)
        except IndexError as error:
            raise _bad(f"{param}.layer", str(error)) from None
        except Unavailable as error:
            raise _bad(f"{param}.value", str(error)) from None
        except (ValueError, TypeError) as error:
            where = "layer" if "layer=" in str(error) else "value"
            raise _bad(f"{param}.{where}", str(error)) from None
        self.tapped(site, f"{param}.value")
        return site

    def tapped(self, site: Any, param: str) -> None:
        """On a server started with --taps, refuse a value at an untapped location, naming the tap to add."""
        tapped = getattr(self.model, "tapped", None)
        if tapped and site.location not in tapped:
            name = f"{site.host.where()}.{site.descriptor.name}"
            tap = name.removeprefix("model.").replace("[", ".").replace("]", "")
            raise _bad(param, f"{untapped(name, site.location, len(tapped))}. On this server: streamscope serve "
                              f"PATH --taps ... {tap}")

    def positions(self, rule: Positions, lengths: list[int], param: str) -> None:
        """Refuse a rule that does not fit each prompt (`lengths`: their token counts; empty where unknown)."""
        for index, length in enumerate(lengths):
            try:
                prompt_positions(rule, length, index)
            except (IndexError, TypeError, ValueError) as error:
                raise _bad(param, str(error).removeprefix("positions: ")) from None

    # ---------------------------------------------------------------- steers and harvests

    def steer(self, raw: Any, param: str, lengths: list[int],
              notes: Optional[list[str]] = None) -> tuple[Steer, dict[str, Any]]:
        """One steer: a `streamscope.Steer` and the JSON the worker gets (its vector as float32 base64). A clamped
        or warned dose is logged, and its message added to `notes` (the response's warnings)."""
        item = _fields(raw, SERVED_STEER_FIELDS, param,
                       " One request is one prompt, so a steer has no 'prompts' (streamscope.Client sends each "
                       "prompt its own steers)." if isinstance(raw, dict) and "prompts" in raw else "")
        # A null number is a field left out: the mode's default where the mode uses it (streamscope.Client sends
        # every field of a Steer, the ones its mode does not use as null).
        item = {key: entry for key, entry in item.items() if not (entry is None and key in NULL_IS_LEFT_OUT)}
        mode = item.get("mode", SteerJSON.model_fields["mode"].default)
        wrong = validate_field(SteerJSON, "mode", mode)
        if wrong is not None:
            raise _bad(f"{param}.mode", wrong)
        sae: Optional[tuple[str, Any, int]] = None  # (name, stored SAE, feature)
        if "sae" in item or "feature" in item or mode == "sae_clamp":
            item, sae = self.sae_steer(item, param, mode)
        for required in STEER_REQUIRED:
            if required not in item:
                raise _bad(f"{param}.{required}", f"a steer needs {required!r}.")
        # Every field's type and range, as declared (`streamscope.bulk.schema.SteerJSON`); then what needs the model.
        spec = declared(SteerJSON, item, param)
        layer = spec.layer
        self.site(spec.value, layer, param)
        vector = self.vector(item["vector"], f"{param}.vector")
        positions = positions_from_json(spec.positions)
        on_dose = self.dose_action(item.get("on_dose"), f"{param}.on_dose")
        condition, condition_payload = self.condition(spec.condition, item["condition"], f"{param}.condition") \
            if spec.condition is not None else (None, None)
        limit = self.limits.max_steer_dose
        max_dose = item.get("max_dose", limit)
        if limit is not None and (max_dose is None or max_dose > limit):
            raise _bad(f"{param}.max_dose", f"{max_dose!r} is past this server's dose limit, {limit:g} "
                                            f"(--max-steer-dose): send a smaller one, or leave it out.")
        if mode in DIRECTIONAL and not float(vector.norm()) > 0:
            raise _bad(f"{param}.vector", f"mode {mode!r} uses the vector as a direction: send a non-zero vector.")
        # An sae_clamp steer is checked here as the addition of its feature's decoder direction (site, width,
        # origin, positions) and with its own dose: the SAE itself was checked against the model when it was stored.
        try:
            steer = Steer(**{name: getattr(spec, name) for name in PLAIN_FIELDS}, vector=vector, positions=positions,
                          origin=spec.origin, max_dose=max_dose, on_dose=on_dose, condition=condition)
            check_steer(self.model, steer if mode != "sae_clamp" else replace(steer, mode="add", projection=None),
                        1, lengths or None)
            where = steer.value if steer.layer is None else f"layers[{steer.layer % len(self.model.layers)}].{steer.value}"
            layer_index = None if steer.layer is None else steer.layer % len(self.model.layers)
            norm, how = self.dose_norm(steer, item["vector"], layer_index)
            steer, message = judge_dose(steer, norm, self.dtype, where, how)
            if message is not None:  # a clamped or warned dose: the log and the caller are told
                dose_logger.warning("streamscope serve: %s", message)
                print(f"streamscope serve: {message}", file=sys.stderr, flush=True)
                if notes is not None:
                    notes.append(message)
        except SteerError as error:
            field = error.field or ("origin" if "another model" in str(error) else "vector")
            raise _bad(f"{param}.{field}", str(error)) from None
        except (ValueError, TypeError, IndexError) as error:
            raise _bad(f"{param}.vector", str(error)) from None
        self.positions(positions, lengths, f"{param}.positions")
        payload = worker_item(steer, layer, vector)
        if condition_payload is not None:
            payload["condition"] = condition_payload
        if mode == "sae_clamp" and sae is not None:
            payload.update(sae=sae[1].file, feature=sae[2])
        return steer, payload

    def dose_norm(self, steer: Steer, vector: Any, layer: Optional[int]) -> tuple[Optional[float], str]:
        """``||h||`` at the steer's value and block for its dose check, and how it was found: the norm its stored
        vector (`vector`, a name) or its own ``origin`` carries for that site, else the engine's measurement
        (`calibrate`), else none (only an overflow is refused). A vector's own norm comes first, so a request's
        check never depends on what the server measured for earlier ones."""
        stored = self.stored_norm(vector, steer.value, layer)
        if stored is not None:
            return stored, carried_how(f"stored vector {vector!r}")
        carried = carried_norm(steer, layer, len(self.model.layers))
        if carried is not None:
            return carried, carried_how("the steer's vector (origin)")
        return self.norms.get((steer.value, layer)), ("measured by the server's engine on streamscope's calibration "
                                                      "text, positions after the first")

    def stored_norm(self, vector: Any, value: str, layer: Optional[int]) -> Optional[float]:
        """The stream norm a stored vector named `vector` carries at (`value`, `layer`), if it carries one there."""
        entry = getattr(self.vectors, "carried", {}).get(vector) if isinstance(vector, str) else None
        return float(entry["norm"]) if entry is not None and (entry["value"], entry["layer"]) == (value, layer) \
            else None

    def dose_action(self, raw: Any, param: str) -> str:
        """A steer's ``on_dose``: the server's --steer-dose-action where left out; "warn" (running past the limit)
        only where the server's action is "warn" too."""
        server = self.limits.steer_dose_action
        if raw is None:
            return server
        if raw not in DOSE_ACTIONS:
            raise _bad(param, f"{raw!r}: one of {', '.join(map(repr, DOSE_ACTIONS))} (what a dose past the limit does).")
        if raw == "warn" and server != "warn":
            raise _bad(param, f"'warn' runs a steer past the dose limit, and this server refuses that "
                              f"(--steer-dose-action {server}): send 'refuse' or 'clamp' (run at the limit).")
        return str(raw)

    def condition(self, spec: Any, raw: dict[str, Any], param: str) -> tuple[Condition, dict[str, Any]]:
        """A steer's condition (`streamscope.Condition`) from its declared fields (`spec`, a
        `streamscope.bulk.schema.ConditionJSON`; `raw`, as sent) and the JSON the worker gets (its vector as float32
        base64)."""
        self.site(spec.value, spec.layer, param)
        vector = self.vector(raw["vector"], f"{param}.vector")
        try:
            condition = Condition(**{name: getattr(spec, name) for name in CONDITION_FIELDS if name != "vector"},
                                  vector=vector)
        except ConditionError as error:
            raise _bad(f"{param}.{error.field or 'vector'}", str(error)) from None
        if condition.scope == "request" and self.prompts_split:
            raise _bad(f"{param}.scope", "a request-scoped condition decides on the whole prompt in the step that "
                                         "runs it, and this server may run a prompt in pieces (chunked prefill, "
                                         "vLLM's default), which would leave the request unsteered: start the "
                                         "server with --no-enable-chunked-prefill, or send scope 'row'.")
        payload = {**{name: getattr(condition, name) for name in CONDITION_FIELDS}, "vector": vector_bytes(vector)}
        return condition, payload

    def sae_steer(self, item: dict[str, Any], param: str, mode: str) -> tuple[dict[str, Any], tuple[str, Any, int]]:
        """A steer by a stored SAE's feature: its value and block are the SAE's, its vector the feature's decoder
        direction (``sae_clamp`` clamps the feature in the loop; any other mode adds, sets, ablates or clamps along
        the direction)."""
        name, feature = item.get("sae"), item.get("feature")
        if name is None:
            raise _bad(f"{param}.sae", "a steer by feature (mode 'sae_clamp', or 'feature') names a stored SAE: "
                                       "\"sae\": \"NAME\" (upload it with PUT /v1/streamscope/saes/NAME).")
        stored = self.stored_sae(name, f"{param}.sae")
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < stored.d_sae:
            raise _bad(f"{param}.feature", f"{feature!r} is not a feature of SAE {name!r}: give an int in "
                                           f"0..{stored.d_sae - 1}.")
        if "vector" in item:
            raise _bad(f"{param}.vector", "a steer by an SAE's feature takes the feature's decoder direction: "
                                          "leave vector out.")
        value, layer = item.get("value", stored.value), item.get("layer", stored.layer)
        if isinstance(layer, int) and not isinstance(layer, bool) and stored.layer is not None:
            layer = layer % len(self.model.layers) if -len(self.model.layers) <= layer < len(self.model.layers) \
                else layer
        if (value, layer) != (stored.value, stored.layer):
            raise _bad(f"{param}.sae", f"SAE {name!r} reads {stored.value} at block {stored.layer}, and the steer "
                                       f"names {value} at block {item.get('layer')}: a feature means something at "
                                       f"its SAE's own site only; leave value and layer out.")
        with torch.no_grad():
            vector = self.saes.decoder_row(name, feature)
        return {**item, "value": value, "layer": layer, "vector": vector.tolist()}, (name, stored, feature)

    def stored_sae(self, name: Any, param: str) -> Any:
        if not isinstance(name, str) or name not in self.saes:
            error = unknown_sae(name, self.saes)
            raise RequestError(error.status, param, f"{param}{error.message.removeprefix('sae')}")
        return self.saes[name]

    def steers(self, raw: Any, param: str, lengths: list[int],
               notes: Optional[list[str]] = None) -> tuple[list[Steer], list[dict[str, Any]]]:
        if isinstance(raw, dict):
            raw = [raw]
        if not isinstance(raw, list):
            raise _bad(param, "a list of steers (JSON objects with value, layer, vector, ...).")
        if len(raw) > self.limits.max_steers:
            raise _bad(param, f"{len(raw)} steers; this server takes at most {self.limits.max_steers} per request "
                              f"(--max-steers-per-request).", 413)
        pairs = [self.remembered(item, f"{param}[{index}]", lengths, notes) for index, item in enumerate(raw)]
        return [steer for steer, _ in pairs], [payload for _, payload in pairs]

    def remembered(self, raw: Any, param: str, lengths: list[int],
                   notes: Optional[list[str]]) -> tuple[Steer, dict[str, Any]]:
        """`steer`'s answer, remembered for a steer of a stored vector (a request steering every block checks one
        steer a block, a millisecond of the event loop at 32): the same JSON, the same prompt lengths, the same
        stored tensor with the same numbers and carried norm, and no stream norm measured since give the answer a
        fresh check gives. A refusal, a clamped or warned dose (logged each time), a condition and an SAE steer
        are checked each time."""
        name = raw.get("vector") if isinstance(raw, dict) else None
        tensor = self.vectors.get(name) if isinstance(name, str) else None
        if tensor is None or tensor.is_inference() or not CHECKED_EACH_TIME.isdisjoint(raw):
            return self.steer(raw, param, lengths, notes)
        key = json.dumps(raw, sort_keys=True)
        state = (tensor._version, len(self.norms), repr(getattr(self.vectors, "carried", {}).get(name)),
                 tuple(lengths))
        found = self._remembered.get(key)
        if found is not None and found[0]() is tensor and found[1] == state:
            return found[2]
        said: list[str] = []
        answer = self.steer(raw, param, lengths, said)
        if notes is not None:
            notes.extend(said)
        if not said:
            if len(self._remembered) >= REMEMBERED:
                self._remembered.clear()
            self._remembered[key] = (weakref.ref(tensor), state, answer)
        return answer

    def harvest(self, raw: Any, param: str, length: Optional[int]) -> dict[str, Any]:
        item = _fields(raw, HARVEST_FIELDS, param)
        spec = declared(HarvestJSON, item, param)  # every field's type and range, as declared; then the model's
        reduce = item.pop("reduce", None)  # applied to the rows before they cross HTTP (`serve.sweeps.reduced`)
        if reduce is not None and ("sae" in item or "top_k" in item):
            raise _bad(f"{param}.reduce", "a harvest of an SAE's features is not reduced: leave reduce out.")
        if "sae" in item or "top_k" in item:
            return self.sae_harvest(item, param, length)
        if spec.values is None:
            raise _bad(f"{param}.values", "a harvest names its values (\"layer_output\", [\"layer_mid\", ...]).")
        values = [spec.values] if isinstance(spec.values, str) else spec.values
        if any(value.split(".")[-1] == HEAD_RESULTS for value in values):
            raise _bad(f"{param}.values", NO_HEAD_RESULTS)
        layers, keep = spec.layers, spec.keep
        positions = positions_from_json(spec.positions)
        if positions == "none":
            raise _bad(f"{param}.positions", "a harvest reads prompt positions: ask for \"last\", \"all\", indices or "
                                             "a slice.")
        # The positions against the prompt first, and the values and blocks with a rule any prompt fits: each
        # refusal then names its own field (a position past the prompt's end is not a block out of range).
        self.positions(positions, [] if length is None else [length], f"{param}.positions")
        named = (tuple(values), json.dumps(layers))
        spec = self._harvested.get(named)
        if spec is None:  # the values and blocks against the model's tree: found once for every request asking
            try:
                spec = harvest_spec(self.model, values, layers, "last", [1])
            except IndexError as error:
                raise _bad(f"{param}.layers", str(error)) from None
            except (ValueError, TypeError, Unavailable) as error:
                where = "layers" if "block index" in str(error) else "values"
                raise _bad(f"{param}.{where}", str(error)) from None
            for site in spec.sites(self.model):
                self.tapped(site, f"{param}.values")
            if len(self._harvested) >= REMEMBERED:
                self._harvested.clear()
            self._harvested[named] = spec
        count = len(prompt_positions(positions, length, 0)) if length is not None else 1
        if count == 0:
            raise _bad(f"{param}.positions", f"the rule selects none of the prompt's {length} positions.")
        sites = sum(1 if value in ROOT_VALUES else len(spec.layers) for value in spec.values)
        size = sites * count * self.hidden * self.element_bytes
        if size > self.limits.max_harvest_bytes:
            raise _bad(param, f"this harvest is {size} bytes ({sites} value-blocks x {count} positions x "
                              f"{self.hidden} x {self.element_bytes} bytes); a request may harvest at most "
                              f"{self.limits.max_harvest_bytes} (--max-harvest-bytes): ask for fewer blocks or "
                              f"positions, or split the request.", 413)
        return {"values": list(spec.values), "layers": list(spec.layers), "positions": rule_json(positions), "keep": keep,
                "bytes": size, **({"reduce": reduce} if reduce is not None else {})}

    def sae_harvest(self, item: dict[str, Any], param: str, length: Optional[int]) -> dict[str, Any]:
        """A harvest of a stored SAE's features at its site: every feature, or the `top_k` largest (values and
        indices), computed in the engine's worker (float32), so the dense stream never leaves it."""
        if "sae" not in item:
            raise _bad(f"{param}.top_k", "top_k is for a harvest of an SAE's features: name the SAE (\"sae\").")
        if "values" in item or "layers" in item:
            raise _bad(param, "a harvest with sae reads the SAE's own value and block: leave values and layers out.")
        stored = self.stored_sae(item["sae"], f"{param}.sae")
        top_k = item.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                                  or not 0 < top_k <= stored.d_sae):
            raise _bad(f"{param}.top_k", f"{top_k!r}: give an int in 1..{stored.d_sae}, or null for every feature.")
        keep = item.get("keep", False)
        self.site(stored.value, stored.layer, f"{param}.sae")
        positions = positions_from_json(item.get("positions", HARVEST_POSITIONS))
        if positions == "none":
            raise _bad(f"{param}.positions", "a harvest reads prompt positions: ask for \"last\", \"all\", indices or "
                                             "a slice.")
        self.positions(positions, [] if length is None else [length], f"{param}.positions")
        count = len(prompt_positions(positions, length, 0)) if length is not None else 1
        if count == 0:
            raise _bad(f"{param}.positions", f"the rule selects none of the prompt's {length} positions.")
        width = stored.d_sae if top_k is None else 2 * top_k
        size = count * width * 4
        if size > self.limits.max_harvest_bytes:
            raise _bad(param, f"this harvest is {size} bytes ({count} positions x {width} float32 features); a request "
                              f"may harvest at most {self.limits.max_harvest_bytes} (--max-harvest-bytes): ask for "
                              f"top_k, or fewer positions.", 413)
        return {"values": [stored.value], "layers": [] if stored.layer is None else [stored.layer],
                "positions": rule_json(positions), "keep": keep, "bytes": size, "sae": stored.file, "top_k": top_k}

    def default_steers(self, raw: Any) -> list[dict[str, Any]]:
        """Check the server-wide default steers (the same JSON as a request's), without a prompt."""
        _, payload = self.steers(raw, "steer", [])
        return payload

    # ---------------------------------------------------------------- the dose check's stream norms

    def steered_sites(self, field: Any) -> list[tuple[str, Optional[int]]]:
        """The (value, block) of each steer in a request's `field` whose stream norm is not known yet (a steer this
        cannot read is left to `check`, which refuses it)."""
        steers = field.get("steer", []) if isinstance(field, dict) else []
        found: list[tuple[str, Optional[int]]] = []
        count = len(self.model.layers)
        for item in [steers] if isinstance(steers, dict) else steers if isinstance(steers, list) else []:
            if not isinstance(item, dict):
                continue
            stored = self.saes[item["sae"]] if isinstance(item.get("sae"), str) and item["sae"] in self.saes \
                else None
            value = item.get("value", stored.value if stored is not None else None)
            layer = item.get("layer", stored.layer if stored is not None else None)
            if not isinstance(value, str) or not (layer is None or (isinstance(layer, int) and -count <= layer < count
                                                                    and not isinstance(layer, bool))):
                continue
            site = (value, None if layer is None else layer % count)
            if site not in self.norms and site not in found and not self.carries(item, site):
                try:
                    self.site(value, site[1], "steer")
                except RequestError:
                    continue
                found.append(site)
        return found

    def carries(self, item: dict[str, Any], site: tuple[str, Optional[int]]) -> bool:
        """Whether a steer's JSON carries a stream norm for `site` (its stored vector's, or its origin's): then the
        dose check takes it, and the engine need not measure one."""
        if self.stored_norm(item.get("vector"), *site) is not None:
            return True
        entry = (item.get("origin") or {}).get(CARRIED) if isinstance(item.get("origin"), dict) else None
        if not isinstance(entry, dict) or entry.get("value") != site[0] or not isinstance(entry.get("norm"),
                                                                                      (int, float)):
            return False
        layer, count = entry.get("layer"), len(self.model.layers)
        return (layer % count if isinstance(layer, int) and -count <= layer < count else layer) == site[1]

    async def calibrate(self, field: Any, engine: Any, harvests: Any) -> None:
        """Measure ``||h||`` at each site the request's steers name that is not measured yet: the engine harvests
        `CALIBRATION_TEXT` there (one request per value, its own harvest, as any request's) and the mean row norm
        after the first position is kept for the server's life. Where it cannot be measured (no engine yet), the
        dose check has no norm and only refuses edits that overflow; the reason is logged."""
        if engine is None or not self.steered_sites(field):
            return
        if self._calibrating is None:
            self._calibrating = asyncio.Lock()
        async with self._calibrating:
            wanted = self.steered_sites(field)
            by_value: dict[str, list[Optional[int]]] = {}
            for value, layer in wanted:
                by_value.setdefault(value, []).append(layer)
            ids = list(self.model.tokenizer(CALIBRATION_TEXT)["input_ids"])
            for value, layers in by_value.items():
                try:
                    await self._measure(engine, harvests, value, [layer for layer in layers if layer is not None],
                                        ids, secrets.token_hex(8))
                except Exception:  # noqa: BLE001  (the dose check goes on without the norm; the log says why)
                    logging.getLogger("streamscope.serve").exception(
                        "streamscope serve: the stream norm of %s could not be measured; steers there are checked "
                        "for overflow only", value)

    async def _measure(self, engine: Any, harvests: Any, value: str, layers: list[int], ids: list[int],
                       token: str) -> None:
        from vllm import SamplingParams

        size = max(1, len(layers)) * len(ids) * self.hidden * 4
        harvest_id = harvests.reserve(size)
        payload = json.dumps({"steer": [], "harvest": {"values": [value], "layers": layers, "positions": "all",
                                                       "id": harvest_id}})
        params = SamplingParams(**ONE_FORWARD, extra_args={XARG: payload})
        try:
            async for _ in engine.generate({"prompt_token_ids": ids, "cache_salt": f"streamscope-calibration-{token}"},
                                           params, f"streamscope-calibration-{token}"):
                pass
            tensors = load(await harvests.take(harvest_id, keep=False))
        finally:
            harvests.delete(harvest_id)
        rows = next(iter(tensors.values())).float()  # [blocks, positions, hidden]; no blocks at the root
        rows = rows.unsqueeze(0) if rows.dim() == 2 else rows
        norms = (rows[:, 1:] if rows.shape[1] > 1 else rows).norm(dim=-1).mean(-1)
        if value in ROOT_VALUES:
            self.norms[(value, None)] = float(norms[0])
        for index, layer in enumerate(layers):
            self.norms[(value, layer)] = float(norms[index])

    # ---------------------------------------------------------------- a whole request

    def check(self, body: dict[str, Any], chat: bool) -> Checked:
        """Check a completion (or chat) request's streamscope field; the default steer unless it opts out."""
        raw = body.get(FIELD)
        if raw is None:
            raw = {}
        own = _fields(raw, REQUEST_FIELDS, FIELD)
        use_default = own.get("default_steer", RequestJSON.model_fields["default_steer"].default)
        wrong = validate_field(RequestJSON, "default_steer", use_default)
        if wrong is not None:
            raise _bad(f"{FIELD}.default_steer", wrong)
        checked = Checked()
        if not own and not (self.default and use_default):
            return checked
        lengths = self.prompt_lengths(body, chat) if own and needs_lengths(own) else []
        if self.default and use_default:
            checked.steer_payload.extend(self.default)
        if "steer" in own:
            steers, payload = self.steers(own["steer"], f"{FIELD}.steer", lengths, checked.warnings)
            if len(payload) + len(checked.steer_payload) > self.limits.max_steers:
                raise _bad(f"{FIELD}.steer", f"with the server's {len(self.default)} default steers this request has "
                                             f"{len(payload) + len(checked.steer_payload)}; the limit is "
                                             f"{self.limits.max_steers}: send default_steer: false, or fewer.", 413)
            checked.steers, checked.steer_payload = steers, checked.steer_payload + payload
        count = len(lengths) if lengths else _prompt_count(body)
        if count > 1:
            # One request has one prefix-cache salt: prompts of one request share KV blocks, which is sound only
            # where a steer edits every position alike (then a shared prefix was steered the same way for each).
            if "harvest" in own:
                raise _bad("prompt", f"a harvest reads one prompt per request; this one has {count}: send "
                                     f"them as separate requests (streamscope.Client.harvest does, concurrently).")
            if not uniform(checked.steer_payload):
                raise _bad("prompt", f"{count} prompts in one request, with a steer that does not edit every "
                                     f"position (positions other than \"all\", generated false, or from_step): "
                                     f"send each prompt as its own request (streamscope.Client does).")
        if "harvest" in own:
            for option in ("n", "best_of"):
                if (body.get(option) or 1) != 1:
                    raise _bad(option, "a harvest reads one prompt once: send n=1 (and best_of=1) with a harvest.")
            checked.harvest = self.harvest(own["harvest"], f"{FIELD}.harvest", lengths[0] if lengths else None)
        checked.length = lengths[0] if len(lengths) == 1 else None
        return checked

    def prompt_lengths(self, body: dict[str, Any], chat: bool) -> list[int]:
        """Each prompt's token count as vLLM will see it (empty where only the engine can tell), with the calling
        thread's own tokenizer, or the model's where the thread has none (one thread at a time)."""
        own = getattr(self._thread, "tokenizer", None)
        if own is not None:
            return self._lengths(body, chat, own)
        with self._tokenizing:
            return self._lengths(body, chat, self.model.tokenizer)

    def _lengths(self, body: dict[str, Any], chat: bool, tokenizer: Any) -> list[int]:
        if chat:
            messages = body.get("messages")
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=body.get("add_generation_prompt",
                                                                                             True), tokenize=True)
            except Exception:  # noqa: BLE001  (vLLM renders and refuses it itself)
                return []
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return [len(ids)]
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                       and all(isinstance(token, int) and not isinstance(token, bool)
                                               for token in prompt)):
            prompt = [prompt]
        if isinstance(prompt, list) and prompt:
            lengths = []
            for item in prompt:
                if isinstance(item, str):
                    lengths.append(len(tokenizer(item, add_special_tokens=body.get("add_special_tokens",
                                                                                   True))["input_ids"]))
                elif isinstance(item, list) and item and all(isinstance(token, int) and not isinstance(token, bool)
                                                             for token in item):
                    lengths.append(len(item))
                else:
                    break
            else:
                return lengths
        raise _bad("prompt", "a request with a streamscope field takes a prompt (a string or a list of token ids) or "
                             "a list of them.")


#: The positions rules that fit every prompt with a token in it: a steer or harvest of these needs no prompt length.
ANY_LENGTH = RULES


def needs_lengths(field: Any) -> bool:
    """Whether checking a request's ``streamscope`` field needs its prompts' token counts (tokenizing a text prompt
    in the server's front end): a steer at indices or a slice (they must fit the prompt), or a harvest of more than
    the last position (its size). Steers at "all", "last" or "none" and a last-position harvest, the usual
    requests, are checked without it; vLLM tokenizes their prompts off the server's event loop as for any request.
    A field this cannot read is checked with the lengths, whose check says what is wrong with it."""
    if not isinstance(field, dict):
        return True
    steers = field.get("steer", [])
    for item in [steers] if isinstance(steers, dict) else steers if isinstance(steers, list) else [None]:
        if not isinstance(item, dict) or item.get("positions", SKIP_FIRST) not in ANY_LENGTH:
            return True
    harvest = field.get("harvest")
    return harvest is not None and (not isinstance(harvest, dict)
                                    or harvest.get("positions", HARVEST_POSITIONS) != "last")


def _prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a completion request holds, without tokenizing them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        return len(prompt)
    return 1


__all__ = ["Checker", "Checked", "Limits", "RequestError", "FIELD", "XARG", "WARNINGS_HEADER",
           "rule_json", "positions_rule", "vector_bytes", "vector_from_bytes", "worker_item",
           "worker_steer"]
