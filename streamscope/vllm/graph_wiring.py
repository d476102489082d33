"""Put the graph ops (`streamscope.vllm.graph_ops`) at every block's stream boundaries of a vLLM model.

Each site is found the bulk path's way (`streamscope.bulk.sites.locate` on
streamscope's envoy tree over the worker's model): the module call that holds
the value and its descriptor, so an op edits and reads exactly what a trace
and the bulk path do (a fused block's two halves, `Summed`; a whole stream's
tensor). At each module call a plain torch hook calls the ops with views of
one `GraphPlan`'s buffers, fixed when the ops go in: the edit op of every
site at the call (one launch for all of a site's rounds, in order), then its
harvest ops, as the hook path steers before it reads. Where a call holds one
site (the common case), its rounds and its harvest are one launch
(`edit_harvest_stream`): one launch a site, 6 a block of the default options
(18 when each round and each harvest was a launch of its own). Installed
before vLLM compiles the model, the hooks are traced into its graph (dynamo
inlines a module's hooks), the ops as opaque nodes; run eagerly, they are
plain hooks.

Values the ops do not serve are left to the hook path, with the reason
(`graph_sites`): a scaled value (Granite's residual multiplier, whose edit is
divided by the multiplier on its way back) and values computed from another
point of a call (``self_attn.head_results``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Hashable, Mapping, NamedTuple, Optional, Sequence

import torch

from ..bulk.sites import Site, locate
from ..errors import Unavailable
from ..families.spec import spec_of
from ..values import INPUT, argument, first_tensor
from .blocks import FUSED, NEXT_INPUT, Summed
from .graph_ops import cache_salt, edit_harvest_stream, edit_stream, edit_stretch, harvest_stream, ops_source
from .graph_plan import GraphPlan

#: The values an op sits at on every block that has them: the stream's boundaries and the sublayers' outputs.
VALUES = ("layer_input", "layer_mid", "mlp_input", "layer_output", "self_attn.attention_output", "mlp.mlp_output")


def site_name(value: str, layer: int) -> str:
    """A site's name in a `GraphPlan`: ``layers.3.layer_output``."""
    return f"layers.{layer}.{value}"


def graph_sites(root: Any, values: Sequence[str] = VALUES,
                layers: Optional[Sequence[int]] = None) -> tuple[dict[str, Site], dict[str, str]]:
    """The sites of `values` at `layers` (every block when None) on `root` (streamscope's envoy tree over the
    worker's model): ``({name: Site}, {name: why the ops do not serve it})``."""
    sites: dict[str, Site] = {}
    skipped: dict[str, str] = {}
    for layer in range(len(root.layers)) if layers is None else layers:
        for value in values:
            name = site_name(value, layer)
            try:
                site = locate(root, value, layer)
            except (Unavailable, ValueError) as error:
                skipped[name] = str(error)
                continue
            reason = unserved(site)
            if reason is None:
                sites[name] = site
            else:
                skipped[name] = reason
    return sites, skipped


def unserved(site: Site) -> Optional[str]:
    """Why the graph ops cannot edit or read `site` (it stays on the hook path), or None where they can."""
    descriptor = site.descriptor
    if getattr(descriptor, "factor", None) is not None:
        return "a scaled value (the block multiplies it before adding it to the stream): the hook path serves it"
    if getattr(descriptor, "bulk_site", None) is not None or getattr(descriptor, "columns", None) is not None:
        return "a value computed from another point of the call: the hook path serves it"
    return None


class StreamAt(NamedTuple):
    """Where a site's tensors sit in its module's call: all the traced hooks read of a site.

    Resolved from the site (its descriptor on its envoy) when the hooks are made,
    so no descriptor or envoy is read inside them: vLLM 0.22's torch (2.11)
    compiles the hooks with a dynamo that takes an instance attribute whose
    value has ``__get__`` (a value descriptor, which `Site` holds) for a class
    descriptor, and stops the compile.

    ``argument``: the stream's ``(index, name)`` in an input call (None: the
    call's first tensor, or its output's); ``residual``: the residual half's
    argument, for a fused block's input; ``pair``: an output that is
    ``(hidden, residual)`` (a fused block's).
    """

    argument: Optional[tuple[int, str]] = None
    residual: Optional[tuple[int, str]] = None
    pair: bool = False


def stream_at(site: Site) -> StreamAt:
    """Where `site`'s tensors sit in its call, as `Summed.halves` and `StreamValue.live` find them."""
    descriptor = site.descriptor
    if isinstance(descriptor, Summed):
        if descriptor.where == INPUT:
            return StreamAt(tuple(descriptor.hidden), tuple(descriptor.residual))
        return StreamAt(pair=True)
    _, where, position = descriptor.site(site.host)
    if where == INPUT and position is not None:
        position = getattr(site.host, position) if isinstance(position, str) else position
        return StreamAt(tuple(position))
    return StreamAt()


