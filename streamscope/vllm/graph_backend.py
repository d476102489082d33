"""The graph-op backend of the one applier: a request's steers and harvest served by the graph ops where they can be.

`streamscope.bulk.requests.RequestApplier` plans requests' rows for Python
hooks. Built with a `GraphBackend`, it hands each entering request to it
first: the steers and the harvest that the ops at `graph_sites` serve go to
the engine's `GraphPlan` (`streamscope.vllm.graph_plan`: persistent buffers the
ops read, filled once a step), the rest stays on the hooks, as before. What
stays on the hooks, and why:

* a steer at a value the ops do not serve (a scaled value, a value computed
  from another point of a call: `graph_wiring.unserved`), an SAE feature clamp
  (not a fixed-size operation a slot holds), every steer of a conditional
  request (its condition is read at its call before any edit there, and the
  ops run first at a call);
* a steer past the plan's edit rounds at its site, and any steer at a module
  call after one that stays on the hooks or out of the ops' order there (at a
  module call the ops run before the hooks, in their site and round order, so
  only steers that keep the request's order go to the ops);
* a request's harvest where any of its steers stays on the hooks (the ops read
  before the hooks edit at a call), where a site has no harvest op, or where
  its rows become something else where they are read (an SAE's features);
* everything of a request the plan refuses (a full slot bank): a logged
  fall-back to the hooks, never a request half-planned.

Where the applier's hooks do not fire (vLLM compiles the model: a GPU server
with ``--graph-ops``, or ``streamscope.load(..., graph_ops=True,
enforce_eager=False)``), none of that may stay on the hooks, where it would
silently not run: `GraphBackend.enter` refuses such a request whole
(`LeftOnHooks`, the plan as it was), and its caller answers it with the error
(the bulk run raises it; the server answers the request with it,
`streamscope.serve.refusals`).

The two backends' rows meet where the applier hands a request its harvest:
the bulk path's `Applier.take` gives a graph-harvested request the plan's
rows, ``[sites, positions, hidden]``, in the layout of its hook reads; the
server (`streamscope.serve.worker.ServeState.send_graph`) takes each step's
rows as they leave the device (`GraphBackend.hand_over`) and hands them to
its harvest writer, as it hands the hooks' reads.

At load a worker calls `insert_at_load`: with the engine's option
(``streamscope.load(path, engine="vllm", graph_ops=True)``, or
``streamscope serve --graph-ops``, carried in vLLM's
``additional_config`` under `CONFIG_KEY`, the compile cache salted beside it
under `graph_ops.SALT_KEY`) it builds the plan, sized from the runner's
``max_num_batched_tokens``, and inserts the ops at every site before the
engine's profile run and warm-up, so a compiled graph holds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Hashable, Optional, Sequence

import torch

from .. import nnsight_seam, vllm_seam
from ..bulk.operations import Operation
from ..bulk.requests import Live, Span, SteerEntry
from ..bulk.sites import Site
from .families import envoy_tree, family_for
from .graph_ops import IDLE, IDLE_SET, LEAN_SET, cache_salt, ops_source, salted
from .graph_plan import INDEX_LAYOUT, GraphPlan, PlannedSteer, PoolBusy, default_pool
from .graph_wiring import graph_sites, insert_ops, stretches_of, wiring_source
from .row_rules import rule_of

logger = logging.getLogger("streamscope.bulk")

#: The key of the graph ops' options in vLLM's ``additional_config`` (what `insert_at_load` reads).
CONFIG_KEY = "streamscope_graph"
#: Where a worker's model runner keeps its `GraphOps` (its ``__dict__``).
RUNNER_ATTRIBUTE = "_streamscope_graph_ops"
#: The values an op sits at by default: every block's stream boundaries and sublayer outputs.
DEFAULT_VALUES = ("layer_input", "layer_mid", "mlp_input", "layer_output", "self_attn.attention_output",
                  "mlp.mlp_output")


@dataclass(frozen=True)
class GraphOptions:
    """What an engine started with graph ops holds (``graph_ops=GraphOptions(...)``, a dict of these fields, or True
    for these defaults).

    Args:
        slots: How many distinct operations (a vector with its mode and
            settings) may be live at once; a request that brings more runs on
            the hooks.
        rounds: Edit ops at each site: how many steers one request may put at
            one site through the ops (more stay on the hooks).
        values: The values an edit op sits at, on every block that serves them.
        harvest: The values a harvest op sits at (every block that serves
            them). The harvest ops share one pool of rows.
        harvest_pool: The pool's rows, each a (position, site) a step
            harvests, ``harvest_pool x hidden`` in the engine's dtype (None:
            `graph_plan.POOL_SITES` sites at every row of a step, 8 x
            ``max_num_batched_tokens``). A request whose harvest alone could
            take more rows in one step is refused; one that fits once the
            live harvests have read their prompts waits (a 503 on a server).
        join: Whether the sites of a run with nothing computed between their
            module calls are one launch at the run's last call (about 3 a
            block instead of 6; `graph_wiring.chains`). False: one launch a
            site, to compare.
        idle_graphs: On a GPU with CUDA graphs: capture, beside each of vLLM's
            graphs, one of the same batch without the ops, which a step that
            marks no row replays (`vllm_seam.keep_graph_sets`): plain
            requests then run none of the ops' launches, at the cost of a
            second capture at start (its time and graph memory, about as much
            again as vLLM's own). On by default: plain requests on a GPU run
            at plain vLLM's speed only with them (issue 39's H100 runs:
            benchmarks/RESULTS.md); False saves the second capture. Does
            nothing where the engine captures no graph (a CPU,
            ``enforce_eager``), where the ops already skip an idle step in
            Python.
        lean_values: On a GPU with CUDA graphs: capture, beside vLLM's
            graphs, one more of each batch holding only the ops at these
            values' sites (those of `values` and `harvest` the model serves),
            which a step that marks no other site replays: a steer, an
            ablation or a harvest at every block's layer_output then launches
            one op a block (its run with the next block's layer_input,
            `join`), not one at each of the block's runs (about 3), for one
            more capture at start. Empty, or where these values' sites are
            every site: no such set. Like `idle_graphs`, nothing changes
            where no graph is captured. On by default at layer_output (on
            the H100 a steer at every block's layer_output went from 0.930
            to 0.945 of plain `vllm serve`, its TPOT from 3.8% to 1.4% above
            plain vLLM's: benchmarks/RESULTS.md, the thirty-fourth session);
            ``()`` saves the third capture.
    """

    slots: int = 256
    rounds: int = 2
    values: tuple[str, ...] = DEFAULT_VALUES
    harvest: tuple[str, ...] = DEFAULT_VALUES
    harvest_pool: Optional[int] = None
    join: bool = True
    idle_graphs: bool = True
    lean_values: tuple[str, ...] = ("layer_output",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        object.__setattr__(self, "harvest", tuple(self.harvest))
        object.__setattr__(self, "lean_values", tuple(self.lean_values))
        if self.slots < 1 or self.rounds < 1:
            raise ValueError(f"graph_ops: slots={self.slots}, rounds={self.rounds}: each is at least 1.")
        unknown = [value for value in self.values + self.harvest + self.lean_values if value not in DEFAULT_VALUES]
        if unknown:
            raise ValueError(f"graph_ops: no op sits at {unknown}: the ops serve {list(DEFAULT_VALUES)}; other values "
                             f"stay on the hook path.")
        if self.harvest_pool is not None and self.harvest_pool < 1:
            raise ValueError(f"graph_ops: harvest_pool={self.harvest_pool}: at least 1 row (None: the default, 8 "
                             f"sites at every row of a step).")

    @classmethod
    def of(cls, option: Any) -> Optional["GraphOptions"]:
        """`option` as options: None or False for none, True for the defaults, a dict of fields, or options."""
        if option is None or option is False:
            return None
        if option is True:
            return cls()
        if isinstance(option, cls):
            return option
        if isinstance(option, dict):
            names = {item.name for item in fields(cls)}
            unknown = sorted(set(option) - names)
            if unknown:
                raise ValueError(f"graph_ops: unknown option(s) {unknown}; the options are {sorted(names)}.")
            return cls(**option)
        raise TypeError(f"graph_ops={option!r}: pass True, False, a dict of GraphOptions' fields or a GraphOptions.")

    def config(self) -> dict[str, Any]:
        """The options as vLLM's ``additional_config`` carries them (plain JSON values)."""
        return {"slots": self.slots, "rounds": self.rounds, "values": list(self.values),
                "harvest": list(self.harvest), "harvest_pool": self.harvest_pool, "join": self.join,
                "idle_graphs": self.idle_graphs, "lean_values": list(self.lean_values)}

    def salt(self) -> str:
        """The compile cache's salt for these options: the ops' and the wiring's code (the families' runs with it),
        the values, the rounds, whether runs are joined."""
        return cache_salt(list(self.values), self.rounds, list(self.harvest),
                          ops_source() + wiring_source() + f"join={self.join}" + f"index={INDEX_LAYOUT}")


def engine_config(option: Any, additional_config: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """`additional_config` with the graph ops' options and the compile cache's salt (a new dict), or None where
    `option` asks for no ops."""
    options = GraphOptions.of(option)
    if options is None:
        return None
    config = salted(additional_config, options.salt())
    config[CONFIG_KEY] = options.config()
    return config


@dataclass
class GraphOps:
    """The ops on one worker's model: the plan they read, the sites they serve by module call and value, the hooks
    that call them (`inserted`), and the values left to the hook path with the reason (`skipped`)."""

    plan: Any  # streamscope.vllm.graph_plan.GraphPlan
    names: dict[tuple[int, str, int], str]
    inserted: Any  # streamscope.vllm.graph_wiring.Inserted
    skipped: dict[str, str] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)  # each edit site's place where its op runs
    #: The chain a joined site runs in (`graph_wiring.chains`): its ops run at the chain's last module call, so a
    #: request's order there is the chain's, and its hooks at the chain's earlier calls run before them.
    chain_of: dict[str, int] = field(default_factory=dict)
    #: Each chain's module calls in order (`Site.key`), its sites' places in it as `order` gives them.
    chain_calls: list[list[tuple[int, str]]] = field(default_factory=list)
    #: How many requests' steers and harvests the ops have served since load (each steer of each request once).
    served: dict[str, int] = field(default_factory=lambda: {"steers": 0, "harvests": 0})
    #: The steps since load: ``marked`` (some row to edit or harvest) and ``idle`` (none: a step an applier planned
    #: without marks, or one no applier planned).
    steps: dict[str, int] = field(default_factory=lambda: {"marked": 0, "idle": 0})
    #: The idle CUDA graphs (`GraphOptions.idle_graphs`): "off" (not asked for), "kept", or why they are not.
    idle_graphs: str = "off"
    #: The lean CUDA graphs (`GraphOptions.lean_values`): "off" (no such set), "kept", or why they are not.
    lean_graphs: str = "off"

    def close_step(self, _scheduler_output: Any = None) -> None:
        """Each step, after every applier took its schedule in (`insert_at_load`): a step none of them planned (vLLM
        called through ``model.vllm_entrypoint``, a trace, a bulk run stopped by its error) marks no row. Without
        this the ops would run its rows by the index the last planned step left: a steer of a finished run would
        edit them, and its ops' host time would be spent for nothing."""
        plan = self.plan
        if not plan.claimed:
            plan.step(())  # resets the index where the last step marked (nothing to copy where it is clean), idle
            self.steps["idle"] += 1
        plan.claimed = False

    def name_of(self, site: Site) -> Optional[str]:
        """The plan's name of `site` (found on any envoy tree over the same model), None where no op sits there."""
        return self.names.get((id(site.module), site.where, id(site.descriptor)))


def build(model: torch.nn.Module, model_type: str, options: GraphOptions, max_rows: int, hidden: int,
          dtype: torch.dtype, device: Any, plain: bool = False) -> GraphOps:
    """The plan for `model` (a worker's vLLM model of `model_type`) sized by `options` and `max_rows` (the engine's
    ``max_num_batched_tokens``), with the ops inserted at every site of `options` that the model serves. `plain`:
    the model runs on vLLM's own runner (no nnsight runner), so it keeps vLLM's forwards, which its compile needs."""
    family = family_for(model_type)
    # the envoys a trace and the bulk path locate sites on; an envoy installs nnsight's controller as each module's
    # forward, which vLLM's compile cannot trace (it hashes the forward's code): a plain model gets its own back
    root = (nnsight_seam.uninstrumented(model, lambda module: envoy_tree(module, family)) if plain
            else envoy_tree(model, family))
    sites, skipped = graph_sites(root, values=tuple(dict.fromkeys(options.values + options.harvest)))
    harvests = [name for name in sites if name.split(".", 2)[2] in options.harvest]
    edits = [name for name in sites if name.split(".", 2)[2] in options.values]
    pool = default_pool(max_rows, len(harvests)) if options.harvest_pool is None else options.harvest_pool
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        check_harvest_memory(pool, hidden, dtype, free)
    plan = GraphPlan(edits, options.rounds, max_rows, hidden, dtype, device, slots=options.slots,
                     harvest_sites=harvests, harvest_pool=pool)
    by_name: dict[Hashable, Site] = {name: site for name, site in sites.items()}
    inserted = insert_ops(plan, by_name, stretches_of(family) if options.join else ())
    names = {(id(site.module), site.where, id(site.descriptor)): name for name, site in sites.items()}
    order = {name: number for number, name in enumerate(edits)}
    chain_of: dict[str, int] = {}
    for number, chain in enumerate(inserted.chains):
        for place, name in enumerate(chain):
            order[name], chain_of[name] = place, number
    return GraphOps(plan, names, inserted, skipped, order, chain_of,
                    [[sites[name].key for name in chain] for chain in inserted.chains])


def check_harvest_memory(pool: int, hidden: int, dtype: torch.dtype, free: int) -> None:
    """Refuse a harvest pool of `pool` rows that takes more than half the device memory left after the weights
    (`free` bytes), naming the setting that shrinks it (the default pool takes 512 MiB at the Llama-3-8B shape
    and 1 GiB at the 70B one)."""
    need = (pool + 1) * hidden * dtype.itemsize
    if need <= free // 2:
        return
    raise ValueError(
        f"streamscope graph ops: the harvest pool ({pool} rows x {hidden}, {dtype}) needs {need / 2**30:.1f} GiB, "
        f"more than half the {free / 2**30:.1f} GiB the device has left after the weights: start the engine with "
        f"a smaller pool (--graph-ops '{{\"harvest_pool\": {max(pool // 4, 1)}}}'; streamscope.load(..., "
        f"graph_ops={{\"harvest_pool\": ...}}) in process), which holds fewer sites' rows a step.")


def insert_at_load(worker: Any) -> Optional[GraphOps]:
    """Called by a worker once its model is loaded (before the profile run): where the engine was started with graph
    ops (`CONFIG_KEY` in ``additional_config``), the plan built and the ops inserted, kept on the model runner
    (`graph_ops_of`); None otherwise."""
    config = vllm_seam.additional_config(worker).get(CONFIG_KEY)
    if not config:
        return None
    runner = vllm_seam.runner_of(worker)
    model = vllm_seam.model_of(runner)
    options = GraphOptions.of(dict(config))
    assert options is not None
    parameter = next(model.parameters())
    ops = build(model, vllm_seam.runner_model_type(runner), options, vllm_seam.max_batched_tokens(runner),
                vllm_seam.hidden_size(runner), vllm_seam.runner_dtype(runner), parameter.device,
                plain=getattr(runner, "nnsight_model", None) is None)
    runner.__dict__[RUNNER_ATTRIBUTE] = ops
    vllm_seam.after_schedule(runner, ops.close_step, last=True)
    sets = graph_sets(ops, options)
    if sets:
        why_not = vllm_seam.keep_graph_sets(runner, IDLE, sets)
        state = "kept" if why_not is None else f"not kept: {why_not} (the ops skip an idle step in Python)"
        ops.idle_graphs = state if IDLE_SET in sets else "off"
        ops.lean_graphs = state if LEAN_SET in sets else "off"
        logger.info("streamscope: CUDA graph sets %s %s", sorted(sets), state)
    pool = ops.plan.pool
    logger.info("streamscope: graph ops at %d sites (%d harvest), %d slots, %d rounds; harvest pool %s, %.2f GiB "
                "(harvest_pool sets its rows)", len(ops.plan.sites), len(ops.plan.harvest_sites), options.slots,
                options.rounds, list(pool.shape), pool.numel() * pool.element_size() / 2**30)
    return ops


def graph_sets(ops: GraphOps, options: GraphOptions) -> dict[str, frozenset[int]]:
    """The graph sets `options` ask for, each its name to the plan's index columns whose ops it keeps
    (`vllm_seam.keep_graph_sets`): the idle set none, the lean set those of the sites at `options.lean_values`
    (left out where it keeps every column, or none); sets the plan's `lean_columns` to the lean set's."""
    plan = ops.plan
    sets: dict[str, frozenset[int]] = {IDLE_SET: frozenset()} if options.idle_graphs else {}
    lean = [name for name in dict.fromkeys([*plan.sites, *plan.harvest_sites])
            if str(name).split(".", 2)[2] in options.lean_values]
    kept = plan.columns_of(lean)
    plan.lean_columns = kept if kept and kept != plan.columns else None
    if plan.lean_columns is not None:
        sets[LEAN_SET] = kept
    elif options.lean_values:  # asked for, and nothing to gain: said, not left for the info route to show
        logger.warning("streamscope: no lean CUDA graphs: the ops at %s are %s, so a lean set would replay what "
                       "vLLM's graphs do", list(options.lean_values),
                       "at no site of this model" if not kept else "at every site")
    return sets


def graph_ops_of(runner: Any) -> Optional[GraphOps]:
    """The `GraphOps` a worker's runner holds (`insert_at_load`), or None where its engine has none."""
    return runner.__dict__.get(RUNNER_ATTRIBUTE)


def backend_for(runner: Any, hooks_fire: Optional[bool] = None) -> Optional["GraphBackend"]:
    """A `GraphBackend` over the runner's ops for one applier, or None where its engine has none. `hooks_fire`:
    whether the applier's hooks fire in a step (None: where vLLM does not compile the model, or a tapped runner
    replays its work at the taps); where they do not, a request the ops cannot serve whole is refused."""
    ops = graph_ops_of(runner)
    if ops is None:
        return None
    if hooks_fire is None:
        hooks_fire = getattr(runner, "nnsight_model", None) is not None or not vllm_seam.compiled(runner)
    return GraphBackend(ops, hooks_fire)


#: How many request shapes a backend remembers how it divided (`GraphBackend._divide`): a bulk run has one or a
#: few; a server's requests come and go, and the memory is cleared when full.
DIVISIONS = 256


class LeftOnHooks(ValueError):
    """Where hooks do not fire (a compiled engine): a request with work the graph ops cannot take, refused whole,
    the plan as it was. ``key``: the applier's request; ``busy``: the slot bank is full of other requests'
    operations (``slots`` of them), or with ``pool`` the harvest pool (of ``pool`` rows) is held by their harvests,
    so the same request may pass later; otherwise the ops cannot serve it at all (``where``: the sites left
    over)."""

    def __init__(self, message: str, busy: bool = False, slots: int = 0, where: Sequence[str] = (),
                 key: Hashable = None, pool: int = 0) -> None:
        super().__init__(message)
        self.busy, self.slots, self.where, self.key, self.pool = busy, slots, list(where), key, pool


def row_rule(entry: SteerEntry) -> Any:
    """The rows `entry` edits as the plan's `RowRule` (its prompt positions, then generated tokens)."""
    return rule_of(entry.rule)


def operation_of(entry: SteerEntry) -> Optional[Operation]:
    """The slot operation of `entry`, or None where the ops cannot run it (an SAE clamp, a gate): a batched add or
    set (its delta ``scale * vector``) as an `Operation`, any other entry's own."""
    if entry.condition_site is not None:
        return None
    if entry.mode in ("add", "set") and isinstance(entry.delta, torch.Tensor):
        return Operation(entry.mode, entry.delta, entry.delta, 1.0, 0.0, False)
    if isinstance(entry.delta, Operation) and entry.delta.mode in ("add", "set", "ablate", "clamp"):
        return entry.delta
    return None


@dataclass
class Handed:
    """A step's rows harvested through the ops, handed to the server's writer (`GraphBackend.hand_over`).

    ``rows [used, hidden]`` (on the host once ``event``, if any, has passed):
    the pool's rows the step filled. ``layout`` is each harvesting request's
    ``(key, count, first position index, first row)``: its `count` positions
    at each of its sites, site by site from that row of ``rows``; ``lives``
    the plan's record of each (its ``sites``, ``positions``, and ``done``:
    its positions harvested so far, this step's included).
    """

    rows: torch.Tensor
    event: Any
    layout: list[tuple[Hashable, int, int, int]]
    lives: dict[Hashable, Any]


class GraphBackend:
    """One applier's side of the graph ops: which of its requests' work the plan does, each step's fill, the rows
    harvested (see the module's docstring). Requests are the applier's keys; the plan is the worker's, shared by
    the appliers it runs one after another."""

    def __init__(self, ops: GraphOps, hooks_fire: bool = True) -> None:
        self.ops = ops
        #: Whether the applier's hooks fire: where not, `enter` refuses what it would leave to them (`LeftOnHooks`).
        self.hooks_fire = hooks_fire
        self.plan = ops.plan
        self.entered: set[Hashable] = set()
        self.harvesting: set[Hashable] = set()  # requests whose harvest the ops read
        self.kept: dict[Hashable, list[Any]] = {}  # each entered request's operations in the plan (`enter`)
        self.steering: dict[Hashable, int] = {}  # requests' steers the ops apply, by request
        self._current: Any = None  # the step whose harvest is in the ops' buffers
        self._copied: list[Any] = []  # steps' harvests on their way to host memory
        #: `_divide`'s answers by request shape, and `_planned`'s lists: at most `DIVISIONS` of each.
        self._divisions: dict[tuple, tuple] = {}
        self._planned_lists: dict[tuple, tuple] = {}
        #: Both answers by the identity of a request's list of steers, which a bulk run's requests with the same
        #: entries share (`streamscope.bulk.apply.run_requests`): each keeps its list alive while it is cached.
        self._by_list: dict[int, tuple] = {}

    def enter(self, key: Hashable, live: Live) -> None:
        """Give the plan what it serves of `live` (the applier's request `key`); `live` keeps the rest, changed in
        place (its steers, its harvest) before the applier plans its hooks."""
        graphed, hooked, harvest, steers = self._routes(live)
        if not self.hooks_fire and (hooked or (live.harvest_sites and not harvest)):
            where = sorted({entry.site.location for entry in hooked}
                           | {site.location for site in (() if harvest else live.harvest_sites)})
            raise LeftOnHooks(f"request {key!r}: the engine is compiled, where hooks do not fire, and its graph ops "
                              f"cannot serve its work at {where} (a value without an op, an SAE or conditional "
                              f"steer, steers at one module call out of the ops' order or past their rounds, a "
                              f"harvest beside such a steer or of positions out of order)", where=where,
                              key=key)
        if not graphed and not harvest:
            return
        names = [self.ops.name_of(site) for site in live.harvest_sites] if harvest else None
        try:
            self.plan.enter(key, steers, live.positions if harvest else (), names)
        except (ValueError, RuntimeError) as error:  # a full bank: the hooks serve the whole request
            if not self.hooks_fire:
                slots = self.plan.bank.bank.shape[0]
                raise LeftOnHooks(f"request {key!r}: {error}", busy=isinstance(error, RuntimeError),
                                  slots=slots, key=key,
                                  pool=self.plan.pool_rows if isinstance(error, PoolBusy) else 0) from error
            logger.info("streamscope: request %r runs on the hooks: %s", key, error)
            return
        self.entered.add(key)
        self.steering[key] = len(graphed)
        # A slot is keyed by its operation's identity: the operations stay alive while their request is, so that no
        # later operation takes a live one's id (and with it that one's slot and vector).
        self.kept[key] = [entry.delta for entry, _, _ in graphed]
        self.ops.served["steers"] += len(graphed)
        self.ops.served["harvests"] += harvest
        live.steers = hooked
        if harvest:
            self.harvesting.add(key)
            live.harvest_sites, live.positions, live.slots = [], [], {}
        live.hooked = None  # its hooked module calls, counted anew

    def _routes(self, live: Live) -> tuple[list[tuple[SteerEntry, str, Operation]], list[SteerEntry], bool,
                                           list[PlannedSteer]]:
        """`_divide`'s answer for `live` and the plan's steers of what the ops serve (`_planned`): once for each
        list of steers a bulk run's requests share, else worked out (from the shape's caches)."""
        harvest_key = (id(live.harvest_sites) if live.harvest_sites else None, self._harvestable(live))
        found = self._by_list.get(id(live.steers))
        if found is not None and found[0] is live.steers and found[1] == harvest_key:
            return found[2]
        graphed, hooked, harvest = self._divide(live)
        routes = (graphed, hooked, harvest, self._planned(graphed) if graphed else [])
        if len(self._by_list) >= DIVISIONS:
            self._by_list.clear()
        self._by_list[id(live.steers)] = (live.steers, harvest_key, routes, live.harvest_sites)
        return routes

    def _divide(self, live: Live) -> tuple[list[tuple[SteerEntry, str, Operation]], list[SteerEntry], bool]:
        """`live`'s steers the ops apply (each with its site's name and operation), those left to the hooks, and
        whether the ops read its harvest. Worked out once for each shape of request (`_shape`): a bulk run's
        requests share their steers' sites and operations, and only their positions differ."""
        shape, pinned = self._shape(live)
        found = self._divisions.get(shape)
        if found is None:
            graphed, hooked, harvest = self._divided(live)
            places = {id(entry): index for index, entry in enumerate(live.steers)}
            found = ([(places[id(entry)], name, operation) for entry, name, operation in graphed],
                     [places[id(entry)] for entry in hooked], harvest, pinned)
            if len(self._divisions) >= DIVISIONS:
                self._divisions.clear()
            self._divisions[shape] = found
        steers = live.steers
        return ([(steers[index], name, operation) for index, name, operation in found[0]],
                [steers[index] for index in found[1]], found[2])

    def _shape(self, live: Live) -> tuple[tuple, tuple]:
        """What `_divided` reads of `live`, as a key: each steer's site, operation and kind, and its harvest's sites
        and whether its rows could go to the ops; with the objects whose ids the key holds, which the cached
        division keeps alive (so no later object takes one of their ids while it is cached)."""
        steers = tuple((id(entry.site), id(entry.delta), entry.mode, entry.condition_site is None)
                       for entry in live.steers)
        pinned = (tuple((entry.site, entry.delta) for entry in live.steers), live.harvest_sites)
        return (steers, id(live.harvest_sites) if live.harvest_sites else None, self._harvestable(live)), pinned

    def _divided(self, live: Live) -> tuple[list[tuple[SteerEntry, str, Operation]], list[SteerEntry], bool]:
        """`_divide`'s answer worked out: the ops' order and rounds first (`_split`), then the chains that must
        leave for the hooks, until none does."""
        graphed, hooked = self._split(live)
        harvest = self._harvests(live, hooked)
        leaving = self._leaving_chains(live, graphed, hooked, harvest)
        while leaving:  # each steer that leaves puts more of the request on the hooks
            on_hooks = {id(entry) for entry in hooked} | leaving
            graphed = [item for item in graphed if id(item[0]) not in leaving]
            hooked = [entry for entry in live.steers if id(entry) in on_hooks]
            harvest = self._harvests(live, hooked)
            leaving = self._leaving_chains(live, graphed, hooked, harvest)
        return graphed, hooked, harvest

    def _planned(self, graphed: list[tuple[SteerEntry, str, Operation]]) -> list[PlannedSteer]:
        """The plan's steers of a request's `graphed` steers. Requests whose steers name the same sites, operations
        and rows share one list, which `GraphPlan.enter` reads and keeps none of: a bulk run's requests (every row,
        and every row but the first, are one `row_rule` whatever the prompt's length), and a server's requests that
        send the same steers (their operations are shared: `ServeState.shared`), whether or not they share their
        entries (`ServeState.admitted_steers`)."""
        rules = [row_rule(entry) for entry, _, _ in graphed]
        key = tuple((name, id(operation), id(entry.delta), id(rule))
                    for (entry, name, operation), rule in zip(graphed, rules))
        found = self._planned_lists.get(key)
        if found is None:
            steers = [PlannedSteer([name], operation, rule, ("operation", id(entry.delta), operation.mode))
                      for (entry, name, operation), rule in zip(graphed, rules)]
            if len(self._planned_lists) >= DIVISIONS:
                self._planned_lists.clear()
            # the operations, deltas and rules whose ids the key holds, kept alive while it is cached
            found = self._planned_lists[key] = (steers, tuple((operation, entry.delta, rule) for (entry, _, operation),
                                                              rule in zip(graphed, rules)))
        return found[0]

    def _leaving_chains(self, live: Live, graphed: list[tuple[SteerEntry, str, Operation]],
                        hooked: list[SteerEntry], harvest: bool) -> set[int]:
        """The steers of `graphed` (by id) that must leave a chain for the hooks: a chain's ops run at its last
        module call, after the hooks at its earlier calls, so where the request has hook work (a steer, or its
        harvest's reads) at a chain's call before the last, its steers in the chain at or before that call go to
        the hooks too, where each runs at its own call."""
        calls = {entry.site.key for entry in hooked}
        if live.harvest_sites and not harvest:
            calls |= {site.key for site in live.harvest_sites}
        leaving: set[int] = set()
        for entry, name, _ in graphed:
            chain = self.ops.chain_of.get(name)
            if chain is not None and any(place >= self.ops.order[name]
                                         for place, call in enumerate(self.ops.chain_calls[chain][:-1])
                                         if call in calls):
                leaving.add(id(entry))
        return leaving

    def _harvests(self, live: Live, hooked: list[SteerEntry]) -> bool:
        """Whether the ops read `live`'s harvest: none of its steers on the hooks, and the harvest one they can."""
        return not hooked and self._harvestable(live)

    def _harvestable(self, live: Live) -> bool:
        """Whether the ops could read `live`'s harvest, its steers aside: rows as they are (no readout, no SAE),
        every site with a harvest op, its positions in order."""
        return (live.readout is None and live.sae is None and bool(live.positions)
                and all(self.ops.name_of(site) in self.plan.harvest_index for site in live.harvest_sites)
                and all(later > earlier for earlier, later in zip(live.positions, live.positions[1:]))
                and live.positions[0] >= 0)

    def _split(self, live: Live) -> tuple[list[tuple[SteerEntry, str, Operation]], list[SteerEntry]]:
        """`live`'s steers the ops apply (each with its site's name and operation) and those left to the hooks."""
        if any(entry.condition_site is not None for entry in live.steers):
            return [], list(live.steers)
        graphed: list[tuple[SteerEntry, str, Operation]] = []
        hooked: list[SteerEntry] = []
        on_hooks: set[Hashable] = set()  # module calls (a joined site: the site) where a steer stays on the hooks
        last: dict[Hashable, tuple[int, int]] = {}  # the last op at each, (site's place, round)
        rounds: dict[str, int] = {}
        for entry in live.steers:
            name = self.ops.name_of(entry.site)
            operation = operation_of(entry)
            # at a module call the ops run in the plan's order of its sites; a chain's, in its call order, as the
            # request's own steers at them run: only a site's rounds keep an order there
            call: Hashable = entry.site.key if name not in self.ops.chain_of else ("site", name)
            if name is not None and operation is not None and call not in on_hooks and name in self.ops.order:
                place = (self.ops.order[name], rounds.get(name, 0))
                if place[1] < self.plan.rounds and place > last.get(call, (-1, -1)):
                    graphed.append((entry, name, operation))
                    rounds[name] = place[1] + 1
                    last[call] = place
                    continue
            hooked.append(entry)
            on_hooks.add(call)
        return graphed, hooked

    def leave(self, key: Hashable) -> None:
        """Take `key` out of the plan (its slots freed where no other request uses them)."""
        if key in self.entered:
            self.entered.discard(key)
            self.steering.pop(key, None)
            self.plan.leave(key)
            self.kept.pop(key, None)

    def step(self, spans: Sequence[Span]) -> None:
        """Before a step runs: the last step's harvest on its way to host memory, then this step's fill."""
        self._queue_copy()
        while len(self._copied) > 1:  # the copy of two steps ago is done by now: no wait on this step's path
            self.plan.settle(self._copied.pop(0))
        self._current = self.plan.step(spans)  # (which sets the ops' switch: `GraphPlan.step`)
        self.ops.steps["idle" if self.plan.idle else "marked"] += 1

    def _queue_copy(self) -> None:
        if self._current is not None:
            self._copied.append(self.plan.copy_out(self._current))
            self._current = None

    def hand_over(self) -> Optional["Handed"]:
        """After a step, the server's way (`streamscope.serve.worker.ServeState.send_graph`): the rows the step
        harvested at the sites its requests asked for, on their way to host memory (pinned on a GPU, not waited
        for: ``event``), for the caller to hand to its own writer; None where the step harvested nothing through the
        ops. Those rows are then no request's here: `take` returns none of them."""
        current, self._current = self._current, None
        if current is None or not current.layout:
            return None
        rows = self.plan.pool[:current.used]
        event = None
        if rows.device.type == "cuda":
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)  # queued behind the step, before the next step overwrites them
            event = torch.cuda.Event()
            event.record()
        else:
            host = rows.clone()  # the plan's own pool, which the next step overwrites
        return Handed(host, event, current.layout, current.lives)

    def settle(self) -> None:
        """After the last step: every step's harvest in host memory, handed to its requests (`take`)."""
        self._queue_copy()
        while self._copied:
            self.plan.settle(self._copied.pop(0))

    def take(self, key: Hashable) -> Optional[torch.Tensor]:
        """`key`'s harvest through the ops, ``[sites, positions, hidden]`` on the host (None if none ran)."""
        return self.plan.take(key) if key in self.harvesting else None

    def close(self) -> None:
        """Every request out of the plan, and harvested rows no one took dropped."""
        self.settle()
        for key in list(self.entered):
            self.leave(key)
        for key in self.harvesting:
            self.plan.take(key)
        self.harvesting.clear()
