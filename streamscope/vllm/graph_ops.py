"""Steers and harvests as `torch.library` ops: opaque to torch.compile, captured into CUDA graphs on fixed addresses.

The hook path (`streamscope.bulk.apply.Applier`, the server's worker) edits
a step's rows from Python, which needs an eager engine or taps that break
vLLM's graphs. These ops do the same work from persistent buffers that
the host fills before each step (`streamscope.vllm.graph_plan.GraphPlan`),
so a graph captured once replays every step, whichever requests steer:

* ``streamscope::edit_stream(hidden, residual, slots, bank, modes, scales,
  projections, norm_match)`` edits, in place, every token row ``r`` whose
  ``slots[r]`` is a slot (``>= 0``) with that slot's operation, exactly as
  `streamscope.bulk.operations.Operation` defines it: add, set, ablate or
  clamp, norm-matched where the slot's flag says so. A row whose slot is
  ``-1`` is left bit for bit as it was.
* ``streamscope::harvest_stream(out, hidden, residual, targets)`` stores,
  for every stream row ``r`` whose ``targets[r]`` is a pool row (``>= 0``),
  the stream's row ``r`` in that row of the harvest pool ``out [pool rows,
  hidden]``; the pool's other rows keep what they held. ``targets`` is the
  harvest site's own column of the plan's index (`GraphPlan` gives each site
  of each request rows of its own): its rows are distinct, and never the
  pool's last row, a spare that the torch body writes back onto itself so
  that its scatter has one destination a row whatever the marks. An idle call
  looks at as many entries as the step has rows, not the pool's size.

* ``streamscope::edit_harvest_stream(hidden, residual, slots, bank, modes,
  scales, projections, norm_match, out, targets)`` is the first then the
  second, in one launch: where a module call holds one site, its edit rounds
  and its harvest (`streamscope.vllm.graph_wiring`). The kernel's program for
  stream row ``r`` stores its edited row in pool row ``targets[r]`` from its
  registers, so the harvest costs no launch of its own.

* ``streamscope::edit_stretch(hidden, residual, index, bank, modes, scales,
  projections, norm_match, pool, lanes, rounds, harvest_lanes, fused)`` runs
  up to `MAX_STAGES` sites in one launch, where nothing runs between their
  module calls, so they see the same pair of tensors (an attention output,
  then the fused stream after it): for each stage ``s`` in order, bit for
  bit `edit_harvest_stream` (or `edit_stream` where ``harvest_lanes[s]`` is
  ``-1``) with the slots ``index[:, lanes[s]:lanes[s] + rounds]``, the pool
  `pool` and the targets ``index[:, harvest_lanes[s]]``, and the stream
  ``hidden + residual`` where ``fused[s]``, ``hidden`` alone elsewhere.

`slots` is one column (one round) or ``[rows, rounds]``, a site's rounds:
one launch runs them in order, each on the row the round before left, so a
site costs one launch whatever its rounds.

A stream comes whole (``residual`` None) or, in vLLM's fused blocks, in two
halves ``hidden + residual`` (`streamscope.vllm.blocks.Summed`): an edit then
goes into the hidden half as the change of the stream, never the residual,
as the bulk path's `Summed.edit_rows` does.

Inside both ops: no host sync, no shape that depends on a tensor's values,
no Python branch on a value (the rows are chosen by ``torch.where``), so a
CUDA graph captures them and torch.compile keeps them as one node each (their
fake implementations check shapes and return nothing).

In an engine every harvest op takes the plan's whole ``pool [pool rows + 1,
hidden]``, never a view of part of it (one site's rows, one request's):
where the ops of one compiled graph mutate views of a tensor beside the
tensor itself, Inductor cannot do the writes in place and copies the whole
tensor between them (12 GiB at a time at the Llama-3-8B shape with every
default site, when each site had a buffer of its own in one tensor; measured
on an H100 in vLLM 0.22: a compile of 319 s against plain vLLM's 7 s, and the
copy's allocation out of memory).

A step that marks no row (`GraphPlan.idle`: nothing to edit, nothing to
harvest) needs none of the ops: the plan's step sets `IDLE` for it, and
each op then returns before it launches anything, wherever its Python body
runs (an uncaptured step; the capture of the idle graphs,
`streamscope.vllm_seam.keep_graph_sets`). Inside vLLM's own CUDA graph capture
the ops run whatever the switch says, so a graph captured for steered steps
always holds them. In a step that marks rows, an op whose columns of the index
the step marks none of returns the same way (`IdleSwitch.leaves`): a step that
steers one block runs one block's ops where no graph holds them (the CPU
engine, a GPU prefill past the captured sizes), not every block's. Where
graphs replay, the lean set (`GraphOptions.lean_values`, where asked for)
does the same for the lean sites: captured with only their ops, it replays a
step that marks no other site, so a steer at every block's layer_output
launches one op a block, not every site's.

Two bodies compute the same thing. On CUDA tensors the ops launch one Triton
kernel each (`streamscope.vllm.graph_kernels`): one program per row, which
returns at once on an unmarked row, so an idle site costs one small launch.
Elsewhere (vLLM's CPU engine) they run torch arithmetic over every row of the
call, which needs no compiler. ``STREAMSCOPE_GRAPH_OPS_BODY=torch`` or
``=triton`` (read at import), or `use_body`, picks one body for every device:
the torch body on a GPU to compare against, the kernels on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

#: The ops' namespace in ``torch.ops``.
NAMESPACE = "streamscope"
#: Each operation's code in the `modes` buffer (the slot's mode).
ADD, SET, ABLATE, CLAMP = 0, 1, 2, 3
#: The operation names of `streamscope.bulk.operations.MODES` the ops run, by code.
MODE_CODES = {"add": ADD, "set": SET, "ablate": ABLATE, "clamp": CLAMP}
#: The dtypes of the index buffers (`slots`, `targets`).
INDEX_DTYPES = (torch.int32, torch.int64)
#: The ops' bodies: "torch" (torch arithmetic over every row) and "triton" (`streamscope.vllm.graph_kernels`).
BODIES = ("torch", "triton")
#: The environment variable that picks one body for every device (unset: the kernels on CUDA, torch elsewhere).
BODY_VARIABLE = "STREAMSCOPE_GRAPH_OPS_BODY"


def _body_of_environment() -> Optional[str]:
    body = os.environ.get(BODY_VARIABLE) or None
    if body is not None and body not in BODIES:
        raise ValueError(f"{BODY_VARIABLE}={body!r}: the graph ops' body is one of {', '.join(BODIES)}, or unset "
                         f"for the Triton kernels on CUDA and torch elsewhere.")
    return body


_body = _body_of_environment()


def use_body(body: Optional[str]) -> Optional[str]:
    """Make the ops run `body` ("torch" or "triton") on every device from now on, or, with None, the default (the
    Triton kernels on CUDA tensors, torch arithmetic elsewhere); returns the setting it replaces.

    A captured CUDA graph keeps the kernels it captured: set the body before
    the capture (or the compile) it is meant for.
    """
    global _body
    if body is not None and body not in BODIES:
        raise ValueError(f"body={body!r}: the graph ops' body is one of {', '.join(BODIES)}, or None.")
    previous, _body = _body, body
    return previous


#: The names of the graph sets streamscope captures beside vLLM's own (`streamscope.vllm_seam.keep_graph_sets`):
#: the idle graphs hold none of the ops, the lean ones only the ops at `GraphOptions.lean_values`' sites.
IDLE_SET, LEAN_SET = "idle", "lean"


class IdleSwitch:
    """Whether the ops skip their work: set for a step that marks no row, for a site the step marks nothing at, and
    around the capture of the graph sets such steps replay.

    ``step``: the engine's current step marks no row (`GraphPlan.idle`, set
    by `streamscope.vllm.graph_plan.GraphPlan.step` before the step runs):
    an op does nothing in it, so skipping it changes no bit.
    ``lean``: the current step marks rows at the lean sites' columns only
    (`GraphPlan.lean_columns`), so the lean graphs, which hold those sites'
    ops alone, may replay it.
    ``capturing``: the name of the graph set being captured (`capture`),
    None outside such a capture: an op whose columns are not among the set's
    ``kept`` ones leaves nothing in it (the idle set keeps none).
    One switch for the process: an engine sets it before each of its own
    steps, and the ops of an engine that runs no step (a warm-up, a profile
    run) read whatever it was, which is safe, since such runs' outputs are
    thrown away and no capture but streamscope's own sets skips.
    """

    def __init__(self) -> None:
        self.step = False
        self.lean = False
        self.capturing: Optional[str] = None
        self.kept: frozenset[int] = frozenset()
        #: ``(marked, known)``: the addresses of the index columns the current step marks, and of every column of
        #: the plan that set it (a site's edit columns by its first round's, a harvest site's by its own); None
        #: where no plan said (every op runs). Set with ``step`` (`GraphPlan.step`).
        self.columns: Optional[tuple[frozenset[int], frozenset[int]]] = None

    def skips(self, device: torch.device) -> bool:
        """Whether an op on `device` returns at once: on an idle step, unless a CUDA graph other than one of
        streamscope's sets is being captured (it must hold the ops: the steps that replay it may steer), and in the
        idle graphs' capture."""
        if self.capturing is not None:
            return not self.kept
        if not self.step:
            return False
        return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def leaves(self, device: torch.device, addresses: Sequence[int]) -> bool:
        """Whether an op whose index columns start at `addresses` returns at once: where it `skips`; in the capture
        of a graph set, where the set keeps none of them; and where the step marks none of them, each a column of
        the plan that set the step (an op called on a tensor of one's own always runs), outside a CUDA graph capture
        (vLLM's graphs hold every site)."""
        if self.capturing is not None:
            return not any(address in self.kept for address in addresses)
        if self.skips(device):
            return True
        columns = self.columns
        if columns is None:
            return False
        marked, known = columns
        if any(address in marked or address not in known for address in addresses):
            return False
        return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def graph_sets(self) -> tuple[str, ...]:
        """The graph sets the current call may use, best first: the set being captured, else those whose graphs
        replay the step bit for bit as vLLM's would (an idle step: the idle set, else the lean one; a step marking
        lean sites only: the lean set); empty for vLLM's own graphs."""
        if self.capturing is not None:
            return (self.capturing,)
        if self.step:
            return (IDLE_SET, LEAN_SET)
        return (LEAN_SET,) if self.lean else ()

    @contextlib.contextmanager
    def capture(self, name: str = IDLE_SET, kept: frozenset[int] = frozenset()) -> Iterator[None]:
        """Around the capture of the graph set `name`: every op returns at once but those at the `kept` columns
        (the idle set: none)."""
        before = self.capturing, self.kept
        self.capturing, self.kept = name, frozenset(kept)
        try:
            yield
        finally:
            self.capturing, self.kept = before


