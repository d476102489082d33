"""One applier for the bulk path and the server: requests enter and leave, and each step's spans plan their rows.

A request's plan (`Live`) is its steers (`SteerEntry`: a site, what the edit
does, which of its positions it edits) and its harvest (sites, prompt
positions). `RequestApplier.enter` makes a request live: the module calls it
needs get one hook each (counted, so a call needed by many requests is hooked
once, and its hook comes off with the last of them), and `leave` takes it back.
`step(spans)` reads the scheduler's spans (`Span`: which request owns which
rows of the step's flattened batch, prefill and decode alike) and works out,
for every hooked module call, one edit per group of steers and one read per
list of harvested sites, over the rows of every request that asked. The hooks
(or an engine's taps, `apply_at`) then run that work.

Requests whose steers are the same (a bulk run's steer over all its prompts;
a server's requests steered by one stored vector) form one bundle: a step
finds each bundle's rows once per distinct position rule, not once per request
and steer, so a steer at every block of a 256-request batch is 32 edits found
from one pass over the spans. Two fast paths come before that: every request
steering every row it runs, with nothing to harvest (`_steady_work`, reused
while the step's requests keep their rows), and every request of the step
steered alike with the same tensors (`uniform_step`: rows ``0:total``).

The bulk path (`streamscope.bulk.apply.Applier`) enters a run's requests at
once and stores each harvested row in its request's buffer; the server
(`streamscope.serve.worker.ServeState`) enters requests as vLLM admits them and
hands the rows to its harvest writer. Both are this class with their own
`store`. The graph-op backend (`streamscope.vllm.graph_plan.GraphPlan`) speaks
the same enter/leave/step vocabulary (docs/graph-ops.md).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence, cast

import torch

from .conditions import Gate, deciding_rows
from .spec import Site
from ..values import INPUT

logger = logging.getLogger("streamscope.serve")

#: The work of one hooked module call in a step: its edits ``(site, mode, rows, delta)`` in order (a condition's
#: decision first, as ``(site, "gate", None, gate)``), then its reads ``(site, rows, [(live, site index, slots)])``.
Work = tuple[list, list]


class Span(NamedTuple):
    """One request's rows in a step's flattened batch: rows ``start .. start + count``, positions ``first ..``.

    `key` names the request (None for a request no plan owns, which is left
    alone). A tuple: a step of a large batch makes one for every request, on
    the engine's critical path.
    """

    key: Optional[Hashable]
    start: int
    count: int  # type: ignore[assignment]
    first: int


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


@dataclass(eq=False)
class SteerEntry:
    """One steer of one request: where it edits, what the edit does, and which of the request's rows it edits."""

    site: Site
    delta: Any  # add/set: ``scale * vector`` in the engine's dtype; any other operation: its `Operation` (or `Gate`)
    mode: Optional[str]  # "add" or "set" (batched across requests), None for an `Operation` applied to its rows
    chosen: Optional[frozenset]  # the prompt positions steered; None for every one
    generated: bool
    length: int
    order: int  # the steer's index among the request's steers at this module call
    from_step: int = 0  # the first generated token steered
    group: tuple = ()  # (site key, order, batch): the requests' steers one edit of a step applies together
    skip_first: bool = False  # every prompt position but the first (the default positions), with `chosen` None
    #: A conditional steer's condition site; its `delta` is then its `streamscope.bulk.conditions.Gate`.
    condition_site: Optional[Site] = None
    slot: int = 0  # the request's slot in its gate (a bulk run's gate serves all of the steer's requests)

    def __post_init__(self) -> None:
        if not self.group:
            # add and set batch every request's rows into one edit; any other operation edits its users' rows
            batch = (id(self.site), self.mode) if self.mode is not None else (id(self.site), id(self.delta))
            self.group = (self.site.key, self.order, batch)

    @property
    def every_row(self) -> bool:
        return (self.chosen is None and not self.skip_first and self.generated and self.from_step == 0
                and self.condition_site is None)

    @property
    def kind(self) -> str:
        """"every" (each row it runs), "but_first" (each but its prompt's first position) or "some" rows."""
        if self.chosen is None and self.generated and self.from_step == 0 and self.condition_site is None:
            return "but_first" if self.skip_first else "every"
        return "some"

    @property
    def rule(self) -> tuple:
        """Which rows it edits, as a value: steers of a request with one rule edit the same rows at every step."""
        return (self.chosen, self.skip_first, self.generated, self.from_step, self.length)

    def ranges(self, span: Span) -> list[tuple[int, int]]:
        """The rows of `span` (its request's) that this steer edits, as row ranges in order."""
        if self.chosen is None and self.generated and self.from_step == 0:
            first = span.start + (self.skip_first and span.first == 0)  # the default: all but position 0
            return [(first, span.start + span.count)] if first < span.start + span.count else []
        ranges = []
        chosen, skip_first, length = self.chosen, self.skip_first, self.length
        for offset in range(span.count):
            position = span.first + offset
            steered = ((chosen is None and (position > 0 or not skip_first)) or
                       (chosen is not None and position in chosen)) if position < length \
                else self.generated and position - length >= self.from_step
            if steered:
                ranges.append((span.start + offset, span.start + offset + 1))
        return ranges


