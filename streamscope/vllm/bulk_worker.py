"""The bulk path's RPC methods, which streamscope's worker extension carries on every vLLM worker it starts.

`collective_rpc` reaches a worker method by name in whichever process runs the
worker (a function would need VLLM_ALLOW_INSECURE_SERIALIZATION to travel).
vLLM appends the class named by ``worker_extension_cls`` to the worker's bases
(``WorkerWrapperBase.init_worker``, refusing any name the worker already has),
so `BulkRPC` defines only new names: the ``streamscope_*`` RPCs. Its methods
join the server's (`streamscope.serve.worker.ServeRPC`) in one extension class,
`streamscope.worker_extension.WorkerExtension` (`WORKER_EXTENSION`), passed on
every engine streamscope starts: in process (`streamscope.load(...,
engine="vllm")`) and under ``streamscope serve``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from .. import vllm_seam
from ..engine import attention_modules, down_projections, norm_parameters, output_projection
from ..nnsight_seam import module_of
from . import graphed, trace_transport
from .bulk import worker_begin, worker_finish, worker_release, worker_root
from .logits import unembedding

#: streamscope's worker extension, as the import path vLLM resolves in the worker's process (a class it appends
#: to the worker's bases): the bulk path's RPCs and the server's.
WORKER_EXTENSION = "streamscope.worker_extension.WorkerExtension"
#: The worker class streamscope starts on a CPU where nnsight's runner is needed (traces; a tapped server):
#: `streamscope.vllm.worker.NNsightCPUWorker`, as the import path vLLM resolves.
CPU_WORKER = "streamscope.vllm.worker.NNsightCPUWorker"


class BulkRPC:
    """Worker methods the client calls through ``collective_rpc`` to run a bulk request (`streamscope.vllm.bulk`),
    read the model's weights, and have nnsight's collect of a trace's saves hand them over as tensors."""

    def streamscope_hand_saves_over(self) -> None:
        """Called by a streamscope client once its engine is up: this worker's collects hand saves over as tensors
        to a client in this process, packed into one buffer for one in another (`trace_transport.pack_saves_in_this_process`).

        nnsight's ``collect_nnsight`` is wrapped on this worker instance (an extension may not override a name the
        worker has). Raw nnsight's client on the same CPU worker class never calls it, so its traces keep
        nnsight's pickling.
        """
        trace_transport.pack_saves_in_this_process()  # in an engine process, nothing has replaced nnsight's pickling yet
        if getattr(self, "streamscope_hands_over", False):
            return
        collect = self.collect_nnsight  # type: ignore[attr-defined]

        def collect_nnsight(*args: Any, **kwargs: Any) -> Any:
            """nnsight's collect; for a streamscope client in this process, its answer is
            `trace_transport.HandedSaves`, for one in another the saves packed into one buffer
            (`trace_transport.PACKED_SAVES`)."""
            with trace_transport.handing_over():
                return collect(*args, **kwargs)

        self.collect_nnsight = collect_nnsight
        self.streamscope_hands_over = True

    def streamscope_take_bundle(self, trace: str, payload: bytes, count: int) -> None:
        """Keep a trace's invokes, pickled together by a client in another process, for its requests to take
        (`trace_transport.bundle_interventions`)."""
        trace_transport.take_bundle(trace, payload, count)

    def streamscope_bundle_counts(self) -> dict[str, int]:
        """`trace_transport.bundle_counts` where this worker runs."""
        return trace_transport.bundle_counts()

    def streamscope_transport_counts(self) -> dict[str, float]:
        """How the collects of this worker's process went: `trace_transport.transport_counts` where the worker runs."""
        return trace_transport.transport_counts()

    def streamscope_saves_transport(self, name: Any) -> Any:
        """Set ``STREAMSCOPE_SAVES_TRANSPORT`` to `name` (``None`` unsets it) where this worker runs; the setting
        before. An engine process reads its own environment, copied from the caller's when the engine started."""
        before = os.environ.get(trace_transport.SAVES_TRANSPORT_ENV)
        if name is None:
            os.environ.pop(trace_transport.SAVES_TRANSPORT_ENV, None)
        else:
            with trace_transport.saves_transport(name):  # refuses a bad name, and sets nothing then
                pass
            os.environ[trace_transport.SAVES_TRANSPORT_ENV] = name
        return before

    def streamscope_bulk_begin(self, payload: bytes) -> None:
        return worker_begin(self, payload)

    def streamscope_bulk_finish(self, inline: bool) -> Any:
        return worker_finish(self, inline)

    def streamscope_bulk_release(self, keys: list[str]) -> None:
        return worker_release(self, keys)

    def streamscope_graphed_counts(self) -> dict[str, int]:
        """How many steer edits at taps this worker's process replayed as captured graphs, and how many it
        captured (`streamscope.vllm.graphed`), since it started."""
        return dict(graphed.COUNTS)

    def streamscope_graph_mode(self) -> str:
        """The CUDA graph mode vLLM resolved for this worker's engine (``NONE``: every step runs eagerly):
        `vllm_seam.graph_mode`."""
        return vllm_seam.graph_mode(vllm_seam.runner_of(self))

    def streamscope_compiled_modules(self) -> list[str]:
        """The class names of the modules vLLM compiles in this worker's model (`vllm_seam.compiled_modules`)."""
        model = vllm_seam.model_of(vllm_seam.runner_of(self))
        return [type(module).__name__ for module in vllm_seam.compiled_modules(model)]

    def streamscope_held_saes(self) -> list[str]:
        """The keys of the SAEs this worker holds between runs (`streamscope.vllm.held`)."""
        state = vllm_seam.runner_of(self).__dict__.get("_streamscope_bulk")
        return [] if state is None else sorted(state.saes.saes)

    # The weights a workflow reads (`streamscope.vllm.engine.VllmEngine`), off the worker's own modules.

    # An answer stays as it is for a client in this process, and travels pickled, on the CPU, to one in another.

    def streamscope_norm_parameters(self, inline: bool, model_type: str) -> Any:
        """The final norm's ``(weight, bias, eps)``."""
        weight, bias, eps = norm_parameters(module_of(worker_root(self, model_type).norm))
        if inline:
            return weight, bias, eps
        return pickle.dumps((None if weight is None else weight.cpu(), None if bias is None else bias.cpu(), eps))

    def streamscope_unembedding_rows(self, inline: bool, model_type: str, ids: list[int]) -> Any:
        """``[len(ids), hidden_size]``: the unembedding's rows for token `ids`."""
        weight = unembedding(vllm_seam.model_of(vllm_seam.runner_of(self))).weight.detach()
        rows = weight[torch.tensor(ids, dtype=torch.long, device=weight.device)].clone()
        return rows if inline else pickle.dumps(rows.cpu())

    def streamscope_head_parameters(self, inline: bool, model_type: str) -> Any:
        """The head's ``(bias, scale, soft_cap)`` after its matrix, as its logits processor applies them
        (`streamscope.engine.Engine.head_parameters`)."""
        module = vllm_seam.model_of(vllm_seam.runner_of(self))
        bias = getattr(unembedding(module), "bias", None)
        processor = module.logits_processor
        cap = None if processor.soft_cap is None else float(processor.soft_cap)
        found = (None if bias is None else bias.detach().cpu().clone(), float(processor.scale), cap)
        return found if inline else pickle.dumps(found)

    # Under tensor parallelism each rank answers with its own columns of a row-parallel projection;
    # the client joins them in rank order (`streamscope.engine.join_shards`).

    def streamscope_output_projections(self, inline: bool, model_type: str, num_layers: int, width: int) -> Any:
        """Per block: this rank's columns of its attention's output projection ``[hidden_size, width / ranks]``,
        or why it has none."""
        found = [module if isinstance(module, str) else output_projection(module, width)
                 for module in attention_modules(worker_root(self, model_type), num_layers)]
        return found if inline else pickle.dumps(found)

    def streamscope_down_projections(self, inline: bool, model_type: str, num_layers: int) -> Any:
        """Per block: this rank's columns of its MLP's down projection ``[hidden_size, intermediate_size /
        ranks]``, or why it has no neurons."""
        found = down_projections(worker_root(self, model_type), num_layers)
        return found if inline else pickle.dumps(found)