#: The process's switch (`IdleSwitch`).
IDLE = IdleSwitch()


#: The library the ops are defined in (`_op`), and each op's Python body by name (what `ops_source` hashes).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_BODIES: dict[str, Callable[..., None]] = {}


def _op(*mutates: str) -> Callable[[Callable[..., None]], Any]:
    """Define a function as the op ``streamscope::<its name>`` (its schema inferred from its annotations, the
    tensors `mutates` names marked as written) on CPU and CUDA tensors, and give back the op
    (``torch.ops.streamscope.<name>.default``), which every caller and torch.compile then call.

    Through torch.library's low-level API rather than `torch.library.custom_op`: that one's Python layer (the
    schema's defaults filled, the written tensors' versions bumped) took 40-45 us a call on the CI machine's CPU,
    where the op's own checks take 8, at every call no CUDA graph replays (every block's ops at every step of
    the CPU engine, and of a GPU prefill past the captured sizes); here the dispatcher calls the body at once.
    """
    def define(function: Callable[..., None]) -> Any:
        name = function.__name__
        _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=mutates))
        for key in ("CPU", "CUDA"):
            _LIBRARY.impl(name, function, key)
        _BODIES[name] = function
        return getattr(getattr(torch.ops, NAMESPACE), name).default
    return define


