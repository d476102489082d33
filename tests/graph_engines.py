"""Test helpers for engines with the graph ops: the workers of an engine with vLLM's compile on, and what a
worker's ops have done (`ops_state`, read through ``LLM.collective_rpc`` in whichever process the worker runs).

The workers are vLLM's own CPU and GPU workers, with streamscope's insertion
of the ops at load (`streamscope.vllm.worker.InsertsGraphOps`).

An untapped server with graph ops runs such a worker. `streamscope.load(..., engine="vllm")` runs nnsight's runner
instead, whose envoys replace every module's forward; nnsight starts every untapped engine eagerly
(``enforce_eager=not taps``), so no compiled engine comes from it. vLLM imports a worker class by its dotted path
(`WORKERS`), in the engine's process (this one: the tests start these engines in process).
"""

from __future__ import annotations

from typing import Any

from streamscope import vllm_seam
from streamscope.vllm.graph_backend import graph_ops_of
from streamscope.vllm.worker import InsertsGraphOps
from streamscope.vllm_seam import CPUWorker, GPUWorker


class CompiledGraphOpsCPUWorker(InsertsGraphOps, CPUWorker):
    """vLLM's CPU worker, the graph ops inserted once its model is loaded (before the compile)."""


class CompiledGraphOpsGPUWorker(InsertsGraphOps, GPUWorker):
    """vLLM's GPU worker, the graph ops inserted once its model is loaded (before the compile and the capture)."""


#: The worker classes by device, as the dotted paths vLLM imports.
WORKERS = {"cpu": f"{__name__}.CompiledGraphOpsCPUWorker", "cuda": f"{__name__}.CompiledGraphOpsGPUWorker"}


def ops_state(worker: Any) -> dict[str, Any]:
    """What `worker`'s graph ops are and have done, in plain values: the sites an edit op and a harvest op sit at,
    the values left to the hooks with the reason, how many steers and harvests the ops served, what the plan holds
    live, and how the model runs (vLLM's compile mode, the CUDA graph mode, the modules it compiles). Called on the
    worker by ``llm.collective_rpc(ops_state)``."""
    runner = vllm_seam.runner_of(worker)
    model = vllm_seam.model_of(runner)
    ops = graph_ops_of(runner)
    compilation = getattr(worker, "vllm_config").compilation_config
    state: dict[str, Any] = {"mode": getattr(compilation.mode, "name", str(compilation.mode)),
                             "graph_mode": vllm_seam.graph_mode(runner),
                             "compiled": [type(module).__name__ for module in vllm_seam.compiled_modules(model)]}
    if ops is not None:
        state.update(sites=[str(name) for name in ops.plan.sites], harvest_sites=list(map(str, ops.plan.harvest_sites)),
                     skipped=dict(ops.skipped), served=dict(ops.served), live=ops.plan.live,
                     bank_live=ops.plan.bank.live)
    return state
