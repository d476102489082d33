"""Apply a bulk run's steers and harvests with one hook per module call, for every request of a step at once.

Both engines flatten a step's tokens to rows: vLLM's ``[tokens, hidden]``
batch as it is, transformers' ``[batch, seq, hidden]`` read row-major. The
engine hands the `Applier` each step's `Span`s (which request owns which
rows, and the position of its first row); the Applier works out once per step
which rows every steer edits and every harvest reads, and each module's hook
then makes one edit and one read over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Optional, Sequence, cast

import torch

from .conditions import Gate, deciding_rows
from .operations import Operation
from .spec import Site, Steer
from ..values import INPUT


class Span(NamedTuple):
    """One request's rows in a step's flattened batch: rows ``start .. start + count``, positions ``first ..``.

    `key` names the request in the bulk run (None for a request the run does
    not own, which is left alone). A tuple: a step of a large batch makes one
    for every request, on the engine's critical path.
    """

    key: Optional[Hashable]
    start: int
    count: int
    first: int


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


def rows_of(ranges: list[tuple[int, int]], device: Any) -> Any:
    """Row ranges as an index: a slice when they are one contiguous block, else a tensor of rows."""
    if not ranges:
        return None
    merged: list[list[int]] = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop])
    if len(merged) == 1:
        return slice(merged[0][0], merged[0][1])
    rows: list[int] = []
    for start, stop in merged:
        rows.extend(range(start, stop))
    # Not a blocking copy, which waits for the step's queued kernels before the host goes on; from pageable
    # memory the driver takes the data before the call returns, so the list may go at once.
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def owned_ranges(spans: Sequence[Span], owned: Any) -> list[tuple[int, int]]:
    """The rows of the spans whose key is in `owned`, as ranges, adjacent spans merged (one pass, once a step)."""
    ranges: list[tuple[int, int]] = []
    first = stop = -1
    for key, start, count, _ in spans:
        if key in owned:
            if start != stop:
                if stop >= 0:
                    ranges.append((first, stop))
                first = start
            stop = start + count
    if stop >= 0:
        ranges.append((first, stop))
    return ranges


#: Up to this many harvested rows a request in a step, the step's rows go to the host in one copy per site.
STAGED_ROWS = 4


class Applier:
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
    """

    def __init__(self, harvest_sites: Sequence[Site], harvest_positions: dict[Hashable, list[int]],
                 steers: Sequence[SteerPlan], device: Any, to_host: bool = True, readout: Any = None) -> None:
        self.harvest_sites = list(harvest_sites)
        self.harvest_positions = harvest_positions
        self.steers = list(steers)
        self.device = torch.device(device)
        self.to_host = to_host
        self.readout = readout
        #: key -> [sites, positions, hidden], filled as the prompts run.
        self.harvested: dict[Hashable, torch.Tensor] = {}
        self.handles: list[Any] = []
        #: location -> the work of its hook, for an engine that serves locations without hooks (`apply_at`).
        self.work_at: dict[str, list[tuple[str, int, Site]]] = {}
        self.spans: list[Span] = []
        self._span_of: dict[Hashable, Span] = {}
        self._harvest_rows: Any = None
        self._harvest_layout: list[tuple[Hashable, int, int]] = []  # (key, rows this step, first slot)
        self._staged = False
        self._pending: list[tuple[int, torch.Tensor, list[tuple[Hashable, int, int]]]] = []  # (site, rows, layout)
        self._steer_rows: list[Any] = [None] * len(self.steers)  # each steer's rows this step (None: none)
        # Each steer's edit, its route (vLLM's halves, an ablation's kernels) chosen once for the run.
        self._editors = [plan.site.row_editor(plan.operation) for plan in self.steers]
        #: At the taps of an engine that replays CUDA graphs (`apply_at`): the engine's `GraphedEdits` for this
        #: run, set before the first step, and the editors that replay from it, made at the first tap.
        self.graphs: Any = None
        self._tap_editors: Optional[list[Any]] = None
        self._every_row = [plan.every_row for plan in self.steers]
        self._but_first = [plan.every_row_but_first for plan in self.steers]
        # Steers that edit the same rows (an ablation at every block) share one computation of them per step.
        self._row_groups = _row_groups(self.steers, self._every_row)
        #: The first error a hook met; the run's other hooks stop working and the caller raises it.
        self.error: Optional[BaseException] = None

    # One computation per step, shared by every hook.

    def step(self, spans: Sequence[Span]) -> None:
        """Take this step's spans: which rows each steer edits and each harvest reads."""
        self.spans = list(spans)
        self._span_of = {span.key: span for span in self.spans if span.key is not None}
        harvest_ranges: list[tuple[int, int]] = []
        layout: list[tuple[Hashable, int, int]] = []
        for span in self.spans if self.harvest_positions else ():
            wanted = self.harvest_positions.get(span.key) if span.key is not None else None
            if not wanted:
                continue
            last = span.first + span.count
            chosen = [position for position in wanted if span.first <= position < last]
            if not chosen:
                continue
            if chosen[0] != wanted[0] and span.first > wanted[0]:
                raise RuntimeError(
                    f"prompt {span.key}'s positions before {span.first} ran in no step this run could see "
                    f"(prefix caching or chunked prefill): start the engine with enable_prefix_caching=False "
                    f"and enable_chunked_prefill=False for a harvest.")
            harvest_ranges.extend((span.start + position - span.first, span.start + position - span.first + 1)
                                  for position in chosen)
            layout.append((span.key, len(chosen), wanted.index(chosen[0])))
        self._harvest_rows = rows_of(harvest_ranges, self.device)
        self._harvest_layout = layout
        # Few rows a request (last-position reads, SAE features): one copy of the step's rows per site, split
        # per request afterwards, instead of a copy a request. Many rows a request: straight into its buffer.
        self._staged = len(harvest_ranges) <= STAGED_ROWS * len(layout)
        found: dict[int, Any] = {}
        for group, first in self._row_groups:
            if group not in found:
                found[group] = self._rows_for(self.steers[first], self._every_row[first], self._but_first[first])
        self._steer_rows = [found[group] for group, _ in self._row_groups]
        for index, plan in enumerate(self.steers):
            if plan.condition_site is not None:
                self._plan_gate(plan, self._steer_rows[index])

    def _plan_gate(self, plan: SteerPlan, rows: Any) -> None:
        """A conditional steer's step: its rows, each one's request (request scope), and the prompts deciding."""
        gate = cast(Gate, plan.operation)
        if gate.condition.scope == "row":
            gate.plan(rows, None, None)
            return
        slots = cast(dict, plan.slots)
        steered = self._steered_ranges(plan)
        row_slots = [slots[key] for key, start, stop in steered for _ in range(start, stop)]
        deciding = []
        for key, start, count, first in self.spans:
            if key is not None and key in slots:
                found = deciding_rows(plan.lengths[key], first, count)
                if found is not None:
                    deciding.append((slots[key], start + found[0], found[1]))
        gate.plan(rows, row_slots, deciding)

    def _steered_ranges(self, plan: SteerPlan) -> list[tuple[Hashable, int, int]]:
        """The rows a steer edits this step, as (request, start, stop) in row order: `_rows_for`'s rows."""
        found = []
        steers_generated = plan.steer.steers_generated
        for span in sorted(self.spans, key=lambda span: span.start):
            chosen = plan.positions.get(span.key) if span.key is not None else None
            if chosen is None:
                continue
            length = plan.lengths[span.key]
            for offset in range(span.count):
                position = span.first + offset
                if (position in chosen) if position < length else steers_generated(position - length):
                    found.append((span.key, span.start + offset, span.start + offset + 1))
        return found

    def _rows_for(self, plan: SteerPlan, every_row: bool, but_first: bool = False) -> Any:
        if every_row:  # a steer of every row: no per-token test, the owned requests' rows merged as they come
            return rows_of(owned_ranges(self.spans, plan.lengths), self.device)
        if but_first:  # the default steer: the same, less the row of each prompt's first position
            owned = plan.lengths
            return rows_of([(start + (first == 0), start + count) for key, start, count, first in self.spans
                            if key in owned and count > (first == 0)], self.device)
        ranges: list[tuple[int, int]] = []
        steers_generated = plan.steer.steers_generated
        spans = self.spans
        if len(plan.positions) < len(spans):
            # A steer of a few requests in a large step (a patch is one request's): its own spans, in row order,
            # rather than a pass over every request of the step for each such steer.
            span_of = self._span_of
            spans = sorted((span_of[key] for key in plan.positions if key in span_of), key=lambda span: span.start)
        for span in spans:
            chosen = plan.positions.get(span.key) if span.key is not None else None
            if chosen is None:
                continue
            length = plan.lengths[span.key]
            for offset in range(span.count):
                position = span.first + offset
                if (position in chosen) if position < length else steers_generated(position - length):
                    ranges.append((span.start + offset, span.start + offset + 1))
        return rows_of(ranges, self.device)

    # The hooks.

    def install(self) -> "Applier":
        """Register one hook per (module, input or output) that any site of the run needs."""
        for site in self.harvest_sites:  # what a site reads of the model once (head_results' columns), unhooked
            site.prepare(self.device)
        calls: dict[tuple[int, str], list[tuple[str, int, Site]]] = {}
        # A condition is read at its call before any steer there edits it (`streamscope.bulk.conditions`).
        for index, plan in enumerate(self.steers):
            if plan.condition_site is not None:
                calls.setdefault(plan.condition_site.key, []).append(("condition", index, plan.condition_site))
        for index, plan in enumerate(self.steers):
            calls.setdefault(plan.site.key, []).append(("steer", index, plan.site))
        for index, site in enumerate(self.harvest_sites):
            calls.setdefault(site.key, []).append(("harvest", index, site))
        for (_, where), work in calls.items():
            self.work_at[work[0][2].location] = work
            module = work[0][2].module
            if where == INPUT:
                def before(_module: Any, args: tuple, kwargs: dict, work=work) -> Any:
                    self._apply(work, (args, kwargs))
                    return None  # edits went into the call's tensors in place
                self.handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            else:
                def after(_module: Any, args: tuple, output: Any, work=work) -> Any:
                    self._apply(work, output)
                    return None
                self.handles.append(module.register_forward_hook(after))
        return self

    def apply_at(self, location: str, raw: Any) -> None:
        """Do the work of the hook at `location` on `raw` (the call's ``(args, kwargs)`` or its output).

        For a vLLM engine that replays CUDA graphs: its hooks do not fire in a
        replayed step, which calls this at each tap instead, on the graph's own
        tensors (rows past the step's tokens are padding no span owns).
        """
        work = self.work_at.get(location)
        if work is not None and self.error is None:
            editors = self._tap_editors
            if editors is None:
                editors = self._tap_editors = (self._editors if self.graphs is None else
                                               [plan.site.row_editor(plan.operation, self.graphs)
                                                for plan in self.steers])
            try:  # `_apply`, written out: this runs at every tap of every replayed step
                self._apply_all(work, raw, editors)
            except Exception as error:  # noqa: BLE001  (kept for the caller: a hook must not take the engine down)
                self.error = error

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _apply(self, work: list[tuple[str, int, Site]], raw: Any) -> None:
        if self.error is not None:
            return
        try:
            self._apply_all(work, raw, self._editors)
        except Exception as error:  # noqa: BLE001  (kept for the caller: a hook must not take the engine down)
            self.error = error

    def _apply_all(self, work: list[tuple[str, int, Site]], raw: Any, editors: list[Any]) -> None:
        for kind, index, site in work:
            if kind == "steer":
                rows = self._steer_rows[index]
                if rows is not None:
                    editors[index](raw, rows)
            elif kind == "condition":
                cast(Gate, self.steers[index].operation).decide(site, raw)
            elif self._harvest_rows is not None:
                rows = site.read_rows(raw, self._harvest_rows)
                self._store(index, rows if self.readout is None else self.readout(rows))

    def _store(self, index: int, rows: torch.Tensor) -> None:
        if self._staged:
            # The step's rows in one copy (into pinned host memory on a GPU, queued behind the step's kernels
            # without a sync); `settle` hands each request its rows once the copies are done.
            staged = self._empty(tuple(rows.shape), rows)
            staged.copy_(rows, non_blocking=True)
            self._pending.append((index, staged, self._harvest_layout))
            return
        # Each request's rows straight into its own buffer: no copy is made later.
        self._split(index, rows, self._harvest_layout, non_blocking=True)

    def _split(self, index: int, rows: torch.Tensor, layout: list[tuple[Hashable, int, int]],
               non_blocking: bool) -> None:
        start = 0
        for key, count, offset in layout:
            buffer = self.harvested.get(key)
            if buffer is None:
                buffer = self.harvested[key] = self._buffer(len(self.harvest_positions[key]), rows)
            buffer[index, offset:offset + count].copy_(rows[start:start + count], non_blocking=non_blocking)
            start += count

    def settle(self) -> None:
        """Hand the staged rows to each request's buffer (waiting for their copies to the host first)."""
        if not self._pending:
            return
        if any(staged.is_pinned() for _, staged, _ in self._pending):
            torch.cuda.synchronize()
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