@dataclass(eq=False)
class Live:
    """One request's plan: its steers, and its harvest's sites, positions and progress."""

    steers: list[SteerEntry]
    harvest_id: Optional[str] = None
    harvest_sites: list[Site] = field(default_factory=list)
    harvest_meta: dict[str, Any] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # position -> its slot in the buffer
    key: int = 0  # the harvest's number in the server writer's messages (`streamscope.serve.writer`)
    read: int = 0  # how many (site, position) rows have been read (counted by the server on the engine's thread)
    written: bool = False  # every row read (the server's harvest writer writes the file)
    #: What each harvested row becomes where the hooks run (an SAE's features), ``[rows, hidden] -> [rows, width]``.
    readout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    sae: Optional[tuple[Any, Optional[int]]] = None  # a server harvest of SAE features: (the SAE, top_k)
    every_row: bool = True  # every steer edits every row the request runs (positions "all", generated, from 0)
    hooked: Optional[frozenset] = None  # `keys()`, made once
    #: Made by `RequestApplier.enter`: each steer's rule class (its index among the request's distinct rules),
    #: one steer standing for each class, and the bundle's signature (requests with equal ones step together).
    owner: Optional[Hashable] = None  # the request's key in the applier (set by `enter`)
    classes: list[int] = field(default_factory=list)
    rules: list[SteerEntry] = field(default_factory=list)
    bundle: int = -1
    signature: tuple = ()
    gated: bool = False  # a steer of it is conditional (its gate is planned every step)

    def planned(self) -> bool:
        """Whether a step that runs this request has work for it: it steers, or its harvest has rows left to read
        (a request that only harvested, its harvest read, needs nothing more)."""
        return bool(self.steers) or bool(self.positions) and not self.written

    def keys(self) -> frozenset[tuple[int, str]]:
        """The module calls hooked while this request lives: its steers', its conditions' and its harvest's.

        A harvest's sites stay hooked after its rows are read, until the
        request ends: a hook with no rows to read costs a dictionary look-up
        per call, where taking a block's hooks off and putting them back on
        for the next request's prompt (every other step, under load) costs
        more than the calls it saves.
        """
        if self.hooked is None:
            self.hooked = frozenset({entry.site.key for entry in self.steers} |
                                    {entry.condition_site.key for entry in self.steers if entry.condition_site} |
                                    {site.key for site in self.harvest_sites})
        return self.hooked


def steer_signature(live: Live) -> Optional[tuple]:
    """What `live`'s steers are, as far as a step's edits go (each one's sites, mode and shared tensor, in order),
    where they edit every row it runs with batched tensors and it harvests nothing; else None.

    Requests of one signature need no rows of their own: a step made of them
    alone edits all its rows with each steer's one tensor (`RequestApplier.uniform_step`).
    """
    if live.harvest_sites or not live.every_row or any(entry.mode is None for entry in live.steers):
        return None
    return tuple((entry.group, id(entry.delta)) for entry in live.steers)


