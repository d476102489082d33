"""The served model's own final norm and head, applied in the engine's worker to rows a client posts.

A `streamscope.Client` reads streams through harvests; the logit lens, a cache's logits and a one-token
generation's logits then need the model's head. Two ways were open: fetch the head's weights once and
apply them on the client, or send the rows to the engine and apply its own modules there. The second is
the one that scales: a 70B model's unembedding is ``vocab x hidden`` (128,256 x 8,192, 2 GiB in bfloat16, split
across tensor-parallel ranks), while a lens over one prompt is ``blocks x positions`` rows of ``hidden``
numbers, and with ``top_k`` only ``k`` probabilities and ids per row come back. It is also the engine's own
arithmetic: its norm kernel, its (vocab-parallel) unembedding, soft cap and scale, as the in-process lens runs
them (`streamscope.workflows.logit_lens.unembed`).

`HeadRPC` is mixed into the server's worker classes (`streamscope.serve.worker.ServeRPC`); the front end
reaches it through the engine client's ``collective_rpc`` (`serve.server`'s ``/v1/streamscope/head``
routes). Every method takes and returns bytes (safetensors), which cross vLLM's engine-core boundary as they
are.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: What a head request may ask for: the logits of every row, or their softmax's top k.
TOP_K_LIMIT = 1024


def pack(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> bytes:
    """Tensors as safetensors bytes (contiguous CPU copies)."""
    from safetensors.torch import save

    return save({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}, metadata=metadata)


def unpack(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`pack`'s tensors and metadata."""
    import json

    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    return load(data), metadata


def head_rows(root: Any, model: torch.nn.Module, rows: torch.Tensor, normed: bool,
              top_k: Optional[int]) -> dict[str, torch.Tensor]:
    """The model's logits of stream rows ``[n, hidden]``: its final norm (unless `normed`: rows already are its
    output), then its unembedding, soft cap and scale. ``{"logits": [n, vocab]}``, or with `top_k` the softmax's
    ``{"probs", "ids"}``, ``[n, top_k]`` each (largest first), as the in-process lens keeps them."""
    from .. import nnsight_seam as seam
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


class HeadRPC:
    """Worker methods behind the ``/v1/streamscope/head`` routes (see the module's docstring)."""

    def _streamscope_head_root(self) -> Any:
        from .. import nnsight_seam as seam

        state = self.model_runner.__dict__.get("_streamscope_serve")  # type: ignore[attr-defined]
        if state is None:
            raise RuntimeError("the streamscope serve worker has not installed its state (no model loaded yet)")
        # Under pipeline parallelism only the last stage holds the final norm and the head; the others answer
        # with a reason, and the route takes the stage that has them.
        if type(seam.module_of(state.root.norm)).__name__ == "PPMissingLayer":
            raise RuntimeError("this pipeline stage holds no final norm")
        return state.root

    def streamscope_serve_head(self, data: bytes, normed: bool, top_k: Optional[int]) -> Any:
        """`head_rows` of the posted ``rows``, as safetensors bytes; a string saying why where it cannot run."""
        try:
            rows = unpack(data)[0]["rows"]
            found = head_rows(self._streamscope_head_root(), self.model_runner.get_model(),  # type: ignore[attr-defined]
                              rows, normed, top_k)
        except Exception as error:  # noqa: BLE001  (the route answers with the reason; the engine serves on)
            return f"{type(error).__name__}: {error}"
        return pack(found)

    def streamscope_serve_head_parameters(self) -> Any:
        """The final norm's ``weight``/``bias``/``eps`` and the head's ``bias``/``scale``/``soft_cap``
        (`streamscope.engine.Engine.norm_parameters`, ``head_parameters``), as safetensors bytes with the
        numbers in its metadata."""
        import json

        from .. import nnsight_seam as seam
        from ..engine import norm_parameters
        from ..vllm.logits import unembedding

        try:
            weight, bias, eps = norm_parameters(seam.module_of(self._streamscope_head_root().norm))
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            head_bias = getattr(unembedding(model), "bias", None)
            processor = model.logits_processor
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        tensors = {name: tensor for name, tensor in (("norm_weight", weight), ("norm_bias", bias),
                                                     ("head_bias", head_bias)) if tensor is not None}
        cap = None if processor.soft_cap is None else float(processor.soft_cap)
        return pack(tensors, {"eps": json.dumps(eps), "scale": json.dumps(float(processor.scale)),
                              "soft_cap": json.dumps(cap)})

    def streamscope_serve_unembedding_rows(self, ids: list[int]) -> Any:
        """``{"rows": [len(ids), hidden]}``: the unembedding's rows for token `ids`, as safetensors bytes."""
        from ..vllm.logits import unembedding

        try:
            head = unembedding(self.model_runner.get_model())  # type: ignore[attr-defined]
            if getattr(head, "tp_size", 1) > 1:  # each rank holds a slice of the vocabulary: no one answers whole
                return ("the unembedding is split across tensor-parallel ranks; read the logits through the head "
                        "route (lens, cache logits) instead of its rows")
            weight = head.weight.detach()  # type: ignore[operator]
            rows = weight[torch.tensor(ids, dtype=torch.long, device=weight.device)]
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        return pack({"rows": rows})
