"""A Parquet shard's table (`streamscope.scale.parquet`): one row a harvested token, the dtype kept or widened exactly.

The Ray runs (tests/scale/test_ray_harvest.py) check a run's tables against the safetensors harvest in float32;
here the layout of one table with two prompts of other position counts, and bfloat16 (which Arrow lacks), and the
file's encodings.
"""

from __future__ import annotations

import pyarrow
import torch

from streamscope.bulk.results import Harvest
from streamscope.scale.parquet import column_names, table, write


def harvest(dtype: torch.dtype) -> Harvest:
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(2, 3, 8, generator=generator).to(dtype), torch.randn(2, 1, 8, generator=generator).to(dtype)]
    roots = [torch.randn(3, 8, generator=generator).to(dtype), torch.randn(1, 8, generator=generator).to(dtype)]
    return Harvest({"layer_output": blocks, "token_embeddings": roots}, [5, 7], [[0, 2, 3], [-1 % 4]], [10, 11])


def test_one_row_a_token_and_one_fixed_size_column_a_value_and_block():
    held = harvest(torch.float32)
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    result = table(held, ids)
    assert result.column_names == ["prompt", "position", "token", *column_names(held)]
    assert column_names(held) == ["layer_output/5", "layer_output/7", "token_embeddings"]
    assert result["prompt"].to_pylist() == [10, 10, 10, 11]
    assert result["position"].to_pylist() == [0, 2, 3, 3]
    assert result["token"].to_pylist() == [1, 3, 4, 8]
    assert result.schema.field("layer_output/7").type == pyarrow.list_(pyarrow.float32(), 8)
    rows = torch.tensor(result["layer_output/7"].to_pylist())
    assert torch.equal(rows, torch.cat([held["layer_output"][0][1], held["layer_output"][1][1]]))
    assert torch.equal(torch.tensor(result["token_embeddings"].to_pylist()), torch.cat(held["token_embeddings"]))


def test_bfloat16_is_widened_to_float32_exactly_and_float16_kept():
    held = harvest(torch.bfloat16)
    result = table(held, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert result.schema.field("layer_output/5").type == pyarrow.list_(pyarrow.float32(), 8)
    rows = torch.tensor(result["layer_output/5"].to_pylist())
    assert torch.equal(rows, torch.cat([held["layer_output"][0][0], held["layer_output"][1][0]]).float())
    half = table(harvest(torch.float16), [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert half.schema.field("token_embeddings").type == pyarrow.list_(pyarrow.float16(), 8)


def test_the_file_reads_back_as_the_table_with_its_floats_byte_stream_split(tmp_path):
    """Written as any Parquet reader reads it: the same table back; each activation column byte-stream-split with
    no dictionary or statistics (what floats gain nothing from), the row columns with both."""
    import pyarrow.parquet

    held = harvest(torch.float16)
    ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
    write(tmp_path / "shard.parquet", held, ids)
    assert pyarrow.parquet.read_table(tmp_path / "shard.parquet").equals(table(held, ids))
    group = pyarrow.parquet.ParquetFile(tmp_path / "shard.parquet").metadata.row_group(0)
    columns = {group.column(index).path_in_schema: group.column(index) for index in range(group.num_columns)}
    for name in column_names(held):
        column = columns[f"{name}.list.element"]
        assert "BYTE_STREAM_SPLIT" in column.encodings and not column.has_dictionary_page, (name, column.encodings)
        assert not column.is_stats_set, name
    for name in ("prompt", "position", "token"):
        assert columns[name].has_dictionary_page and columns[name].is_stats_set, name
