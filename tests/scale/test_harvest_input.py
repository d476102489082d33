"""A distributed harvest's input: every dataset form read the same, and bad input refused before Ray starts."""

from __future__ import annotations

import json
import sys

import pytest

from streamscope.scale import harvest, read_prompts
from streamscope.scale.shards import MANIFEST, RunFolder

ROWS = [{"text": "The Eiffel Tower", "ids": [5, 6, 7]}, {"text": "is in Paris", "ids": [8, 9]}]


def test_a_list_of_prompts_or_of_records():
    assert read_prompts(["a b", [1, 2]]) == ["a b", [1, 2]]
    assert read_prompts(ROWS) == ["The Eiffel Tower", "is in Paris"]
    assert read_prompts(ROWS, column="ids") == [[5, 6, 7], [8, 9]]


def test_jsonl_and_parquet_files(tmp_path):
    import pyarrow
    import pyarrow.parquet

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    assert read_prompts(jsonl) == ["The Eiffel Tower", "is in Paris"]
    assert read_prompts(jsonl, column="ids") == [[5, 6, 7], [8, 9]]
    parquet = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), parquet)
    assert read_prompts(parquet) == ["The Eiffel Tower", "is in Paris"]
    assert read_prompts(str(parquet), column="ids") == [[5, 6, 7], [8, 9]]


def test_a_datasets_dataset_and_its_folder(tmp_path):
    import datasets
    dataset = datasets.Dataset.from_list(ROWS)
    assert read_prompts(dataset, column="ids") == [[5, 6, 7], [8, 9]]
    dataset.save_to_disk(str(tmp_path / "one"))
    assert read_prompts(tmp_path / "one") == ["The Eiffel Tower", "is in Paris"]
    datasets.DatasetDict({"train": dataset}).save_to_disk(str(tmp_path / "splits"))
    assert read_prompts(tmp_path / "splits", split="train") == ["The Eiffel Tower", "is in Paris"]
    with pytest.raises(ValueError, match="holds the splits train: pass split="):
        read_prompts(tmp_path / "splits")


def test_a_missing_column_names_the_columns_there(tmp_path):
    import pyarrow
    import pyarrow.parquet

    with pytest.raises(KeyError, match="no column 'body'.*'text', 'ids'"):
        read_prompts(ROWS, column="body")
    parquet = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), parquet)
    with pytest.raises(KeyError, match="no column 'body'; it has 'text', 'ids'"):
        read_prompts(parquet, column="body")
    with pytest.raises(TypeError, match="row 1 of the list is a float"):
        read_prompts(["a", 1.5])
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


@pytest.fixture
def path(checkpoints):
    return checkpoints("llama")


def refused(path, out, **options):
    import ray

    arguments = {"dataset": ["a b", "c d"], "checkpoint": path, "values": ["layer_output"], "layers": [0],
                 "out": out, "engine": "transformers", "progress": False, **options}
    with pytest.raises(Exception) as error:
        harvest(**arguments)
    assert not ray.is_initialized()  # refused before Ray started
    return error.value


def test_bad_requests_are_refused_before_ray_starts(path, tmp_path):
    import ray  # noqa: F401  (the ray extra)
    assert "unknown value 'layer_outptu'" in str(refused(path, tmp_path / "a", values=["layer_outptu"]))
    assert "block 7 is out of range" in str(refused(path, tmp_path / "b", layers=[7]))
    assert "unknown engine" in str(refused(path, tmp_path / "c", engine="sglang"))
    assert "2 lists for 3 prompts" in str(refused(path, tmp_path / "d", dataset=["a", "b", "c"],
                                                  positions=[[0], [0]]))
    assert "no column 'body'" in str(refused(path, tmp_path / "e", dataset=ROWS, column="body"))
    for bad in (0, -3, 2.5, "8"):  # an explicit shard size is checked as ever; None plans one
        assert f"shard_size={bad!r}: a shard holds at least one prompt" in str(refused(path, tmp_path / "f",
                                                                                      shard_size=bad))
    assert "positions='every'" in str(refused(path, tmp_path / "g", positions="every"))  # checked by the plan


def test_a_folder_of_another_run_is_refused(path, tmp_path):
    import ray  # noqa: F401  (the ray extra)
    other = tmp_path / "other"
    RunFolder(other, {"checkpoint": "elsewhere", "values": ["layer_output"]}).open()
    error = refused(path, other)
    assert isinstance(error, FileExistsError) and "holds another run's shards (checkpoint:" in str(error)
    assert json.loads((other / MANIFEST).read_text())["checkpoint"] == "elsewhere"  # left as it was
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "index.json").write_text("{}")
    assert "not a resumable run" in str(refused(path, plain))


def test_without_ray_the_error_says_what_to_install(path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'streamscope\[ray\]'"):
        harvest(["a"], path, ["layer_output"], [0], out=tmp_path / "run", engine="transformers")


def test_parallel_sizes_and_the_format_are_checked_before_ray_starts(path, tmp_path):
    import ray  # noqa: F401  (the ray extra)
    from transformers import AutoConfig

    blocks = AutoConfig.from_pretrained(path).num_hidden_layers
    error = refused(path, tmp_path / "a", engine="vllm", engine_options={"pipeline_parallel_size": blocks + 1})
    assert f"pipeline_parallel_size={blocks + 1} is more stages than the model's {blocks} blocks" in str(error)
    assert "a whole number" in str(refused(path, tmp_path / "b", engine="vllm",
                                           engine_options={"pipeline_parallel_size": 0}))
    assert "tensor_parallel_size=2.0: give a whole number" in str(refused(path, tmp_path / "c", engine="vllm",
                                                                       engine_options={"tensor_parallel_size": 2.0}))
    assert "format='csv': choose one of safetensors, parquet" in str(refused(path, tmp_path / "d", format="csv"))
    assert not any((tmp_path / name).exists() for name in "abcd")  # nothing written


def test_an_unreachable_cluster_is_refused_at_once_and_nothing_is_written(path, tmp_path):
    import socket

    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = refused(path, tmp_path / "run", address=f"127.0.0.1:{port}")
    assert isinstance(error, ConnectionError) and f"no Ray cluster is reachable at '127.0.0.1:{port}'" in str(error)
    assert "ray start --head" in str(error) and not (tmp_path / "run").exists()
    assert "give HOST:PORT" in str(refused(path, tmp_path / "run", address="nowhere"))


def test_the_command_prints_a_refusal_without_a_traceback(path, tmp_path, capsys):
    from streamscope.cli import main

    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n")
    code = main(["harvest", str(path), str(dataset), "--values", "layer_output", "--layers", "0", "--column", "body",
                 "--out", str(tmp_path / "run"), "--engine", "transformers", "--format", "parquet"])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"streamscope harvest: {dataset} has no column 'body'")
    assert not (tmp_path / "run").exists()


def test_the_command_leaves_the_shard_size_to_the_plan():
    from streamscope.cli import parser

    arguments = parser().parse_args(["harvest", "model", "rows.jsonl", "--values", "layer_output", "--out", "run"])
    assert arguments.shard_size is None
    assert parser().parse_args(["harvest", "model", "rows.jsonl", "--values", "layer_output", "--out", "run",
                                "--shard-size", "64"]).shard_size == 64
