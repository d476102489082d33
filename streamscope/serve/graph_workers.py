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

# The classes live beside the in-process engine's workers, which start them too
# (``streamscope.load(..., graph_ops=True)`` with vLLM's compile on); the
# server's worker paths name them here.
from ..vllm.compiled_workers import GraphOpsCPUWorker, GraphOpsPlainGPUWorker

__all__ = ["GraphOpsCPUWorker", "GraphOpsPlainGPUWorker"]
