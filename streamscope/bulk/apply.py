"""Apply a bulk run's steers and harvests with one hook per module call, for every request of a step at once.

Both engines flatten a step's tokens to rows: vLLM's ``[tokens, hidden]``
batch as it is, transformers' ``[batch, seq, hidden]`` read row-major. The
`Applier` is the server's applier too (`streamscope.bulk.requests.RequestApplier`):
a run enters all its requests at once, each with its share of the run's
steers, then the engine hands it each step's `Span`s (which request owns
which rows, and the position of its first row); it works out once per step
which rows every steer edits and every harvest reads, and each module's hook
then makes one edit and one read over the whole batch. What is the bulk
path's own is where harvested rows go: each request's buffer, taken with `take`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch

from .conditions import Gate
from .operations import Operation
from .requests import Live, RequestApplier, Span, SteerEntry, rows_of
from .spec import Site, Steer, locate, steer_positions

__all__ = ["Applier", "Span", "SteerPlan", "rows_of", "steer_plans"]


@dataclass
class SteerPlan:
    """A checked steer: its site, its operation ready on the engine, and which prompts' positions it touches."""

    steer: Steer
    site: Site
    operation: Operation
    positions: dict[Hashable, frozenset[int]]  # each steered request's prompt positions (shared: `steer_plans`)
    lengths: dict[Hashable, int]               # each steered request's prompt length (shared too)
    #: A conditional steer's condition site (`streamscope.bulk.conditions`); its `operation` is then a `Gate`.
    condition_site: Optional[Site] = None
    slots: Optional[dict[Hashable, int]] = None  # a conditional steer's requests, each one's slot in its gate


#: Up to this many harvested rows a request in a step, the step's rows go to the host in one copy per site.
STAGED_ROWS = 4


