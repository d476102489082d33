"""A dataset's harvest over a Ray cluster: N replicas of an engine, one shard at a time each, resumable.

The driver (the process that calls `harvest`) reads the prompts, checks the
run, cuts the prompts into shards of ``shard_size`` (by default as many as
hold 1 GiB of rows, at most 1,024: `streamscope.scale.planning`) and hands
them to Ray actors, one engine per actor (`Replica`): a vLLM engine with its
own tensor and pipeline parallel sizes, or a transformers model. Each replica harvests
its shard with the engine's own bulk path (`model.harvest`, so a shard holds
exactly what one process's harvest of the same prompts holds) and writes it
into the run folder itself (`streamscope.scale.shards`): on several nodes the
folder must be one every node sees (a shared file system).

The driver keeps one shard in flight per replica. A replica that dies (its
process killed, its node lost, its engine out of memory) is reported and
dropped; its shard goes back to the queue for the others, and finished shards
stay. An error inside a shard (a value the family does not serve, a position
past a prompt's end) would fail on any replica: the run stops once the shards
in flight are written, and says why. Either way nothing is half-written, and
running the same call again resumes: finished shards are skipped.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm.auto import tqdm
from transformers import AutoConfig

from ..bulk.positions import Positions
from ..bulk.sites import ROOT_VALUES, value_names
from ..bulk.spec import harvest_values, token_ids
from ..loading import load
from .dataset import fingerprint, read_prompts
from .planning import planned_shard_size
from .shards import FORMATS, MANIFEST, RunFolder, write_shard

ENGINES = ("vllm", "transformers")


class HarvestFailed(RuntimeError):
    """A distributed harvest stopped before every shard was written; finished shards are kept for a resume.

    Attributes:
        folder: The run's folder.
        finished: How many of the run's shards are written.
        shards: How many shards the run has.
        failures: One dict per failure: ``replica``, ``shard``, ``node``, ``error``.
    """

    def __init__(self, message: str, folder: Path, finished: int, shards: int, failures: list[dict[str, Any]]):
        super().__init__(message)
        self.folder, self.finished, self.shards, self.failures = folder, finished, shards, failures


@dataclass
class Progress:
    """Where a distributed harvest stands, handed to a ``progress=`` callable after every shard.

    Attributes:
        shards_done: Shards written (those a resumed run found finished included).
        shards: The run's shards.
        tokens: Prompt tokens harvested by this call.
        tokens_per_second: This call's harvested tokens over its seconds so far.
        eta_seconds: Seconds left at this call's rate of shards (None before the first).
        replicas: Replicas still serving.
        failures: The replicas' failures so far (see `HarvestFailed.failures`).
        record: The shard just written (its prompts, tokens, replica, node, seconds).
    """

    shards_done: int
    shards: int
    tokens: int
    tokens_per_second: float
    eta_seconds: Optional[float]
    replicas: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict)


class Replica:
    """One engine in a Ray actor: harvests a shard of prompts and writes it to the run folder.

    Made into a Ray actor class by `harvest` (``ray.remote(Replica)``), so
    `streamscope.scale` imports without Ray.
    """

    def __init__(self, checkpoint: str, engine: str, options: dict[str, Any], index: int) -> None:
        ranks = int(options.get("tensor_parallel_size", 1)) * int(options.get("pipeline_parallel_size", 1))
        if ranks == 1:
            # One rank: a vLLM engine runs in this actor's process rather than in two more of its own.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        self.index = index
        self.model = load(checkpoint, engine=engine, **options)

    def where(self) -> dict[str, Any]:
        """This replica's node id, host and process id."""
        import ray

        return {"replica": self.index, "node": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(), "pid": os.getpid()}

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Harvest one shard's prompts (global indices ``job["first"]``...) and write the shard."""
        start = time.perf_counter()
        ids = token_ids(self.model, job["prompts"])
        options = dict(job["harvest_options"])
        options.setdefault("shard_size", len(ids))  # vLLM: the whole shard in one engine run
        harvest = self.model.harvest(ids, job["values"], job["layers"], job["positions"], progress=False, **options)
        harvest.prompts = list(range(job["first"], job["first"] + len(ids)))
        record = {**self.where(), "tokens": sum(len(tokens) for tokens in ids),
                  "seconds": time.perf_counter() - start}
        write_shard(Path(job["folder"]), job["shard"], harvest, record, job["format"], ids)
        return {**record, "shard": job["shard"], "prompts": len(ids)}

    def close(self) -> None:
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


def _positions_key(positions: Any) -> Any:
    """The positions rule as JSON, for the manifest."""
    if isinstance(positions, slice):
        return {"slice": [positions.start, positions.stop, positions.step]}
    if isinstance(positions, (list, tuple, range)):
        return [_positions_key(item) for item in positions]
    return positions


