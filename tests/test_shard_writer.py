"""The harvest's shard writer: safetensors files written from each tensor's own memory, in a background thread.

The oracle is the `safetensors` package itself: its `save_file` (on contiguous copies) gives the bytes a file must
have, and its readers (`safe_open`, `load_file`) must read ours back bit for bit.
"""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from streamscope.bulk import results
from streamscope.bulk.results import INDEX, Harvest, ShardWriter, assemble, iter_harvest, load_harvest
from streamscope.bulk.safetensors_io import DTYPES, write_safetensors
from streamscope.bulk.spec import HarvestSpec

ENGINE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its width: equal bits, NaNs and signed zeros included."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    flat = tensor.contiguous().reshape(-1)
    return flat.view(integer) if tensor.dtype != torch.bool else flat.to(torch.uint8)


def _assert_same(read: torch.Tensor, wanted: torch.Tensor) -> None:
    assert read.dtype == wanted.dtype and read.shape == wanted.shape
    assert torch.equal(_bits(read), _bits(wanted))


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if values.numel():
        values.view(-1)[0] = float("nan")  # bits the readers must keep as they are
        values.view(-1)[-1] = -0.0
    return values.to(dtype)


def _against_save_file(tensors: dict[str, torch.Tensor], tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(tensors, ours)
    save_file({name: tensor.contiguous().clone() for name, tensor in tensors.items()}, str(theirs))
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = load_file(str(ours))
    assert set(loaded) == set(tensors)
    with safe_open(str(ours), framework="pt") as opened:
        assert set(opened.keys()) == set(tensors)
        for name, tensor in tensors.items():
            _assert_same(loaded[name], tensor)
            _assert_same(opened.get_tensor(name), tensor)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("dtype", ENGINE_DTYPES, ids=str)
def test_engine_dtypes_byte_for_byte(dtype: torch.dtype, tmp_path: Path) -> None:
    tensors = {f"layer_output/{prompt}": _random((6, 5 + prompt, 16), dtype, prompt) for prompt in range(3)}
    tensors["token_embeddings/0"] = _random((5, 16), dtype, 9)
    _against_save_file(tensors, tmp_path)


def test_mixed_dtypes_in_save_file_order(tmp_path: Path) -> None:
    """Every dtype a shard can hold in one file: the layout order is `save_file`'s, so the bytes are too."""
    tensors = {}
    for number, dtype in enumerate(DTYPES):
        base = torch.arange(-3, 9).reshape(3, 4)
        tensors[f"value-{number:02d}"] = (base % 3 == 0) if dtype == torch.bool else base.abs().to(dtype)
    tensors["x/engine-f32"] = _random((4, 8), torch.float32, 1)
    tensors["a/engine-bf16"] = _random((4, 8), torch.bfloat16, 2)
    tensors["m/engine-f16"] = _random((4, 8), torch.float16, 3)
    _against_save_file(tensors, tmp_path)


def test_empty_and_zero_size(tmp_path: Path) -> None:
    _against_save_file({}, tmp_path)
    _against_save_file({"none/0": torch.empty(0, 7, dtype=torch.bfloat16), "none/1": torch.empty(3, 0),
                        "scalar": torch.tensor(2.5, dtype=torch.float16), "row/0": _random((1, 7), torch.float32, 4)},
                       tmp_path)


def test_views_and_non_contiguous(tmp_path: Path) -> None:
    """A harvest hands out views of one buffer, and may hand strided ones: each written as its own elements."""
    buffer = _random((4, 6, 8), torch.bfloat16, 5)
    tensors = {"first": buffer[0], "rows": buffer[1:3], "last": buffer[3], "transposed": buffer[1].t(),
               "strided": buffer[:, ::2, 1::3], "column": _random((5, 9), torch.float16, 6)[:, 4],
               "expanded": torch.ones(3, dtype=torch.float32).expand(4, 3)}
    assert not tensors["transposed"].is_contiguous() and not tensors["strided"].is_contiguous()
    _against_save_file(tensors, tmp_path)
    head = (tmp_path / "ours.safetensors").read_bytes()[:8]
    data = sum(tensor.nbytes for tensor in tensors.values())  # each view's own bytes, not its buffer's
    assert (tmp_path / "ours.safetensors").stat().st_size == 8 + struct.unpack("<Q", head)[0] + data


def test_inference_tensors(tmp_path: Path) -> None:
    with torch.inference_mode():
        made = _random((3, 4), torch.bfloat16, 7) * 2
    _against_save_file({"made": made, "view": made[1:]}, tmp_path)


def test_unsupported_dtype_named() -> None:
    with pytest.raises(TypeError, match=r"'bad' is torch.complex64.*convert it"):
        write_safetensors({"bad": torch.zeros(2, dtype=torch.complex64)}, "/nonexistent/never.safetensors")


# --- ShardWriter: the background thread, its bound, its errors -------------------------------------------------


def _part(prompts: list[int], dtype: torch.dtype = torch.bfloat16, hidden: int = 8) -> tuple[HarvestSpec, Harvest]:
    """A part as the engines hand it: `assemble`'s views of one buffer a prompt."""
    spec = HarvestSpec(["token_embeddings", "layer_output"], [0, 2], positions=[list(range(3 + p)) for p in
                                                                                range(max(prompts) + 1)])
    buffers = [_random((3, 3 + prompt, hidden), dtype, 100 + prompt) for prompt in prompts]
    return spec, assemble(spec, buffers, prompts)


@pytest.mark.parametrize("dtype", ENGINE_DTYPES, ids=str)
def test_writer_round_trip(dtype: torch.dtype, tmp_path: Path) -> None:
    spec, whole = _part(list(range(7)), dtype)
    writer = ShardWriter(tmp_path / "h", spec, 7)
    for start in range(0, 7, 3):
        chunk = list(range(start, min(start + 3, 7)))
        writer.write(Harvest({value: [whole.values[value][p] for p in chunk] for value in whole.values},
                             whole.layers, [whole.positions[p] for p in chunk], chunk))
    folder = writer.close()
    assert not writer._thread.is_alive()
    assert sorted(path.name for path in folder.iterdir()) == [INDEX] + [f"shard-{n:05d}.safetensors" for n in range(3)]
    loaded = load_harvest(folder)
    assert loaded.prompts == list(range(7)) and loaded.layers == [0, 2]
    for value in whole.values:
        for read, wanted in zip(loaded[value], whole[value]):
            _assert_same(read, wanted)
    shards = list(iter_harvest(folder))
    assert [shard.prompts for shard in shards] == [[0, 1, 2], [3, 4, 5], [6]]


class _Gate:
    """Stands in for the file write: holds each part until let through, counting the parts alive at once."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Semaphore(0)
        self.written: list[str] = []

    def __call__(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        self.started.release()
        assert self.open.wait(30), "the test never let the write through"
        write_safetensors(tensors, path)
        self.written.append(path.name)


def test_write_returns_before_the_disk_and_blocks_when_full(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _Gate()
    monkeypatch.setattr(results, "write_safetensors", gate)
    spec, _ = _part([0, 1, 2, 3])
    writer = ShardWriter(tmp_path / "h", spec, 4, held=2)
    start = time.perf_counter()
    writer.write(_part([0])[1])  # taken by the thread, held at the gate
    assert gate.started.acquire(timeout=10)
    writer.write(_part([1])[1])  # waits in the queue: the second part held
    assert time.perf_counter() - start < 5 and gate.written == []  # both returned with nothing on disk
    third_done = threading.Event()

    def third() -> None:
        writer.write(_part([2])[1])
        third_done.set()

    caller = threading.Thread(target=third)
    caller.start()
    assert not third_done.wait(0.5), "a third part was taken while two were held: the queue grew"
    assert writer._parts.qsize() == 1
    gate.open.set()  # the first shard written frees a slot: the third part goes in
    assert third_done.wait(10)
    caller.join()
    writer.write(_part([3])[1])
    folder = writer.close()
    assert gate.written == [f"shard-{n:05d}.safetensors" for n in range(4)]
    assert load_harvest(folder).prompts == [0, 1, 2, 3]


def test_writer_error_surfaces_at_close_with_no_index(tmp_path: Path) -> None:
    spec, part = _part([0, 1])
    folder = tmp_path / "h"
    writer = ShardWriter(folder, spec, 3)
    writer.write(Harvest({v: t[:1] for v, t in part.values.items()}, part.layers, part.positions[:1], [0]))
    (folder / "shard-00001.safetensors.partial").mkdir()  # the second shard cannot be opened: an OSError
    writer.write(Harvest({v: t[1:] for v, t in part.values.items()}, part.layers, part.positions[1:], [1]))
    with pytest.raises(RuntimeError, match=r"shard-00001\.safetensors failed \(IsADirectoryError.*no index") as caught:
        writer.close()
    assert isinstance(caught.value.__cause__, IsADirectoryError)
    assert not writer._thread.is_alive()
    assert not (folder / INDEX).exists()
    with pytest.raises(FileNotFoundError, match="was the run finished"):
        load_harvest(folder)
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(part)


def test_writer_error_stops_the_next_write(tmp_path: Path) -> None:
    spec, part = _part([0])
    writer = ShardWriter(tmp_path / "h", spec, 2)
    bad = Harvest({value: [torch.zeros(2, dtype=torch.complex64)] for value in part.values}, part.layers,
                  part.positions, [0])
    writer.write(bad)
    deadline = time.monotonic() + 10
    while writer._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match=r"shard-00000\.safetensors failed \(TypeError.*complex64"):
        writer.write(part)  # the run stops at its next chunk rather than harvesting for nothing
    writer.abort()
    assert not writer._thread.is_alive()
    assert not (tmp_path / "h" / INDEX).exists() and not list((tmp_path / "h").glob("*.partial"))


def test_abort_writes_no_index_and_ends_the_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the harvest loop: the shard being written finishes, the waiting one is dropped."""
    gate = _Gate()
    monkeypatch.setattr(results, "write_safetensors", gate)
    spec, _ = _part([0, 1])
    writer = ShardWriter(tmp_path / "h", spec, 2)
    writer.write(_part([0])[1])
    assert gate.started.acquire(timeout=10)
    writer.write(_part([1])[1])
    gate.open.set()
    writer.abort()
    assert not writer._thread.is_alive()
    assert gate.written in (["shard-00000.safetensors"], ["shard-00000.safetensors", "shard-00001.safetensors"])
    assert not (tmp_path / "h" / INDEX).exists()
    writer.abort()  # idempotent
    with pytest.raises(FileExistsError, match="choose an empty folder"):
        ShardWriter(tmp_path / "h", spec, 2)


def test_header_is_the_format() -> None:
    """The first bytes by hand, from the format's spec: u64 little-endian length, JSON, spaces to 8 bytes."""
    from streamscope.bulk.safetensors_io import layout

    head, names = layout({"b": torch.zeros(2, 3, dtype=torch.bfloat16), "a": torch.zeros(4)})
    length = struct.unpack("<Q", head[:8])[0]
    assert length == len(head) - 8 and length % 8 == 0
    assert head[8:].rstrip(b" ") == (b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},'
                                     b'"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]}}')
    assert names == ["a", "b"]