class Applier(RequestApplier):
    """Hooks that steer and harvest a bulk run's requests, installed on the engine's modules for the run.

    Args:
        harvest_sites: The sites to read, in the result's order.
        harvest_positions: Each owned request's prompt positions to read, by key.
        steers: The checked steers, applied in order at their sites before any
            harvest at the same site reads (a harvest sees the steered value).
        device: Where the step's row indices live (the engine's device).
        to_host: Whether harvested rows move to host memory as they are read.
        readout: What each harvested row becomes before it is stored, where
            the hooks run (an SAE's features); None to store the value.
        graph: The engine's graph-op backend
            (`streamscope.vllm.graph_backend.GraphBackend`), or None: the steers
            and harvests the ops serve run there, the rest on the hooks, and
            `take` gives each request its rows from either.
    """

    def __init__(self, harvest_sites: Sequence[Site], harvest_positions: dict[Hashable, list[int]],
                 steers: Sequence[SteerPlan], device: Any, to_host: bool = True, readout: Any = None,
                 graph: Any = None) -> None:
        super().__init__(device, keep_error=True, strict=True, hooked=False, graph=graph)
        self.harvest_sites = list(harvest_sites)
        self.harvest_positions = harvest_positions
        self.steers = list(steers)
        self.to_host = to_host
        self.readout = readout
        #: key -> [sites, positions, hidden], filled as the prompts run.
        self.harvested: dict[Hashable, torch.Tensor] = {}
        self._pending: list[tuple[int, torch.Tensor, list[tuple[Live, int, list[int]]]]] = []  # (site, rows, layout)
        #: On CUDA, the stream the rows' copies to the host run on, made at the first such copy (None until then),
        #: and the event recorded on it after the latest copy, which `settle` waits for while `_copying`.
        self.side: Optional[torch.cuda.Stream] = None
        self.copied: Optional[torch.cuda.Event] = None
        self._copying = False
        try:
            for key, live in run_requests(self.harvest_sites, harvest_positions, self.steers, readout).items():
                self.enter(key, live)
        except BaseException:
            self.close()  # the requests entered so far leave the engine's graph plan as they found it
            raise

    @property
    def handles(self) -> list[Any]:
        """The hooks' handles (one per module call the run needs)."""
        return [handle for handle, _ in self.hooks.values()]

    def install(self) -> "Applier":
        """Register one hook per (module, input or output) that any site of the run needs."""
        super().install()
        return self

    def store(self, rows: torch.Tensor, layout: list[tuple[Live, int, list[int]]]) -> None:
        """Keep a read's rows (``[rows, width]``, each layout entry's ``len(slots)`` in turn) in their requests'
        buffers: copied there now, or staged for `settle` where a request has few rows in the step.

        On CUDA the copies to host memory run on the applier's side stream
        (`side`), off the compute stream's critical path: an in-stream copy
        to the host holds up every kernel queued after it. The side stream
        first waits for the compute stream's work so far (the read that made
        `rows`), and `settle` waits for its copies before the host reads a
        buffer. On the CPU, or where rows stay on the device (``to_host``
        False), the copies are made as before, on the current stream.

        `rows` is never the engine's own memory: every read that reaches here
        is a new tensor, or a slice of one (`Site.read_rows` clones a slice of
        the batch and gathers scattered rows; a fused stream's rows are summed,
        cloned or gathered; head results and a readout's features are
        computed; `RequestApplier.read` splits one such tensor among
        readouts). So the next step's in-place writes to the engine's buffers
        (a CUDA graph's static ones too) cannot race with a copy still pending
        on the side stream, and no private copy is made here. What remains is
        `rows`' own memory: once the hook drops it, the caching allocator
        would hand its block to the compute stream's next kernels while the
        copy may still be reading it; ``record_stream`` keeps the block out of
        use until the side stream's work queued so far is done.
        """
        side = self._side_stream(rows)
        if side is None:
            self._copy_out(rows, layout)
            return
        side.wait_stream(torch.cuda.current_stream(rows.device))  # the rows are complete before they are copied
        with torch.cuda.stream(side):
            self._copy_out(rows, layout)
        # record_stream rather than references kept until an event says done: the block goes back to the pool as
        # soon as the copy ends (the allocator checks at its next allocation), with no list to poll here, where
        # references kept to `settle` would hold a whole run's rows on the device.
        rows.record_stream(side)
        assert self.copied is not None
        self.copied.record(side)
        self._copying = True

    def _copy_out(self, rows: torch.Tensor, layout: list[tuple[Live, int, list[int]]]) -> None:
        index = layout[0][1]
        if sum(len(slots) for _, _, slots in layout) <= STAGED_ROWS * len(layout):
            # Few rows a request (last-position reads, SAE features): the step's rows in one copy (into pinned host
            # memory on a GPU, queued without a sync); `settle` hands each request its rows once the copies are done.
            staged = self._empty(tuple(rows.shape), rows)
            staged.copy_(rows, non_blocking=True)
            self._pending.append((index, staged, layout))
            return
        # Many rows a request: each request's rows straight into its own buffer; no copy is made later.
        self._split(index, rows, layout, non_blocking=True)

    def _side_stream(self, rows: torch.Tensor) -> Optional[torch.cuda.Stream]:
        """The stream `rows`' copies to the host run on: the applier's side stream on CUDA (made here the first
        time; an applier's rows are on the engine's one device), None where the copies stay on the current stream
        (rows on the CPU, or kept on the device)."""
        if not self.to_host or not rows.is_cuda:
            return None
        if self.side is None:
            self.side = torch.cuda.Stream(rows.device)
            self.copied = torch.cuda.Event()
        return self.side

    def wait_copies(self) -> None:
        """Wait until the rows' copies queued on the side stream are in host memory (its latest event; the
        compute stream, and the engine's next step queued on it, go on)."""
        if self._copying:
            assert self.copied is not None
            self.copied.synchronize()
            self._copying = False

    def _split(self, index: int, rows: torch.Tensor, layout: list[tuple[Live, int, list[int]]],
               non_blocking: bool) -> None:
        start = 0
        for live, _, slots in layout:
            key, count, offset = live.owner, len(slots), slots[0]
            buffer = self.harvested.get(key)
            if buffer is None:
                buffer = self.harvested[key] = self._buffer(len(live.positions), rows)
            buffer[index, offset:offset + count].copy_(rows[start:start + count], non_blocking=non_blocking)
            start += count

    def settle(self) -> None:
        """Hand the staged rows to each request's buffer, and the rows the graph ops harvested to theirs; after it,
        every buffer in `harvested` is complete in host memory (the side stream's copies waited for first)."""
        if self.graph is not None:
            self.graph.settle()
            for key in self.graph.harvesting:
                rows = self.graph.take(key)
                if rows is not None:
                    self.harvested[key] = rows
        self.wait_copies()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for index, staged, layout in pending:
            self._split(index, staged, layout, non_blocking=False)

    def _empty(self, shape: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
        if not self.to_host or rows.device.type == "cpu":
            return torch.empty(shape, dtype=rows.dtype, device=rows.device)
        return torch.empty(shape, dtype=rows.dtype, pin_memory=True)

    def _buffer(self, positions: int, rows: torch.Tensor) -> torch.Tensor:
        shape = (len(self.harvest_sites), positions, rows.shape[-1])
        if rows.device.type == "cpu" and rows.is_pinned():  # staged rows: the buffer is read on the host only
            return torch.empty(shape, dtype=rows.dtype)
        return self._empty(shape, rows)

    def take(self, key: Hashable) -> Optional[torch.Tensor]:
        """One request's harvest, ``[sites, positions, hidden]`` in site order (None if none ran), forgotten here."""
        self.settle()
        return self.harvested.pop(key, None)


def run_requests(harvest_sites: list[Site], harvest_positions: dict[Hashable, list[int]],
                 plans: Sequence[SteerPlan], readout: Any) -> dict[Hashable, Live]:
    """Each request of a bulk run as the applier's `Live`: its share of each steer (in the run's order, each steer
    one round at its module call, so that it stays one edit over all its requests' rows) and its harvest.

    Requests that every steer treats alike (its positions in each, and the prompt's length where an entry's rows
    depend on it) share one list of entries, made once from one of them: the work is the steers times the kinds of
    request, not times the requests (256 requests with an ablation at every block: one list of 32 entries)."""
    requests: dict[Hashable, Live] = {}
    for key, positions in harvest_positions.items():
        requests[key] = Live([], harvest_sites=harvest_sites, positions=list(positions),
                             slots={position: slot for slot, position in enumerate(positions)}, readout=readout)
    entries = _Entries(plans)
    classes = entries.classes()
    lists: dict[tuple[int, ...], list[SteerEntry]] = {}
    list_of: dict[Hashable, list[SteerEntry]] = {}
    for keys in classes.values():
        made = entries.list_for(keys[0])
        made = lists.setdefault(tuple(map(id, made)), made)  # (classes told apart by identity may hold equal lists)
        list_of.update(dict.fromkeys(keys, made))
    for key in entries.order:  # the run's order of requests, as each steer lists them
        live = requests.get(key)
        if live is None:
            live = requests[key] = Live([])
        live.steers = list_of[key]  # nothing changes a request's list once made
    return requests


class _Entries:
    """A bulk run's steer entries, made once for each kind of request (`run_requests`).

    An entry serves the requests of one length and positions, or of every length where it edits every row or every
    row but the first, where no row it edits depends on the length; a conditional steer's entry is its request's
    own (each holds its request's slot in the gate)."""

    def __init__(self, plans: Sequence[SteerPlan]) -> None:
        self.plans = list(plans)
        self.rounds: list[int] = []  # each plan's round at its module call, in the run's order
        taken: dict[tuple[int, str], int] = {}
        for plan in self.plans:
            self.rounds.append(taken.get(plan.site.key, 0))
            taken[plan.site.key] = self.rounds[-1] + 1
        self.made: list[dict[tuple, SteerEntry]] = [{} for _ in self.plans]
        self.order: dict[Hashable, None] = {}  # the steered requests, in the order `classes` met them
        self._kinds: dict[tuple[int, int], tuple[bool, bool]] = {}  # (id of positions, length) -> `_kind`

    def any_length(self, plan: SteerPlan) -> bool:
        """Whether `plan`'s entry may serve every length (where it edits every row, or every row but the first)."""
        return bool(plan.steer.generated) and not plan.steer.from_step and not plan.slots

    def kind(self, chosen: frozenset, length: int) -> tuple[bool, bool]:
        """`_kind` of positions `chosen` in a `length`-token prompt, worked out once for each set and length."""
        found = self._kinds.get((id(chosen), length))
        if found is None:
            found = self._kinds[(id(chosen), length)] = _kind(chosen, length)
        return found

    def classes(self) -> dict[tuple, list[Hashable]]:
        """The steered requests by kind, in the run's order: requests of one kind get the same entries from every
        steer (steers over every prompt with one rule share their table of positions: `steer_plans`)."""
        tables: dict[int, tuple[dict, dict, bool]] = {}  # id of positions -> (positions, lengths, any length)
        for plan in self.plans:
            positions, lengths, lengthless = tables.get(id(plan.positions), (plan.positions, plan.lengths, True))
            tables[id(plan.positions)] = (positions, lengths, lengthless and self.any_length(plan))
        own = any(plan.slots for plan in self.plans)  # a conditional steer's requests are each of their own kind
        classes: dict[tuple, list[Hashable]] = {}
        for positions, lengths, _ in tables.values():
            for key in positions:
                if key in self.order:
                    continue
                self.order[key] = None
                length, marks, every_length = lengths[key], [], True
                for table, _, lengthless in tables.values():
                    chosen = table.get(key)
                    if chosen is None:
                        marks.append(None)
                        continue
                    every, skip_first = self.kind(chosen, length)
                    if lengthless and (every or skip_first):
                        marks.append(skip_first)
                    else:
                        marks.append(id(chosen))
                        every_length = False
                kind = (None if every_length else length, tuple(marks), key if own else None)
                classes.setdefault(kind, []).append(key)
        return classes

    def list_for(self, key: Hashable) -> list[SteerEntry]:
        """Request `key`'s entries, one a steer that applies to it, in the run's order."""
        return [self.entry(number, plan, key) for number, plan in enumerate(self.plans) if key in plan.positions]

    def entry(self, number: int, plan: SteerPlan, key: Hashable) -> SteerEntry:
        """Plan `number`'s entry for request `key`: the one its requests of that length and positions share, or of
        every length where its rows do not depend on it; a conditional steer's, the request's own."""
        made, steer = self.made[number], plan.steer
        chosen, length = plan.positions[key], plan.lengths[key]
        entry = made.get((length, chosen)) if not plan.slots else None
        if entry is not None:
            return entry
        every, skip_first = self.kind(chosen, length)
        lengthless = self.any_length(plan) and (every or skip_first)
        entry = made.get(("any length", skip_first)) if lengthless else None
        if entry is None:
            entry = SteerEntry(plan.site, plan.operation, None, None if every or skip_first else chosen,
                               bool(steer.generated), length, self.rounds[number], steer.from_step,
                               skip_first=skip_first, condition_site=plan.condition_site,
                               slot=plan.slots[key] if plan.slots else 0)
            if lengthless:
                made[("any length", skip_first)] = entry
        if not plan.slots:
            made[(length, chosen)] = entry
        return entry


def _kind(chosen: frozenset, length: int) -> tuple[bool, bool]:
    """Whether prompt positions `chosen` of a `length`-token prompt are every one, or every one but the first."""
    # distinct positions below `length`: every one where there are `length` of them from 0 to the last
    low, high = (min(chosen), max(chosen)) if chosen else (0, -1)
    every = len(chosen) == length and low == 0 and high == length - 1
    return every, not every and len(chosen) == length - 1 and low == 1 and high == length - 1


def steer_plans(steers: Sequence[tuple[Steer, Site]], keys: Sequence[Hashable], lengths: Sequence[int],
                dtype: torch.dtype, device: Any, root: Any = None) -> list[SteerPlan]:
    """Each steer with its vector ready and its positions resolved for every prompt it applies to.

    `keys[i]` names prompt i in the run; `lengths[i]` is its token count. `root` is the envoy tree the sites were
    found on, where a conditional steer's condition site is found too (a conditional steer needs it).
    """
    plans = []
    # Positions by rule and length, for rules that name no prompt (a string, one position): steers at every block
    # with one rule share their sets (a run of prompts of many lengths once built one a steer and length)
    resolved: dict[tuple[Any, int], frozenset] = {}
    # Steers over every prompt with one such rule share one table of positions and one of lengths, which
    # `run_requests` reads once for all of them; steers of one vector and settings share one operation (made once,
    # one slot of the graph ops' bank), as a server's requests do
    tables: dict[tuple[type, Any], tuple[dict[Hashable, frozenset], dict[Hashable, int]]] = {}
    every_length: Optional[dict[Hashable, int]] = None
    operations: dict[tuple, Any] = {}
    for steer, site in steers:
        indices = list(range(len(keys)) if steer.prompts is None else steer.prompts)
        shared = isinstance(steer.positions, (str, int))
        table_key = (type(steer.positions), steer.positions) if shared and steer.prompts is None else None
        table = tables.get(table_key) if table_key is not None else None
        if table is None:
            if steer.prompts is None:
                every_length = dict(zip(keys, lengths)) if every_length is None else every_length
                steer_lengths = every_length
            else:
                steer_lengths = {keys[i]: lengths[i] for i in indices}
            table = _positions_of(steer, keys, lengths, indices, resolved if shared else None), steer_lengths
            if table_key is not None:
                tables[table_key] = table
        positions, steer_lengths = table
        settings = (id(steer.vector), steer.mode, steer.scale, steer.projection, steer.norm_match)
        operation: Any = operations.get(settings) if steer.mode != "sae_clamp" else None
        if operation is None:
            operation = steer.operation(dtype, device)
            if steer.mode != "sae_clamp":
                operations[settings] = operation
        condition_site, slots = None, None
        if steer.condition is not None:
            if root is None:
                raise ValueError(f"{steer.described()}: a conditional steer's plan needs the model's tree (root=).")
            condition = steer.condition
            condition_site = locate(root, condition.value, condition.layer)
            slots = {keys[i]: slot for slot, i in enumerate(indices)}
            operation = Gate(operation, condition, len(indices), device)
        plans.append(SteerPlan(steer, site, operation, positions, steer_lengths, condition_site, slots))
    return plans


def _positions_of(steer: Steer, keys: Sequence[Hashable], lengths: Sequence[int], indices: Sequence[int],
                  resolved: Optional[dict[tuple[Any, int], frozenset]]) -> dict[Hashable, frozenset]:
    """The prompt positions `steer` edits in each prompt it applies to, by key; with `resolved`, the sets of its
    rule (which names no prompt) by length, shared with the other steers of that rule."""
    by_length: dict[int, frozenset] = {}  # a steer's positions depend on its prompt's length alone
    positions = {}
    for i in indices:
        chosen = by_length.get(lengths[i])
        if chosen is None:
            chosen = resolved.get((steer.positions, lengths[i])) if resolved is not None else None
            if chosen is None:
                chosen = frozenset(steer_positions(steer, lengths[i], i))
                if resolved is not None:
                    resolved[(steer.positions, lengths[i])] = chosen
            by_length[lengths[i]] = chosen
        positions[keys[i]] = chosen
    return positions
