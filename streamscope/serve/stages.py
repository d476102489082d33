"""``streamscope serve --pipeline-parallel-size N``: each stage steers and harvests the blocks it holds.

Under pipeline parallelism every stage's worker sees every request's plan
(vLLM hands each stage the same scheduler output), but a stage's model holds
only its own run of blocks (`streamscope.vllm.pipeline`): the others are
placeholders that never run. So in the worker (`streamscope.serve.worker`):

* a steer is applied by the stage that holds its block (`worker.Stage.holds`); the
  other stages skip it, so the request's rows are edited once;
* a harvest reads, on each stage, the sites that stage holds, and the stage's
  first tensor-parallel rank writes them as a part,
  ``<id>.stage<rank>.safetensors``: one tensor ``[held sites, positions,
  hidden]`` with the held sites' indices in the run's order in its metadata.
  A stage that holds none of the harvest's sites writes nothing; one that
  holds all of them (an SAE readout's one site) writes the whole file itself.

The front end (`streamscope.serve.storage`) puts the parts together once they
cover every site (`merge`): the file one stage would have written, in the
same ``<id>.safetensors`` form, so a download is the same under any
pipeline parallel size. This module is the front end's and the client's too,
so it imports no vLLM: the worker's side of a stage is `worker.Stage`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..bulk.sites import ROOT_VALUES
from .writer import PART


def sites_of(values: Sequence[str], layers: Sequence[int]) -> list[tuple[str, Optional[int]]]:
    """A harvest's sites as ``(value, block)`` in the run's order (root values once, block values once a block)."""
    return [(value, None) if value in ROOT_VALUES else (value, layer)
            for value in values for layer in ([None] if value in ROOT_VALUES else layers)]


def parts(folder: Path, harvest_id: str) -> list[Path]:
    """The stage parts written of a harvest (an id the front end made: 32 hex digits, so never a pattern)."""
    if not (isinstance(harvest_id, str) and len(harvest_id) == 32
            and all(character in "0123456789abcdef" for character in harvest_id)):
        return []
    return sorted(folder.glob(f"{harvest_id}.{PART}*.safetensors"))


def merge(folder: Path, harvest_id: str) -> bool:
    """Put a harvest's stage parts together into ``<id>.safetensors`` once they cover every site; True when done."""
    found = parts(folder, harvest_id)
    if not found:
        return False
    helds: list[list[int]] = []
    meta: dict[str, Any] = {}
    for path in found:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
        helds.append(json.loads(metadata.pop("held")))
        meta = {key: json.loads(item) for key, item in metadata.items()}
    count = len(sites_of(meta["values"], meta["layers"]))
    if sorted(index for held in helds for index in held) != list(range(count)):
        return False  # a stage's part is still to come
    whole: Optional[torch.Tensor] = None
    for held, path in zip(helds, found):
        with safe_open(str(path), "pt") as handle:
            part = handle.get_tensor("part")
        if whole is None:
            whole = torch.empty((count, *part.shape[1:]), dtype=part.dtype)
        whole[held] = part
    assert whole is not None
    tensors: dict[str, torch.Tensor] = {}
    index, blocks = 0, len(meta["layers"])
    for value in meta["values"]:
        width = 1 if value in ROOT_VALUES else blocks
        tensors[value] = whole[index] if value in ROOT_VALUES else whole[index:index + width]
        tensors[value] = tensors[value].clone()
        index += width
    final = folder / f"{harvest_id}.safetensors"
    aside = folder / f".{harvest_id}.merging"
    save_file(tensors, str(aside), metadata={key: json.dumps(item) for key, item in meta.items()})
    os.replace(aside, final)
    for path in found:
        path.unlink(missing_ok=True)
    return True