class RequestApplier:
    """The live requests' plans, the hooks they need, and each step's rows (see the module's docstring).

    Args:
        device: Where a step's row indices live (the engine's device).
        keep_error: The bulk path's way with an error in a hook: keep the first
            one in `error` (the caller raises it) and do no more work. Otherwise
            (the server's) `hook_failed` takes it: the step's work is dropped,
            the step's requests are aborted with the error, and the engine
            serves on.
        strict: Refuse a harvest whose earlier positions ran in no step seen
            (prefix caching, chunked prefill), naming the engine's flags.
        hooked: Whether hooks go on as requests enter (else from `install`).
        graph: The graph-op backend (`streamscope.vllm.graph_backend.GraphBackend`),
            where the engine has the ops: each entering request's steers and
            harvest that the ops serve go to it, the rest stays on the hooks.
    """

    def __init__(self, device: Any, keep_error: bool = False, strict: bool = False, hooked: bool = True,
                 graph: Any = None) -> None:
        self.device = torch.device(device)
        self.keep_error, self.strict, self.hooked = keep_error, strict, hooked
        self.graph = graph
        self.live: dict[Hashable, Live] = {}
        #: Kept by `enter` and `leave`, so that a step whose live requests are as the last step's costs no pass over
        #: them: how many live requests have work; how many need each hooked module call; how many make each set of
        #: uniform steers (`steer_signature`), one request's steers standing for each set.
        self.planned = 0
        self.key_counts: dict[tuple[int, str], int] = {}
        self.signatures: dict[Optional[tuple], int] = {}
        self.representatives: dict[tuple, list[SteerEntry]] = {}
        self.hooks: dict[tuple[int, str], tuple[Any, str]] = {}  # key -> (the hook's handle, its site's location)
        self.locations: dict[str, tuple[int, str]] = {}
        self.sites_at: dict[tuple[int, str], Site] = {}  # a hooked call's site (its module and location)
        self.work: dict[tuple[int, str], Work] = {}
        #: This step's harvested rows where `store` keeps them: (rows [n, width], [(live, site index, slots)]).
        self.reads: list[tuple[torch.Tensor, list[tuple[Live, int, list[int]]]]] = []
        self.last_shape: Any = None  # the requests' rows of the last step whose work can be reused
        #: Where every live request steers every row it runs with the same tensors and none harvests: their steers,
        #: one request's list standing for all (`steer_signature`); None otherwise.
        self.uniform: Optional[list[SteerEntry]] = None
        self.uniform_work: tuple[int, dict[tuple[int, str], Work]] = (-1, {})
        self._changed = False
        #: Each edit's route (`Site.row_editor`), made once per site and operation while a request uses them:
        #: (site id, operation id) -> [editor, users, site, operation]; at the taps of an engine that replays CUDA
        #: graphs, editors that replay from `graphs` (a `streamscope.vllm.graphed.GraphedEdits`, set before the
        #: first step).
        self.editors: dict[tuple[int, int], list] = {}
        self.graphs: Any = None
        self._tap_editors: dict[tuple[int, int], Any] = {}
        self._prepared: set[int] = set()
        #: Each bundle's number (requests with equal steers step together), by its signature: [number, requests].
        self._bundles: dict[tuple, list[int]] = {}
        self._bundle_numbers = itertools.count()
        #: The first error a hook met (`keep_error`); the other hooks stop working and the caller raises it.
        self.error: Optional[BaseException] = None

    # ---------------------------------------------------------------- requests

    def enter(self, key: Hashable, live: Live) -> None:
        """Make `live` the live request `key`: hooks on the module calls it needs that none had, its editors, and the
        counts a step's plan reads (work left, whether every request steers alike) updated by its share."""
        if key in self.live:
            self.leave(key)
        if self.graph is not None:
            self.graph.enter(key, live)  # what the ops serve leaves `live`, before its hooks are planned
        live.owner = key
        live.gated = any(entry.condition_site is not None for entry in live.steers)
        live.every_row = all(entry.every_row for entry in live.steers)
        rules: dict[tuple, int] = {}
        live.classes = [rules.setdefault(entry.rule, len(rules)) for entry in live.steers]
        live.rules = [live.steers[live.classes.index(number)] for number in range(len(rules))]
        steered: tuple = tuple((entry.group, id(entry.delta), number)
                               for entry, number in zip(live.steers, live.classes))
        steered += tuple(rule.kind for rule in live.rules)
        found_bundle = self._bundles.get(steered)
        if found_bundle is None:
            found_bundle = self._bundles[steered] = [next(self._bundle_numbers), 0]
        found_bundle[1] += 1
        live.bundle, live.signature = found_bundle[0], steered
        self.live[key] = live
        for entry in live.steers:
            if entry.mode is None:
                # by site and operation: the server hands one operation to every steer of one vector and setting
                found = self.editors.get((id(entry.site), id(entry.delta)))
                if found is None:
                    self.editors[(id(entry.site), id(entry.delta))] = [entry.site.row_editor(entry.delta), 1,
                                                                       entry.site, entry.delta]
                else:
                    found[1] += 1
        if live.harvest_sites and id(live.harvest_sites) not in self._prepared:
            for site in live.harvest_sites:  # what a site reads of the model once (head_results' columns)
                site.prepare(self.device)
            self._prepared.add(id(live.harvest_sites))
        for hooked in live.keys():
            count = self.key_counts.get(hooked, 0)
            if not count:
                self._site_of(hooked, live)
                if self.hooked:
                    self._hook_on(hooked)
            self.key_counts[hooked] = count + 1
        signature = steer_signature(live)
        if signature is not None and signature not in self.signatures:
            self.representatives[signature] = live.steers
        self.signatures[signature] = self.signatures.get(signature, 0) + 1
        self.planned += live.planned()
        self._changed = True

    def leave(self, key: Hashable) -> Optional[Live]:
        """The request's `Live`, no longer live (None where it had none): its share of `enter` taken back, and the
        hooks only it needed taken off."""
        if self.graph is not None:
            self.graph.leave(key)
        live = self.live.pop(key, None)
        if live is None:
            return None
        bundle = self._bundles[live.signature]
        bundle[1] -= 1
        if not bundle[1]:
            del self._bundles[live.signature]
        for hooked in live.keys():
            count = self.key_counts[hooked] - 1
            if count:
                self.key_counts[hooked] = count
            else:
                del self.key_counts[hooked]
                self.sites_at.pop(hooked, None)
                if hooked in self.hooks:
                    self._hook_off(hooked)
        for entry in live.steers:
            found = self.editors.get((id(entry.site), id(entry.delta))) if entry.mode is None else None
            if found is not None:
                found[1] -= 1
                if not found[1]:
                    del self.editors[(id(entry.site), id(entry.delta))]
                    self._tap_editors.pop((id(entry.site), id(entry.delta)), None)
        signature = steer_signature(live)
        count = self.signatures[signature] - 1
        if count:
            self.signatures[signature] = count
        else:
            del self.signatures[signature]
            if signature is not None:
                self.representatives.pop(signature, None)
        self.planned -= live.planned()
        self._changed = True
        return live

    def close(self) -> None:
        """Every request made not live (hooks off, the graph ops' plan rid of them): the applier's run is over."""
        for key in list(self.live):
            self.leave(key)
        if self.graph is not None:
            self.graph.close()

    def done(self, live: Live) -> None:
        """`live`'s harvest is read in full (the server counts its rows): it needs no more reads."""
        if not live.written:
            live.written = True
            self.planned -= not live.steers  # its harvest was its only work

    # ---------------------------------------------------------------- a step's plan

    def covers(self, keys: Any) -> bool:
        """Whether the uniform fast path serves a step of the requests `keys` (each live, every live one alike)."""
        self._settle_changes()
        return self.uniform is not None and self.live.keys() >= keys

    def _settle_changes(self) -> None:
        if self._changed:
            only = next(iter(self.signatures)) if len(self.signatures) == 1 else None
            self.uniform = None if only is None else self.representatives[only]
            self.uniform_work = (-1, {})
            self._changed = False

    def step(self, spans: Sequence[Span]) -> None:
        """Take this step's spans (in row order; unknown keys are left alone): every hooked call's work."""
        if self.graph is not None:
            self.graph.step(spans)  # the ops' buffers filled before the step runs, whatever the hooks have to do
        self._settle_changes()
        if not self.planned:  # no live request, or none with work left (their harvests read): no hook has work
            self.work, self.last_shape = {}, None
            return
        self.work = self.plan(spans)

    def uniform_step(self, total: int) -> dict[tuple[int, str], Work]:
        """`plan`'s work where every request of the step is live and `uniform`: each steer edits the step's rows
        ``0:total`` with the tensor every request shares, worked out once per step size."""
        size, work = self.uniform_work
        if size != total:
            work = {}
            for entry in self.uniform or ():  # in the request's order: a second steer at a call after the first
                work.setdefault(entry.site.key, ([], []))[0].append((entry.site, entry.mode, slice(0, total),
                                                                      entry.delta))
            self.uniform_work = (total, work)
        self.last_shape = None  # the general plan's reuse of its own last work does not see these steps
        self.work = work
        return work

    def plan(self, spans: Sequence[Span]) -> dict[tuple[int, str], Work]:
        """Every hooked module call's work this step: its steer edits (by round) and its harvest reads, each over
        the rows of the requests that asked, in the step's flattened batch."""
        live_of = self.live.get
        bundles: dict[int, list[tuple[Live, Span]]] = {}  # the steering requests, by bundle, each in row order
        harvesting: list[tuple[Live, Span]] = []
        steady = True  # every planned request steered at every row, none harvesting
        for span in spans:
            live = live_of(span[0])
            if live is None:
                continue
            if live.positions and not live.written:
                harvesting.append((live, span))
                steady = False
            if live.steers:
                members = bundles.get(live.bundle)
                if members is None:
                    members = bundles[live.bundle] = []
                members.append((live, span))
                steady = steady and live.every_row
        if steady:
            # The same requests at the same rows as the last step edit the same rows with the same vectors.
            rows = [(live, span.start, span.count) for members in bundles.values() for live, span in members]
            if rows != self.last_shape:
                self.last_shape, self.work = rows, self._steady_work(bundles)
            return self.work
        # Each bundle's rows, once per rule class: [ranges, rows in all, index].
        parts = {bundle: [_class_rows(members, number, rule.kind) for number, rule in enumerate(members[0][0].rules)]
                 for bundle, members in bundles.items()}
        shape: Any = None
        if not harvesting and not any(members[0][0].gated for members in bundles.values()):
            # Steps that edit the same rows of the same bundles (a decode step after a decode step) edit as the last
            # one did: its work, without a gate or a read to plan anew.
            shape = ("rows", [(bundle, [part[0] for part in found]) for bundle, found in parts.items()])
            if shape == self.last_shape:
                return self.work
        self.last_shape = shape
        harvests: dict[int, tuple[list[Site], list, list]] = {}  # the harvesting requests by their list of sites
        for live, span in harvesting:
            self._plan_harvest(live, span, harvests)
        work: dict[tuple[int, str], Work] = {}
        index = _Indices(self.device)
        self._plan_steers(bundles, parts, work, index)
        # One read a site for every request whose harvest names the same sites (one list), its rows' index made
        # once for all of the sites.
        for sites, ranges, members in harvests.values():
            found_rows = index(ranges)
            for number, site in enumerate(sites):
                found = work.get(site.key)
                if found is None:
                    found = work[site.key] = ([], [])
                found[1].append((site, found_rows, [(live, number, slots) for live, slots in members]))
        return work

    def _plan_harvest(self, live: Live, span: Span, harvests: dict[int, tuple[list[Site], list, list]]) -> None:
        wanted = live.positions
        last = span.first + span.count
        chosen = [position for position in wanted if span.first <= position < last]
        if not chosen:
            return
        if self.strict and chosen[0] != wanted[0] and span.first > wanted[0]:
            raise RuntimeError(
                f"prompt {span.key}'s positions before {span.first} ran in no step this run could see "
                f"(prefix caching or chunked prefill): start the engine with enable_prefix_caching=False "
                f"and enable_chunked_prefill=False for a harvest.")
        ranges = [(span.start + position - span.first, span.start + position - span.first + 1)
                  for position in chosen]
        slots = [live.slots[position] for position in chosen]
        group = harvests.get(id(live.harvest_sites))
        if group is None:
            group = harvests[id(live.harvest_sites)] = (live.harvest_sites, [], [])
        group[1].extend(ranges)
        group[2].append((live, slots))

    def _plan_steers(self, bundles: dict[int, list[tuple[Live, Span]]], parts: dict[int, list[list]],
                     work: dict[tuple[int, str], Work], index: "_Indices") -> None:
        """Each bundle's rows once per rule class, then each of its steers' group takes them, by round."""
        steers: dict[tuple[int, str], dict[int, dict[tuple, tuple[Site, Optional[str], list, list]]]] = {}
        # a gate's rows and members across bundles, in its edit's row order (a gate is one group: one edit)
        gates: dict[int, tuple[SteerEntry, list[tuple[SteerEntry, Span, int]], list]] = {}
        for bundle, members in bundles.items():
            first = members[0][0]
            found = parts[bundle]
            for place, entry in enumerate(first.steers):
                part = found[first.classes[place]]
                if entry.condition_site is not None:
                    # each member's own steer at this place: its gate slot and prompt length
                    gate = gates.setdefault(id(entry.delta), (entry, [], []))
                    gate[1].extend((live.steers[place], span, sum(stop - start for start, stop in
                                                                  live.steers[place].ranges(span)))
                                   for live, span in members)
                    gate[2].extend(part[0])
                if part[0]:
                    at_round = steers.setdefault(entry.site.key, {}).setdefault(entry.order, {})
                    group = at_round.setdefault(entry.group[2], (entry.site, entry.mode, [], []))
                    group[2].append(part)
                    if entry.mode is not None and part[1] is None:  # the rows a batched vector is repeated over
                        part[1] = sum(stop - start for start, stop in part[0])
                    group[3].append((len(part[0]), entry.delta, part[1]))
        for key, rounds in steers.items():
            edits = []
            for order in sorted(rounds):
                for site, mode, pieces, deltas in rounds[order].values():
                    if len(pieces) == 1:  # one bundle's class: its index, made once for all its steers
                        piece = pieces[0]
                        if piece[2] is None:
                            piece[2] = rows_of(piece[0], self.device)
                        rows = piece[2]
                    else:
                        rows = index([found for piece in pieces for found in piece[0]])
                    edits.append((site, mode, rows, _deltas(deltas) if mode is not None else deltas[0][1]))
            work[key] = (edits, [])
        # A condition is read at its call before any edit there, at the rows its steer edits (and its prompt's).
        for entry, gate_members, ranges in gates.values():
            self._plan_gate(cast(Gate, entry.delta), gate_members, index(ranges) if ranges else None)
            site = cast(Site, entry.condition_site)
            found_work = work.get(site.key)
            if found_work is None:
                found_work = work[site.key] = ([], [])
            found_work[0].insert(0, (site, "gate", None, entry.delta))

    def _steady_work(self, bundles: dict[int, list[tuple[Live, Span]]]) -> dict[tuple[int, str], Work]:
        """`plan`'s work where every request's steers edit all its rows and none harvests: each bundle's steers
        take its requests' whole spans, found once for the bundle."""
        groups: dict[tuple, tuple[Site, Optional[str], list, list]] = {}
        for members in bundles.values():
            ranges = [(span.start, span.start + span.count) for _, span in members]
            count = sum(span.count for _, span in members)
            for entry in members[0][0].steers:
                group = groups.get(entry.group)
                if group is None:
                    group = groups[entry.group] = (entry.site, entry.mode, [], [])
                group[2].extend(ranges)
                group[3].append((len(ranges), entry.delta, count))
        work: dict[tuple[int, str], Work] = {}
        # by round (a request's second steer at a module call after every first one), groups in arrival order
        for (key, _, _), (site, mode, ranges, deltas) in sorted(groups.items(), key=lambda item: item[0][1]):
            work.setdefault(key, ([], []))[0].append(
                (site, mode, rows_of(ranges, self.device), _deltas(deltas) if mode is not None else deltas[0][1]))
        return work

    def _plan_gate(self, gate: Gate, members: list[tuple[SteerEntry, Span, int]], rows: Any) -> None:
        """A conditional steer's step (`Gate.plan`): its rows, each one's slot in the gate and, for a request-scoped
        condition, the prompts deciding in this step. The front end refuses a request-scoped condition where a
        prompt may run in pieces; should one do so, the server aborts the request with the error (`request_failed`), and
        a bulk run (`strict`) raises."""
        if gate.condition.scope != "request":
            gate.plan(rows, None, None)
            return
        row_slots: list[int] = []
        deciding = []
        for entry, span, count in members:
            row_slots.extend([entry.slot] * count)
            try:
                found = deciding_rows(entry.length, span.first, span.count)
            except RuntimeError as error:
                if self.strict:
                    raise
                self.request_failed(span.key, "its conditional steer's deciding rows", error)
                found = None
            if found is not None:
                deciding.append((entry.slot, span.start + found[0], found[1]))
        gate.plan(rows, row_slots, deciding)

    # ---------------------------------------------------------------- hooks

    def install(self) -> "RequestApplier":
        """Hook every module call the live requests need (where hooks did not go on as they entered)."""
        self.hooked = True
        for key in self.key_counts:
            if key not in self.hooks:
                self._hook_on(key)
        return self

    def remove(self) -> None:
        """Take every hook off (the live requests stay; `install` puts them back)."""
        for key in list(self.hooks):
            self._hook_off(key)
        self.hooked = False

    def _site_of(self, key: tuple[int, str], live: Live) -> None:
        conditions = [entry.condition_site for entry in live.steers if entry.condition_site is not None]
        self.sites_at[key] = next(site for site in [entry.site for entry in live.steers] + conditions
                                  + live.harvest_sites if site.key == key)

    def _hook_on(self, key: tuple[int, str]) -> None:
        site = self.sites_at[key]
        self.locations[site.location] = key
        if key[1] == INPUT:
            def before(_module: Any, args: tuple, kwargs: dict, key: Any = key) -> None:
                self.apply(key, (args, kwargs))  # edits go into the call's tensors in place
            self.hooks[key] = (site.module.register_forward_pre_hook(before, with_kwargs=True), site.location)
        else:
            def after(_module: Any, args: tuple, output: Any, key: Any = key) -> None:
                self.apply(key, output)
            self.hooks[key] = (site.module.register_forward_hook(after), site.location)

    def _hook_off(self, key: tuple[int, str]) -> None:
        handle, location = self.hooks.pop(key)
        handle.remove()
        self.locations.pop(location, None)

    def apply_at(self, location: str, raw: Any) -> None:
        """Do the work of the hook at `location` on `raw` (the call's ``(args, kwargs)`` or its output).

        For a vLLM engine that replays CUDA graphs: its hooks do not fire in a
        replayed step, which calls this at each tap instead, on the graph's own
        tensors (rows past the step's tokens are padding no span owns).
        """
        key = self.locations.get(location)
        if key is not None:
            self.apply(key, raw, tap=True)

    def apply(self, key: tuple[int, str], raw: Any, tap: bool = False) -> None:
        """Do the step's work at the hooked call `key` on `raw`: its edits, then its reads (kept by `store`)."""
        work = self.work.get(key)
        if work is None or self.error is not None:
            return
        try:
            self._apply_all(work, raw, tap)
        except Exception as error:  # noqa: BLE001  (a hook must not take the engine down)
            if self.keep_error:
                self.error = error
                return
            self.hook_failed(key, error)

    def request_failed(self, key: Hashable, where: str, error: Exception) -> None:
        """The request `key`'s work at `where` cannot be done in this step (`error`), without `strict`: here it is
        logged; the server (`streamscope.serve.worker.ServeState`) aborts the request, answered with the error, so
        that it never runs unsteered."""
        logger.error("streamscope serve: request %s: %s failed: %s", key, where, error)

    def hook_failed(self, key: tuple[int, str], error: Exception) -> None:
        """A hook at the module call `key` raised `error` mid-step (without `keep_error`): the step's work is
        dropped, so that no later call of the step edits or reads on a half-done plan. The server
        (`streamscope.serve.worker.ServeState`) also aborts every request that had work in the step, each answered
        with the error."""
        logger.exception("streamscope serve: a hook failed; this step's plans were dropped")
        self.work, self.last_shape = {}, None

    def _apply_all(self, work: Work, raw: Any, tap: bool) -> None:
        edits, harvests = work
        editors = self.editors if not tap or self.graphs is None else None
        for site, mode, rows, delta in edits:
            if mode is None:
                if rows is not None:
                    (editors[(id(site), id(delta))][0] if editors is not None else self._tap_editor(site, delta))(
                        raw, rows)
            elif mode == "gate":  # a conditional steer's decision, before the edits at this call
                delta.decide(site, raw)
            elif rows is not None:
                site.edit_rows(raw, rows, delta, mode)
        for site, rows, layout in harvests:
            if rows is not None:
                self.read(site, raw, rows, layout)

    def _tap_editor(self, site: Site, operation: Any) -> Any:
        found = self._tap_editors.get((id(site), id(operation)))
        if found is None:
            found = self._tap_editors[(id(site), id(operation))] = site.row_editor(operation, self.graphs)
        return found

    def read(self, site: Site, raw: Any, rows: Any, layout: list[tuple[Live, int, list[int]]]) -> None:
        """One read of a step's rows at `site`, each request's readout applied (one call where they share it)."""
        read = site.read_rows(raw, rows)  # stays on the device until `store` moves it
        readout = layout[0][0].readout
        if all(live.readout is readout for live, _, _ in layout):
            self.store(read if readout is None else readout(read), layout)
            return
        start = 0  # an SAE harvest's rows become its features here, so the dense rows never leave
        for entry in layout:
            live, count = entry[0], len(entry[2])
            piece = read[start:start + count]
            self.store(piece if live.readout is None else live.readout(piece), [entry])
            start += count

    def store(self, rows: torch.Tensor, layout: list[tuple[Live, int, list[int]]]) -> None:
        """Keep a read's rows (``[rows, width]``, each layout entry's ``len(slots)`` in turn) until the step ends:
        in `reads`, for the caller to take after the step (the server's writer). The bulk path stores them in
        each request's buffer instead."""
        self.reads.append((rows, layout))


