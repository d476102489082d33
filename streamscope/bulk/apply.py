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
    positions: dict[Hashable, frozenset[int]]  # each steered request's prompt positions
    lengths: dict[Hashable, int]               # each steered request's prompt length
    #: A conditional steer's condition site (`streamscope.bulk.conditions`); its `operation` is then a `Gate`.
    condition_site: Optional[Site] = None
    slots: Optional[dict[Hashable, int]] = None  # a conditional steer's requests, each one's slot in its gate

    @property
    def every_row(self) -> bool:
        """Whether the steer edits every row of the requests it owns: each prompt position, each generated token."""
        return (self.steer.generated and self.steer.from_step == 0
                and all(len(chosen) == self.lengths[key] for key, chosen in self.positions.items()))

    @property
    def every_row_but_first(self) -> bool:
        """Whether the steer edits every row of the requests it owns but each prompt's first position (the default
        positions, `streamscope.bulk.spec.SKIP_FIRST`), every generated token too."""
        return (self.steer.generated and self.steer.from_step == 0 and not self.every_row
                and all(chosen == frozenset(range(1, self.lengths[key])) for key, chosen in self.positions.items()))


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
    one round at its module call, so that it stays one edit over all its requests' rows) and its harvest."""
    requests: dict[Hashable, Live] = {}
    for key, positions in harvest_positions.items():
        requests[key] = Live([], harvest_sites=harvest_sites, positions=list(positions),
                             slots={position: slot for slot, position in enumerate(positions)}, readout=readout)
    rounds: dict[tuple[int, str], int] = {}
    kinds: dict[tuple[int, int], tuple[bool, bool]] = {}  # (id of positions, length) -> (every, all but the first)
    for plan in plans:
        order = rounds.get(plan.site.key, 0)
        rounds[plan.site.key] = order + 1
        steer = plan.steer
        # One entry for the requests of one length and positions (entries are read, never changed), and one for
        # every length where it edits every row or every row but the first (no row it edits depends on the length);
        # but a gated steer's, which each hold their request's slot in the gate
        shared: dict[tuple, SteerEntry] = {}
        any_length = bool(steer.generated) and not steer.from_step and not plan.slots
        for key, chosen in plan.positions.items():
            length = plan.lengths[key]
            entry = shared.get((length, chosen)) if not plan.slots else None
            if entry is None:
                every, skip_first = kinds.get((id(chosen), length)) or kinds.setdefault((id(chosen), length),
                                                                                        _kind(chosen, length))
                lengthless = any_length and (every or skip_first)
                entry = shared.get(("any length", skip_first)) if lengthless else None
                if entry is None:
                    entry = SteerEntry(plan.site, plan.operation, None, None if every or skip_first else chosen,
                                       bool(steer.generated), length, order, steer.from_step,
                                       skip_first=skip_first, condition_site=plan.condition_site,
                                       slot=plan.slots[key] if plan.slots else 0)
                    if lengthless:
                        shared[("any length", skip_first)] = entry
                if not plan.slots:
                    shared[(length, chosen)] = entry
            live = requests.get(key)
            if live is None:
                live = requests[key] = Live([])
            live.steers.append(entry)
    # requests with the same entries share one list (nothing changes a request's list once made), which the graph
    # ops' backend routes once for all of them (`GraphBackend._routes`)
    lists: dict[tuple[int, ...], list[SteerEntry]] = {}
    for live in requests.values():
        if live.steers:
            live.steers = lists.setdefault(tuple(map(id, live.steers)), live.steers)
    return requests


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
    for steer, site in steers:
        indices = list(range(len(keys)) if steer.prompts is None else steer.prompts)
        shared = isinstance(steer.positions, (str, int))
        by_length: dict[int, frozenset] = {}  # a steer's positions depend on its prompt's length alone
        positions = {}
        for i in indices:
            chosen = by_length.get(lengths[i])
            if chosen is None:
                chosen = resolved.get((steer.positions, lengths[i])) if shared else None
                if chosen is None:
                    chosen = frozenset(steer_positions(steer, lengths[i], i))
                    if shared:
                        resolved[(steer.positions, lengths[i])] = chosen
                by_length[lengths[i]] = chosen
            positions[keys[i]] = chosen
        operation: Any = steer.operation(dtype, device)
        condition_site, slots = None, None
        if steer.condition is not None:
            if root is None:
                raise ValueError(f"{steer.described()}: a conditional steer's plan needs the model's tree (root=).")
            condition = steer.condition
            condition_site = locate(root, condition.value, condition.layer)
            slots = {keys[i]: slot for slot, i in enumerate(indices)}
            operation = Gate(operation, condition, len(indices), device)
        plans.append(SteerPlan(steer, site, operation, positions, {keys[i]: lengths[i] for i in indices},
                               condition_site, slots))
    return plans
