"""The persistent buffers the graph ops read (`streamscope.vllm.graph_ops`), and their fill once a step.

A graph captured once must find, at every replay, its edits and harvests in
tensors at the same addresses. `GraphPlan` owns them:

* a `SlotBank`: every distinct operation of the live requests (a vector with
  its mode, scale, projection and norm-match flag) in one slot of
  ``bank [slots, hidden]`` and its per-slot buffers, shared by every request
  and site that uses it (an ablation at every block is one slot), written
  when a request brings a new one, not per step;
* one device index ``[max_rows, lanes + harvest sites]`` of int32: column
  ``j`` is lane ``j``'s row -> slot map (a lane is one edit op: a site and a
  round, a request's second steer at one site being the second round),
  ``-1`` for a row left alone; after the lanes, one column a harvest site,
  its row -> pool row map (``-1``: not harvested there). It is stored lane
  by lane (each column contiguous, the tensor a transposed view), so that a
  step writes and copies only the columns its requests use: one for a steer
  at one block, of 576 at the Llama-3-8B shape. The ops read columns of it
  (views, fixed addresses);
* ``pool [pool rows + 1, hidden]``: where the harvest ops store the rows a
  step harvests, each (position, site) a request asks for in a row of its
  own, a request's rows of the step site by site; the last row is the ops'
  spare, which no step names (`graph_ops.harvest_stream`). A harvest is
  admitted while the most rows one step could harvest for the live
  harvests fits the pool (`GraphPlan.enter`), so no step overflows it.

`GraphPlan.step` turns the scheduler's spans (`streamscope.bulk.apply.Span`:
which request owns which rows this step, prefill and decode alike) into the
index on the host, then moves it to the device: the lanes this step's
requests use, and those the last step wrote (reset to ``-1``), each up to the
step's last marked row or the last step's, so no stale mark survives in a
graph's padding rows. On a GPU the lanes go packed from one of two pinned
staging buffers, without a wait, and land in their columns by one indexed
copy on the device; the host never rewrites a buffer whose copy may still be
queued. Each live request keeps its lane
marks as one row of a table, so a step whose requests each steer whole
spans (every decode step, a prefill of every position) is one gather from
it, whatever the batch and however many distinct vectors; only a span a
steer edits in part (chosen prompt positions) is written range by range.
Requests enter and leave in time of their own steers only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..bulk.apply import Span
from ..bulk.operations import DIRECTIONAL, Operation
from .graph_ops import IDLE, MODE_CODES
from .row_rules import RowRule


#: How the plan's index is stored (part of the compile cache's salt: a graph captured with the ops reads it by its
#: strides): lane by lane, each lane's rows contiguous, a harvest site's pool rows after the lanes.
INDEX_LAYOUT = "lanes+pool"
#: The harvest pool's rows by default, per row of a step: a step may harvest up to this many sites at every one
#: of its rows (8 x 8,192 rows: 512 MiB at the Llama-3-8B shape, 1 GiB at the 70B one).
POOL_SITES = 8


class PoolBusy(RuntimeError):
    """A harvest the pool cannot take now: the live requests' harvests hold it (it may pass once they have read
    their prompts)."""


def default_pool(max_rows: int, harvest_sites: int) -> int:
    """The harvest pool's rows by default: `POOL_SITES` sites (every harvest site, where there are fewer) at every
    row of a step."""
    return max_rows * min(POOL_SITES, harvest_sites)


class SlotBank:
    """Each distinct steer operation of the live requests in one slot of persistent device buffers.

    Args:
        slots: How many distinct operations may be live at once.
        hidden: The stream's width.
        dtype, device: The engine's.

    ``bank [slots, hidden]`` holds each slot's vector as `Operation` uses it
    (``delta`` for add and set, ``unit`` for ablate and clamp); ``modes``,
    ``scales``, ``projections`` and ``norm_match`` (``[slots]``) the rest.
    """

    def __init__(self, slots: int, hidden: int, dtype: torch.dtype, device: Any) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}: a bank holds at least one operation.")
        self.bank = torch.zeros((slots, hidden), dtype=dtype, device=device)
        self.modes = torch.zeros(slots, dtype=torch.int32, device=device)
        self.scales = torch.zeros(slots, dtype=torch.float32, device=device)
        self.projections = torch.zeros(slots, dtype=torch.float32, device=device)
        self.norm_match = torch.zeros(slots, dtype=torch.bool, device=device)
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[Hashable, list[int]] = {}  # key -> [slot, users]

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """``(bank, modes, scales, projections, norm_match)``, in `graph_ops.edit_stream`'s order."""
        return self.bank, self.modes, self.scales, self.projections, self.norm_match

    def acquire(self, key: Hashable, operation: Operation, uses: int = 1) -> int:
        """The slot of `key`'s operation, written on its first use; `uses` uses of it, each given back by a
        `release` (a request's steers of one operation at many sites take theirs at once).

        `key` names the operation (a stored vector's name with its settings):
        requests that name the same key share its slot.
        """
        held = self._held.get(key)
        if held is not None:
            held[1] += uses
            return held[0]
        if not isinstance(operation, Operation) or operation.mode not in MODE_CODES:
            mode = getattr(operation, "mode", "sae_clamp")
            raise ValueError(f"the graph ops run add, set, ablate and clamp, not {mode!r}: an SAE feature clamp "
                             f"stays on the hook path (streamscope.bulk.apply).")
        if not self._free:
            raise RuntimeError(f"the slot bank is full ({self.bank.shape[0]} distinct operations live): start the "
                               f"engine with more graph slots, or wait for requests to finish.")
        slot = self._free.pop()
        vector = operation.unit if operation.mode in DIRECTIONAL else operation.delta
        if vector.shape != self.bank.shape[1:]:
            self._free.append(slot)
            raise ValueError(f"the steer's vector has shape {tuple(vector.shape)}; the stream is "
                             f"[{self.bank.shape[1]}].")
        # Each write queued on the stream, none waiting for the device: fill_ takes a host number as a kernel
        # argument, where assigning one would copy it from host memory.
        self.bank[slot].copy_(vector.to(self.bank.dtype), non_blocking=True)
        self.modes[slot].fill_(MODE_CODES[operation.mode])
        self.scales[slot].fill_(operation.scale)
        self.projections[slot].fill_(operation.projection)
        self.norm_match[slot].fill_(operation.norm_match)
        self._held[key] = [slot, uses]
        return slot

    def release(self, key: Hashable, uses: int = 1) -> None:
        """Give back `uses` uses of `key`'s slot; the slot is free once its last user releases it."""
        held = self._held[key]
        held[1] -= uses
        if not held[1]:
            del self._held[key]
            self._free.append(held[0])

    @property
    def live(self) -> int:
        """How many slots hold an operation."""
        return len(self._held)


