"""Pipeline parallelism on vLLM: which stage holds which blocks.

Under ``pipeline_parallel_size=N`` vLLM gives each stage (a worker, with its
own tensor-parallel ranks) a contiguous run of blocks; the embeddings live on
the first stage and the final norm and logits on the last, and every other
block of a stage's model is a placeholder (``PPMissingLayer``). The bulk path
reads and steers each value on the stage that holds it
(`stage_sites`, `gather`); a trace is refused, since its body runs on one
worker's envoy tree, where the other stages' blocks are placeholders.

The bulk path: each stage's worker installs the run's hooks for the values of
its own blocks (`stage_sites`) and hands back its part of every prompt's
harvest; the client puts the parts together in the run's order (`gather`):
the same ``[sites, positions, hidden]`` a single stage would have read.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .. import nnsight_seam as seam
from .. import vllm_seam
from ..bulk.sites import ROOT_VALUES, Site, locate
from ..bulk.spec import HarvestSpec


def stages(num_layers: int, size: int) -> list[tuple[int, int]]:
    """Each stage's blocks as ``(first, stop)``, as vLLM splits `num_layers` over `size` stages."""
    return vllm_seam.stage_blocks(num_layers, size)


def describe(num_layers: int, size: int) -> str:
    """One clause a stage: its blocks, and the root values it holds."""
    lines = []
    for rank, (first, stop) in enumerate(stages(num_layers, size)):
        roots = (["token_embeddings"] if rank == 0 else []) + (["final_norm_output", "logits"] if rank == size - 1 else [])
        blocks = f"block {first}" if stop - first == 1 else f"blocks {first}-{stop - 1}"
        lines.append(f"stage {rank}: {blocks}" + (f", {', '.join(roots)}" if roots else ""))
    return "; ".join(lines)


def missing(module: Any) -> bool:
    """Whether `module` is a placeholder for a block (or root module) another pipeline stage holds."""
    return vllm_seam.missing_layer(module)


def holds(root: Any, value: str, layer: Optional[int]) -> bool:
    """Whether this worker's stage runs the module call that holds `value` at block `layer` (None: a root value).

    A block's values are on the stage whose model has the block (the others hold a placeholder). The root's
    are by stage, not by module: a later stage of some families (GPT-2) builds the embedding too, but only
    the first runs it; the final norm runs on the last.
    """
    if layer is not None:
        return not missing(seam.module_of(root.layers[layer]))
    stage, size = vllm_seam.pipeline_stage()
    return stage == 0 if value == "token_embeddings" else stage == size - 1


def site_count(spec: HarvestSpec) -> int:
    """The run's harvest sites, every stage's: root values once, block values once a block."""
    return sum(1 if value in ROOT_VALUES else len(spec.layers) for value in spec.values)


def stage_sites(root: Any, spec: HarvestSpec) -> tuple[list[Site], list[int]]:
    """This stage's harvest sites, and their indices in the run's order (`HarvestSpec.sites`)."""
    sites, held = [], []
    index = 0
    for value in spec.values:
        for layer in ([None] if value in ROOT_VALUES else spec.layers):
            if holds(root, value, layer):
                sites.append(locate(root, value, layer))
                held.append(index)
            index += 1
    return sites, held


def gather(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's bulk results as one stage's: each prompt's harvest put together from the stages' parts.

    Tensor-parallel ranks of one stage hand back the same values; the first is kept.
    """
    results = [result for result in results if result is not None]
    for result in results:
        if result["error"] is not None:
            return result
    first = results[0]
    if len(results) == 1:
        return first
    logits: dict[Any, torch.Tensor] = {}
    for result in reversed(results):  # the last stage computes them (each of its tensor-parallel ranks: the first kept)
        logits.update(result["logits"])
    if all(result["held"] == first["held"] for result in results):  # one stage (tensor-parallel ranks)
        return {**first, "logits": logits}
    count = first["sites"]
    harvested: dict[Any, Optional[torch.Tensor]] = {}
    filled: dict[Any, set[int]] = {}
    for result in results:
        held = result["held"]
        for key, part in result["harvested"].items():
            if part is None:
                continue
            whole = harvested.get(key)
            if whole is None:
                whole = harvested[key] = torch.empty((count, *part.shape[1:]), dtype=part.dtype)
            whole[held] = part.to(whole.device)
            filled.setdefault(key, set()).update(held)
    for key, sites in filled.items():
        if len(sites) < count:
            harvested[key] = None  # a stage ran none of the prompt's tokens: reported as not harvested
    return {"harvested": harvested, "logits": logits, "error": None, "held": list(range(count)), "sites": count}
