"""`streamscope.Client`: a ``streamscope serve`` server with the in-process engines' `generate` and `harvest`.

    client = streamscope.Client("http://localhost:8000", api_key="...")
    result = client.generate(prompts, max_tokens=32, steer=[streamscope.Steer("layer_output", 16, v, scale=4.0)],
                             harvest={"values": "layer_output", "layers": [16]})
    result.texts, result.tokens, result.harvest["layer_output"][0]

Requests go through the ``openai`` client, ``concurrency`` at a time, with
their steers and harvest in the request's ``streamscope`` field. Prompts that
can share a request (no harvest, the same steers for each, every one editing
every position alike) go ``batch`` to a request, as the completions API's
prompt list; any other prompt is a request of its own. Harvests are
downloaded as safetensors through the same HTTP session. The results are the
same `Generation` and `Harvest` types the engines return.
"""

from __future__ import annotations

import inspect
import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx
import torch
from safetensors.torch import save

from ..bulk.dose import DoseWarning, carried_entry
from ..bulk.results import Generation, Harvest, ShardWriter
from ..bulk.schema import ENCODED, FRONT_END_ONLY, HARVEST_FIELDS, ONE_FORWARD, SERVED_STEER_FIELDS, SteerJSON
from ..bulk.spec import HarvestSpec, Positions, Steer
from .protocol import FIELD, WARNINGS_HEADER, rule_json, uniform
from .remote import RemoteModel
from .storage import harvest_tensors, sae_bytes
from .sweeps import client_patch, client_statistics


def steer_request(steer: Steer, sae: Optional[str] = None) -> dict[str, Any]:
    """`steer` as a server request's JSON (`streamscope.Client` sends it): every field a request takes
    (`SERVED_STEER_FIELDS`); its dose limit and on_dose only where the steer sets them (otherwise the server's
    --max-steer-dose and --steer-dose-action apply; a limit past the server's is refused there, naming it). An
    ``sae_clamp`` steer goes by its SAE's stored name `sae`, without a vector or origin: the server clamps with its
    stored copy of the SAE."""
    data = {name: getattr(steer, name) for name in SERVED_STEER_FIELDS if name not in ENCODED + FRONT_END_ONLY}
    data["positions"] = rule_json(steer.positions)
    if steer.condition is not None:
        data["condition"] = steer.condition.to_dict()
    for name in ("max_dose", "on_dose"):  # a steer's own setting reaches the server: none is ignored
        if getattr(steer, name) != SteerJSON.model_fields[name].default:
            data[name] = getattr(steer, name)
    if steer.mode == "sae_clamp":
        data.update(sae=sae, feature=steer.feature)
        return data
    vector: Any = steer.vector
    if isinstance(vector, torch.Tensor):
        vector = vector.detach().to(torch.float32).cpu().reshape(-1).tolist()
    data.update(vector=vector, origin=steer.origin)
    return data


def harvest_request(**fields: Any) -> dict[str, Any]:
    """A harvest request's JSON (`streamscope.Client` sends it) from its declared fields (`HARVEST_FIELDS`), a field
    left None left out (the server's default), the positions as a JSON rule."""
    unknown = sorted(set(fields) - set(HARVEST_FIELDS))
    if unknown:
        raise TypeError(f"a harvest request has no {', '.join(unknown)}: its fields are "
                        f"{', '.join(HARVEST_FIELDS)}.")
    return {name: rule_json(item) if name == "positions" else item for name, item in fields.items()
            if item is not None}


