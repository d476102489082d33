"""The harvest writer: each step's harvested rows into their requests' buffers, and a finished buffer to its file.

The serve worker (`streamscope.serve.worker`) copies a step's harvested rows
to host memory without waiting for them. Putting the rows in their requests'
buffers and writing each finished harvest is Python work, and on a thread of
the engine's own process it takes the interpreter lock from the engine's loop
at every step (the engine waits for the device in a torch call, the thread
takes the lock, and the engine's next line waits for the thread). So it runs
in a process of its own: this file, started by the worker's writer thread as
a script (``python writer.py FOLDER RANK``). It imports torch and safetensors
and nothing of streamscope's, so it starts in the time torch takes to import.

The worker's writer thread sends it frames on its standard input, in step order:

==========  =================================================================================================
``admit``   a harvest's `Record` (its id, sites, positions, the runs of its file), before any of its rows
``rows``    a step's copy to host memory, as raw bytes, and where each request's rows lie in it
            (``pieces``: key, site index, slots, first element, rows, width); then the harvests it completes
``drop``    a harvest whose request ended before its prompt ran: its buffer goes, nothing is written
==========  =================================================================================================

A frame is its JSON header's length (little-endian u32), its payload's length
(u64), the header, then the payload. The process ends when its input closes
(the worker has exited). Where it cannot be started, or dies, the writer
thread keeps a `Store` itself: the same code, in the engine's process.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

#: safetensors' names of the dtypes a harvest buffer holds.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
#: A pipeline stage's part of a harvest: ``<id>.stage<rank>.safetensors`` (`streamscope.serve.stages`).
PART = "stage"
_FRAME = struct.Struct("<IQ")
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass
class Record:
    """What the writer knows of one harvest: enough to fill its buffer and write its file.

    `runs` are the file's tensors as runs of the buffer's sites, ``(name,
    first site, sites, squeezed)`` (a root value is one squeezed site); an
    SAE harvest has ``sae`` set and its top k, if any; a pipeline stage's part
    has ``part`` set (its sites are the stage's own, named in ``meta["held"]``).
    """

    harvest_id: str
    sites: int
    positions: int
    meta: dict[str, Any]
    runs: list[tuple[str, int, int, bool]] = field(default_factory=list)
    sae: bool = False
    top_k: Optional[int] = None
    part: bool = False
    buffer: Optional[torch.Tensor] = None  # [sites, positions, width], made at the harvest's first rows

    def header(self) -> dict[str, Any]:
        state = asdict(self)
        del state["buffer"]
        return state


class Store:
    """The harvests being written: their buffers, filled a step at a time, each written once its last row is in."""

    def __init__(self, folder: Optional[Path], rank: int = 0) -> None:
        self.folder = folder
        self.rank = rank
        self.records: dict[int, Record] = {}

    def admit(self, key: int, record: Record) -> None:
        self.records[key] = record

    def drop(self, key: int) -> None:
        self.records.pop(key, None)

    def rows(self, host: torch.Tensor, pieces: list, complete: list[int]) -> None:
        """Store a step's rows (`host`, flat; `pieces` as the module says) and write the harvests in `complete`."""
        by_request: dict[int, list] = {}
        for piece in pieces:
            by_request.setdefault(piece[0], []).append(piece)
        for key, group in by_request.items():
            record = self.records.get(key)
            if record is None:
                continue
            try:
                if record.buffer is None:
                    record.buffer = torch.empty((record.sites, record.positions, group[0][5]), dtype=host.dtype)
                if not store_every_site(record.buffer, host, group):
                    for _, index, slots, start, count, width in group:
                        put(record.buffer[index], slots, host[start:start + count * width].view(count, width))
            except Exception as error:  # noqa: BLE001  (this harvest says why; the others go on)
                self.records.pop(key, None)
                self.fail(record.harvest_id, f"{type(error).__name__}: {error}")
        for key in complete:
            record = self.records.pop(key, None)
            if record is None or record.buffer is None:
                continue
            try:
                self.write(record)
            except Exception as error:  # noqa: BLE001
                self.fail(record.harvest_id, f"{type(error).__name__}: {error}")

    def write(self, record: Record) -> None:
        """Write one complete harvest, aside then renamed, so the front end never reads half a file."""
        if self.folder is None or not valid_id(record.harvest_id):
            return
        buffer = record.buffer
        assert buffer is not None
        if record.part:
            write_part(self.folder, record.harvest_id, self.rank, buffer, record.meta)
            return
        metadata = {key: json.dumps(item) for key, item in record.meta.items()}
        final = self.folder / f"{record.harvest_id}.safetensors"
        aside = self.folder / f".{record.harvest_id}.writing"
        if not record.sae and buffer.dtype in SAFETENSORS_DTYPES:
            save_runs(aside, buffer, record.runs, metadata)  # the buffer's own bytes: no copy per value
        else:
            save_file(_tensors(record), str(aside), metadata=metadata)
        os.replace(aside, final)

    def fail(self, harvest_id: Optional[str], message: str) -> None:
        fail(self.folder, harvest_id, message)


def _tensors(record: Record) -> dict[str, torch.Tensor]:
    buffer = record.buffer
    assert buffer is not None
    if record.sae:  # one site: [1, positions, d_sae], or the top k's values then their indices
        if record.top_k is None:
            return {"sae_features": buffer.clone()}
        return {"sae_values": buffer[..., :record.top_k].clone(), "sae_indices": buffer[..., record.top_k:].long()}
    return {name: buffer[first].clone() if squeezed else buffer[first:first + count].clone()
            for name, first, count, squeezed in record.runs}


def fail(folder: Optional[Path], harvest_id: Optional[str], message: str) -> None:
    """Leave the reason a harvest will not come, for the front end to answer its download with."""
    if folder is None or not valid_id(harvest_id):
        return
    aside = folder / f".{harvest_id}.failing"
    aside.write_text(message)
    os.replace(aside, folder / f"{harvest_id}.error")


def valid_id(harvest_id: Any) -> bool:
    """Whether `harvest_id` is one the front end makes (32 hex digits): nothing else names a file here."""
    return isinstance(harvest_id, str) and len(harvest_id) == 32 and all(c in "0123456789abcdef" for c in harvest_id)


def part_file(folder: Path, harvest_id: str, rank: int) -> Path:
    return folder / f"{harvest_id}.{PART}{rank}.safetensors"


def write_part(folder: Path, harvest_id: str, rank: int, buffer: torch.Tensor, meta: dict[str, Any]) -> None:
    """This stage's part of a harvest, ``[held sites, positions, hidden]``, written aside then renamed.

    `meta` is the harvest's (values, layers, positions) with ``held``: the part's sites' indices in the run's order.
    """
    metadata = {key: json.dumps(item) for key, item in meta.items()}
    final = part_file(folder, harvest_id, rank)
    aside = folder / f".{final.name}.writing"
    if buffer.dtype in SAFETENSORS_DTYPES:
        save_runs(aside, buffer.contiguous(), [("part", 0, buffer.shape[0], False)], metadata)
    else:
        save_file({"part": buffer.contiguous()}, str(aside), metadata=metadata)
    os.replace(aside, final)


def save_runs(path: Path, buffer: torch.Tensor, parts: list[tuple[str, int, int, bool]],
              metadata: dict[str, str]) -> None:
    """A safetensors file of runs of `buffer`'s first dimension, written straight from it.

    `buffer` is contiguous; each part is (name, first index, count, squeezed):
    the tensor ``buffer[first:first + count]``, or ``buffer[first]`` when
    squeezed. The parts follow each other in `buffer`, so the file's data is
    the buffer's own bytes: one write, and nothing held but the header while
    it is made (safetensors' own `save_file` copies every tensor first).
    """
    row = buffer[0].numel() * buffer.element_size()
    header: dict[str, Any] = {}
    end = 0
    for name, first, count, squeezed in parts:
        assert first * row == end, "the parts must follow each other in the buffer"
        shape = list(buffer.shape[1:]) if squeezed else [count, *buffer.shape[1:]]
        header[name] = {"dtype": SAFETENSORS_DTYPES[buffer.dtype], "shape": shape,
                        "data_offsets": [end, end + count * row]}
        end += count * row
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    data = buffer.contiguous().view(torch.uint8).reshape(-1)[:end]
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        file.write(memoryview(data.numpy()))


def put(target: torch.Tensor, slots: list[int], rows: torch.Tensor) -> None:
    """``target[..., slots, :] = rows``, as a slice where the positions follow each other."""
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        target[..., first:first + len(slots), :] = rows
    else:
        target[..., slots, :] = rows


def store_every_site(buffer: torch.Tensor, host: torch.Tensor, group: list) -> bool:
    """Store one request's rows of a step in one copy, where the step read every one of its sites at the same
    positions and the copy holds them evenly spaced (each site's read of the same requests): True if done."""
    if len(group) != buffer.shape[0]:
        return False
    group = sorted(group, key=lambda piece: piece[1])
    _, _, slots, start, count, width = group[0]
    stride = group[1][3] - start if len(group) > 1 else count * width
    if stride < count * width:
        return False  # sites read in another order than they are stored (blocks asked last-first): one copy each
    for number, (_, index, other_slots, other_start, _, _) in enumerate(group):
        if index != number or other_slots != slots or other_start != start + number * stride:
            return False
    put(buffer, slots, host.as_strided((len(group), count, width), (stride, width, 1), host.storage_offset() + start))
    return True


# ---------------------------------------------------------------- the process and its frames

def send_frame(stream: Any, header: dict[str, Any], payload: Optional[torch.Tensor] = None) -> None:
    """Write one frame to `stream`: `header` as JSON, then `payload`'s bytes (a flat host tensor) as they are."""
    data = json.dumps(header, separators=(",", ":")).encode()
    body = memoryview(payload.view(torch.uint8).numpy()) if payload is not None else None
    stream.write(_FRAME.pack(len(data), 0 if body is None else body.nbytes) + data)
    if body is not None:
        stream.write(body)  # the pipe's write waits outside the interpreter lock
    stream.flush()


def handle(store: Store, header: dict[str, Any], payload: bytes) -> None:
    """Apply one frame to `store`."""
    kind = header["kind"]
    if kind == "admit":
        record = header["record"]
        record["runs"] = [tuple(run) for run in record["runs"]]
        store.admit(header["key"], Record(**record))
    elif kind == "rows":
        host = torch.frombuffer(bytearray(payload), dtype=_DTYPES[header["dtype"]])
        store.rows(host, header["pieces"], header["complete"])
    elif kind == "drop":
        store.drop(header["key"])
    else:
        raise ValueError(f"unknown frame {kind!r}")


def main(argv: list[str]) -> int:
    """The writer process: frames from standard input until it closes."""
    store = Store(Path(argv[1]) if argv[1] else None, int(argv[2]))
    stream = sys.stdin.buffer
    while True:
        head = stream.read(_FRAME.size)
        if len(head) < _FRAME.size:
            return 0
        size, length = _FRAME.unpack(head)
        header = json.loads(stream.read(size))
        payload = stream.read(length) if length else b""
        try:
            handle(store, header, payload)
        except Exception as error:  # noqa: BLE001  (a bad frame fails its harvests, not the process)
            print(f"streamscope harvest writer: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            for key in [header.get("key"), *(piece[0] for piece in header.get("pieces", ()))]:
                record = store.records.pop(key, None) if key is not None else None
                if record is not None:
                    store.fail(record.harvest_id, f"{type(error).__name__}: {error}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