def _nested(positions: Positions) -> bool:
    return (isinstance(positions, (list, tuple)) and len(positions) > 0
            and all(isinstance(item, (list, tuple, range)) for item in positions))


def _check_request(checkpoint: str, engine: str, values: Any, layers: Any, positions: Positions,
                   count: int, engine_options: dict[str, Any]) -> tuple[list[str], Any, Any]:
    """The values, blocks and parallel sizes checked against the checkpoint's config, before Ray starts; the
    checked values and blocks, and the config."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}.")
    values = harvest_values(values)
    for value in values:
        if value not in value_names():
            raise ValueError(f"unknown value {value!r} for a harvest: choose one of {', '.join(value_names())}.")

    config = AutoConfig.from_pretrained(checkpoint)
    config = getattr(config, "text_config", None) or config
    blocks = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = engine_options.get(name, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"engine_options {name}={size!r}: give a whole number, 1 or more.")
    stages = engine_options.get("pipeline_parallel_size", 1)
    if blocks is not None and stages > blocks:  # as streamscope.load refuses it, but before any replica starts
        raise ValueError(f"pipeline_parallel_size={stages} is more stages than the model's {blocks} blocks: every "
                         f"stage needs a block. Use at most {blocks} (vLLM splits the blocks as evenly as it can).")
    if isinstance(layers, int):
        layers = [layers]
    if layers is not None:
        layers = list(layers)
        if blocks is not None:
            for layer in layers:
                if not isinstance(layer, int) or not -blocks <= layer < blocks:
                    raise IndexError(f"layers: block {layer!r} is out of range: {checkpoint} has {blocks} blocks "
                                     f"(0-{blocks - 1}).")
            layers = [layer % blocks for layer in layers]
    elif all(value in ROOT_VALUES for value in values):
        layers = []
    if _nested(positions) and len(positions) != count:  # type: ignore[arg-type]
        raise ValueError(f"positions has {len(positions)} lists for {count} prompts: give one list per prompt, "  # type: ignore[arg-type]
                         f"or one rule for every prompt.")
    return values, layers, config


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("a distributed harvest runs on Ray: `pip install 'streamscope[ray]'` "
                          "(or `pip install 'ray[data]'`).") from None
    return ray


def _connect(ray: Any, address: Optional[str]) -> bool:
    """Join the Ray cluster at `address` (or the one this process already joined); True if this call started it."""
    if ray.is_initialized():
        return False
    _probe(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except ConnectionError as error:
        raise ConnectionError(f"no Ray cluster is reachable at {address!r} ({error}): start one with "
                              f"`ray start --head` and pass its address, or pass address=None for a local one.") from None
    return True


def _probe(address: Optional[str], timeout: float = 5.0) -> None:
    """Refuse a cluster address nothing answers at within `timeout` seconds (``ray.init`` would wait minutes)."""
    if address is None or address == "auto" or address.startswith("local"):
        return  # a new local cluster, or the one `ray start` left the address of (ray.init says at once if none)
    where = address.split("://", 1)[-1]
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address={address!r}: give HOST:PORT (the head's GCS, 6379 by default), "
                         f"ray://HOST:10001, or 'auto'.")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ConnectionError(f"no Ray cluster is reachable at {address!r} ({error}): start one with "
                              f"`ray start --head` there and pass its address, or pass address=None for a local "
                              f"one.") from None


def harvest(dataset: Any, checkpoint: str | Path, values: Any, layers: Any = None, positions: Positions = "last", *,
            out: str | Path, replicas: int = 1, engine: str = "vllm", engine_options: Optional[dict[str, Any]] = None,
            column: Optional[str] = None, split: Optional[str] = None, shard_size: Optional[int] = None,
            harvest_options: Optional[dict[str, Any]] = None, num_cpus: float = 1, num_gpus: Optional[float] = None,
            address: Optional[str] = None, progress: bool | Callable[[Progress], None] = True,
            format: str = "safetensors") -> Path:
    """Harvest values of a whole dataset on `replicas` engines over Ray, into a resumable folder of shards.

    Args:
        dataset: A list of prompts (strings or token-id lists) or of dicts, a
            ``.jsonl`` or ``.parquet`` file, a `datasets.Dataset` or its
            ``save_to_disk`` folder (`streamscope.scale.dataset.read_prompts`).
        checkpoint: The model folder; every replica (every node) must see it.
        values, layers, positions: As `model.harvest` takes them.
        out: The run's folder (shared by every node). Running the same call
            again on it resumes; a folder of another run is refused.
        replicas: How many engines harvest side by side.
        engine: ``"vllm"`` or ``"transformers"``.
        engine_options: `streamscope.load`'s keyword arguments for each replica
            (``tensor_parallel_size``, ``pipeline_parallel_size``, ``dtype``, ...).
        column, split: The dataset's text or token-id column, and split.
        shard_size: Prompts per shard (and per engine run on vLLM). Default None: as many of the largest
            prompt (the longest, for ``"all"``) as hold 1 GiB of rows in the engine's dtype, at most 1,024, as
            `model.harvest(out=)` bounds its shards (`streamscope.scale.planning`); the manifest records the
            number, and a resume with the default plans the same.
        harvest_options: More of `model.harvest`'s options (``batch_size`` on transformers).
        num_cpus, num_gpus: Ray resources each replica holds. ``num_gpus``
            defaults to the replica's ranks (tensor x pipeline parallel size)
            where the cluster has GPUs, else 0.
        address: The Ray cluster (``"auto"``, ``"ray://host:10001"``); None: the
            cluster this process joined, or a new local one.
        progress: A bar with tokens/s and the ETA; or a callable given a `Progress` after each shard.
        format: ``"safetensors"``: the shards `load_harvest` and `iter_harvest` read; ``"parquet"``: Parquet
            tables of one row a harvested token (prompt, position, token id, one fixed-size list column a
            value and block: `streamscope.scale.parquet`), the form SAE trainers stream.

    Returns:
        The folder, which `streamscope.load_harvest` and `iter_harvest` read.

    Raises:
        HarvestFailed: when the run stopped with shards unwritten (every
            replica died, or a shard raised); finished shards are kept.
    """
    checkpoint = str(Path(checkpoint).resolve()) if Path(checkpoint).exists() else str(checkpoint)
    engine_options = dict(engine_options or {})
    harvest_options = dict(harvest_options or {})
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r}: a harvest needs at least one replica.")
    if shard_size is not None and (not isinstance(shard_size, int) or shard_size < 1):
        raise ValueError(f"shard_size={shard_size!r}: a shard holds at least one prompt.")
    _check_format(format)
    prompts = read_prompts(dataset, column, split)
    if not prompts:
        raise ValueError("the dataset has no rows.")
    values, layers, config = _check_request(checkpoint, engine, values, layers, positions, len(prompts),
                                            engine_options)
    planned = shard_size is None
    if shard_size is None:  # planned here, before any replica holds a shard's rows
        shard_size = planned_shard_size(prompts, checkpoint, config, engine, engine_options, values, layers,
                                        positions, harvest_options)
    ray = _ray()
    shards = math.ceil(len(prompts) / shard_size)
    manifest = {"checkpoint": checkpoint, "engine": engine, "values": values, "layers": layers,
                "positions": _positions_key(positions), "shard_size": shard_size, "prompts": len(prompts),
                "dataset": fingerprint(prompts), "format": format}
    folder = RunFolder(out, manifest)
    _check_folder(folder, planned)  # another run's folder is refused before Ray starts
    started = _connect(ray, address) if _unfinished(folder, shards) else False
    failures: list[dict[str, Any]] = []
    try:
        folder.open()
        finished = folder.finished()
        pending = deque(number for number in range(shards) if number not in finished)
        if pending:
            _schedule(ray, folder, pending, prompts, shards, len(finished), values, layers, positions, checkpoint,
                      engine, engine_options, harvest_options, replicas, num_cpus, num_gpus, progress, failures)
    finally:
        if started:
            ray.shutdown()
    return folder.close(shards, failures)


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: choose one of {', '.join(FORMATS)}.")
    if format == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ImportError("format='parquet' writes with pyarrow: `pip install pyarrow`.") from None


def _check_folder(folder: RunFolder, planned: bool) -> None:
    """`RunFolder.check`; where the folder's run differs only in a shard size this call planned (a run begun with
    another number, or before the default was planned), the refusal names the number that resumes it."""
    try:
        folder.check()
    except FileExistsError as error:
        path = folder.folder / MANIFEST
        held = json.loads(path.read_text()) if planned and path.exists() else {}
        if held.get("shard_size") is None or {**held, "shard_size": 0} != {**folder.manifest, "shard_size": 0}:
            raise
        raise FileExistsError(f"{error} Without shard_size this run plans {folder.manifest['shard_size']} prompts a "
                              f"shard; pass shard_size={held['shard_size']} to resume the run there.") from None


def _unfinished(folder: RunFolder, shards: int) -> bool:
    """Whether the run has shards to harvest (a finished run run again needs no cluster)."""
    return not folder.folder.exists() or len(folder.finished()) < shards


def _schedule(ray: Any, folder: RunFolder, pending: deque, prompts: list[Any], shards: int, done: int,
              values: list[str], layers: Any, positions: Positions, checkpoint: str, engine: str,
              engine_options: dict[str, Any], harvest_options: dict[str, Any], replicas: int, num_cpus: float,
              num_gpus: Optional[float], progress: Any, failures: list[dict[str, Any]]) -> None:
    """Run the pending shards on the replicas until every one is written, or raise `HarvestFailed`."""
    shard_size = folder.manifest["shard_size"]
    live = _start_replicas(ray, checkpoint, engine, engine_options, replicas, num_cpus, num_gpus)

    def job(number: int) -> dict[str, Any]:
        first = number * shard_size
        chosen = positions[first:first + shard_size] if _nested(positions) else positions  # type: ignore[index]
        return {"shard": number, "first": first, "prompts": prompts[first:first + shard_size], "values": values,
                "layers": layers, "positions": chosen, "folder": str(folder.folder),
                "harvest_options": harvest_options, "format": folder.format}

    in_flight: dict[Any, tuple[int, int]] = {}

    def dispatch() -> None:
        busy = {index for index, _ in in_flight.values()}
        for index in live:
            if index not in busy and pending:
                number = pending.popleft()
                in_flight[live[index].run.remote(job(number))] = (index, number)

    bar = tqdm(total=shards, initial=done, desc="harvest", unit="shard", disable=progress is not True)
    begun, tokens, written = time.perf_counter(), 0, 0
    stop: Optional[str] = None
    try:
        dispatch()
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            index, number = in_flight.pop(ready[0])
            try:
                record = ray.get(ready[0])
            except ray.exceptions.RayActorError as error:
                # The replica's process is gone: its shard goes back to the queue for the others.
                failures.append({"replica": index, "shard": number, "error": _first_line(error)})
                live.pop(index, None)
                pending.appendleft(number)
                if not live:
                    stop = "every replica failed"
                    break
                dispatch()
                continue
            except ray.exceptions.RayTaskError as error:
                # The shard itself raised (bad input, an unserved value): any replica would. Stop once the
                # shards in flight are written.
                failures.append({"replica": index, "shard": number, "error": _first_line(error.cause or error)})
                stop = f"shard {number} raised {_first_line(error.cause or error)}"
                pending.clear()
                continue
            done, written, tokens = done + 1, written + 1, tokens + record["tokens"]
            elapsed = time.perf_counter() - begun
            rate = tokens / elapsed if elapsed > 0 else 0.0
            left = shards - done
            eta = elapsed / written * left if written else None  # wall seconds a shard, replicas side by side
            bar.update(1)
            bar.set_postfix_str(f"{rate:,.0f} tok/s, {len(live)} replicas" + (f", {len(failures)} failed" if failures else ""))
            if callable(progress):
                progress(Progress(done, shards, tokens, rate, eta, len(live), list(failures), record))
            if stop is None:
                dispatch()
    finally:
        bar.close()
        _release(ray, live)
    if stop is not None or pending:
        finished = len(folder.finished())
        lines = "\n".join(f"  replica {failure['replica']} on shard {failure['shard']}: {failure['error']}"
                          for failure in failures)
        raise HarvestFailed(f"the harvest stopped ({stop}); {finished} of {shards} shards are written in "
                            f"{folder.folder}. Failures:\n{lines}\nRun the same harvest again to resume it.",
                            folder.folder, finished, shards, failures)


def _start_replicas(ray: Any, checkpoint: str, engine: str, engine_options: dict[str, Any], replicas: int,
                    num_cpus: float, num_gpus: Optional[float]) -> dict[int, Any]:
    """`replicas` Ray actors, each a `Replica` holding one engine, by index; each takes the GPUs its engine's ranks
    need unless `num_gpus` says otherwise (none on a cluster without GPUs)."""
    ranks = int(engine_options.get("tensor_parallel_size", 1)) * int(engine_options.get("pipeline_parallel_size", 1))
    if num_gpus is None:
        num_gpus = ranks if ray.cluster_resources().get("GPU", 0) else 0
    actor = ray.remote(Replica)
    run = uuid.uuid4().hex[:8]
    return {index: actor.options(name=f"streamscope-harvest-{run}-{index}", num_cpus=num_cpus, num_gpus=num_gpus,
                                 max_restarts=0, max_task_retries=0).remote(checkpoint, engine, engine_options, index)
            for index in range(replicas)}


def _release(ray: Any, live: dict[int, Any]) -> None:
    """Close every replica's engine (GPU memory back), then end its actor."""
    closing = [handle.close.remote() for handle in live.values()]
    try:
        ray.get(closing, timeout=120)
    except Exception:  # noqa: BLE001  (a replica that cannot close is killed below all the same)
        pass
    for handle in live.values():
        ray.kill(handle)


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:500] if lines else type(error).__name__

