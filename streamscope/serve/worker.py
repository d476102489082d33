"""The server's side in vLLM's worker: each request's own steers and harvest, applied to its token rows every step.

The in-process bulk path (`streamscope.vllm.bulk`) runs one planned batch at
a time. A server's requests arrive and finish at any step, each with its own
plan, which vLLM hands the worker in the request's ``SamplingParams.extra_args``
(the body's ``vllm_xargs``, filled in by the server's front end after checking
it: `streamscope.serve.protocol`). `ServeState` keeps the live requests'
plans; at every step it reads the scheduler's token spans (as the bulk path
does), and for every module call that any live request needs it does one edit
per steer round and one read per harvested value over the whole flattened
batch, at the rows of the requests that asked. A request without a plan is
never touched: its rows are not among those edited or read, and a step with
no planned request runs no hook at all (hooks are installed while a request
needs them).

A harvest is complete once its prompt positions have run; its tensors are
written to the server's harvest folder as ``<id>.safetensors`` (atomically:
written aside, then renamed), which the front end serves and deletes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .. import nnsight_seam as seam
from ..bulk.apply import Span, rows_of
from ..bulk.spec import ROOT_VALUES, Site, Steer, layer_list, locate, prompt_positions
from ..values import INPUT
from .stages import Stage, sites_of, write_part

#: The environment variable that carries the server's settings (the harvest folder) to the engine's processes.
ENVIRONMENT = "STREAMSCOPE_SERVE"
logger = logging.getLogger("streamscope.serve")


@dataclass
class SteerEntry:
    site: Site
    delta: torch.Tensor
    mode: str
    chosen: Optional[frozenset]  # the prompt positions steered; None for every one
    generated: bool
    length: int
    order: int  # the steer's index among the request's steers at this module call


@dataclass(eq=False)
class Live:
    """One request's plan in the worker: its steers, and its harvest's sites, positions and buffer."""

    steers: list[SteerEntry]
    harvest_id: Optional[str] = None
    harvest_sites: list[Site] = field(default_factory=list)
    harvest_meta: dict[str, Any] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # position -> its slot in the buffer
    buffer: Optional[torch.Tensor] = None
    filled: Optional[torch.Tensor] = None  # which slots were read
    written: bool = False
    error: Optional[str] = None

    def keys(self) -> set[tuple[int, str]]:
        return {entry.site.key for entry in self.steers} | {site.key for site in self.harvest_sites}


class ServeState:
    """The live requests' plans on one worker, the hooks they need, and each step's rows."""

    def __init__(self, runner: Any, model_type: str, folder: Optional[str], writer: bool) -> None:
        from ..vllm.bulk import worker_tree

        self.runner = runner
        self.root = worker_tree(runner.get_model(), model_type)
        self.stage = Stage(self.root)  # under pipeline parallelism: the blocks this worker holds (serve/stages.py)
        self.folder = Path(folder) if folder else None
        self.writer = writer  # the rank that writes harvests (others compute the same rows)
        self.live: dict[str, Live] = {}
        self.sites: dict[tuple[str, Optional[int]], Site] = {}
        self.hooks: dict[tuple[int, str], Any] = {}
        self.locations: dict[str, tuple[int, str]] = {}
        self.work: dict[tuple[int, str], tuple[list, list]] = {}
        self.done: list[Live] = []
        self.last_shape: Optional[tuple] = None  # the requests' rows of the last step whose work can be reused
        model = runner.get_model()
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, runner.model_config.dtype
        execute_model = runner.execute_model

        def updated(scheduler_output: Any) -> None:
            try:
                self.observe(scheduler_output)
            except Exception:  # noqa: BLE001  (a bad plan must not stop the engine serving everyone else)
                logger.exception("streamscope serve: a step's plan failed; its requests run unsteered")
                self.work, self.last_shape = {}, None

        def executed(*args: Any, **kwargs: Any) -> Any:
            output = execute_model(*args, **kwargs)
            if self.done:
                self.flush()
            return output

        # On the instance: vLLM's worker calls these through the runner, whatever its class.
        seam.wrap_update_states(runner, updated)
        runner.execute_model = executed
        interleaver = getattr(getattr(runner, "nnsight_model", None), "interleaver", None)
        if getattr(interleaver, "taps", None):
            replay = interleaver.replay

            def replayed(location: str, live: Any) -> Any:
                key = self.locations.get(location)
                if key is not None:
                    self.apply(key, live)
                return replay(location, live)

            interleaver.replay = replayed

    # ---------------------------------------------------------------- requests

    def site(self, value: str, layer: Optional[int]) -> Site:
        key = (value, layer)
        if key not in self.sites:
            self.sites[key] = locate(self.root, value, layer)
        return self.sites[key]

    def admit(self, payload: str, length: int) -> Live:
        """A request's plan from its JSON (checked by the front end), with its positions for its real prompt."""
        from .protocol import positions_rule, vector_from_bytes

        plan = json.loads(payload)
        steers: list[SteerEntry] = []
        per_key: dict[tuple[int, str], int] = {}
        for item in plan.get("steer", ()):
            if not self.stage.holds(item["value"], item["layer"]):
                continue  # another pipeline stage's block: that stage applies it
            site = self.site(item["value"], item["layer"])
            rule = positions_rule(item["positions"], "positions")
            steer = Steer(item["value"], item["layer"], vector_from_bytes(item["vector"]), scale=item["scale"],
                          positions=rule, mode=item["mode"], generated=item["generated"])
            chosen = None if rule == "all" else frozenset(prompt_positions(rule, length, 0))
            order = per_key.get(site.key, 0)
            per_key[site.key] = order + 1
            steers.append(SteerEntry(site, steer.delta(self.dtype, self.device), steer.mode, chosen,
                                     steer.generated, length, order))
        live = Live(steers)
        harvest = plan.get("harvest")
        if harvest is not None:
            rule = positions_rule(harvest["positions"], "positions")
            layers = layer_list(self.root, harvest["layers"])
            live.harvest_id = harvest["id"]
            sites = sites_of(harvest["values"], layers)
            held = [index for index, (value, layer) in enumerate(sites) if self.stage.holds(value, layer)]
            live.harvest_sites = [self.site(*sites[index]) for index in held]
            live.positions = prompt_positions(rule, length, 0)
            live.slots = {position: slot for slot, position in enumerate(live.positions)}
            live.harvest_meta = {"values": harvest["values"], "layers": layers, "positions": live.positions}
            if self.stage.pipelined:
                live.harvest_meta["held"] = held
                live.written = not held  # a stage holding none of its sites has nothing to write
        return live

    def observe(self, scheduler_output: Any) -> None:
        """Take this step's new and finished requests, then work out every hook's rows."""
        from .protocol import XARG

        before, admitted = len(self.live), False
        for data in scheduler_output.scheduled_new_reqs:
            params = getattr(data, "sampling_params", None)
            payload = (getattr(params, "extra_args", None) or {}).get(XARG)
            if payload is None:
                continue
            try:
                self.live[data.req_id] = self.admit(payload, len(data.prompt_token_ids or ()))
                admitted = True
            except Exception as error:  # noqa: BLE001  (this request's harvest says why; the engine serves on)
                logger.exception("streamscope serve: request %s's plan was refused in the worker", data.req_id)
                self.fail(json.loads(payload).get("harvest", {}).get("id"), f"{type(error).__name__}: {error}")
        for request_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            live = self.live.pop(request_id, None)
            if live is not None and live.harvest_id is not None and not live.written:
                self.fail(live.harvest_id, "the request finished before its prompt ran (aborted?)")
        if len(self.live) != before or admitted:  # the hooks change only when the live requests do
            self.hook(set().union(*(live.keys() for live in self.live.values())) if self.live else set())
        if not self.live:
            self.work, self.last_shape = {}, None
            return
        self.work = self.plan_step(scheduler_output)

    def plan_step(self, scheduler_output: Any) -> dict[tuple[int, str], tuple[list, list]]:
        counts = scheduler_output.num_scheduled_tokens.get
        states = self.runner.requests
        spans: list[tuple[Live, Span]] = []
        start = 0
        for request_id in self.runner.input_batch.req_ids:
            count = counts(request_id)
            if count is None:
                continue
            live = self.live.get(request_id)
            if live is not None:
                spans.append((live, Span(request_id, start, count, states[request_id].num_computed_tokens)))
            start += count
        # A run of decode steps over the same requests, each steered at every row and none harvesting, edits the
        # same rows with the same vectors every step: the last step's work is this one's.
        shape = tuple((span.key, span.start, span.count) for _, span in spans)
        uniform = all(not live.harvest_sites or live.written for live, _ in spans) and \
            all(entry.chosen is None and entry.generated for live, _ in spans for entry in live.steers)
        if uniform and shape == self.last_shape:
            return self.work
        self.last_shape = shape if uniform else None
        # key -> (rounds of steer edits, harvest reads)
        steers: dict[tuple[int, str], dict[int, dict[tuple[int, str], tuple[Site, str, list, list]]]] = {}
        reads: dict[tuple[int, str], dict[int, tuple[Site, list, list]]] = {}
        for live, span in spans:
            for entry in live.steers:
                ranges = self._steer_ranges(entry, span)
                if ranges:
                    rounds = steers.setdefault(entry.site.key, {}).setdefault(entry.order, {})
                    group = rounds.setdefault((id(entry.site), entry.mode), (entry.site, entry.mode, [], []))
                    group[2].extend(ranges)
                    group[3].append((len(ranges), entry.delta, sum(stop - begin for begin, stop in ranges)))
            if live.harvest_sites and not live.written:
                last = span.first + span.count
                chosen = [position for position in live.positions if span.first <= position < last]
                if chosen:
                    ranges = [(span.start + position - span.first, span.start + position - span.first + 1)
                              for position in chosen]
                    for index, site in enumerate(live.harvest_sites):
                        read = reads.setdefault(site.key, {}).setdefault(id(site), (site, [], []))
                        read[1].extend(ranges)
                        read[2].append((live, index, [live.slots[position] for position in chosen]))
        work: dict[tuple[int, str], tuple[list, list]] = {}
        for key in set(steers) | set(reads):
            edits = []
            for order in sorted(steers.get(key, {})):
                for site, mode, ranges, deltas in steers[key][order].values():
                    edits.append((site, mode, rows_of(ranges, self.device), self._deltas(deltas)))
            harvests = [(site, rows_of(ranges, self.device), layout)
                        for site, ranges, layout in reads.get(key, {}).values()]
            work[key] = (edits, harvests)
        return work

    @staticmethod
    def _steer_ranges(entry: SteerEntry, span: Span) -> list[tuple[int, int]]:
        if entry.chosen is None and entry.generated:
            return [(span.start, span.start + span.count)]
        ranges = []
        for offset in range(span.count):
            position = span.first + offset
            steered = (entry.chosen is None or position in entry.chosen) if position < entry.length \
                else entry.generated
            if steered:
                ranges.append((span.start + offset, span.start + offset + 1))
        return ranges

    @staticmethod
    def _deltas(deltas: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
        """The vector each edited row gets, ``[rows, hidden]`` (one vector broadcasts where one request owns them)."""
        if len(deltas) == 1:
            return deltas[0][1]
        return torch.cat([delta.expand(rows, -1) for _, delta, rows in deltas])

    # ---------------------------------------------------------------- hooks

    def hook(self, keys: set[tuple[int, str]]) -> None:
        """Hooks on exactly the module calls the live requests need."""
        for key in [key for key in self.hooks if key not in keys]:
            self.hooks.pop(key).remove()
        for key in keys - set(self.hooks):
            site = self._site_at(key)
            self.locations[site.location] = key
            if key[1] == INPUT:
                def before(_module: Any, args: tuple, kwargs: dict, key: Any = key) -> None:
                    self.apply(key, (args, kwargs))
                self.hooks[key] = site.module.register_forward_pre_hook(before, with_kwargs=True)
            else:
                def after(_module: Any, args: tuple, output: Any, key: Any = key) -> None:
                    self.apply(key, output)
                self.hooks[key] = site.module.register_forward_hook(after)

    def _site_at(self, key: tuple[int, str]) -> Site:
        for live in self.live.values():
            for site in [entry.site for entry in live.steers] + live.harvest_sites:
                if site.key == key:
                    return site
        raise KeyError(key)

    def apply(self, key: tuple[int, str], raw: Any) -> None:
        work = self.work.get(key)
        if work is None:
            return
        edits, harvests = work
        try:
            for site, mode, rows, delta in edits:
                if rows is not None:
                    site.edit_rows(raw, rows, delta, mode)
            for site, rows, layout in harvests:
                if rows is None:
                    continue
                read = site.read_rows(raw, rows)
                start = 0
                for live, index, slots in layout:
                    self._store(live, index, slots, read[start:start + len(slots)])
                    start += len(slots)
        except Exception:  # noqa: BLE001  (logged; a hook must not take the engine down)
            logger.exception("streamscope serve: a hook failed; this step's plans were dropped")
            self.work, self.last_shape = {}, None

    def _store(self, live: Live, index: int, slots: list[int], rows: torch.Tensor) -> None:
        if live.buffer is None:
            shape = (len(live.harvest_sites), len(live.positions), rows.shape[-1])
            pinned = rows.device.type != "cpu"
            live.buffer = torch.empty(shape, dtype=rows.dtype, pin_memory=pinned)
            live.filled = torch.zeros(shape[:2], dtype=torch.bool)
        first, count = slots[0], len(slots)
        if slots == list(range(first, first + count)):
            live.buffer[index, first:first + count].copy_(rows, non_blocking=True)
            live.filled[index, first:first + count] = True
        else:
            live.buffer[index, slots] = rows.to("cpu")
            live.filled[index, slots] = True
        if bool(live.filled.all()) and not any(item is live for item in self.done):
            self.done.append(live)

    # ---------------------------------------------------------------- harvests to disk

    def flush(self) -> None:
        """Write every completed harvest to the server's folder (once its copies to host memory have landed)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        done, self.done = self.done, []
        for live in done:
            live.written = True
            if not self.writer or self.folder is None or live.buffer is None:
                continue
            if self.stage.pipelined:  # this stage's sites only: the front end puts the stages' parts together
                if _valid_id(live.harvest_id):
                    write_part(self.folder, str(live.harvest_id), self.stage.rank, live.buffer, live.harvest_meta)
                live.buffer = None
                continue
            tensors: dict[str, torch.Tensor] = {}
            index = 0
            layers = len(live.harvest_meta["layers"])
            for value in live.harvest_meta["values"]:
                if value in ROOT_VALUES:
                    tensors[value] = live.buffer[index].clone()
                    index += 1
                else:
                    tensors[value] = live.buffer[index:index + layers].clone()
                    index += layers
            metadata = {key: json.dumps(item) for key, item in live.harvest_meta.items()}
            self._write(live.harvest_id, tensors, metadata)
            live.buffer = None

    def _write(self, harvest_id: Optional[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        from safetensors.torch import save_file

        if self.folder is None or not _valid_id(harvest_id):
            return
        final = self.folder / f"{harvest_id}.safetensors"
        aside = self.folder / f".{harvest_id}.writing"
        save_file(tensors, str(aside), metadata=metadata)
        os.replace(aside, final)

    def fail(self, harvest_id: Optional[str], message: str) -> None:
        """Leave the reason a harvest will not come, for the front end to answer its download with."""
        if not self.writer or self.folder is None or not _valid_id(harvest_id):
            return
        aside = self.folder / f".{harvest_id}.failing"
        aside.write_text(message)
        os.replace(aside, self.folder / f"{harvest_id}.error")


def _valid_id(harvest_id: Any) -> bool:
    """Whether `harvest_id` is one the front end makes (32 hex digits): nothing else names a file here."""
    return isinstance(harvest_id, str) and len(harvest_id) == 32 and all(c in "0123456789abcdef" for c in harvest_id)


def install(worker: Any) -> None:
    """Put a `ServeState` on this worker's runner (once), when the engine runs under ``streamscope serve``."""
    settings = os.environ.get(ENVIRONMENT)
    runner = worker.model_runner
    if not settings or "_streamscope_serve" in runner.__dict__:
        return
    options = json.loads(settings)
    writer = True
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        # The first tensor-parallel rank of each pipeline stage: with one stage it writes the harvest, with
        # several its stage's part (serve/stages.py).
        writer = get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001  (no parallel groups: one rank)
        pass
    runner.__dict__["_streamscope_serve"] = ServeState(runner, runner.model_config.hf_config.model_type,
                                                       options.get("harvests"), writer)


class ServeRPC:
    """Installs the server's per-request plans on the worker once its model is loaded."""

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)  # type: ignore[misc]
        install(self)
        return result


def _gpu_worker() -> type:
    from ..vllm.bulk_worker import GPUWorker

    return type("ServeGPUWorker", (ServeRPC, GPUWorker), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    # The worker classes vLLM imports by path in its worker process; built on first use, so that importing this
    # module does not import a platform's worker that the other platform lacks.
    if name == "ServeGPUWorker":
        klass = _gpu_worker()
    elif name == "ServeCPUWorker":
        from ..vllm.worker import NNsightCPUWorker

        klass = type("ServeCPUWorker", (ServeRPC, NNsightCPUWorker), {"__module__": __name__})
    else:
        raise AttributeError(name)
    globals()[name] = klass
    return klass


def worker_cls(on_cpu: bool) -> str:
    """The worker class vLLM starts for ``streamscope serve``, as the import path it takes."""
    return f"{__name__}.{'ServeCPUWorker' if on_cpu else 'ServeGPUWorker'}"