def stream_of(at: StreamAt, raw: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A site's tensors in a call, ``[rows, hidden]`` as the ops take them: ``(hidden, residual)`` for a fused
    block's halves, ``(tensor, None)`` else. transformers' own modules in vLLM's Transformers backend (the
    `Backend` layout) hold ``[1, rows, hidden]``: the ops get a view of it, so their edit lands in the call."""
    if at.argument is not None:
        hidden = argument(raw, *at.argument)
        residual = None if at.residual is None else argument(raw, *at.residual)
    elif at.pair and isinstance(raw, tuple):
        hidden, residual = raw[0], raw[1]
    elif at.pair:
        hidden, residual = raw, None
    else:
        hidden, residual = first_tensor(raw), None
    return _rows(hidden), None if residual is None else _rows(residual)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    # `view`, not `reshape`: a copy would take the op's edit away from the call, where a view cannot be made it says so
    return tensor if tensor.dim() == 2 else tensor.view(-1, tensor.shape[-1])


def wiring_source() -> str:
    """The source of what decides which tensors the ops get at a call (the hooks, the halves, a value's tensor, the
    runs joined in one launch): traced into the graph, but not hashed by vLLM's AOT compile cache, which hashes no
    traced file. The runs each family joins are stated in its module and its layout's (`Layout.stretches`): their
    files' text is part of it, read, not imported."""
    code = "\n".join(inspect.getsource(function) for function in (insert_ops, _calls, _before, _after, StreamAt,
                                                                      stream_at, stream_of, _rows, argument,
                                                                      first_tensor, chains, _joined))
    here = Path(__file__).resolve().parent
    stated = [here / "blocks.py", *sorted((here / "families").glob("*.py"))]
    return code + "".join(path.read_text() for path in stated)


def stretches_of(family: ModuleType) -> tuple[tuple[str, ...], ...]:
    """The runs of `family`'s block values that one launch serves: its spec's, or its layout's
    (`Layout.stretches`; a family that states no layout has fused halves)."""
    spec = spec_of(family)
    return spec.stretches if spec.stretches is not None else (spec.layout or FUSED).stretches()


def chains(plan: GraphPlan, sites: Mapping[Hashable, Site], stretches: Sequence[Sequence[str]]) -> list[list[str]]:
    """The plan's sites that one launch serves together, each chain in call order: the sites of a run of
    `stretches` (values with nothing computed between their module calls, `Layout.stretches`) on one block, the
    next block's layer_input where a run ends with `NEXT_INPUT`. A site joins a chain where it has an edit op and
    its module call holds no other site of the plan; a site that does not breaks the run there. Two sites at least
    make a chain."""
    planned = set(plan.sites) | set(plan.harvest_sites)
    at_call: dict[tuple[int, str], int] = {}
    for name in planned:
        at_call[sites[name].key] = at_call.get(sites[name].key, 0) + 1
    layers = sorted({int(str(name).split(".")[1]) for name in planned})
    found: list[list[str]] = []
    for layer in layers:
        for run in stretches:
            chain: list[str] = []
            for value in run:
                name = (site_name("layer_input", layer + 1) if value == NEXT_INPUT else site_name(value, layer))
                if name not in planned:
                    continue  # no op there: nothing is computed between the sites either side
                if name in plan.sites and at_call[sites[name].key] == 1:
                    chain.append(name)
                    continue
                if len(chain) > 1:
                    found.append(chain)
                chain = []
            if len(chain) > 1:
                found.append(chain)
    return found


