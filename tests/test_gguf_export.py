"""`export_gguf` writes control vectors that llama.cpp loads (issue 38, item 9).

No llama.cpp build installs here (PyPI's llama-cpp-python is a source package only, and Debian has none), so the
oracle is llama.cpp's rule restated from its source, `llama_cpp_control_vector` below:

* common/common.cpp, ``common_control_vector_load_one``: every tensor is named ``direction.N`` with N parsed by
  ``std::stoi``; N < 0 is "invalid/unparsable", N == 0 "invalid (zero) direction tensor layer index", and either
  rejects the whole file; each tensor must be F32, 1-D, all of one length n_embd; tensor N is stored at offset
  ``n_embd * (N - 1)`` of one buffer ("do not store data for layer 0 (it's not used)").
* src/llama-adapter.cpp, ``llama_adapter_cvec::apply``: ``for il in 1 .. n_layer - 1``, block il's tensor takes
  the buffer at ``n_embd * (il - 1)`` where the buffer is that long ("buffer doesn't have data for layer 0");
  the model's graph adds ``tensors[il]`` to block il's output (``build_cvec(cur, il)``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import streamscope
from streamscope.directions import ControlVectorWarning, Direction, export_gguf, find, import_gguf

POSITIVE = ["I love this film, it is wonderful", "I love this book, it is great", "I love this song, it is lovely",
            "I love this meal, it is superb"]
NEGATIVE = ["I hate this film, it is awful", "I hate this book, it is dreadful", "I hate this song, it is bad",
            "I hate this meal, it is horrid"]


def llama_cpp_control_vector(path: Path, n_layer: int) -> dict[int, np.ndarray]:
    """What llama.cpp adds to each block's output from the control-vector file at `path`, ``{block: vector}``,
    by llama.cpp's own rule (module docstring); raises ValueError with llama.cpp's message where it refuses."""
    reader = gguf.GGUFReader(str(path))
    n_embd, data = -1, np.zeros(0, dtype=np.float32)
    for tensor in reader.tensors:
        prefix, _, suffix = tensor.name.partition(".")
        try:
            layer = int(suffix) if prefix == "direction" else -1
        except ValueError:
            layer = -1
        if layer < 0:
            raise ValueError("invalid/unparsable direction tensor layer index")
        if layer == 0:
            raise ValueError("invalid (zero) direction tensor layer index")
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError("invalid (non-F32) direction tensor type")
        if len([size for size in tensor.shape if size != 1]) > 1 or len(tensor.shape) != 1:
            raise ValueError("invalid (non-1D) direction tensor shape")
        if n_embd == -1:
            n_embd = int(tensor.n_elements)
        elif int(tensor.n_elements) != n_embd:
            raise ValueError("direction tensor does not match previous dimensions")
        if data.size < n_embd * layer:
            data = np.concatenate([data, np.zeros(n_embd * layer - data.size, dtype=np.float32)])
        data[n_embd * (layer - 1): n_embd * layer] += np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    applied = {}
    for block in range(1, n_layer):
        offset = n_embd * (block - 1)
        if offset + n_embd <= data.size:
            applied[block] = data[offset: offset + n_embd]
    return applied


def _write(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(tensors))
    for name, vector in tensors.items():
        writer.add_tensor(name, vector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def model(checkpoints):
    return streamscope.load(checkpoints("llama"))


@pytest.fixture(scope="module")
def sweep(model):
    return find(model, POSITIVE, NEGATIVE, progress=False)  # every block, 0 included, as README's example


def test_the_restated_rule_refuses_what_llama_cpp_refuses(model, tmp_path):
    width = model.hidden_size
    with pytest.raises(ValueError, match=r"invalid \(zero\)"):
        llama_cpp_control_vector(_write(tmp_path / "zero.gguf", {"direction.0": np.ones(width, np.float32),
                                                                  "direction.1": np.ones(width, np.float32)}), 3)
    with pytest.raises(ValueError, match="unparsable"):
        llama_cpp_control_vector(_write(tmp_path / "name.gguf", {"vector.1": np.ones(width, np.float32)}), 3)
    with pytest.raises(ValueError, match="previous dimensions"):
        llama_cpp_control_vector(_write(tmp_path / "widths.gguf", {"direction.1": np.ones(width, np.float32),
                                                                    "direction.2": np.ones(width + 1, np.float32)}), 3)
    # direction.N lands on block N; past the last block it is dropped.
    vectors = {"direction.1": np.full(width, 1.0, np.float32), "direction.5": np.full(width, 5.0, np.float32)}
    applied = llama_cpp_control_vector(_write(tmp_path / "ok.gguf", vectors), 3)
    assert sorted(applied) == [1, 2] and (applied[1] == 1.0).all() and (applied[2] == 0.0).all()


def test_a_sweeps_file_loads_in_llama_cpp_with_each_block_on_its_block(model, sweep, tmp_path):
    assert 0 in sweep.layers
    with pytest.warns(ControlVectorWarning, match=r"block 0's direction is left out.*direction\.0"):
        path = export_gguf(sweep, tmp_path / "sweep.gguf")
    applied = llama_cpp_control_vector(path, model.num_layers)
    assert sorted(applied) == list(range(1, model.num_layers))
    for block, vector in applied.items():
        assert np.array_equal(vector, sweep[block].vector.numpy()), block
    # streamscope reads it back to the same blocks.
    imported = import_gguf(path, model)
    assert [direction.layer for direction in imported] == list(range(1, model.num_layers))
    for direction in imported:
        assert torch.equal(direction.vector, sweep[direction.layer].vector)


def test_a_sweep_without_block_0_exports_without_a_warning(model, sweep, tmp_path):
    later = find(model, POSITIVE, NEGATIVE, layers=list(range(1, model.num_layers)), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ControlVectorWarning)
        path = export_gguf(later, tmp_path / "later.gguf")
    assert sorted(llama_cpp_control_vector(path, model.num_layers)) == list(range(1, model.num_layers))
    # One direction by hand, at block 1: a file of one tensor.
    single = export_gguf(sweep[1], tmp_path / "one.gguf")
    assert list(llama_cpp_control_vector(single, model.num_layers)) == [1]


def test_block_0_by_hand_and_blocks_past_the_model_are_refused_with_the_fix(model, sweep, tmp_path):
    with pytest.raises(ValueError, match=r"cannot hold block 0.*direction\.0.*blocks 1 and up"):
        export_gguf(sweep[0], tmp_path / "zero.gguf")
    with pytest.raises(ValueError, match="cannot hold block 0"):
        export_gguf([sweep[0], sweep[1]], tmp_path / "zero.gguf")
    assert not (tmp_path / "zero.gguf").exists()
    past = Direction(sweep[1].vector, "layer_output", model.num_layers, "mean_difference", sweep[1].model)
    with pytest.raises(ValueError, match="past the model's last block.*ignore them"):
        export_gguf([past], tmp_path / "past.gguf")
    only_zero = find(model, POSITIVE, NEGATIVE, layers=[0], progress=False)
    with pytest.raises(ValueError, match="only block 0"):
        export_gguf(only_zero, tmp_path / "only.gguf")


def test_import_still_reads_files_with_a_block_0_tensor(model, tmp_path):
    """A file written before (streamscope's earlier export) keeps loading into streamscope, block 0 included."""
    width = model.hidden_size
    vectors = {0: np.linspace(-1, 1, width, dtype=np.float32), 2: np.cos(np.arange(width, dtype=np.float32))}
    path = _write(tmp_path / "old.gguf", {f"direction.{block}": vector for block, vector in vectors.items()})
    imported = import_gguf(path, model)
    assert [direction.layer for direction in imported] == [0, 2]
    for direction in imported:
        assert np.array_equal(direction.vector.numpy(), vectors[direction.layer])