def _columns(lanes: Sequence[int]) -> Any:
    """Lane columns as the cheapest index of them: an int, a slice where they are evenly spaced (a steer at every
    block), else an array."""
    if len(lanes) == 1:
        return lanes[0]
    step = lanes[1] - lanes[0]
    if step > 0 and all(later - earlier == step for earlier, later in zip(lanes, lanes[1:])):
        return slice(lanes[0], lanes[-1] + 1, step)
    return np.array(lanes, dtype=np.intp)


@dataclass
class _LaneEdit:
    """One steer of a live request: the lanes it edits, its slot, its rows."""

    columns: Any  # an int (one lane) or a tensor of lane columns
    columns_key: tuple[int, ...]
    slot: int
    rule: RowRule


@dataclass
class _Live:
    edits: list[_LaneEdit]
    positions: tuple[int, ...] = ()  # harvested prompt positions, sorted
    sites: tuple[int, ...] = ()  # the request's harvest sites, as indices into the plan's, in its own order
    harvest_lanes: tuple[int, ...] = ()  # the index's column of each of them
    done: int = 0  # positions harvested so far
    row: int = 0  # its row of the plan's table of lane marks (0: the row of no marks)
    lanes: frozenset = frozenset()  # the index's columns its edits mark (its harvest's, only in a step it reads)
    #: Its edits' distinct row rules: a steer at every block has 32 edits of one rule, which a step checks once.
    rules: tuple = ()
    #: The first position from which its rules edit every row (`RowRule.every_from`): a span from there on needs
    #: no check (every decode step of a steer at every position, or every one but the first).
    covered_from: float = 0
    #: The lanes its edits mark and the slot each holds (its row of the plan's table), for a span edited in part.
    columns: Any = None
    marks: Any = None
    shares: tuple = ()  # ((share, uses), ...): the bank's slots it holds, each as many times as its edits use it


class _Listed(NamedTuple):
    """What the requests given one list of steers share before their slots (`GraphPlan._listed`)."""

    steers: Sequence[PlannedSteer]  # the list, kept so that no later list takes its id while this is remembered
    lanes: list[tuple[int, ...]]  # each steer's lanes
    shares: tuple[tuple[Hashable, Operation, int], ...]  # each distinct share, its operation and its steers' count
    which: tuple[int, ...]  # each steer's share, as an index into `shares`
    uses: tuple[tuple[Hashable, int], ...]  # each distinct share and its steers' count (`_Live.shares`)


class _Shape(NamedTuple):
    """What the requests given one list of steers with the same slots share (`GraphPlan._live_of`)."""

    steers: Sequence[PlannedSteer]  # the list, kept so that no later list takes its id while this is remembered
    edits: list[_LaneEdit]
    rules: tuple  # the edits' distinct row rules
    lanes: frozenset  # every lane the edits mark
    columns: np.ndarray  # the table row's lanes, and the slot each holds
    marks: np.ndarray
    covered_from: float  # `_Live.covered_from`
    chosen: Any  # `columns` as the cheapest index (`_columns`), and `marks` shaped to write with it
    chosen_marks: Any


