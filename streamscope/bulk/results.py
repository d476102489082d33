"""What a bulk run hands back: a `Harvest` per prompt in memory, safetensors shards on disk, a `Generation`.

A harvest's layout, the same on both engines and on disk:

* ``harvest["layer_output"]`` is a list with one tensor per prompt,
  ``[len(layers), positions, hidden_size]``: the blocks in ``harvest.layers``
  order, the prompt's chosen positions in ``harvest.positions[i]`` order;
* a root value (``token_embeddings``, ``final_norm_output``) is one tensor per
  prompt, ``[positions, hidden_size]``;
* ``harvest["self_attn.head_results"]`` holds each head's result a position,
  ``[len(layers), positions, heads, hidden_size]``.

On disk (``out=folder``) the prompts are written in shards as they finish (by a
writer thread, while the engine runs the next chunk: `ShardWriter`),
``shard-00000.safetensors`` ..., each tensor named ``"<value>/<prompt>"``,
with ``index.json`` listing the values, blocks, positions and which prompts
each shard holds. `load_harvest` reads a folder back into a `Harvest` (all
of it, or chosen prompts); `iter_harvest` yields one `Harvest` per shard, for
runs larger than memory.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from safetensors.torch import load_file

from ..display import shape, table
from .safetensors_io import write_safetensors
from .sites import ROOT_VALUES
from .spec import HarvestSpec

INDEX = "index.json"


@dataclass
class Harvest:
    """Harvested values per prompt: ``harvest[value][prompt]`` is ``[len(layers), positions, hidden]``.

    Attributes:
        values: value name -> one tensor per prompt (root values: ``[positions, hidden]``).
        layers: The blocks, in the order of the tensors' first dimension.
        positions: Each prompt's positions, in the order of the tensors' positions dimension.
        prompts: The global index of each prompt held here (a shard holds some of a run's prompts).
        reduce: None, or how each prompt's positions were reduced where they were read (``"last"``,
            ``"mean"``: `streamscope.bulk.moments.reduce_positions`): then the positions dimension holds one
            row, the reduction of the positions in `positions`.
    """

    values: dict[str, list[torch.Tensor]]
    layers: list[int]
    positions: list[list[int]]
    prompts: list[int] = field(default_factory=list)
    reduce: Optional[str] = None

    def __getitem__(self, value: str) -> list[torch.Tensor]:
        if value not in self.values:
            raise KeyError(f"{value!r} was not harvested: this harvest holds {', '.join(self.values)}.")
        return self.values[value]

    def __contains__(self, value: object) -> bool:
        return value in self.values

    def __len__(self) -> int:
        return len(self.positions)

    def keys(self) -> list[str]:
        return list(self.values)

    def __repr__(self) -> str:
        first = {value: shape(tensors[0]) if tensors else "[]" for value, tensors in self.values.items()}
        held = ", ".join(f"{value} {size}" for value, size in first.items())
        reduced = f", positions reduced by {self.reduce}" if self.reduce else ""
        return f"Harvest({len(self)} prompts, blocks {self.layers}{reduced}; prompt 0: {held})"

    def _repr_html_(self) -> str:
        rows = [[value, len(tensors), shape(tensors[0]) if tensors else "-"] for value, tensors in self.values.items()]
        return table(f"harvest of {len(self)} prompts at blocks {self.layers}", ["value", "prompts", "prompt 0's shape"],
                     rows)

    def stacked(self, value: str) -> torch.Tensor:
        """One tensor ``[prompts, layers, positions, hidden]`` (root: ``[prompts, positions, hidden]``).

        Only where every prompt has the same number of positions (``"last"``, or equal lengths).
        """
        tensors = self[value]
        counts = {tensor.shape[-2] for tensor in tensors}
        if len(counts) > 1:
            raise ValueError(f"{value}: the prompts have {sorted(counts)} positions each, so they cannot be "
                             f"stacked; index harvest[{value!r}][i] per prompt instead.")
        return torch.stack(tensors)


def assemble(spec: HarvestSpec, per_prompt: Sequence[Optional[torch.Tensor]], prompts: Sequence[int]) -> Harvest:
    """A `Harvest` from each prompt's ``[sites, positions, hidden]`` (sites in `HarvestSpec.sites` order), as views."""
    values: dict[str, list[torch.Tensor]] = {value: [] for value in spec.values}
    for prompt, buffer in zip(prompts, per_prompt):
        if buffer is None:
            raise RuntimeError(f"prompt {prompt} was not harvested: the engine ran none of its prompt tokens "
                               f"through the hooked modules (a prefix cache hit?).")
        index = 0
        for value in spec.values:
            if value in ROOT_VALUES:
                values[value].append(buffer[index])
                index += 1
            else:
                count = len(spec.layers)
                rows = buffer[index:index + count]
                shape = spec.shapes.get(value)  # a row stored flattened (head_results' [heads, hidden])
                values[value].append(rows if shape is None else rows.unflatten(-1, shape))
                index += count
    return Harvest(values, list(spec.layers), [spec.positions[prompt] for prompt in prompts], list(prompts),
                   spec.reduce)


