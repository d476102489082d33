"""The worker classes of ``streamscope serve --graph-ops`` without taps: vLLM's own worker that inserts the graph ops.

An untapped server runs vLLM's own worker and runner (`streamscope.serve.worker.worker_cls`).
With ``--graph-ops`` the worker must insert streamscope's graph ops once its
model is loaded, before the profile run, the compile and any CUDA graph
capture: that changes what vLLM's own ``load_model`` does, which only a worker
class can (an extension is appended to the worker's bases and may override
nothing). These are vLLM's CPU and GPU workers with
`streamscope.vllm.worker.InsertsGraphOps` first, the same insertion the
in-process engine's workers make (``streamscope.load(..., graph_ops=True)``).

vLLM imports them by path in the worker's process
(`streamscope.serve.worker.GRAPH_WORKERS`); the server's front end names them and never imports this
module (importing vLLM's GPU worker there would keep vLLM from forking its
engine process).
"""

from __future__ import annotations

from ..vllm.worker import InsertsGraphOps
from ..vllm_seam import CPUWorker, GPUWorker

__all__ = ["GraphOpsCPUWorker", "GraphOpsPlainGPUWorker"]


class GraphOpsCPUWorker(InsertsGraphOps, CPUWorker):
    """vLLM's CPU worker, its model's graph ops inserted at load (an untapped ``streamscope serve --graph-ops``)."""


class GraphOpsPlainGPUWorker(InsertsGraphOps, GPUWorker):
    """vLLM's GPU worker, its model's graph ops inserted at load, before the compile and the CUDA graph capture (an
    untapped ``streamscope serve --graph-ops``). Not yet run on a GPU (docs/graph-ops.md)."""