@dataclass
class Inserted:
    """The ops' hooks on a model: `remove` takes them off. `salt` is what vLLM's compile cache must be salted
    with for this set of ops (`graph_ops.cache_salt`, under ``additional_config``)."""

    plan: GraphPlan
    salt: str
    handles: list[Any] = field(default_factory=list)
    #: The sites joined in one launch, each chain in call order (`chains`).
    chains: list[list[str]] = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def insert_ops(plan: GraphPlan, sites: Mapping[Hashable, Site], stretches: Sequence[Sequence[str]] = ()) -> Inserted:
    """Hook the ops onto every module call of `sites` (named as `plan` names them): the edit op of each of the
    plan's sites (its rounds in one launch), then the harvest ops of its harvest sites (a call's one site: its
    rounds and its harvest in one op). The sites of a chain (`chains` of `stretches`) are one launch at the
    chain's last call, each site's rounds and harvest in call order. A site the plan does not name is refused."""
    unknown = [name for name in list(plan.sites) + plan.harvest_sites if name not in sites]
    if unknown:
        raise ValueError(f"the plan names sites {unknown[:4]} that the model does not serve: build the plan from "
                         f"graph_sites(...)'s names.")
    joined = chains(plan, sites, stretches)
    in_chain = {name for chain in joined for name in chain}
    work: dict[tuple[int, str], list[Any]] = {}
    named: dict[tuple[int, str], set[Hashable]] = {}  # the sites at each module call
    hosts: dict[tuple[int, str], Site] = {}  # a site at each module call: its module gets the hook
    for chain in joined:
        last = hosts[sites[chain[-1]].key] = sites[chain[-1]]
        named.setdefault(last.key, set()).update(chain)
        work.setdefault(last.key, []).append(("stretch", stream_at(last), _joined(plan, sites, chain)))
    for name in plan.sites:
        if name in in_chain:
            continue
        site = hosts[sites[name].key] = sites[name]
        named.setdefault(site.key, set()).add(name)
        work.setdefault(site.key, []).append(("edit", stream_at(site), (plan.rounds_of(name),)))
    for name in plan.harvest_sites:
        if name in in_chain:
            continue
        site = hosts[sites[name].key] = sites[name]
        named.setdefault(site.key, set()).add(name)
        # the whole pool, never a view of part of it (graph_ops' docstring says why), and the site's targets
        work.setdefault(site.key, []).append(("harvest", stream_at(site), (plan.pool, plan.targets_of(name))))
    for key, items in work.items():
        items.sort(key=lambda item: item[0] == "harvest")  # stable: each site's edits, then the harvests
        if len(named[key]) == 1 and len(items) == 2 and items[-1][0] == "harvest":
            # One site at the call: its edit rounds and its harvest are one launch (the edited rows stored from the
            # program's registers). Where a call holds several sites, the harvests wait for every site's edits.
            (_, at, (slots,)), (_, _, (pool, targets)) = items
            items[:] = [("edit_harvest", at, (slots, pool, targets))]
    inserted = Inserted(plan, cache_salt([str(name) for name in plan.sites], plan.rounds,
                                         [str(name) for name in plan.harvest_sites],
                                         ops_source() + wiring_source() + repr(joined)), chains=joined)
    for key, items in work.items():
        module, where = hosts[key].module, key[1]
        run = _calls(items, plan.bank.buffers)
        if where == INPUT:
            inserted.handles.append(module.register_forward_pre_hook(_before(run), with_kwargs=True))
        else:
            inserted.handles.append(module.register_forward_hook(_after(run)))
    return inserted


# The hooks hold what they call in closures, not in default arguments: vLLM 0.22's torch (2.11) cannot load a
# compiled graph back from vLLM's AOT cache whose guards read a function's defaults (its `DefaultsSource` fails to
# unpickle), so every start would compile again.

def _joined(plan: GraphPlan, sites: Mapping[Hashable, Site], chain: list[str]) -> tuple[Any, ...]:
    """What `edit_stretch` takes for `chain`: the plan's index and harvest pool, each site's first lane, the
    rounds, each site's harvest column (-1: none) and whether it reads the stream as two halves."""
    fused = []
    for name in chain:
        at = stream_at(sites[name])
        fused.append(at.residual is not None or at.pair)
    return (plan.index, plan.pool, [plan.lane_of[(name, 0)] for name in chain], plan.rounds,
            [plan.harvest_lane_of.get(name, -1) for name in chain], fused)


def _calls(items: list[Any], buffers: tuple[torch.Tensor, ...]) -> Any:
    """The ops of one module call, in order, on the call's inputs or output."""
    def run(raw: Any) -> None:
        for kind, at, tensors in items:
            hidden, residual = stream_of(at, raw)
            if kind == "edit":
                edit_stream(hidden, residual, tensors[0], *buffers)
            elif kind == "harvest":
                harvest_stream(tensors[0], hidden, residual, tensors[1])
            elif kind == "stretch":
                index, pool, lanes, rounds, harvest_lanes, fused = tensors
                edit_stretch(hidden, residual, index, *buffers, pool, lanes, rounds, harvest_lanes, fused)
            else:
                edit_harvest_stream(hidden, residual, tensors[0], *buffers, tensors[1], tensors[2])
    return run


def _before(run: Any) -> Any:
    def before(_module: Any, args: tuple, kwargs: dict) -> None:
        run((args, kwargs))
    return before


def _after(run: Any) -> Any:
    def after(_module: Any, args: tuple, output: Any) -> None:
        run(output)
    return after