def _fake(op: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register a function as `op`'s fake implementation: what torch.compile runs on fake tensors."""
    return torch.library.register_fake(op, lib=_LIBRARY)


def _runs_kernel(device: torch.device) -> bool:
    return _body == "triton" or (_body is None and device.type == "cuda")


def _kernels() -> ModuleType:
    # Imported on first use: the CPU engine's torch body needs no triton.
    return importlib.import_module("streamscope.vllm.graph_kernels")


def _check_stream(op: str, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"{op}: the stream is [rows, hidden] (vLLM's flattened tokens), not {tuple(hidden.shape)}.")
    if residual is not None and (residual.shape != hidden.shape or residual.dtype != hidden.dtype
                                 or residual.device != hidden.device):
        raise ValueError(f"{op}: the residual half {tuple(residual.shape)} {residual.dtype} must match the hidden "
                         f"half {tuple(hidden.shape)} {hidden.dtype} on one device.")


def _check_index(op: str, name: str, index: torch.Tensor, rows: int, device: torch.device) -> None:
    if index.dim() != 1 or index.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: {name} is a 1-D int32 or int64 index, not {tuple(index.shape)} {index.dtype}.")
    if index.device != device:
        raise ValueError(f"{op}: {name} is on {index.device}, the stream on {device}: keep the plan's buffers on "
                         f"the engine's device.")
    if index.shape[0] < rows:
        raise ValueError(f"{op}: {name} holds {index.shape[0]} entries for {rows} rows: size it for the most rows a "
                         f"step runs (the plan's max_rows).")


def _check_slots(op: str, slots: torch.Tensor, rows: int, device: torch.device) -> None:
    if slots.dim() == 2:
        if slots.shape[1] < 1:
            raise ValueError(f"{op}: slots [rows, rounds] holds at least one round, not {tuple(slots.shape)}.")
        _check_index(op, "slots", slots[:, 0], rows, device)
    else:
        _check_index(op, "slots", slots, rows, device)


def _check_edit(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: torch.Tensor,
                modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                norm_match: torch.Tensor, op: str = "streamscope::edit_stream") -> None:
    _check_stream(op, hidden, residual)
    _check_slots(op, slots, hidden.shape[0], hidden.device)
    if bank.dim() != 2 or bank.shape[1] != hidden.shape[1] or bank.dtype != hidden.dtype:
        raise ValueError(f"{op}: the bank is [slots, {hidden.shape[1]}] in the stream's dtype {hidden.dtype}, not "
                         f"{tuple(bank.shape)} {bank.dtype}.")
    count = bank.shape[0]
    for name, tensor, dtypes in (("modes", modes, INDEX_DTYPES), ("scales", scales, (torch.float32,)),
                                 ("projections", projections, (torch.float32,)), ("norm_match", norm_match,
                                                                                  (torch.bool,))):
        if tuple(tensor.shape) != (count,) or tensor.dtype not in dtypes:
            raise ValueError(f"{op}: {name} is one {dtypes[0]} a slot, [{count}], not {tuple(tensor.shape)} "
                             f"{tensor.dtype}.")
    for name, tensor in (("bank", bank), ("modes", modes), ("scales", scales), ("projections", projections),
                         ("norm_match", norm_match)):
        if tensor.device != hidden.device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, the stream on {hidden.device}: keep the plan's "
                             f"buffers on the engine's device.")