#: A harvest without ``shard_size``: a shard (on vLLM, one engine run) holds at most this many bytes of rows...
SHARD_BYTES = 1 << 30
#: ... and at most this many prompts.
SHARD_PROMPTS = 1024


def check_shard_size(shard_size: Optional[int]) -> None:
    if shard_size is not None and (not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1):
        raise ValueError(f"shard_size={shard_size!r}: a shard holds at least one prompt (an int); leave it out for "
                         f"shards of at most {SHARD_BYTES >> 20} MiB of rows.")


def shard_fits(prompts: int, size: int, shard_size: Optional[int]) -> bool:
    """Whether one shard may hold `prompts` prompts of `size` bytes of rows: `shard_size` prompts where given, else
    `SHARD_PROMPTS` prompts and `SHARD_BYTES` bytes."""
    if shard_size is not None:
        return prompts <= shard_size
    return prompts <= SHARD_PROMPTS and size <= SHARD_BYTES


class ShardCutter:
    """A harvest's prompts cut into consecutive shards before their rows exist (vLLM runs the engine a shard at a
    time): `shard_size` prompts each where given, else as many as hold at most `SHARD_BYTES` of rows (one prompt
    at least, `SHARD_PROMPTS` at most).

    A row's bytes start as `row_bytes`, an estimate from the hidden size, and `measure` reads them off each
    part the run assembles: a value whose rows are wider (MLP neurons, an SAE's features) can make only the
    first shard larger than the limit.
    """

    def __init__(self, spec: HarvestSpec, count: int, shard_size: Optional[int], row_bytes: int) -> None:
        check_shard_size(shard_size)
        self.spec, self.count, self.shard_size, self.row_bytes = spec, count, shard_size, max(1, row_bytes)

    def rows(self, prompt: int) -> int:
        """The rows a prompt's harvest holds: one a position, or one where the positions are reduced."""
        return 1 if self.spec.reduce else len(self.spec.positions[prompt])

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        while start < self.count:
            end, size = start, 0
            while end < self.count:
                grown = size + self.rows(end) * self.row_bytes
                if end > start and not shard_fits(end + 1 - start, grown, self.shard_size):
                    break
                size, end = grown, end + 1
            yield list(range(start, end))
            start = end

    def measure(self, part: Harvest) -> None:
        rows = sum(self.rows(prompt) for prompt in part.prompts)
        size = sum(tensor.nbytes for tensors in part.values.values() for tensor in tensors)
        if rows and size:
            self.row_bytes = -(-size // rows)


def estimated_row_bytes(spec: HarvestSpec, hidden_size: int, dtype: torch.dtype) -> int:
    """A harvested row's bytes over every site, taking each value as `hidden_size` wide (`spec.shapes` where it
    gives the row's shape)."""
    width = 0
    for value in spec.values:
        sites = 1 if value in ROOT_VALUES else len(spec.layers)
        shape = spec.shapes.get(value)
        width += sites * (hidden_size if shape is None else int(torch.Size(shape).numel()))
    return width * dtype.itemsize


class ShardWriter:
    """Writes a run's prompts to ``out`` in safetensors shards as they finish, then the index.

    `write` hands a part to one writer thread and returns, so the engine runs the next chunk while the disk writes
    this one. At most `held` parts are held by the writer (the one being written and those waiting); `write` blocks
    while that many are held, so memory stays bounded however fast the engine is. `close` waits for every shard,
    raises a writer error in the caller (naming the shard), and only then writes ``index.json``; `abort` (a failed
    run) stops the thread and writes no index, so a half harvest never looks complete.

    A part's tensors are written from their own memory (no copy): the caller must not write to them after `write`.
    """

    def __init__(self, out: str | Path, spec: HarvestSpec, prompts: int, held: int = 2) -> None:
        if held < 1:
            raise ValueError(f"held={held}: the writer needs room for at least one part.")
        self.folder = Path(out)
        self.folder.mkdir(parents=True, exist_ok=True)
        if (self.folder / INDEX).exists() or any(self.folder.glob("shard-*.safetensors")):
            raise FileExistsError(f"{self.folder} already holds a harvest: choose an empty folder.")
        self.spec = spec
        self.count = prompts
        self.shards: list[dict[str, Any]] = []
        self.closed = False
        self._slots = threading.BoundedSemaphore(held)
        self._parts: queue.Queue[Optional[tuple[str, dict[str, torch.Tensor]]]] = queue.Queue()
        self._stop = threading.Event()
        self._error: Optional[tuple[str, BaseException]] = None
        self._thread = threading.Thread(target=self._drain, name="streamscope-shard-writer", daemon=True)
        self._thread.start()

    def write(self, harvest: Harvest) -> None:
        """Queue `harvest`'s prompts as the next shard (blocking while `held` parts wait); raises a writer error."""
        if self.closed:
            raise RuntimeError(f"the writer of {self.folder} is closed: start a new harvest to write more.")
        self._raise()
        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors = {f"{value}/{prompt}": tensor for value, per_prompt in harvest.values.items()
                   for prompt, tensor in zip(harvest.prompts, per_prompt)}
        self._slots.acquire()
        self._raise(release=True)
        self.shards.append({"file": name, "prompts": list(harvest.prompts)})
        self._parts.put((name, tensors))

    def close(self) -> Path:
        """Wait for every shard, then write the index; the folder. Raises (and writes no index) if a shard failed."""
        if self.closed:
            return self.folder
        self.closed = True
        self._parts.put(None)
        self._thread.join()
        self._raise()
        index = {"values": self.spec.values, "layers": self.spec.layers, "positions": self.spec.positions,
                 "prompts": self.count, "shards": self.shards, "reduce": self.spec.reduce}
        partial = self.folder / (INDEX + ".partial")
        partial.write_text(json.dumps(index))
        os.replace(partial, self.folder / INDEX)  # the index appears whole or not at all
        return self.folder

    def abort(self) -> None:
        """Stop after the shard being written, drop the waiting ones, write no index (a failed run); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._parts.put(None)
        self._thread.join()

    def _raise(self, release: bool = False) -> None:
        if self._error is not None:
            if release:
                self._slots.release()
            name, error = self._error
            raise RuntimeError(f"writing {self.folder / name} failed ({type(error).__name__}: {error}); the harvest "
                               f"has no index and is incomplete: fix the cause and write it to an empty folder."
                               ) from error

    def _drain(self) -> None:
        while True:
            item = self._parts.get()
            if item is None:
                return
            name, tensors = item
            try:
                if self._error is None and not self._stop.is_set():
                    write_safetensors(tensors, self.folder / name)
            except BaseException as error:  # handed to the caller's thread, raised there
                self._error = (name, error)
            finally:
                del item, tensors  # the part's memory goes before the slot is given back
                self._slots.release()


def _index(folder: Path) -> dict[str, Any]:
    path = folder / INDEX
    if not path.exists():
        raise FileNotFoundError(f"{folder} holds no harvest index ({INDEX}): was the run finished?")
    index = json.loads(path.read_text())
    if index.get("format", "safetensors") != "safetensors":
        raise ValueError(f"{folder} holds {index['format'].capitalize()} shards: read them with pyarrow "
                         f"(pyarrow.parquet.read_table on each file of its {INDEX}) or datasets "
                         f"(load_dataset('parquet', data_files=[...])); load_harvest reads safetensors shards.")
    return index


def iter_harvest(folder: str | Path) -> Iterator[Harvest]:
    """Each shard of a harvest folder as a `Harvest` of its prompts, one at a time."""
    folder = Path(folder)
    index = _index(folder)
    for shard in index["shards"]:
        tensors = load_file(str(folder / shard["file"]))
        prompts = shard["prompts"]
        values = {value: [tensors[f"{value}/{prompt}"] for prompt in prompts] for value in index["values"]}
        yield Harvest(values, index["layers"], [index["positions"][prompt] for prompt in prompts], prompts,
                      index.get("reduce"))


def load_harvest(folder: str | Path, prompts: Optional[Sequence[int]] = None) -> Harvest:
    """A harvest folder (or the chosen prompts of it) as one in-memory `Harvest`, prompts in run order."""
    index = _index(Path(folder))
    wanted = set(range(index["prompts"]) if prompts is None else prompts)
    values: dict[str, dict[int, torch.Tensor]] = {value: {} for value in index["values"]}
    for shard in iter_harvest(folder):
        for value, per_prompt in shard.values.items():
            for prompt, tensor in zip(shard.prompts, per_prompt):
                if prompt in wanted:
                    values[value][prompt] = tensor
    order = sorted(wanted)
    missing = [prompt for prompt in order if prompt not in values[index["values"][0]]]
    if missing:
        raise KeyError(f"prompts {missing[:10]} are not in {folder}.")
    return Harvest({value: [held[prompt] for prompt in order] for value, held in values.items()},
                   index["layers"], [index["positions"][prompt] for prompt in order], order, index.get("reduce"))


@dataclass
class Generation:
    """A bulk generation's results, one entry per prompt.

    Attributes:
        tokens: The generated token ids.
        texts: The generated texts (on vLLM its own detokenizer's, which leaves out a last character whose
            bytes the tokens end before completing; transformers' decode shows it as U+FFFD).
        logits: Per prompt, ``[steps, vocab_size]`` float32: the logits each
            generated token was sampled from (with ``return_logits=True``), else None.
        harvest: The prompts' harvest (a `Harvest`, or the folder it was written
            to with ``out=``), else None.
    """

    tokens: list[list[int]]
    texts: list[str]
    logits: Optional[list[torch.Tensor]] = None
    harvest: Any = None

    def __len__(self) -> int:
        return len(self.texts)

    def __repr__(self) -> str:
        counts = sorted({len(tokens) for tokens in self.tokens})
        span = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}" if counts else "0"
        extras = [name for name, held in (("logits", self.logits), ("harvest", self.harvest)) if held is not None]
        first = self.texts[0] if self.texts else ""
        return (f"Generation({len(self)} prompts, {span} tokens each{', with ' + ' and '.join(extras) if extras else ''}; "
                f"text 0: {first[:40] + ('…' if len(first) > 40 else '')!r})")

    def _repr_html_(self) -> str:
        rows = [[index, len(tokens), text] for index, (tokens, text) in enumerate(zip(self.tokens, self.texts))]
        return table(f"generation of {len(self)} prompts", ["prompt", "tokens", "text"], rows)
