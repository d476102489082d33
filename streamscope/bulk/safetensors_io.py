"""A safetensors file written straight from each tensor's memory, with no copy of the tensors first.

safetensors' own `save_file` copies every tensor's bytes (``tobytes``) before it writes the file, and the harvest
cloned every tensor before that (its per-prompt tensors are views of one buffer a prompt): two full extra copies of
a shard on the host, made in the engine's thread. This module writes the format itself (the spec in safetensors'
README): an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype", "shape", "data_offsets"}}``,
offsets relative to the data that follows, padded with spaces to a multiple of 8), then each tensor's bytes.

The tensors are laid out in the order `save_file` uses (wider dtypes first as its Rust ``Dtype`` enum orders them,
then by name), so a file written here is byte for byte the file `save_file` writes for the same tensors; both
readers (`safe_open`, `load_file`) read it. ``file.write`` of a large buffer releases the GIL, so a writer thread
calling `write_safetensors` lets the engine's thread run on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Mapping

import torch

# torch dtype -> (the format's dtype name, its rank in safetensors' Rust `Dtype` enum, which orders `save_file`'s
# layout: a higher rank is written first).
DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.float8_e5m2: ("F8_E5M2", 6),
    torch.float8_e4m3fn: ("F8_E4M3", 7),
    torch.int16: ("I16", 9),
    torch.uint16: ("U16", 10),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.uint32: ("U32", 14),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 16),
    torch.int64: ("I64", 17),
    torch.uint64: ("U64", 18),
}


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's elements in row-major order as bytes: its own memory when it is a contiguous host tensor (a
    view into a larger buffer gives only its own elements), a contiguous copy otherwise."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    """The file's first bytes (length and padded JSON header) and the names in the order their bytes follow."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor: a shard holds tensors only.")
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name!r} is {tensor.dtype}, which safetensors cannot store: convert it to one of "
                            f"{sorted(str(dtype) for dtype in DTYPES)}.")
    names = sorted(tensors, key=lambda name: (-DTYPES[tensors[name].dtype][1], name))
    header: dict[str, dict[str, object]] = {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPES[tensor.dtype][0], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format's writers pad it
    return len(text).to_bytes(8, "little") + text, names


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write `tensors` to `path` as a safetensors file, each tensor's bytes straight from its memory.

    The tensors may be views of one buffer, non-contiguous (made contiguous one at a time), of any shape including
    zero-size; the caller must not write to them until this returns. The file is written under a temporary name and
    renamed when whole, so a file at `path` is never a partial one.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian bytes; this writer runs on little-endian hosts only.")
    head, names = layout(tensors)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as file:
            file.write(head)
            for name in names:
                file.write(_host_bytes(tensors[name]))
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


__all__ = ["DTYPES", "layout", "write_safetensors"]