def _class_rows(members: list[tuple[Live, Span]], number: int, kind: str) -> list:
    """The rows the steers of rule class `number` edit in a bundle's spans: [ranges, rows in all, index] (the
    last two made where needed). The usual rules (every row; every row but a prompt's first) take one range a span, made inline."""
    # (a span unpacked: faster than its fields by name, once a request a step)
    if kind == "every":
        ranges = [(start, start + count) for _, (_, start, count, _) in members]
    elif kind == "but_first":
        ranges = [(start + (first == 0), start + count) for _, (_, start, count, first) in members
                  if count > (first == 0)]
    else:
        ranges = []
        for live, span in members:
            ranges.extend(live.rules[number].ranges(span))
    return [ranges, None, None]


class _Indices:
    """A step's row indices by their ranges: the same rows at many sites (a harvest of every block reads each
    request's rows at each) make one index, copied to the device once a step rather than once a site."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.found: dict[tuple[tuple[int, int], ...], Any] = {}

    def __call__(self, ranges: list[tuple[int, int]]) -> Any:
        key = tuple(ranges)
        rows = self.found.get(key)
        if rows is None:
            rows = self.found[key] = rows_of(ranges, self.device)
        return rows


def _deltas(deltas: list[tuple[int, torch.Tensor, int]]) -> torch.Tensor:
    """The vector each edited row gets, ``[rows, hidden]``, or one ``[hidden]`` that broadcasts to every row where
    the requests share it (one request, or several steered by the same vector and scale)."""
    first = deltas[0][1]
    if all(delta is first for _, delta, _ in deltas):
        return first
    return torch.cat([delta.expand(rows, -1) for _, delta, rows in deltas])


def features(sae: Any, top_k: Optional[int], rows: torch.Tensor) -> torch.Tensor:
    """An SAE harvest's rows: the SAE's features ``[rows, d_sae]`` (float32), or the top k's values then indices
    ``[rows, 2 k]``, as `streamscope.sae.FeatureReadout` computes them in process."""
    encoded = sae.encode(rows.float())
    if top_k is None:
        return encoded
    top = encoded.topk(top_k, dim=-1)
    return torch.cat([top.values, top.indices.float()], dim=-1)
