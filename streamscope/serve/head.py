"""The served model's own final norm and head, applied in the engine's worker to rows a client posts.

A `streamscope.Client` reads streams through harvests; the logit lens, a cache's logits and a one-token
generation's logits then need the model's head. Two ways were open: fetch the head's weights once and
apply them on the client, or send the rows to the engine and apply its own modules there. The second is
the one that scales: a 70B model's unembedding is ``vocab x hidden`` (128,256 x 8,192, 2 GiB in bfloat16, split
across tensor-parallel ranks), while a lens over one prompt is ``blocks x positions`` rows of ``hidden``
numbers, and with ``top_k`` only ``k`` probabilities and ids per row come back. It is also the engine's own
arithmetic: its norm kernel, its (vocab-parallel) unembedding, soft cap and scale, as the in-process lens runs
them (`streamscope.workflows.logit_lens.unembed`).

The worker's methods behind these routes are `streamscope.serve.worker.HeadRPC`, part of streamscope's
worker extension; the front end reaches them through the engine client's ``collective_rpc`` (`serve.server`'s
``/v1/streamscope/head`` routes). Every method takes and returns bytes (safetensors), which cross vLLM's
engine-core boundary as they are. This module holds what the client shares (`pack`, `unpack`) and the
arithmetic (`head_rows`); it imports no vLLM.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
from safetensors.torch import load, save

from .. import nnsight_seam as seam

#: What a head request may ask for: the logits of every row, or their softmax's top k.
TOP_K_LIMIT = 1024


def pack(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> bytes:
    """Tensors as safetensors bytes (contiguous CPU copies)."""
    return save({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}, metadata=metadata)


def unpack(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`pack`'s tensors and metadata."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    return load(data), metadata


def head_rows(root: Any, model: torch.nn.Module, rows: torch.Tensor, normed: bool,
              top_k: Optional[int]) -> dict[str, torch.Tensor]:
    """The model's logits of stream rows ``[n, hidden]``: its final norm (unless `normed`: rows already are its
    output), then its unembedding, soft cap and scale. ``{"logits": [n, vocab]}``, or with `top_k` the softmax's
    ``{"probs", "ids"}``, ``[n, top_k]`` each (largest first), as the in-process lens keeps them."""
    from ..vllm.logits import engine_logits

    parameter = next(model.parameters())
    rows = rows.to(device=parameter.device, dtype=parameter.dtype)
    with torch.no_grad():
        if not normed:
            norm = seam.module_of(root.norm)
            # The class's forward, past any hook a live request's plan put on the norm (it reads its own rows).
            out = type(norm).forward(norm, rows)
            rows = out[0] if isinstance(out, tuple) else out
        logits = engine_logits(model, rows)
        if top_k is None:
            return {"logits": logits.float()}
        top = logits.float().softmax(-1).topk(top_k, dim=-1)
        return {"probs": top.values, "ids": top.indices}
