"""A harvest shard as a Parquet table: one row per harvested token, the form SAE trainers stream.

A row is one (prompt, position) of the shard, in the harvest's order (prompts
in run order, each prompt's chosen positions in order):

* ``prompt`` (int64): the prompt's index in the dataset;
* ``position`` (int32): the token's position in its prompt;
* ``token`` (int64): the token id at that position;
* one column per harvested value and block, ``"<value>/<block>"`` (a root
  value: ``"<value>"``), each a ``fixed_size_list<hidden>`` of floats: the
  value's ``[hidden]`` vector at that token.

Floats keep the engine's dtype where Arrow has it (float32, float16);
bfloat16, which Arrow lacks, is widened to float32 (exactly: every bfloat16
is a float32). Read a run's shards with ``pyarrow.parquet.read_table`` or
``datasets.load_dataset("parquet", data_files=[...])`` on the files
``index.json`` lists.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy
import torch

from ..bulk.results import Harvest
from ..bulk.sites import ROOT_VALUES


def column_names(harvest: Harvest) -> list[str]:
    """The activation columns of a harvest's table, in the order they are written."""
    return [value if value in ROOT_VALUES else f"{value}/{layer}"
            for value in harvest.values for layer in ([None] if value in ROOT_VALUES else harvest.layers)]


def _floats(tensor: torch.Tensor) -> Any:
    """`tensor` ``[rows, hidden]`` as a numpy array Arrow takes (bfloat16 widened to float32)."""
    if tensor.dtype not in (torch.float32, torch.float16, torch.float64):
        tensor = tensor.to(torch.float32)
    return tensor.detach().cpu().contiguous().numpy()


def table(harvest: Harvest, token_ids: Sequence[Sequence[int]]) -> Any:
    """The shard's table: one row per harvested token (`harvest` of prompts whose ids are `token_ids`)."""
    import pyarrow

    prompts: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    for prompt, chosen, ids in zip(harvest.prompts, harvest.positions, token_ids):
        prompts.extend([prompt] * len(chosen))
        positions.extend(chosen)
        tokens.extend(ids[position] for position in chosen)
    columns: dict[str, Any] = {"prompt": pyarrow.array(prompts, pyarrow.int64()),
                               "position": pyarrow.array(positions, pyarrow.int32()),
                               "token": pyarrow.array(tokens, pyarrow.int64())}
    for value, per_prompt in harvest.values.items():
        layers: list[Any] = [None] if value in ROOT_VALUES else list(range(len(harvest.layers)))
        for slot in layers:
            # A prompt's root value is [positions, hidden]; a block value [blocks, positions, hidden] (head_results
            # [blocks, positions, heads, hidden]: a token's row is its heads' results, flattened).
            rows = [(tensor if slot is None else tensor[slot]).flatten(1) for tensor in per_prompt]
            hidden = rows[0].shape[-1]
            flat = _floats(torch.cat(rows)).reshape(-1) if rows else numpy.zeros(0, numpy.float32)
            name = value if slot is None else f"{value}/{harvest.layers[slot]}"
            columns[name] = pyarrow.FixedSizeListArray.from_arrays(pyarrow.array(flat), hidden)
    return pyarrow.table(columns)


#: The columns that name a row; every other column is an activation.
ROW_COLUMNS = ["prompt", "position", "token"]


def write(path: Any, harvest: Harvest, token_ids: Sequence[Sequence[int]]) -> None:
    """Write the shard's table to `path` (a temporary name: `streamscope.scale.shards` renames it).

    The activations' floats are written byte-stream-split (each float's bytes grouped by significance before
    snappy compresses them) with neither a dictionary nor page statistics, which floats gain nothing from:
    measured on the CPU on 2026-12-07 with widened bfloat16 rows, 1.5x pyarrow's default write rate at 0.44 of
    the float32 bytes (the default: 0.40). The row columns keep both. Any Parquet reader reads the encoding.
    """
    import pyarrow.parquet

    shard = table(harvest, token_ids)
    floats = [f"{name}.list.element" for name in shard.column_names if name not in ROW_COLUMNS]
    pyarrow.parquet.write_table(shard, str(path), use_dictionary=ROW_COLUMNS, write_statistics=ROW_COLUMNS,
                                use_byte_stream_split=floats)
