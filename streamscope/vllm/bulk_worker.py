"""The bulk path's RPC methods on vLLM's worker, and nnsight's GPU worker with them.

`collective_rpc` reaches a worker method by name in whichever process runs the
worker (a function would need VLLM_ALLOW_INSECURE_SERIALIZATION to travel), so
both workers streamscope starts carry these: its CPU worker
(`streamscope.vllm.worker.NNsightCPUWorker`) and, on a GPU, `GPUWorker`, which is
nnsight's GPU worker plus these methods.
"""

from __future__ import annotations

from typing import Any

from ..nnsight_seam import NNsightGPUWorker


class BulkRPC:
    """Worker methods the client calls through ``collective_rpc`` to run a bulk request (`streamscope.bulk.vllm`)."""

    def streamscope_bulk_begin(self, payload: bytes) -> None:
        from ..bulk.vllm import worker_begin

        return worker_begin(self, payload)

    def streamscope_bulk_finish(self, inline: bool) -> Any:
        from ..bulk.vllm import worker_finish

        return worker_finish(self, inline)


class GPUWorker(BulkRPC, NNsightGPUWorker):
    """nnsight's GPU worker with the bulk path's RPC methods."""


GPU_WORKER_CLS = f"{GPUWorker.__module__}.{GPUWorker.__qualname__}"
