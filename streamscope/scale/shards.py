"""A resumable harvest's folder: the run's manifest, shards written whole or not at all, the index at the end.

The folder a distributed harvest writes is the one `model.harvest(out=...)`
writes (``shard-00000.safetensors`` ..., tensors ``"<value>/<prompt>"``,
``index.json``), so `streamscope.load_harvest` and `iter_harvest` read it.
With ``format="parquet"`` the shards are Parquet tables instead,
``shard-00000.parquet`` ..., one row per harvested token
(`streamscope.scale.parquet`), and ``index.json`` says so. Beside them:

* ``run.json``, the run's manifest (checkpoint, engine, values, blocks,
  positions, shard size, the dataset's digest), written first. A restarted
  run with the same manifest resumes; any other run is refused.
* ``shard-NNNNN.json``, one per finished shard: its prompts, their positions
  and token counts, and which replica wrote it. A shard is finished when its
  record exists; the record is written after the shard's tensors.

Every file is written to a hidden temporary name (``.shard-00003.safetensors.<id>.tmp``)
and renamed, which is atomic on one file system: a replica killed mid-write
leaves a temporary file that the next run deletes, never a half shard.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Optional

from ..bulk.results import INDEX, Harvest
from ..bulk.safetensors_io import write_safetensors
from . import parquet

MANIFEST = "run.json"
#: The shard formats: the safetensors shards `load_harvest` reads, or Parquet tables of one row a token.
FORMATS = ("safetensors", "parquet")


def shard_file(number: int, format: str = "safetensors") -> str:
    return f"shard-{number:05d}.{format}"


def record_file(number: int) -> str:
    return f"shard-{number:05d}.json"


def _atomic_write(path: Path, write: Any) -> None:
    """Call ``write(temporary_path)``, then rename the file to `path` (one atomic step)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda temporary: temporary.write_text(text))


def write_shard(folder: Path, number: int, harvest: Harvest, record: dict[str, Any], format: str = "safetensors",
                token_ids: Optional[list[list[int]]] = None) -> None:
    """Write one finished shard: its tensors (or its Parquet table, which needs the prompts' `token_ids`), then
    its record (which marks it finished)."""
    name = shard_file(number, format)
    if format == "parquet":
        if token_ids is None:
            raise ValueError("a Parquet shard has a token column: pass the prompts' token_ids.")
        _atomic_write(folder / name, lambda temporary: parquet.write(temporary, harvest, token_ids))
    else:
        # Each tensor's bytes straight from the harvest's buffers (its views included): no copy of the shard.
        tensors = {f"{value}/{prompt}": tensor for value, per_prompt in harvest.values.items()
                   for prompt, tensor in zip(harvest.prompts, per_prompt)}
        write_safetensors(tensors, folder / name)
    record = {**record, "file": name, "prompts": list(harvest.prompts),
              "positions": harvest.positions, "layers": harvest.layers}
    write_text(folder / record_file(number), json.dumps(record))


class RunFolder:
    """The output folder of one resumable run, checked against the run's manifest before anything runs."""

    def __init__(self, folder: str | Path, manifest: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        self.format = manifest.get("format", "safetensors")

    def check(self) -> None:
        """Refuse a folder that holds another run (or a harvest not written by a resumable run); writes nothing."""
        path = self.folder / MANIFEST
        if path.exists():
            held = json.loads(path.read_text())
            differ = [key for key in sorted(set(held) | set(self.manifest)) if held.get(key) != self.manifest.get(key)]
            if differ:
                details = "; ".join(f"{key}: {held.get(key)!r} there, {self.manifest.get(key)!r} now" for key in differ)
                raise FileExistsError(f"{self.folder} holds another run's shards ({details}): choose another folder, "
                                      f"or run the same harvest again there to resume it.")
        elif self.folder.exists() and ((self.folder / INDEX).exists() or any(self.folder.glob("shard-*"))):
            raise FileExistsError(f"{self.folder} holds a harvest that is not a resumable run (no {MANIFEST}): "
                                  f"choose an empty folder.")

    def open(self) -> None:
        """Create the folder and its manifest, or check that the folder holds this run; clear stray temporaries."""
        self.check()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / MANIFEST
        if not path.exists():
            write_text(path, json.dumps(self.manifest, indent=1))
        for stray in self.folder.glob(".shard-*.tmp"):
            stray.unlink(missing_ok=True)  # a replica died writing it: the shard runs again

    def finished(self) -> dict[int, dict[str, Any]]:
        """The finished shards' records, by shard number."""
        records = {}
        for path in self.folder.glob("shard-*.json"):
            number = int(path.stem.split("-")[1])
            if (self.folder / shard_file(number, self.format)).exists():
                records[number] = json.loads(path.read_text())
        return records

    def close(self, shards: int, failures: Optional[list[dict[str, Any]]] = None) -> Path:
        """Write ``index.json`` once every shard is finished; the folder then reads as one harvest."""
        records = self.finished()
        missing = [number for number in range(shards) if number not in records]
        if missing:
            raise RuntimeError(f"{self.folder}: shards {missing[:10]} are not finished; run the harvest again to "
                               f"finish them.")
        positions: list[list[int]] = []
        for number in range(shards):
            positions.extend(records[number]["positions"])
        index = {"values": self.manifest["values"], "layers": records[0]["layers"] if shards else [],
                 "positions": positions, "prompts": len(positions),
                 "shards": [{"file": records[number]["file"], "prompts": records[number]["prompts"]}
                            for number in range(shards)],
                 "tokens": sum(records[number]["tokens"] for number in range(shards)),
                 "failures": failures or []}
        if self.format != "safetensors":
            index["format"] = self.format  # load_harvest reads safetensors shards; it says so of any other
        write_text(self.folder / INDEX, json.dumps(index))
        return self.folder
