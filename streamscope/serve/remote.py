"""A `streamscope.Client` as a model: what the toolbox may ask of a server, decided here and nowhere else.

The workflows read a model through its sizes, tokenizer, config, ``harvest``, ``generate``, ``cache`` and
``model.engine`` (`streamscope.engine.Engine`). A Client offers all of them, with a `RemoteEngine` as its
engine: it declares ``runs_traces = False`` (a server runs no trace body: nnsight's code never crosses HTTP),
so a workflow that can work from harvests (the logit lens, the cache) asks it for the pieces that do cross:

* streams and contributions, harvested at every position (`streamscope.Client.harvest`);
* the engine's own final norm and head applied to posted rows in its worker (``POST /v1/streamscope/head``,
  `streamscope.serve.head`: the unembedding never leaves the server, so it scales to a 70B vocabulary);
* the final norm's and the head's small parameters and chosen unembedding rows (a cache's norm scales and
  logit attributions).

What cannot cross is refused with the reason (`NOT_OVER_HTTP`): attention internals the server does not tap
(patterns, scores, queries, keys, values, per-head outputs), gradients, a trace's body, the output and down
projections' weights (gigabytes on a large model).
"""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from types import SimpleNamespace
from typing import Any, ClassVar, Optional, Sequence

import torch
from transformers import AutoTokenizer, PretrainedConfig

from ..bulk.norms import norms
from ..engine import Engine
from ..errors import Unavailable
from ..workflows.cache import build_cache
from ..workflows.runs import run_with_cache
from .head import pack, unpack
from .remote_cache import NOT_OVER_HTTP, remote_cache