def _edited(stream: torch.Tensor, vector: torch.Tensor, mode: torch.Tensor, scale: torch.Tensor,
            projection: torch.Tensor, norm_match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's edit by its own slot: (the edited rows, the change of a direction's ablate or clamp).

    `Operation.__call__` per row: with ``c`` the coefficient of the row's
    vector (1 to add, ``-scale (x . d)`` to ablate, ``projection - x . d`` to
    clamp), rounded to the stream's dtype from float32 as a Python scalar's
    product is, the row becomes ``x + c v`` (or ``v`` for a set), then is
    rescaled to its old norm where the slot norm-matches.
    """
    along = torch.bmm(stream.unsqueeze(1), vector.unsqueeze(2)).view(-1)  # [rows]: each row on its direction
    wide = along.float()
    coefficient = torch.where(mode == ABLATE, -(scale * wide),
                              torch.where(mode == CLAMP, projection - wide, torch.ones_like(wide))).to(stream.dtype)
    change = coefficient.unsqueeze(-1) * vector
    edited = torch.where((mode == SET).unsqueeze(-1), vector, stream + change)
    before = stream.norm(dim=-1, keepdim=True)
    after = edited.norm(dim=-1, keepdim=True)
    # A row the edit left at zero stays zero: there is no direction to give the old norm to (as `Operation` does).
    factor = torch.where(after > 0, before / after.clamp_min(torch.finfo(after.dtype).tiny), torch.zeros_like(after))
    edited = torch.where(norm_match.unsqueeze(-1), edited * factor, edited)
    return edited, change


@_op("hidden")
def edit_stream(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: torch.Tensor,
                modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                norm_match: torch.Tensor) -> None:
    """Edit, in place, the stream's rows that `slots` marks, each by its slot's operation.

    Args:
        hidden: The stream ``[rows, hidden]``, or its hidden half where
            `residual` is given; the only tensor the op changes.
        residual: The residual half of a fused block's stream, or None.
        slots: ``[>= rows]`` int: row ``r``'s slot, ``-1`` for a row left alone
            (entries past ``rows``, a graph's padding, are not read); or
            ``[>= rows, rounds]``: a site's rounds, column by column, each
            edit applied to the row as the round before left it, in one
            launch.
        bank: ``[slots, hidden]`` in the stream's dtype: each slot's vector,
            ``scale * vector`` for add and set, the unit direction for ablate
            and clamp (`streamscope.bulk.operations.prepare`).
        modes: ``[slots]`` int, each slot's `MODE_CODES`.
        scales: ``[slots]`` float32, the fraction an ablate removes.
        projections: ``[slots]`` float32, the projection a clamp sets.
        norm_match: ``[slots]`` bool, whether the slot rescales each edited
            row to its norm before the edit.
    """
    _check_edit(hidden, residual, slots, bank, modes, scales, projections, norm_match)
    if hidden.shape[0] == 0 or IDLE.leaves(hidden.device, (slots.data_ptr(),)):  # a shape and the host's switch
        return
    if _runs_kernel(hidden.device):
        _kernels().edit_rows(hidden, residual, slots, bank, modes, scales, projections, norm_match)
        return
    _edit_by_torch(hidden, residual, slots, bank, modes, scales, projections, norm_match)


def _edit_by_torch(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: torch.Tensor,
                   modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                   norm_match: torch.Tensor) -> None:
    """`edit_stream`'s torch body: every row of the call edited by its slot's operation, the unmarked rows kept;
    with a column of slots a round, each round in order."""
    if slots.dim() == 2:
        for round_ in range(slots.shape[1]):
            _edit_by_torch(hidden, residual, slots[:, round_], bank, modes, scales, projections, norm_match)
        return
    rows = hidden.shape[0]
    slot = slots[:rows].long()
    marked = slot >= 0
    safe = slot.clamp_min(0)  # unmarked rows gather slot 0 and discard it, so no shape depends on the marks
    vector = bank.index_select(0, safe)
    mode = modes.index_select(0, safe)
    stream = hidden if residual is None else hidden + residual
    edited, change = _edited(stream, vector, mode, scales.index_select(0, safe), projections.index_select(0, safe),
                             norm_match.index_select(0, safe))
    if residual is None:
        # A stream in one tensor takes the edited rows as they are (`Summed`'s and `Site`'s write-back of rows).
        result = edited
    else:
        # The hidden half takes the stream's change: a direction's ablate or clamp without a norm match adds its
        # change itself (`Operation.add_change`), anything else ``edited - stream`` (`Summed._edit_rows`).
        direct = ((mode == ABLATE) | (mode == CLAMP)) & ~norm_match.index_select(0, safe)
        result = hidden + torch.where(direct.unsqueeze(-1), change, edited - stream)
    hidden.copy_(torch.where(marked.unsqueeze(-1), result, hidden))


@_fake(edit_stream)
def _edit_stream_fake(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                      bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                      norm_match: torch.Tensor) -> None:
    _check_edit(hidden, residual, slots, bank, modes, scales, projections, norm_match)


def _check_pool(op: str, pool: torch.Tensor, hidden: torch.Tensor) -> None:
    if pool.dim() != 2 or pool.shape[1] != hidden.shape[1] or pool.dtype != hidden.dtype:
        raise ValueError(f"{op}: the harvest pool is [rows, {hidden.shape[1]}] in the stream's dtype {hidden.dtype}, "
                         f"not {tuple(pool.shape)} {pool.dtype}: pass the plan's whole pool, its last row spare.")
    if pool.device != hidden.device:
        raise ValueError(f"{op}: the harvest pool is on {pool.device}, the stream on {hidden.device}: keep the "
                         f"plan's buffers on the engine's device.")


def _check_harvest(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], targets: torch.Tensor,
                   op: str = "streamscope::harvest_stream") -> None:
    _check_stream(op, hidden, residual)
    _check_pool(op, out, hidden)
    _check_index(op, "targets", targets, hidden.shape[0], hidden.device)


@_op("out")
def harvest_stream(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                   targets: torch.Tensor) -> None:
    """Copy the stream's rows that `targets` marks into their rows of the harvest pool `out`, in place.

    Args:
        out: ``[pool rows, hidden]``, the stream's dtype: the plan's whole
            pool (never a view of part of it: the module's docstring says
            why). Row ``targets[r]`` takes the stream's row ``r``; the op
            changes no other row. Its last row is a spare no target names.
        hidden, residual: The stream, whole or in two halves (their sum is
            read, bit for bit the bulk path's `Summed.stream_rows`).
        targets: ``[>= rows]`` int, this site's column of the plan's index:
            the pool row stream row ``r`` is stored in, ``-1`` for none.
            Its non-negative entries are distinct and below the pool's last
            row; entries at or past the call's rows are not read.
    """
    _check_harvest(out, hidden, residual, targets)
    if min(hidden.shape[0], out.shape[0]) == 0 or IDLE.leaves(hidden.device, (targets.data_ptr(),)):
        return  # shapes and the host's switch, never a value
    if _runs_kernel(hidden.device):
        _kernels().harvest_rows(out, hidden, residual, targets)
        return
    _harvest_by_torch(out, hidden, residual, targets)


def _harvest_by_torch(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                      targets: torch.Tensor) -> None:
    """`harvest_stream`'s torch body: every row of the call scattered to its pool row, through the spare one.

    A row harvested nowhere writes the spare row's own bits back onto it, so
    the scatter has one destination a row (no shape depends on the marks)
    and changes nothing but the targeted rows: targets are distinct and
    never the spare, so no write meets another of a different value.
    """
    rows = hidden.shape[0]
    target = targets[:rows].long()
    valid = target >= 0
    destination = torch.where(valid, target, torch.full_like(target, out.shape[0] - 1))
    stream = hidden if residual is None else hidden + residual
    current = out.index_select(0, destination)
    out.index_copy_(0, destination, torch.where(valid.unsqueeze(-1), stream, current))


@_fake(harvest_stream)
def _harvest_stream_fake(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                         targets: torch.Tensor) -> None:
    _check_harvest(out, hidden, residual, targets)


@_op("hidden", "out")
def edit_harvest_stream(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                        bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                        norm_match: torch.Tensor, out: torch.Tensor, targets: torch.Tensor) -> None:
    """`edit_stream`, then `harvest_stream` of the edited stream, in one launch: a site's edit rounds and its
    harvest (`streamscope.vllm.graph_wiring` puts it where a module call holds one site).

    Args:
        hidden, residual, slots, bank, modes, scales, projections, norm_match:
            As `edit_stream`'s.
        out, targets: As `harvest_stream`'s. The kernel's program for stream
            row ``r`` stores its edited row in pool row ``targets[r]`` from
            its registers.
    """
    _check_edit_harvest(hidden, residual, slots, bank, modes, scales, projections, norm_match, out, targets)
    if hidden.shape[0] == 0 or IDLE.leaves(hidden.device, (slots.data_ptr(), targets.data_ptr())):
        return  # a shape and the host's switch, never a value
    if _runs_kernel(hidden.device):
        _kernels().edit_harvest_rows(hidden, residual, slots, bank, modes, scales, projections, norm_match, out,
                                     targets)
        return
    _edit_by_torch(hidden, residual, slots, bank, modes, scales, projections, norm_match)
    if out.shape[0]:
        _harvest_by_torch(out, hidden, residual, targets)


def _check_edit_harvest(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                        bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                        norm_match: torch.Tensor, out: torch.Tensor, targets: torch.Tensor) -> None:
    _check_edit(hidden, residual, slots, bank, modes, scales, projections, norm_match)
    _check_harvest(out, hidden, residual, targets, "streamscope::edit_harvest_stream")


@_fake(edit_harvest_stream)
def _edit_harvest_stream_fake(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                              bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor,
                              projections: torch.Tensor, norm_match: torch.Tensor, out: torch.Tensor,
                              targets: torch.Tensor) -> None:
    _check_edit_harvest(hidden, residual, slots, bank, modes, scales, projections, norm_match, out, targets)


#: The most sites (stages) one `edit_stretch` launch runs: the kernel takes each stage's lane and harvest lane as
#: one scalar argument of four.
MAX_STAGES = 4


def _check_stretch(hidden: torch.Tensor, residual: Optional[torch.Tensor], index: torch.Tensor, bank: torch.Tensor,
                   modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor, norm_match: torch.Tensor,
                   pool: torch.Tensor, lanes: Sequence[int], rounds: int, harvest_lanes: Sequence[int],
                   fused: Sequence[bool]) -> None:
    op = "streamscope::edit_stretch"
    if not len(lanes) == len(harvest_lanes) == len(fused):
        raise ValueError(f"{op}: lanes, harvest_lanes and fused hold one entry a stage (a site of the stretch), not "
                         f"{len(lanes)}, {len(harvest_lanes)} and {len(fused)}: give each stage all three.")
    if not 1 <= len(lanes) <= MAX_STAGES:
        raise ValueError(f"{op}: a stretch runs 1 to {MAX_STAGES} stages in one launch, not {len(lanes)}: split "
                         f"the sites into stretches of at most {MAX_STAGES}.")
    if index.dim() != 2:
        raise ValueError(f"{op}: index is the plan's slot index [max_rows, columns], not {tuple(index.shape)}.")
    if rounds < 1:
        raise ValueError(f"{op}: a stage runs at least one round, not rounds={rounds}.")
    for stage, lane in enumerate(lanes):
        if lane < 0 or lane + rounds > index.shape[1]:
            raise ValueError(f"{op}: stage {stage}'s lane {lane} with {rounds} rounds reaches outside the index's "
                             f"{index.shape[1]} columns: give each stage the first column of its rounds.")
    if any(not -1 <= lane < index.shape[1] for lane in harvest_lanes):
        raise ValueError(f"{op}: harvest_lanes {list(harvest_lanes)} name a column outside the index's "
                         f"{index.shape[1]}: each is the column of a stage's targets, or -1 for a stage that harvests "
                         f"nothing.")
    if any(fused) and residual is None:
        raise ValueError(f"{op}: stage {list(fused).index(True)} is fused (its stream is hidden + residual) and no "
                         f"residual is given: pass the block's residual half, or mark the stage whole.")
    _check_edit(hidden, residual, index[:, lanes[0]:lanes[0] + rounds], bank, modes, scales, projections,
                norm_match, op)
    harvesting = [lane for lane in harvest_lanes if lane >= 0]
    if harvesting:
        _check_harvest(pool, hidden, residual, index[:, harvesting[0]], op)


@_op("hidden", "pool")
def edit_stretch(hidden: torch.Tensor, residual: Optional[torch.Tensor], index: torch.Tensor, bank: torch.Tensor,
                 modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor, norm_match: torch.Tensor,
                 pool: torch.Tensor, lanes: list[int], rounds: int, harvest_lanes: list[int],
                 fused: list[bool]) -> None:
    """Several sites in one launch, where nothing runs between their module calls, so they see the same pair of
    tensors (an attention output, then the fused stream after it): stage ``s``'s edit rounds and harvest, for each
    stage in order, each on the row as the stage before left it.

    The result is, bit for bit, for each stage ``s`` in order, `edit_harvest_stream`
    (``harvest_lanes[s] >= 0``) or `edit_stream` with ``residual if fused[s]
    else None``, the slots ``index[:, lanes[s]:lanes[s] + rounds]`` and, for
    the harvest, the pool `pool` and the targets ``index[:, harvest_lanes[s]]``.

    Args:
        hidden, residual: The stream's halves: a fused stage reads the
            stream ``hidden + residual`` and edits the hidden half, a whole
            stage reads and edits ``hidden`` alone (the residual is ignored;
            it may be None where no stage is fused).
        index: ``[>= rows, columns]`` int, the plan's index: stage ``s``'s
            rounds are its columns ``lanes[s]`` to ``lanes[s] + rounds``, its
            targets (as `harvest_stream`'s) its column ``harvest_lanes[s]``.
        bank, modes, scales, projections, norm_match: As `edit_stream`'s.
        pool: ``[pool rows, hidden]``, the plan's whole harvest pool (as
            `harvest_stream`'s `out`); only the rows the harvesting stages'
            targets name change, distinct across the stages too (the plan
            gives each site its own: the kernel's programs store them at
            once). Not read where no stage harvests.
        lanes: Each stage's first column of `index`.
        rounds: The rounds each stage runs.
        harvest_lanes: Each stage's column of targets in `index`, ``-1`` for
            a stage that harvests nothing.
        fused: Whether each stage sees the fused stream (``hidden +
            residual``) or ``hidden`` whole.
    """
    _check_stretch(hidden, residual, index, bank, modes, scales, projections, norm_match, pool, lanes, rounds,
                   harvest_lanes, fused)
    if hidden.shape[0] == 0 or IDLE.skips(hidden.device):  # a shape and the host's switch, never a value
        return
    base, column = index.data_ptr(), index.stride(1) * index.element_size()
    edits = [IDLE.leaves(hidden.device, (base + lane * column,)) for lane in lanes]
    harvests = [harvest_lane < 0 or IDLE.leaves(hidden.device, (base + harvest_lane * column,))
                for harvest_lane in harvest_lanes]
    if all(edits) and all(harvests):  # no stage of the stretch marked in this step
        return
    if _runs_kernel(hidden.device):
        _kernels().edit_stretch_rows(hidden, residual, index, bank, modes, scales, projections, norm_match, pool,
                                     lanes, rounds, harvest_lanes, fused)
        return
    for lane, harvest_lane, stage_fused, left, unread in zip(lanes, harvest_lanes, fused, edits, harvests):
        second = residual if stage_fused else None
        if not left:
            _edit_by_torch(hidden, second, index[:, lane:lane + rounds], bank, modes, scales, projections,
                           norm_match)
        if not unread and pool.shape[0]:
            _harvest_by_torch(pool, hidden, second, index[:, harvest_lane])


@_fake(edit_stretch)
def _edit_stretch_fake(hidden: torch.Tensor, residual: Optional[torch.Tensor], index: torch.Tensor,
                       bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                       norm_match: torch.Tensor, pool: torch.Tensor, lanes: list[int], rounds: int,
                       harvest_lanes: list[int], fused: list[bool]) -> None:
    _check_stretch(hidden, residual, index, bank, modes, scales, projections, norm_match, pool, lanes, rounds,
                   harvest_lanes, fused)


#: The ops streamscope inserts, by name: what the compile cache's salt hashes (`cache_salt`).
OPS = {"edit_stream": edit_stream, "harvest_stream": harvest_stream, "edit_harvest_stream": edit_harvest_stream,
       "edit_stretch": edit_stretch}


def kernel_source() -> str:
    """The text of `streamscope.vllm.graph_kernels` (the Triton kernels and their launches), read from its file
    beside this one: hashed without importing triton."""
    return Path(__file__).with_name("graph_kernels.py").read_text(encoding="utf-8")


def ops_source() -> str:
    """The source of every function the ops run (their bodies, checks and fake implementations, the choice of
    body, and the Triton kernels' module): torch.compile treats the ops as opaque, so vLLM's hash of the files it
    traced never reads this code."""
    functions: tuple[Callable[..., Any], ...] = (
        _check_stream, _check_index, _check_slots, _check_edit, _edited, *_BODIES.values(), _edit_by_torch,
        _edit_stream_fake, _check_pool, _check_harvest, _harvest_by_torch, _harvest_stream_fake, _check_edit_harvest,
        _edit_harvest_stream_fake, _check_stretch, _edit_stretch_fake, _runs_kernel, _kernels, IdleSwitch, _op)
    own = "\n".join(inspect.getsource(function) for function in functions)
    return own + "\n" + kernel_source()


#: The code that decides which module call an op's hook sits on and which of its tensors the op gets, by path
#: under the package: the block values and their descriptors, the families' envoy trees, a site's lookup, the
#: hooks and the plan's buffers. It runs at load, outside what dynamo traces (a moved site changes no traced file).
PLACEMENT = ("blocks", "families", "values.py", "bulk/sites.py", "vllm/blocks.py", "vllm/families",
             "vllm/graph_wiring.py", "vllm/graph_plan.py")


def placement_source() -> str:
    """The text of every file of `PLACEMENT`, each after its path, in path order: read from the files, so hashing
    imports none of them."""
    package = Path(__file__).resolve().parent.parent
    files = sorted(path for name in PLACEMENT
                   for path in ((package / name).rglob("*.py") if (package / name).is_dir() else [package / name]))
    return "\n".join(f"{path.relative_to(package).as_posix()}\n{path.read_text(encoding='utf-8')}" for path in files)


def cache_salt(sites: Sequence[str], rounds: int, harvest_sites: Sequence[str], source: Optional[str] = None) -> str:
    """A hex digest of what streamscope puts into a model's compiled graph: the ops' code, which ops sit at which
    sites and how many edit rounds each has, and the code that places them (`placement_source`).

    vLLM keys its compile cache on its config's hash (which covers
    ``additional_config``), the environment, the compiler and the source of
    the files dynamo traced; streamscope's ops are opaque, so their code is
    in none of those. Passing ``additional_config={SALT_KEY: cache_salt(...)}``
    to the engine makes a changed op, or another set of sites, a new cache
    directory, never a graph compiled without (or with other) ops.

    Args:
        sites: The sites an edit op sits at (location names), in any order.
        rounds: Edit ops a site holds (a request's steers at one site, in order).
        harvest_sites: The sites a harvest op sits at.
        source: The ops' code (`ops_source()` when None).

    The sizes of the buffers the ops read (slots, the harvest pool, the
    engine's ``max_num_batched_tokens``) are in the config's hash beside the
    salt (the graph ops' options, vLLM's scheduler config). The choice of
    body (`use_body`) is not: an op is one opaque call in the compiled graph,
    which picks its body each time it runs.
    """
    content = {"ops": sorted(OPS), "source": ops_source() if source is None else source,
               "placement": placement_source(), "sites": sorted(sites), "rounds": int(rounds),
               "harvest_sites": sorted(harvest_sites), "torch": torch.__version__}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


#: The key of `cache_salt` in vLLM's ``additional_config``.
SALT_KEY = "streamscope_graph_ops"


def salted(additional_config: Optional[dict[str, Any]], salt: str) -> dict[str, Any]:
    """`additional_config` (the engine's, or None) with streamscope's salt under `SALT_KEY`: a new dict."""
    config = dict(additional_config or {})
    config[SALT_KEY] = salt
    return config
