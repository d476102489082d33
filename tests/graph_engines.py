"""Test helpers for engines with the graph ops: the workers of an engine with vLLM's compile on, and what a
worker's ops have done (`ops_state`, read through ``LLM.collective_rpc`` in whichever process the worker runs).

The workers are streamscope's own (`streamscope.vllm.compiled_workers`): vLLM's CPU and GPU workers with
streamscope's insertion of the ops at load (`streamscope.vllm.worker.InsertsGraphOps`), the workers of
``streamscope.load(..., engine="vllm", graph_ops=True)`` where vLLM's compile stays on and of an untapped server
with graph ops. A test that starts a bare ``vllm.LLM`` names them by their dotted path (`WORKERS`), which vLLM
imports in the engine's process.
"""

from __future__ import annotations

from typing import Any

from streamscope import vllm_seam
from streamscope.vllm.graph_backend import graph_ops_of
from streamscope.vllm.worker import COMPILED_WORKERS

#: The worker classes by device, as the dotted paths vLLM imports.
WORKERS = {"cpu": COMPILED_WORKERS["cpu"], "cuda": COMPILED_WORKERS["gpu"]}


def ops_state(worker: Any) -> dict[str, Any]:
    """What `worker`'s graph ops are and have done, in plain values: the sites an edit op and a harvest op sit at,
    the values left to the hooks with the reason, how many steers and harvests the ops served, what the plan holds
    live, its steps (marked and idle) and the rows the last step marked, and how the model runs (vLLM's compile mode, the CUDA graph mode, the
    modules it compiles, the CUDA graphs captured in the worker's process: vLLM's, the idle and the lean ones). Called on the
    worker by ``llm.collective_rpc(ops_state)``."""
    runner = vllm_seam.runner_of(worker)
    model = vllm_seam.model_of(runner)
    ops = graph_ops_of(runner)
    compilation = getattr(worker, "vllm_config").compilation_config
    captured = vllm_seam.captured_graphs()
    state: dict[str, Any] = {"mode": getattr(compilation.mode, "name", str(compilation.mode)),
                             "graph_mode": vllm_seam.graph_mode(runner),
                             "compiled": [type(module).__name__ for module in vllm_seam.compiled_modules(model)],
                             "graphs": len(captured["ops"]), "idle_graphs": len(captured["idle"]),
                             "lean_graphs": len(captured["lean"])}
    if ops is not None:
        state.update(sites=[str(name) for name in ops.plan.sites], harvest_sites=list(map(str, ops.plan.harvest_sites)),
                     skipped=dict(ops.skipped), served=dict(ops.served), live=ops.plan.live,
                     bank_live=ops.plan.bank.live, steps=dict(ops.steps), marked_rows=ops.plan.marked_rows,
                     idle_graphs_state=ops.idle_graphs, lean_graphs_state=ops.lean_graphs)
    return state