@dataclass
class StepHarvest:
    """What one step harvested: ``rows [used, hidden]``, the pool's first rows (on the host once `wait` returns),
    and `layout`, each harvesting request's ``(key, count, first position index, first pool row)``: its `count`
    positions at each of its sites, site by site from that pool row (``[its sites, count, hidden]``)."""

    rows: Optional[torch.Tensor]
    layout: list[tuple[Hashable, int, int, int]]
    used: int = 0
    event: Any = None
    #: The harvesting requests' plans, kept for `GraphPlan.settle` after a request leaves.
    lives: dict[Hashable, Any] = field(default_factory=dict)

    def wait(self) -> None:
        """Wait for the step's device-to-host copy (a no-op on the CPU or once done)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


@dataclass(frozen=True)
class PlannedSteer:
    """A request's steer for `GraphPlan.enter`: its operation at `sites` (one edit op each, the next free round),
    its rows by `rule`, and `share`, the key under which requests share the operation's slot."""

    sites: Sequence[Hashable]
    operation: Operation
    rule: RowRule
    share: Hashable


#: How many shapes of request a plan remembers the lanes and edits of (`GraphPlan.enter`): a bulk run has one or a
#: few; a server's come and go, and the memory is cleared when full.
SHAPES = 256


class GraphPlan:
    """The graph ops' persistent buffers for an engine, and their fill from each step's spans.

    Args:
        sites: The sites an edit op sits at (any hashable names, the wiring's).
        rounds: Edit ops at each site: how many steers one request may put
            at one site, applied in its order.
        max_rows: The most token rows a step runs (vLLM's
            ``max_num_batched_tokens``).
        hidden, dtype, device: The stream's width, the engine's dtype and device.
        slots: How many distinct operations may be live at once.
        harvest_sites: The sites a harvest op sits at, in the harvest's order.
        harvest_pool: The harvest pool's rows: how many (position, site)
            rows one step may harvest (None: `POOL_SITES` sites at every row
            of a step, or every harvest site where there are fewer).
    """

    def __init__(self, sites: Sequence[Hashable], rounds: int, max_rows: int, hidden: int, dtype: torch.dtype,
                 device: Any, slots: int = 256, harvest_sites: Sequence[Hashable] = (),
                 harvest_pool: Optional[int] = None) -> None:
        if rounds < 1 or max_rows < 1:
            raise ValueError(f"rounds={rounds}, max_rows={max_rows}: a plan has at least one of each.")
        pool = default_pool(max_rows, len(harvest_sites)) if harvest_pool is None else harvest_pool
        if pool < 0 or (harvest_sites and pool < 1):
            raise ValueError(f"harvest_pool={pool}: a plan that harvests holds at least one row.")
        self.sites = list(sites)
        self.rounds = rounds
        self.lane_of = {(site, round_): index * rounds + round_
                        for index, site in enumerate(self.sites) for round_ in range(rounds)}
        if len(self.lane_of) != len(self.sites) * rounds:
            raise ValueError("sites: each site is named once.")
        self.harvest_sites = list(harvest_sites)
        self.harvest_index = {site: number for number, site in enumerate(self.harvest_sites)}
        #: Each harvest site's column of the index (its row -> pool row map), after the lanes.
        self.harvest_lane_of = {site: len(self.lane_of) + number for number, site in enumerate(self.harvest_sites)}
        self.max_rows, self.pool_rows = max_rows, pool
        self.device = torch.device(device)
        self.bank = SlotBank(slots, hidden, dtype, self.device)
        #: `_lanes_of`'s answers by the steers' sites, `_live_of`'s edits by the steers' list and slots (the list's
        #: steers kept, so that no later list takes its id while its edits are remembered): `SHAPES` of each.
        self._lanes_by_shape: dict[tuple, list[tuple[int, ...]]] = {}
        self._edits_by_steers: dict[tuple, _Shape] = {}
        self._by_list: dict[int, _Listed] = {}  # `_listed`'s answers by the list's identity: `SHAPES` of them
        columns = len(self.lane_of) + len(self.harvest_sites)
        # Stored lane by lane: a step writes and copies only the lanes its requests use (`index` is the transposed
        # view, [max_rows, columns], as the ops read it).
        self._lanes = torch.full((columns, max_rows), -1, dtype=torch.int32, device=self.device)
        self.index = self._lanes.t()
        # Each column's address as the ops see it (`graph_ops.IdleSwitch.leaves`): an edit lane's is its site's first
        # round's (an op takes a site's rounds as one view), a harvest column's its own.
        address = [self.index[:, column].data_ptr() for column in range(columns)]
        self._site_column = [address[(lane // rounds) * rounds] for lane in range(len(self.lane_of))] + \
            address[len(self.lane_of):]
        #: Every column's address (`_site_column`'s values), and those the last `step` marks.
        self.columns = frozenset(self._site_column)
        self.marked_columns: frozenset[int] = frozenset()
        #: The columns of the lean graphs' sites (`graph_backend.graph_sets`), None where the engine keeps no lean
        #: set: a step that marks these columns only may replay the lean graphs (`graph_ops.IDLE.lean`).
        self.lean_columns: Optional[frozenset[int]] = None
        #: Whether a step filled the plan since the engine last closed one (`step`; `GraphOps.close_step`).
        self.claimed = False
        # The host's copy, filled each step. On a GPU the step's lanes go packed through one of two pinned staging
        # buffers (values, and the lanes' numbers), so the copy does not wait, and the host never rewrites a buffer
        # whose copy may still be queued; an indexed copy on the device puts each in its column.
        # (numpy's, on the host: a step's fill is a few small operations, each a microsecond there, not ten)
        self._host_lanes = torch.full((columns, max_rows), -1, dtype=torch.int32)
        self._host = self._host_lanes.numpy()
        on_gpu = self.device.type == "cuda"
        self._staging = [(torch.empty(columns * max_rows, dtype=torch.int32, pin_memory=True),
                          torch.empty(columns, dtype=torch.long, pin_memory=True)) for _ in range(2)] if on_gpu else []
        self._landing = (torch.empty(columns * max_rows, dtype=torch.int32, device=self.device),
                         torch.empty(columns, dtype=torch.long, device=self.device)) if on_gpu else None
        self._written: frozenset = frozenset()  # the lanes the last step wrote (their rows up to `_dirty`)
        self._events: list[Any] = [None, None]
        self._turn = 0
        # Every harvest op gets this whole tensor (never a view of part of it: `graph_ops`' docstring says why); its
        # last row is the ops' spare, which no step names.
        self.pool = torch.zeros((pool + 1, hidden), dtype=dtype, device=self.device)
        self._live: dict[Hashable, _Live] = {}
        # Each live request's lane marks as one row (row 0: none), so that a step whose requests each steer whole
        # spans (decode; a prefill of every position) fills its rows with one gather from this table.
        self._table = np.full((64, columns), -1, dtype=np.int32)
        self._free_rows = list(range(63, 0, -1))
        self._dirty = 0  # rows of the device index that the last step's copy covered
        #: Bumped at every change of the table: a step whose rows come from the table alone (`step`) is the last
        #: step's again, and copies nothing, where its owners, their rows and this are the last step's.
        self._table_version = 0
        self._filled: Optional[tuple[list[int], list[int], int]] = None  # (owners, counts, version) of the last fill
        self._rows: dict[Hashable, torch.Tensor] = {}  # each request's harvested rows so far, on the host
        #: Whether the last `step` marks no row: none of its requests has a steer live (begun or not) or a harvest
        #: read in it. The ops change nothing in it, so they may skip it (`graph_ops.IDLE`); its index is still
        #: reset where the step before marked.
        self.idle = True

    # What each op reads: views of the persistent buffers, at fixed addresses.

    def columns_of(self, sites: Sequence[Hashable]) -> frozenset[int]:
        """The addresses of `sites`' columns as the ops see them (`columns`): each edit site's first round's, each
        harvest site's own; a site of neither kind has none."""
        found = [self.index[:, self.lane_of[(site, 0)]].data_ptr() for site in sites if (site, 0) in self.lane_of]
        found += [self.index[:, self.harvest_lane_of[site]].data_ptr() for site in sites if site in self.harvest_lane_of]
        return frozenset(found)

    def slots_of(self, site: Hashable, round_: int = 0) -> torch.Tensor:
        """The edit op's row -> slot map at `site`, round `round_`: ``[max_rows]`` int32 (a column of `index`)."""
        return self.index[:, self.lane_of[(site, round_)]]

    def rounds_of(self, site: Hashable) -> torch.Tensor:
        """Every round's row -> slot map at `site`, ``[max_rows, rounds]`` int32 (its lanes, side by side in
        `index`): what one op reads to run the site's rounds in one launch."""
        first = self.lane_of[(site, 0)]
        return self.index[:, first:first + self.rounds]

    def targets_of(self, site: Hashable) -> torch.Tensor:
        """The harvest op's row -> pool row map at `site`, ``-1`` for a row not harvested there, ``[max_rows]``
        int32 (a column of `index`)."""
        return self.index[:, self.harvest_lane_of[site]]

    # Requests.

    def enter(self, key: Hashable, steers: Sequence[PlannedSteer] = (), harvest_positions: Sequence[int] = (),
              harvest_sites: Optional[Sequence[Hashable]] = None) -> None:
        """Make `key` live with its steers (each at its sites' next free round, in order) and its harvest (prompt
        positions, at `harvest_sites`: every harvest site when None). Nothing changes where it is refused."""
        if key is None or key in self._live:
            raise ValueError(f"request {key!r} is already live (or None): leave it first.")
        listed = self._listed(key, steers)
        sites = self.harvest_sites if harvest_sites is None else list(harvest_sites)
        missing = [site for site in sites if site not in self.harvest_index] if harvest_positions else []
        if missing:
            raise ValueError(f"request {key!r} harvests {missing}, where the graph has no harvest op.")
        positions = tuple(sorted(set(harvest_positions)))
        if positions:
            self._admit_harvest(key, len(sites), len(positions))
        taken: list[int] = []
        try:
            for share, operation, uses in listed.shares:
                taken.append(self.bank.acquire(share, operation, uses))
        except Exception:
            for (share, _, uses), _ in zip(listed.shares, taken):
                self.bank.release(share, uses)
            raise
        slots = tuple(taken[which] for which in listed.which)
        live, columns, marks = self._live_of(listed, slots)
        if live.edits:
            live.row = self._table_row()
            self._table[live.row, columns] = marks
            self._table_version += 1
        if positions:
            live.positions = positions
            live.sites = tuple(self.harvest_index[site] for site in sites)
            live.harvest_lanes = tuple(self.harvest_lane_of[site] for site in sites)
        self._live[key] = live

    def _listed(self, key: Hashable, steers: Sequence[PlannedSteer]) -> _Listed:
        """What `steers` need of the plan before their slots: their lanes and distinct shares, worked out once for
        the requests given one list (a bulk run's, a server's that send the same steers)."""
        found = self._by_list.get(id(steers))  # (a record keeps its list alive: no other list takes that id)
        if found is not None:
            return found
        lanes = self._lanes_of(key, steers)
        number: dict[Hashable, int] = {}
        shares: list[list[Any]] = []
        for steer in steers:
            if steer.share not in number:
                number[steer.share] = len(shares)
                shares.append([steer.share, steer.operation, 0])
            shares[number[steer.share]][2] += 1
        found = _Listed(steers, lanes, tuple(map(tuple, shares)), tuple(number[steer.share] for steer in steers),
                        tuple((share, uses) for share, _, uses in shares))
        if len(self._by_list) >= SHAPES:
            self._by_list.clear()
        self._by_list[id(steers)] = found
        return found

    def _lanes_of(self, key: Hashable, steers: Sequence[PlannedSteer]) -> list[tuple[int, ...]]:
        """Each steer's lanes (its sites' next free rounds, in order), by the steers' sites: requests with steers at
        the same sites share the answer, which is worked out once (refused where a site has no op or no round
        left, for each request that asks)."""
        shape = tuple(tuple(steer.sites) for steer in steers)
        lanes = self._lanes_by_shape.get(shape)
        if lanes is not None:
            return lanes
        taken: dict[Hashable, int] = {}
        lanes = []
        for sites in shape:
            mine = []
            for site in sites:
                round_ = taken.get(site, 0)
                if (site, round_) not in self.lane_of:
                    where = "no edit op" if (site, 0) not in self.lane_of else f"{self.rounds} edit round(s)"
                    raise ValueError(f"request {key!r} steers site {site!r} {round_ + 1} time(s); the graph has "
                                     f"{where} there: start the engine with the site and rounds it needs.")
                taken[site] = round_ + 1
                mine.append(self.lane_of[(site, round_)])
            lanes.append(tuple(mine))
        if len(self._lanes_by_shape) >= SHAPES:
            self._lanes_by_shape.clear()
        self._lanes_by_shape[shape] = lanes
        return lanes

    def _live_of(self, listed: _Listed, slots: tuple[int, ...]) -> tuple[_Live, np.ndarray, np.ndarray]:
        """A new request's record (its edits: lanes, slot, rows; their distinct rules and every lane they mark),
        and its row of the table: the lanes' columns and the slot each holds. Requests given one list of steers
        (`GraphBackend` hands a bulk run's requests of one length the same list) with the same slots share the
        edits, which nothing changes."""
        steers, lanes = listed.steers, listed.lanes
        found = self._edits_by_steers.get((id(steers), slots))
        if found is None or found.steers is not steers:
            edits = [_LaneEdit(_columns(mine), mine, slot, steer.rule)
                     for steer, mine, slot in zip(steers, lanes, slots)]
            columns = np.array([lane for mine in lanes for lane in mine], dtype=np.intp)
            marks = np.array([slot for mine, slot in zip(lanes, slots) for _ in mine], dtype=np.int32)
            rules = tuple(dict.fromkeys(edit.rule for edit in edits))
            chosen = _columns(columns.tolist()) if len(columns) else None
            found = _Shape(steers, edits, rules, frozenset(lane for edit in edits for lane in edit.columns_key),
                           columns, marks, max((rule.every_from for rule in rules), default=0), chosen,
                           int(marks[0]) if isinstance(chosen, int) else marks[:, None])
            if len(self._edits_by_steers) >= SHAPES:
                self._edits_by_steers.clear()
            self._edits_by_steers[(id(steers), slots)] = found
        live = _Live(found.edits, rules=found.rules, lanes=found.lanes, covered_from=found.covered_from,
                     columns=found.chosen, marks=found.chosen_marks,
                     shares=listed.uses)
        return live, found.columns, found.marks

    def _admit_harvest(self, key: Hashable, sites: int, positions: int) -> None:
        """Refuse a harvest of `positions` positions at `sites` sites where the most rows one step could then
        harvest would not fit the pool: for good (ValueError) where the request alone would not, for now
        (`PoolBusy`: the live harvests hold the pool; a 503 on a server) otherwise."""
        alone = sites * min(positions, self.max_rows)
        if alone > self.pool_rows:
            raise ValueError(f"request {key!r} harvests {positions} position(s) at {sites} site(s): up to {alone} rows "
                             f"in one step, and the graph ops' harvest pool holds {self.pool_rows}: start the engine "
                             f"with a larger pool (graph ops' harvest_pool) or harvest fewer sites or positions a "
                             f"request.")
        most = self.most_harvested((sites, positions))
        if most > self.pool_rows:
            raise PoolBusy(f"the graph ops' harvest pool ({self.pool_rows} rows) is held by the live requests' "
                           f"harvests (one step could harvest {most} rows with this request's): wait for requests "
                           f"to finish, or start the engine with a larger pool (harvest_pool).")

    def most_harvested(self, extra: Optional[tuple[int, int]] = None) -> int:
        """The most rows one step could harvest for the live requests (and `extra`, a harvest's ``(sites, positions
        left)``): the step's `max_rows` rows go to the positions left of the harvests asking the most sites first."""
        asks = [(len(live.sites), len(live.positions) - live.done) for live in self._live.values() if live.positions]
        if extra is not None:
            asks.append(extra)
        budget = self.max_rows
        most = 0
        for sites, left in sorted(asks, reverse=True):
            taken = min(left, budget)
            most += sites * taken
            budget -= taken
            if not budget:
                break
        return most

    def leave(self, key: Hashable) -> None:
        """Forget `key`: its slots released where no other request uses them (a no-op for a key not live)."""
        live = self._live.pop(key, None)
        if live is None:
            return
        for share, uses in live.shares:
            self.bank.release(share, uses)
        if live.row:
            self._table[live.row] = -1
            self._free_rows.append(live.row)
            self._table_version += 1

    def _table_row(self) -> int:
        if not self._free_rows:  # twice the rows, the old ones kept: amortized constant time a request
            grown = np.full((2 * self._table.shape[0], self._table.shape[1]), -1, dtype=np.int32)
            grown[:self._table.shape[0]] = self._table
            self._free_rows.extend(range(2 * self._table.shape[0] - 1, self._table.shape[0] - 1, -1))
            self._table = grown
        return self._free_rows.pop()

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def marked_rows(self) -> int:
        """The rows of the device index up to the last the last step marked (0: none): the next step resets them."""
        return self._dirty

    # The step.

    def step(self, spans: Sequence[Span]) -> StepHarvest:
        """Fill the index for this step's `spans` and copy it to the device (one copy); the step's harvest layout.

        Call before the step runs (before a graph's replay): the ops read the
        index that the copy fills, queued before them on the same stream.
        A step whose index is the last step's (the same requests in the same
        rows, each steered whole by the same table rows: a steady decode
        batch) fills and copies nothing.
        After the step, `copy_out` its harvest. `spans` come in row order,
        as the scheduler lays the batch out. Sets the ops' switch
        (`graph_ops.IDLE`) for the step: idle where it marks no row, and the
        columns it marks (a fill that raises leaves every op on); and
        `claimed`, which the engine's close of the step reads
        (`graph_backend.GraphOps.close_step`).
        """
        IDLE.step, IDLE.lean, IDLE.columns = False, False, None
        self.claimed = True
        owners: list[int] = []  # per span (and gap): its request's table row, 0 for no marks
        counts: list[int] = []
        partial: list[tuple[_Live, int, int, int]] = []  # spans some steer edits in part: written range by range
        layout: list[tuple[Hashable, int, int, int]] = []
        lives: dict[Hashable, Any] = {}
        picked: list[tuple[int, Any, int, int]] = []  # (harvest lane, stream rows, first pool row, rows)
        used = 0  # the pool's rows this step harvests into
        lane_sets: dict[int, Any] = {}  # the lanes this step's requests mark: each request's set, once by id
        total = marked = 0  # marked: the rows up to the last this step marks (a slot or a harvest)
        for key, start, count, first in spans:
            if start < total:
                raise ValueError(f"span of {key!r} at row {start} overlaps the rows before it: pass the step's spans "
                                 f"in row order, as the scheduler lays the batch out.")
            if start > total:
                owners.append(0)
                counts.append(start - total)
            total = start + count
            live = self._live.get(key) if key is not None else None
            owner = 0
            if live is not None:
                lane_sets[id(live.lanes)] = live.lanes
                if live.row:
                    rules = live.rules
                    if first >= live.covered_from or (rules[0].covers(first, count) if len(rules) == 1
                                                      else all(rule.covers(first, count) for rule in rules)):
                        owner = live.row
                    else:
                        partial.append((live, start, count, first))
                    marked = total
                if live.positions and live.done < len(live.positions):
                    after, end = self._harvest_span(key, live, start, count, first, picked, layout, lives, used)
                    if after > used:
                        used = after
                        lane_sets[id(live.harvest_lanes)] = live.harvest_lanes
                        marked = max(marked, end)
            owners.append(owner)
            counts.append(count)
        if total > self.max_rows:
            raise ValueError(f"this step runs {total} rows; the graph plan holds {self.max_rows}: size max_rows "
                             f"for the engine's max_num_batched_tokens.")
        if used > self.pool_rows:  # (admission keeps every step within the pool: `enter`)
            raise RuntimeError(f"this step harvests {used} rows; the graph ops' harvest pool holds {self.pool_rows}.")
        # (no lanes where the plan's requests mark nothing this step: a harvest done, a steer not begun)
        lanes: set[int] = set().union(*lane_sets.values()) if marked else set()
        # Rows past `marked` and lanes no request of the step marks hold -1 on the device once the last step's marks
        # there are reset: a step of plain requests after another copies nothing, and a steered one only its lanes,
        # up to its last marked row.
        self._write(owners, counts, total, marked, partial, picked, lanes)
        self.idle = not marked
        self.marked_columns = frozenset(self._site_column[lane] for lane in lanes)
        lean = self.lean_columns
        IDLE.step, IDLE.lean = self.idle, lean is not None and self.marked_columns <= lean
        IDLE.columns = (self.marked_columns, self.columns)
        return StepHarvest(None, layout, used, lives=lives)

    def _write(self, owners: list[int], counts: list[int], total: int, marked: int,
               partial: list[tuple[_Live, int, int, int]], picked: list[tuple[int, Any, int, int]],
               lanes: set[int]) -> None:
        """The step's index filled on the host and copied to the device, up to its last marked row and the last
        step's; nothing where it is the last step's index: a decode step of the same requests in the same rows,
        each steered whole by the same table rows (most steps of a steady batch)."""
        filled = (owners, counts, self._table_version) if not partial and not picked else None
        if filled is not None and filled == self._filled and marked == self._dirty and lanes == self._written:
            return
        rows = max(marked, self._dirty)
        reset = self._written - lanes
        self._fill_rows(owners, counts, total, marked, rows, partial, picked, sorted(lanes), sorted(reset))
        if rows and (lanes or reset):
            self._copy(rows, sorted(lanes | reset))
        self._dirty, self._written, self._filled = marked, frozenset(lanes), filled

    def _fill_rows(self, owners: list[int], counts: list[int], total: int, marked: int, rows: int,
                   partial: list[tuple[_Live, int, int, int]], picked: list[tuple[int, Any, int, int]],
                   lanes: list[int], reset: list[int]) -> None:
        """The host index of a step's `lanes` up to row `rows`: every row below `marked` from its request's table
        row (one gather of those lanes), then the spans steered in part, range by range, then each harvested
        site's rows, their pool rows; the rest, and the last step's lanes in `reset`, -1."""
        by_lane = self._host  # [columns, max_rows]
        if reset:
            by_lane[_columns(reset), :self._dirty] = -1
        if not lanes:
            return
        chosen = _columns(lanes)  # one lane (a steer at one block) or evenly spaced ones index views, not copies
        if rows > marked:
            by_lane[chosen, marked:rows] = -1
        if marked:
            owner = np.array(owners, dtype=np.intp)
            if len(owners) != total:  # some span of several rows: each row its span's owner
                owner = np.repeat(owner, counts)
            by_lane[chosen, :marked] = self._table[:, chosen][owner[:marked]].T
        for live, start, count, first in partial:
            if len(live.rules) == 1:  # every edit by one rule (a steer at every block): its ranges once, all lanes
                for low, high in live.rules[0].ranges(start, count, first):
                    by_lane[live.columns, low:high] = live.marks
                continue
            for edit in live.edits:
                for low, high in edit.rule.ranges(start, count, first):
                    by_lane[edit.columns, low:high] = edit.slot
        for lane, at, base, taken in picked:  # (the harvest columns' other rows hold -1 from the table)
            by_lane[lane, at] = np.arange(base, base + taken, dtype=np.int32)

    def _copy(self, rows: int, lanes: list[int]) -> None:
        """The host index's `lanes`, rows ``0 .. rows``, to the device: one lane by one copy, more packed and put in
        their columns by an indexed copy on the device."""
        if not self._staging:
            chosen = _columns(lanes)
            if isinstance(chosen, np.ndarray):
                chosen = torch.from_numpy(chosen)
            self._lanes[chosen, :rows] = self._host_lanes[chosen, :rows]
            return
        turn, self._turn = self._turn, self._turn ^ 1
        self._wait_for(turn)
        self._pack(turn, rows, lanes)
        self._launch(turn, rows, len(lanes), lanes[0])
        self._mark(turn)

    # `_copy`'s parts, apart so that the server's host-time log times each (the H100 spent 195-400 us a step in
    # `_copy` where this CPU's model of it spends about 25).

    def _pack(self, turn: int, rows: int, lanes: list[int]) -> None:
        """The step's lanes into staging buffer `turn` (pinned): one lane as it is, more side by side with their
        numbers."""
        values, numbers = self._staging[turn]
        if len(lanes) == 1:
            values.numpy()[:rows] = self._host[lanes[0], :rows]
            return
        count = len(lanes)
        packed = values.numpy()[:count * rows].reshape(count, rows)
        chosen = _columns(lanes)
        if isinstance(chosen, slice):  # evenly spaced lanes (a steer at every block): one strided copy
            packed[:] = self._host[chosen, :rows]
        else:  # ("clip": the lanes are columns; numpy buffers `out` under the default "raise")
            np.take(self._host[:, :rows], lanes, axis=0, out=packed, mode="clip")
        numbers.numpy()[:count] = lanes

    def _launch(self, turn: int, rows: int, count: int, lane: int) -> None:
        """Staging buffer `turn`'s `count` lanes to the device, not waited for: one lane into its column, more into
        the landing buffer, then into their columns by an indexed copy on the device."""
        values, numbers = self._staging[turn]
        if count == 1:
            self._lanes[lane, :rows].copy_(values[:rows], non_blocking=True)
            return
        landed, landed_numbers = self._landing  # type: ignore[misc]
        landed[:count * rows].copy_(values[:count * rows], non_blocking=True)
        landed_numbers[:count].copy_(numbers[:count], non_blocking=True)
        self._lanes[:, :rows].index_copy_(0, landed_numbers[:count], landed[:count * rows].view(count, rows))

    def _mark(self, turn: int) -> None:
        """An event after staging buffer `turn`'s copies, which `_wait_for` waits on before the buffer is reused."""
        self._events[turn] = torch.cuda.Event()
        self._events[turn].record()

    def _wait_for(self, turn: int) -> None:
        """Until staging buffer `turn`'s last copy (two steps ago) has left it: done long since, unless the host
        ran ahead of the device."""
        if self._events[turn] is not None:
            self._events[turn].synchronize()

    def _harvest_span(self, key: Hashable, live: _Live, start: int, count: int, first: int,
                      picked: list[tuple[int, Any, int, int]], layout: list[tuple[Hashable, int, int, int]],
                      lives: dict[Hashable, Any], used: int) -> tuple[int, int]:
        """Give a span's harvested positions pool rows from `used` on, site by site (`picked`, `layout`): the pool's
        rows used after it, and the row after the span's last harvested one."""
        wanted = live.positions
        low, high = bisect.bisect_left(wanted, first), bisect.bisect_left(wanted, first + count)
        if low == high:
            return used, 0
        if low > live.done:
            raise RuntimeError(f"request {key!r}'s positions before {first} ran in no step this plan saw (prefix "
                               f"caching or chunked prefill): start the engine with enable_prefix_caching=False and "
                               f"enable_chunked_prefill=False for a harvest.")
        taken, offset = high - low, start - first
        end = wanted[high - 1] + offset + 1
        at: Any = (slice(wanted[low] + offset, end) if wanted[high - 1] - wanted[low] == taken - 1  # a run: a slice
                   else np.array(wanted[low:high], dtype=np.intp) + offset)
        for number, lane in enumerate(live.harvest_lanes):
            picked.append((lane, at, used + number * taken, taken))
        layout.append((key, taken, low, used))
        lives[key] = live
        live.done = high
        return used + taken * len(live.harvest_lanes), end

    def copy_out(self, harvest: StepHarvest) -> StepHarvest:
        """After the step: its harvested rows on their way to host memory (pinned, not waited for, on a GPU)."""
        if not harvest.used:
            return harvest
        rows = self.pool[:harvest.used]
        if rows.device.type == "cuda":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)  # queued behind the step, before the next step overwrites them
            harvest.event = torch.cuda.Event()
            harvest.event.record()
        else:
            host = rows.clone()
        harvest.rows = host
        return harvest

    def settle(self, harvest: StepHarvest) -> None:
        """Wait for a step's copy and hand each request its rows (`take`)."""
        if harvest.rows is None:
            return
        harvest.wait()
        width = harvest.rows.shape[-1]
        for key, count, offset, base in harvest.layout:
            live = harvest.lives.get(key)
            if live is not None:
                buffer = self._rows.get(key)
                if buffer is None:
                    buffer = self._rows[key] = harvest.rows.new_empty((len(live.sites), len(live.positions), width))
                buffer[:, offset:offset + count] = harvest.rows[base:base + len(live.sites) * count].view(
                    len(live.sites), count, width)

    def take(self, key: Hashable) -> Optional[torch.Tensor]:
        """`key`'s harvest, ``[its sites, positions, hidden]`` on the host (None if none ran), forgotten here;
        complete once every position ran (`complete`)."""
        return self._rows.pop(key, None)

    def complete(self, key: Hashable) -> bool:
        """Whether every harvested position of live request `key` has run."""
        live = self._live.get(key)
        return live is not None and live.done == len(live.positions)