class RemoteEngine(Engine):
    """A ``streamscope serve`` server as an engine: no traces; harvests, and the engine's head over HTTP."""

    name: ClassVar[str] = "remote"
    runs_traces: ClassVar[bool] = False
    no_gradients: ClassVar[Optional[str]] = (
        "a server runs its model under inference mode and returns no gradients. Load the checkpoint on "
        "transformers for gradients: `streamscope.load(path, engine=\"transformers\")`.")

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.client = client

    def precision(self) -> tuple[str, torch.dtype]:
        """Refused: the server's device and dtype are its engine's (``--dtype``, its startup log), which the
        served config does not say; `streamscope check` measures precision on a model loaded in process."""
        raise NotImplementedError("a server does not state its engine's device and dtype (its --dtype and startup "
                                  "log do); run streamscope check on the checkpoint loaded in process")

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(NOT_OVER_HTTP["trace"])

    run = trace_input = run_each = unembed = _refuse  # type: ignore[assignment]

    def settable(self, value: str, block: int) -> Optional[str]:
        return ("a server takes no per-edit runs from a workflow: streamscope.patch over a Client runs the "
                "server's own sweep (Client.patch_sweep)")

    def batch(self, asked: Optional[int], default: int, count: int) -> int:
        """Every prompt in one call: the client sends them concurrently, `Client.concurrency` at a time."""
        return super().batch(asked, max(1, count), count)

    def head(self, rows: torch.Tensor, normed: bool = False, top_k: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The engine's own final norm (unless `normed`) and head on stream rows ``[n, hidden_size]``:
        ``{"logits": [n, vocab_size]}``, or with `top_k` the softmax's ``{"probs", "ids"}`` ``[n, top_k]``.

        Sent in chunks that keep each request under the server's ``--max-harvest-bytes`` both ways."""
        rows = rows.reshape(-1, rows.shape[-1])
        limit = int(self.client.limits["max_harvest_bytes"])
        width = max(rows.shape[-1], self.client.vocab_size if top_k is None else 2 * top_k)
        chunk = max(1, limit // (4 * width + 64))
        parts: dict[str, list[torch.Tensor]] = {}
        params: dict[str, Any] = {"normed": "true" if normed else "false"}
        if top_k is not None:
            params["top_k"] = top_k
        for start in range(0, max(1, rows.shape[0]), chunk):
            data = pack({"rows": rows[start:start + chunk].float()})
            response = self.client._route("POST", "head", content=data, params=params,
                                         headers={"Content-Type": "application/octet-stream"})
            for name, tensor in unpack(response.content)[0].items():
                parts.setdefault(name, []).append(tensor)
        return {name: torch.cat(tensors) for name, tensors in parts.items()}

    def lens(self, prompts: Sequence[str], layers: list[int], value: str, k: int,
             keep_logits: bool) -> list[list[torch.Tensor]]:
        """`streamscope.lens`'s per-prompt tensors from the server (`lens_found`)."""
        return lens_found(self.client, prompts, layers, value, k, keep_logits)

    def cache(self, prompts: Any, values: Any = None, layers: Any = None, **options: Any) -> Any:
        """`model.cache`'s `streamscope.Cache` from the server's harvests (`streamscope.serve.remote_cache`)."""
        return remote_cache(self.client, prompts, values, layers, **options)

    def norm_parameters(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], float]:
        tensors, numbers = self._parameters()
        return tensors.get("norm_weight"), tensors.get("norm_bias"), float(numbers["eps"])

    def head_parameters(self) -> tuple[Optional[torch.Tensor], float, Optional[float]]:
        tensors, numbers = self._parameters()
        return tensors.get("head_bias"), float(numbers["scale"]), numbers["soft_cap"]

    def _parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if self.client._head_parameters is None:
            tensors, metadata = unpack(self.client._route("GET", "head/parameters").content)
            self.client._head_parameters = (tensors, {key: json.loads(value) for key, value in metadata.items()})
        return self.client._head_parameters

    def unembedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        wanted = [int(item) for item in torch.as_tensor(ids).reshape(-1).tolist()]
        response = self.client._route("POST", "head/rows", content=json.dumps({"ids": wanted}),
                                     headers={"Content-Type": "application/json"})
        return unpack(response.content)[0]["rows"]

    def output_projections(self) -> list[torch.Tensor | str]:
        return [NOT_OVER_HTTP["weights"]] * self.client.num_layers

    def down_projections(self) -> list[torch.Tensor | str]:
        return [NOT_OVER_HTTP["weights"]] * self.client.num_layers


class RemoteSupport:
    """A block's (or the root's) support table as the server's model states it: ``rows`` is ``{value: None
    where served, else the reason}``."""

    def __init__(self, rows: dict[str, Optional[str]]) -> None:
        self.rows = rows


class RemoteBlock:
    """Block `index` of the served model, as far as the workflows read it without a trace: its support table."""

    def __init__(self, index: int, rows: dict[str, Optional[str]]) -> None:
        self.index = index
        self._rows = rows

    def support(self) -> RemoteSupport:
        return RemoteSupport(self._rows)

    def __repr__(self) -> str:
        return f"RemoteBlock({self.index})"


class RemoteModel:
    """What a `streamscope.Client` offers the toolbox as a model (mixed into the Client).

    Sizes, config and the tokenizer come from the server once (``GET /v1/streamscope/model`` and
    ``/tokenizer``) and are kept; `engine` is a `RemoteEngine`.
    """

    _facts: Optional[dict[str, Any]] = None
    _tokenizer: Any = None
    _served_config: Any = None
    _engine: Optional[RemoteEngine] = None
    _limits: Optional[dict[str, Any]] = None
    _blocks: Optional[tuple[RemoteBlock, ...]] = None
    _head_parameters: Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]] = None

    def _route(self, method: str, path: str, **options: Any) -> Any:  # the Client's
        raise NotImplementedError

    def info(self) -> dict[str, Any]:  # the Client's
        raise NotImplementedError

    @property
    def facts(self) -> dict[str, Any]:
        """The served model's description (`streamscope.serve.model_routes.describe`), fetched once."""
        if self._facts is None:
            self._facts = self._route("GET", "model").json()
        return self._facts

    @property
    def limits(self) -> dict[str, Any]:
        """The server's limits (``max_harvest_bytes``, ...), read once: requests are sized under them."""
        if self._limits is None:
            self._limits = dict(self.info()["limits"])
        return self._limits

    @property
    def engine(self) -> RemoteEngine:
        if self._engine is None:
            self._engine = RemoteEngine(self)
        return self._engine

    @property
    def num_layers(self) -> int:
        return int(self.facts["num_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.facts["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.facts["vocab_size"])

    @property
    def num_heads(self) -> int:
        if self.facts["num_heads"] is None:
            raise Unavailable("num_heads", "model", "the served model states no number of attention heads")
        return int(self.facts["num_heads"])

    @property
    def layers(self) -> tuple[RemoteBlock, ...]:
        """One `RemoteBlock` per block: its support table (``len(client.layers)`` is the number of blocks)."""
        if self._blocks is None:
            # Each named as the server's block kind, as the in-process model's blocks are (messages name it).
            kinds = {kind: type(kind, (RemoteBlock,), {}) for kind in set(self.facts["kinds"])}
            self._blocks = tuple(kinds[kind](index, rows)
                                 for index, (kind, rows) in enumerate(zip(self.facts["kinds"], self.facts["blocks"])))
        return self._blocks

    def support(self) -> Any:
        """The root's support table as ``support().root.rows``."""
        return SimpleNamespace(root=RemoteSupport(self.facts["root"]))

    @property
    def config(self) -> Any:
        """The served checkpoint's config (a transformers ``PretrainedConfig``)."""
        if self._served_config is None:
            self._served_config = PretrainedConfig.from_dict(dict(self.facts["config"]))
        return self._served_config

    @property
    def tokenizer(self) -> Any:
        """The server's own tokenizer, downloaded once: text tokenizes and decodes here as on the server."""
        if self._tokenizer is None:
            data = self._route("GET", "tokenizer").content
            with tempfile.TemporaryDirectory(prefix="streamscope-tokenizer-") as folder:
                zipfile.ZipFile(io.BytesIO(data)).extractall(folder)
                self._tokenizer = AutoTokenizer.from_pretrained(folder)
        return self._tokenizer

    def cache(self, prompts: Any, values: Any = None, layers: Any = None, **kwargs: Any) -> Any:
        """`model.cache` over HTTP: the values a harvest carries, at every position, in a `streamscope.Cache`
        (`streamscope.serve.remote_cache`: what it does not carry is said there)."""
        return build_cache(self, prompts, values, layers, **kwargs)

    def run_with_cache(self, input: Any, return_type: Optional[str] = "logits", **kwargs: Any) -> tuple[Any, Any]:
        """TransformerLens's ``run_with_cache`` over HTTP (`streamscope.workflows.runs.run_with_cache`): the
        logits and loss from the cache's logits, the engine's own head on the final norm's output."""
        return run_with_cache(self, input, return_type=return_type, **kwargs)

    def norms(self, prompts: Any = None, value: str = "layer_output", layers: Any = None) -> Any:
        """``||h||`` per block from harvests, as `model.norms` (`streamscope.bulk.norms.norms`)."""
        return norms(self, prompts, value, layers)


def lens_found(client: Any, prompts: Sequence[str], layers: list[int], value: str, k: int,
               keep_logits: bool) -> list[list[torch.Tensor]]:
    """The logit lens of each prompt over a server, in `streamscope.lens`'s per-prompt layout: ``[logits [1,
    blocks, seq, vocab]]`` with `keep_logits`, else ``[probs [1, blocks, seq, k], ids [1, blocks, seq, k]]``.

    Each prompt's `value` at `layers`, every position, is harvested; the engine's own final norm and head are
    applied to those rows in its worker, and only the top `k` (or, asked for, the logits) come back."""
    if value not in client.facts["values"]:
        reason = client.facts["unavailable"].get(value, "it is not a value a harvest takes")
        raise ValueError(f"the lens reads {value!r}, which this server does not serve: {reason}")
    harvest = client.harvest(list(prompts), value, layers=layers, positions="all")
    found = []
    for rows in harvest.values[value]:  # [blocks, seq, hidden]
        blocks, seq = rows.shape[0], rows.shape[1]
        out = client.engine.head(rows.reshape(-1, rows.shape[-1]), normed=False, top_k=None if keep_logits else k)
        if keep_logits:
            found.append([out["logits"].reshape(1, blocks, seq, -1)])
        else:
            found.append([out["probs"].reshape(1, blocks, seq, k), out["ids"].reshape(1, blocks, seq, k)])
    return found