def _row_groups(plans: Sequence[SteerPlan], every_row: Sequence[bool]) -> list[tuple[int, int]]:
    """Per plan, (its group, the group's first plan): plans in one group edit the same rows at every step."""
    groups: dict[Any, tuple[int, int]] = {}
    found = []
    for index, (plan, every) in enumerate(zip(plans, every_row)):
        steer = plan.steer
        # Made once per run: which prompts, at which positions, and from which generated token on.
        signature: Any = (("own", index) if plan.condition_site is not None else  # its rows go with its gate
                          ("every", tuple(sorted(plan.lengths.items()))) if every else
                          ("but_first", tuple(sorted(plan.lengths.items()))) if plan.every_row_but_first else
                          ("some", tuple(sorted((key, tuple(sorted(chosen))) for key, chosen in plan.positions.items())),
                           tuple(sorted(plan.lengths.items())), bool(steer.generated), steer.from_step))
        if signature not in groups:
            groups[signature] = (len(groups), index)
        found.append(groups[signature])
    return found


def steer_plans(steers: Sequence[tuple[Steer, Site]], keys: Sequence[Hashable], lengths: Sequence[int],
                dtype: torch.dtype, device: Any, root: Any = None) -> list[SteerPlan]:
    """Each steer with its vector ready and its positions resolved for every prompt it applies to.

    `keys[i]` names prompt i in the run; `lengths[i]` is its token count. `root` is the envoy tree the sites were
    found on, where a conditional steer's condition site is found too (a conditional steer needs it).
    """
    from .spec import locate, steer_positions

    plans = []
    for steer, site in steers:
        indices = list(range(len(keys)) if steer.prompts is None else steer.prompts)
        positions = {keys[i]: frozenset(steer_positions(steer, lengths[i], i)) for i in indices}
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
