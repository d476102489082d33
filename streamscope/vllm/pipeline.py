"""Pipeline parallelism on vLLM: which stage holds which blocks.

Under ``pipeline_parallel_size=N`` vLLM gives each stage (a worker, with its
own tensor-parallel ranks) a contiguous run of blocks; the embeddings live on
the first stage and the final norm and logits on the last, and every other
block of a stage's model is a placeholder (``PPMissingLayer``). The bulk path
reads and steers each value on the stage that holds it
(`streamscope.bulk.pipeline`); a trace is refused, since its body runs on one
worker's envoy tree, where the other stages' blocks are placeholders.
"""

from __future__ import annotations

from typing import Any


def stages(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each stage's blocks as ``(first, stop)``, as vLLM splits `num_layers` over `size` stages."""
    from vllm.distributed.utils import get_pp_indices

    return [get_pp_indices(num_layers, rank, size) for rank in range(size)]


def describe(num_layers: int, size: int) -> str:
    """One clause a stage: its blocks, and the root values it holds."""
    lines = []
    for rank, (first, stop) in enumerate(stages(num_layers, size)):
        roots = (["token_embeddings"] if rank == 0 else []) + (["final_norm_output", "logits"] if rank == size - 1 else [])
        lines.append(f"stage {rank}: blocks {first}-{stop - 1}" + (f", {', '.join(roots)}" if roots else ""))
    return "; ".join(lines)


def missing(module: Any) -> bool:
    """Whether `module` is a placeholder for a block (or root module) another pipeline stage holds."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return isinstance(module, PPMissingLayer)