class Client(RemoteModel):
    """A ``streamscope serve`` server, spoken to with `generate` and `harvest` as a model is.

    It is also a model for the toolbox (`streamscope.serve.remote.RemoteModel`): ``streamscope.lens(client,
    ...)``, ``client.cache(...)``, ``streamscope.directions.find(client, ...)``, SAE features through
    ``client.harvest(..., sae=...)``, and their plots and views, each computed from harvests and the engine's
    own head, as far as HTTP carries (`streamscope.serve.remote.NOT_OVER_HTTP` says what it does not).

    Args:
        url: The server's address (``http://host:8000``; ``/v1`` is added).
        api_key: The server's ``--api-key``, if it has one.
        model: The served model's name; the server's first by default.
        concurrency: How many requests are in flight at once.
        timeout: Seconds one request may take.
        batch: How many prompts one request may carry where they can share one (see above); 1 for one each.
    """

    def __init__(self, url: str, api_key: Optional[str] = None, model: Optional[str] = None, concurrency: int = 32,
                 timeout: float = 600.0, batch: int = 16) -> None:
        import openai

        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        self.openai = openai.OpenAI(base_url=base, api_key=api_key or "none", timeout=timeout, max_retries=0)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base + "/", headers=headers, timeout=timeout)
        self.model = model or self.openai.models.list().data[0].id
        self.concurrency = concurrency
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch: prompts per request, an int >= 1, not {batch!r}.")
        self.batch = batch
        self._default_steer: Optional[bool] = None
        # id(SAE object) -> (the object, kept so that its id is not reused; the name this client stored it under)
        self._sae_names: dict[int, tuple[Any, str]] = {}

    # ---------------------------------------------------------------- the server's own endpoints

    def _route(self, method: str, path: str, **options: Any) -> Any:
        """One request to the server's ``/v1/streamscope/`` routes; a refusal raises the ``openai`` error for it."""
        import openai

        response = self.http.request(method, f"streamscope/{path}", **options)
        if response.status_code >= 400:
            try:
                body = response.json()
                message = body["error"]["message"]
            except Exception:  # noqa: BLE001  (not vLLM's error layout: the text)
                body, message = None, response.text
            kinds = {400: openai.BadRequestError, 401: openai.AuthenticationError, 404: openai.NotFoundError}
            raise kinds.get(response.status_code, openai.APIStatusError)(message, response=response, body=body)
        return response

    def info(self) -> dict[str, Any]:
        """The served model's layers, hidden size, values, taps, limits, stored vectors and SAEs, and the engine's
        CUDA graph mode (``graph_mode``: ``"NONE"`` where every step runs eagerly)."""
        return self._route("GET", "info").json()

    def store_vector(self, name: str, vector: Any, stream_norm: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Store `vector` on the server under `name`; a steer may then name it. Returns the server's listing entry
        (name, size, norm: the vector's length, stream_norm).

        `vector` is a ``[hidden_size]`` tensor or a `streamscope.directions.Direction`, which stores the stream
        norm it was made against (its ``stream_norm`` at its value and block) with it. `stream_norm` gives one for
        a tensor: ``{"value": ..., "layer": ..., "norm": ...}`` (`streamscope.bulk.dose.carried_entry`; ``norm``
        as `model.norms` measures it). A steer by this name at that value and block has its dose checked against
        it where the server has measured no norm there.
        """
        if hasattr(vector, "unit") and hasattr(vector, "stream_norm"):  # a Direction
            if stream_norm is None and vector.stream_norm is not None:
                stream_norm = carried_entry(vector.value, vector.layer, vector.stream_norm)
            vector = vector.vector
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"store_vector takes a [hidden_size] tensor or a Direction, not a {type(vector).__name__}.")
        metadata = {"streamscope.stream_norm": json.dumps(stream_norm)} if stream_norm is not None else None
        data = save({"vector": vector.detach().to(torch.float32).contiguous().cpu()}, metadata=metadata)
        return self._route("PUT", f"vectors/{name}", content=data,
                           headers={"Content-Type": "application/octet-stream"}).json()

    def store_sae(self, name: str, sae: Any) -> dict[str, Any]:
        """Store a `streamscope.sae.SAE` on the server under `name` (its weights as safetensors, float32).

        A steer (``sae.clamp(...)``) or ``harvest(..., sae=...)`` may then
        use the SAE object itself through this client, or its name. The
        server checks it against its model (width, block, value, taps).
        """
        response = self._route("PUT", f"saes/{name}", content=sae_bytes(sae),
                              headers={"Content-Type": "application/octet-stream"})
        self._sae_names[id(sae)] = (sae, name)
        return response.json()

    def saes(self) -> list[dict[str, Any]]:
        """The stored SAEs: name, value, layer, widths, activation, bytes."""
        return self._route("GET", "saes").json()["saes"]

    def delete_sae(self, name: str) -> None:
        self._route("DELETE", f"saes/{name}")
        self._sae_names = {key: value for key, value in self._sae_names.items() if value[1] != name}

    def _sae_name(self, sae: Any) -> str:
        if isinstance(sae, str):
            return sae
        if id(sae) not in self._sae_names:
            raise ValueError(f"{sae!r} is not stored on the server through this client: store it once with "
                             f"client.store_sae(name, sae), then use it (or its name).")
        return self._sae_names[id(sae)][1]

    def vectors(self) -> list[dict[str, Any]]:
        """The stored vectors: name, size, norm (the vector's length), stream_norm (the one it carries, or None)."""
        return self._route("GET", "vectors").json()["vectors"]

    def delete_vector(self, name: str) -> None:
        self._route("DELETE", f"vectors/{name}")

    def download(self, harvest_id: str, keep: bool = False) -> dict[str, Any]:
        """A harvest's tensors and its values, layers and positions, by the id a completion named."""
        response = self._route("GET", f"harvests/{harvest_id}", params={"keep": "true" if keep else "false"})
        tensors, metadata = harvest_tensors(response.content)
        return {"tensors": tensors, **metadata}

    # ---------------------------------------------------------------- sweeps the server runs (serve/sweeps.py)

    def patch_sweep(self, clean: Any, corrupted: Any, metric: Any = None, *, answer: Any = None, wrong: Any = None,
                    value: str = "layer_output", layers: Optional[Sequence[int]] = None,
                    positions: Optional[Sequence[int]] = None, repeats: int = 3, **options: Any) -> Any:
        """Activation patching run by the server in one request, with a noise floor over `repeats` unpatched runs
        of each prompt: a `streamscope.serve.sweeps.RemotePatching`. ``streamscope.patch(client, ...)`` calls it.
        The metric crosses as JSON: ``answer``/``wrong``, or `streamscope.serve.sweeps.token_logit`/``token_logprob``."""
        return client_patch(self, clean, corrupted, metric, answer=answer, wrong=wrong, value=value, layers=layers,
                            positions=positions, repeats=repeats, **options)

    def statistics(self, prompts: Sequence[Any], labels: Sequence[Any], value: str = "layer_output",
                   layers: Any = None, positions: Positions = "last", **options: Any) -> Any:
        """Running moments per label, gathered and reduced by the server, which sends only the moments (a
        `streamscope.bulk.moments.Moments`, equal bit for bit to `model.statistics` on the same rows). Options:
        ``reduce`` ("mean"), ``second``, ``pairs``."""
        return client_statistics(self, prompts, labels, value, layers, positions, **options)

    # ---------------------------------------------------------------- generate and harvest

    def _steer_json(self, steer: Steer) -> dict[str, Any]:
        if not isinstance(steer, Steer):
            raise TypeError(f"steer takes streamscope.Steer objects, not a {type(steer).__name__}.")
        return steer_request(steer, self._sae_name(steer.sae) if steer.mode == "sae_clamp" else None)

    def _complete(self, prompt: Any, options: dict[str, Any], field: dict[str, Any]) -> Any:
        known = inspect.signature(self.openai.completions.create).parameters
        # vLLM's own sampling options (top_k, ignore_eos, return_token_ids, ...) travel as extra body fields.
        extra = {key: value for key, value in options.items() if key not in known}
        if field:
            extra[FIELD] = field
        options = {key: value for key, value in options.items() if key in known}
        raw = self.openai.completions.with_raw_response.create(model=self.model, prompt=prompt,
                                                                extra_body=extra or None, **options)
        return raw.parse(), header_warnings(raw.headers)

    def _complete_all(self, prompts: Sequence[Any], options: dict[str, Any],
             fields: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
        """Each prompt's completion choice and its response, in order: prompts that can share a request go `batch`
        to one."""
        if isinstance(prompts, str):
            raise TypeError("generate and harvest take a list of prompts; wrap a single prompt in a list.")
        prompts = list(prompts)
        one_each = (options.get("n") or 1) != 1 or (options.get("best_of") or 1) != 1  # a choice per prompt, as read
        size = 1 if one_each or not self._shareable(fields) else self.batch
        groups = [list(range(start, min(start + size, len(prompts)))) for start in range(0, len(prompts), size)]

        notes: list[str] = []

        def one(group: list[int]) -> list[Any]:
            batch = [prompts[index] for index in group]
            response, messages = self._complete(batch[0] if len(group) == 1 else batch, options, fields[group[0]])
            notes.extend(messages)
            # (choice, its response): a harvest's id is on the response (one prompt each where there is one)
            return [(choice, response) for choice in sorted(response.choices, key=lambda choice: choice.index)]

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(groups)))) as pool:
            found = [choice for choices in pool.map(one, groups) for choice in choices]
        # The server's dose warnings, raised here as in process: once each per call (in process, once per steer),
        # in the caller's thread, where its warning filters and catch_warnings apply.
        for message in dict.fromkeys(notes):
            warnings.warn(message, DoseWarning, stacklevel=3)
        return found

    def _shareable(self, fields: list[dict[str, Any]]) -> bool:
        """Whether these prompts may share requests: no harvest, the same steers each, each editing every position."""
        if self.batch == 1 or not fields or any(field != fields[0] for field in fields) or "harvest" in fields[0]:
            return False
        if "steer" not in fields[0]:  # then the server's default steer, if any, applies: is it one that may share?
            if self._default_steer is None:
                self._default_steer = bool(self.info()["default_steer"])
            return not self._default_steer
        return uniform(fields[0]["steer"])

    @staticmethod
    def _per_prompt(positions: Positions, count: int) -> list[Any]:
        nested = (isinstance(positions, (list, tuple)) and len(positions) > 0
                  and all(isinstance(item, (list, tuple, range)) for item in positions))
        if nested:
            if len(positions) != count:
                raise ValueError(f"positions has {len(positions)} lists for {count} prompts: give one list per "
                                 f"prompt, or one rule for every prompt.")
            return [rule_json(list(item)) for item in positions]  # type: ignore[union-attr]
        return [rule_json(positions)] * count

    def _harvest_field(self, values: Any, layers: Any, positions: Positions, count: int,
                       reduce: Optional[str] = None) -> list[dict[str, Any]]:
        values = [values] if isinstance(values, str) else list(values)
        if isinstance(layers, range):
            layers = list(layers)
        # reduce: the rows are reduced on the server (serve/sweeps.reduced)
        return [harvest_request(values=values, layers=layers, positions=rule, reduce=reduce)
                for rule in self._per_prompt(positions, count)]

    def _assemble(self, downloads: list[dict[str, Any]]) -> Harvest:
        first = downloads[0]
        values: dict[str, list[torch.Tensor]] = {value: [] for value in first["values"]}
        for item in downloads:
            for value in values:
                values[value].append(item["tensors"][value])
        return Harvest(values, list(first["layers"]), [list(item["positions"]) for item in downloads],
                       list(range(len(downloads))), first.get("reduce"))

    def _downloads(self, choices: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
        ids = [response.model_extra[FIELD]["harvest"] for _, response in choices]
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(ids)))) as pool:
            return list(pool.map(self.download, ids))

    def generate(self, prompts: Sequence[Any], max_tokens: int = 16, *, steer: Sequence[Steer] = (),
                 harvest: Optional[dict[str, Any]] = None, return_logits: bool = False, progress: bool = False,
                 **sampling: Any) -> Generation:
        """Sample a completion of each prompt with steers applied and values harvested, as `model.generate`.

        `sampling` is the completion request's (``temperature``, ``top_p``,
        ``seed``, ...; greedy by default, as in process). Logits are not
        served over HTTP: ask for ``logprobs=k`` and read the responses'.
        ``progress`` is taken for the model's signature; nothing is drawn. A
        steer's vector may also be a stored vector's name (``vector="happy"``).
        ``return_logits`` with ``max_tokens=1``: each prompt's ``[1, vocab_size]``
        logits, its final norm's output at the last position harvested in the
        steered forward and sent through the engine's own head (for more tokens
        pass logprobs=k and read vLLM's top-k log-probs).
        """
        if return_logits:
            if max_tokens != 1 or harvest is not None:
                raise ValueError("return_logits over a server: the first token's logits only (max_tokens=1, no "
                                 "harvest=), read from the final norm's output through the engine's head; for "
                                 "more tokens pass logprobs=k (vLLM's top-k log-probs), or run the model in "
                                 "process.")
            found = self.generate(prompts, 1, steer=steer, harvest={"values": "final_norm_output", "layers": None,
                                                                    "positions": "last"}, **sampling)
            assert found.harvest is not None
            logits = [self.engine.head(rows.reshape(-1, rows.shape[-1]), normed=True)["logits"]
                      for rows in found.harvest.values["final_norm_output"]]
            return Generation(found.tokens, found.texts, logits, None)
        steer = list(steer or ())
        count = len(prompts)
        harvest_fields = None
        if harvest is not None:
            options = dict(harvest)
            harvest_fields = self._harvest_field(options.pop("values"), options.pop("layers", None),
                                                 options.pop("positions", "last"), count)
            if options:
                raise TypeError(f"harvest= takes values, layers and positions; not {', '.join(options)}.")
        fields: list[dict[str, Any]] = []
        for index in range(count):
            field: dict[str, Any] = {}
            mine = [self._steer_json(item) for item in steer if item.prompts is None or index in item.prompts]
            if mine:
                field["steer"] = mine
            if harvest_fields is not None:
                field["harvest"] = harvest_fields[index]
            fields.append(field)
        options = {"temperature": 0.0, **sampling, "max_tokens": max_tokens, "return_token_ids": True}
        choices = self._complete_all(prompts, options, fields)
        tokens = [list(choice.model_extra.get("token_ids") or []) for choice, _ in choices]
        texts = [choice.text for choice, _ in choices]
        harvested = self._assemble(self._downloads(choices)) if harvest is not None else None
        return Generation(tokens, texts, None, harvested)

    def harvest(self, prompts: Sequence[Any], values: Any = None, layers: Any = None, positions: Positions = "last",
                out: Optional[str | Path] = None, shard_size: int = 1024, progress: bool = False, sae: Any = None,
                top_k: Optional[int] = None, reduce: Optional[str] = None) -> Harvest | Path:
        """Read values at chosen blocks and positions of many prompts, as `model.harvest` (``out=`` writes shards).

        ``sae=`` (a stored SAE's name, or an SAE stored through this client)
        harvests its features at its own site, computed on the server's
        engine: ``"sae_features"`` ``[1, positions, d_sae]`` per prompt, or
        with ``top_k``, ``"sae_values"`` and ``"sae_indices"``
        ``[1, positions, top_k]``, as `model.harvest(..., sae=...)`. ``reduce="last"`` or ``"mean"`` reduces
        each prompt's positions on the server, before its rows cross HTTP, as `model.harvest(reduce=...)` does.
        """
        if sae is not None and reduce is not None:
            raise ValueError("a harvest with sae= is not reduced: leave reduce out.")
        if sae is not None:
            if values is not None or layers is not None:
                raise TypeError("a harvest with sae= reads the SAE's own value and block: leave values and layers "
                                "out.")
            if out is not None:
                raise ValueError("a harvest with sae= returns the features in memory; harvest the dense value to "
                                 "disk (out=) without sae=.")
            name = self._sae_name(sae)
            fields = [{"harvest": harvest_request(sae=name, top_k=top_k, positions=rule)}
                      for rule in self._per_prompt(positions, len(prompts))]
        elif values is None:
            raise TypeError("harvest needs the values to read (or sae= for an SAE's features).")
        else:
            fields = [{"harvest": item} for item in self._harvest_field(values, layers, positions, len(prompts),
                                                                        reduce)]
        options = dict(ONE_FORWARD)
        if out is None:
            return self._assemble(self._downloads(self._complete_all(prompts, options, fields)))
        writer: Optional[ShardWriter] = None
        try:
            for start in range(0, len(prompts), shard_size):
                chunk = list(range(start, min(start + shard_size, len(prompts))))
                part = self._assemble(self._downloads(self._complete_all([prompts[i] for i in chunk], options,
                                                                [fields[i] for i in chunk])))
                part.prompts = chunk
                if writer is None:
                    spec = HarvestSpec(list(part.values), part.layers, [], reduce=part.reduce)
                    writer = ShardWriter(out, spec, len(prompts))
                writer.spec.positions.extend(part.positions)
                writer.write(part)  # written while the server runs the next chunk
            assert writer is not None, "harvest needs at least one prompt"
            return writer.close()
        finally:
            if writer is not None:
                writer.abort()  # after close a no-op; on an error, no index (a half harvest) and the thread ends


def header_warnings(headers: Any) -> list[str]:
    """The dose warnings a server's response carries (its `WARNINGS_HEADER`, a JSON list of messages); none where
    it carries none, or a server that predates the header."""
    raw = headers.get(WARNINGS_HEADER)
    if not raw:
        return []
    try:
        messages = json.loads(raw)
    except ValueError:
        return [str(raw)]
    return [str(message) for message in messages] if isinstance(messages, list) else [str(messages)]


__all__ = ["Client", "header_warnings"]
