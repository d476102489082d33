"""The graph ops' bodies as Triton kernels: one launch an op, one program a row, nothing done for an idle row.

`streamscope.vllm.graph_ops` runs these on CUDA tensors (and, where asked,
on the CPU through Triton's interpreter); elsewhere it keeps its torch
arithmetic. Their results are the torch body's, step for step:

* `edit_rows` launches one program per row of the call. A program whose
  row's slot is ``-1`` loads that one index entry and returns, so an idle
  site costs one small launch and every unmarked row keeps its bits (NaN,
  inf and -0.0 included: it is never written). A marked row's program reads
  its row in blocks of ``block`` columns (any hidden size): a first pass
  accumulates, in float32, the row's projection on its direction and its
  squared norm (where the mode or a norm match needs them), a second the
  edited row's squared norm (norm match only), a third writes the row.
  Given a site's rounds (``slots`` ``[rows, rounds]``), a program runs
  them in order on its row, one launch for them all: an idle row loads one
  index entry a round and writes nothing; a round that edits after one that
  did waits at a barrier first (its first pass reads columns other threads
  of the program stored).
* `edit_harvest_rows` is `edit_rows` with a harvest (``HARVEST``): each
  program also loads its row's target, the pool row it fills (``-1``:
  none), copies a row no round edits there as `harvest_rows` does, and
  stores an edited one from the registers of the last pass of each round
  that edits it, rounded as `harvest_rows` adds the stored halves: the bits
  of the two kernels one after the other.
* `edit_stretch_rows` runs a stretch of sites (`graph_ops.edit_stretch`)
  in one launch: each program runs the stages in order, each stage its
  rounds and, where it harvests, its store or copy into its own pool row
  (the stage's column of targets in the index), as `edit_harvest_rows` does
  for one site. The lanes and the harvest lanes are runtime arguments, so
  one compiled kernel serves every stretch of the same layout; which stages
  are fused and which harvest are constexpr masks. A program loads all its
  row's slots in one load and the harvesting stages' targets in another, and
  returns where none is marked and nothing is harvested; a round that edits,
  or a harvest's copy, after an earlier round or stage stored the row waits
  at a barrier first.
* `harvest_rows` scatters: one program per stream row of the call, so an
  idle decode step of 64 rows launches 64 programs, whatever the pool's
  size. A program whose target is ``-1`` returns; the others copy their row
  (the sum of the two halves in a fused block) into their pool row.

Every value the torch body rounds to the stream's dtype (the summed stream,
the projection, the coefficient, the change, the edited row, the norms, the
norm's factor, the rescaled row, the change written back) is rounded here to
that dtype at the same point (`_rounded`), from a float32 computation, as
torch's elementwise ops on bfloat16 and float16 compute in float32 and round
once. So a plain add or set gives the torch body's bits in every dtype; an
ablate, a clamp or a norm match differs only where the float32 sums of a
row's products, summed in another order, round differently.

Nothing here reads a tensor's value on the host: a launch is a grid of the
call's rows, with shapes and strides as arguments, so a CUDA graph captures
it. Entries of the index past the call's rows (a captured batch's padding)
are never read.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from streamscope.vllm.graph_ops import MAX_STAGES

#: The widest block of columns a program handles at once; a wider row is read in several blocks.
MAX_BLOCK = 1024
#: Whether the edit kernels on CUDA launch as programmatic dependents (Hopper's PDL: a program may start before
#: the kernel ahead of it ends, and waits for it before reading): `scripts/graph_ops_gpu_check.py` times an idle
#: launch both ways; off until a GPU shows it gains.
DEPENDENT_LAUNCH = False
#: The modes `_edit_rows` has a branch for (any other code would be edited as an add): a mode added to
#: `graph_ops.MODE_CODES` without one fails tests/test_graph_kernels.py.
KERNEL_MODES = ("add", "set", "ablate", "clamp")
#: The mode codes of `streamscope.vllm.graph_ops` (ADD, SET, ABLATE, CLAMP), as the kernels compare them.
_SET, _ABLATE, _CLAMP = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


@triton.jit
def _rounded(value, DTYPE: tl.constexpr):
    """`value` (float32) rounded to nearest (ties to even) in the stream's dtype, as a float32 again: the value
    torch's op would have stored.

    bfloat16 is rounded on the bits: Triton's interpreter truncates a
    float32 cast to bfloat16, where a GPU rounds to nearest, so the kernel
    spells the rounding out and both give the same bits. float16 casts round
    to nearest on both.
    """
    if DTYPE == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))  # a NaN stays a NaN
    elif DTYPE == tl.float16:
        return value.to(tl.float16).to(tl.float32)
    else:
        return value


@triton.jit
def _copy_row(out_row, out_column, hidden_row, hidden_column, residual_row, residual_column, width, offsets,
              FUSED: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    """A stream row into a row of the harvest pool: the hidden half plus the residual, rounded as torch adds them, in a
    fused block; a whole stream's row as it is."""
    for start in range(0, width, BLOCK):
        columns = start + offsets
        inside = columns < width
        value = tl.load(hidden_row + columns * hidden_column, mask=inside)
        if FUSED:
            second = tl.load(residual_row + columns * residual_column, mask=inside)
            value = _rounded(value.to(tl.float32) + second.to(tl.float32), DTYPE).to(DTYPE)
        tl.store(out_row + columns * out_column, value, mask=inside)


@triton.jit
def _row_block(start, offsets, width, hidden_row, hidden_column, residual_row, residual_column, vector_row,
               bank_column, FUSED: tl.constexpr, DTYPE: tl.constexpr):
    """The block of a marked row's columns from `start`, as each of `_edit_rows`' passes reads it: the columns and
    which lie inside the row, then in float32 the hidden half, the stream (the hidden half plus the residual half,
    rounded as torch adds them) and the row's direction."""
    columns = start + offsets
    inside = columns < width
    hidden = tl.load(hidden_row + columns * hidden_column, mask=inside, other=0.0).to(tl.float32)
    stream = hidden
    if FUSED:
        residual = tl.load(residual_row + columns * residual_column, mask=inside, other=0.0).to(tl.float32)
        stream = _rounded(hidden + residual, DTYPE)
    vector = tl.load(vector_row + columns * bank_column, mask=inside, other=0.0).to(tl.float32)
    return columns, inside, hidden, stream, vector


@triton.jit
def _edited_block(stream, vector, coefficient, is_set, DTYPE: tl.constexpr):
    """A block of the edited row before a norm match, and the change of a direction's edit (``c v``)."""
    change = _rounded(coefficient * vector, DTYPE)
    return tl.where(is_set, vector, _rounded(stream + change, DTYPE)), change


@triton.jit
def _edit_row(hidden_row, hidden_column, residual_row, residual_column, slot, bank, bank_row_stride, bank_column,
              modes, modes_stride, scales, scales_stride, projections, projections_stride, norm_match,
              norm_match_stride, width, tiny, offsets, kept_row, out_column, target,
              FUSED: tl.constexpr, BLOCK: tl.constexpr, HARVEST: tl.constexpr, DTYPE: tl.constexpr):
    """One round's edit of a marked row (``slot >= 0``): three passes over its blocks of columns; with ``HARVEST``
    and a target row, the edited stream also stored there from the last pass's registers."""
    mode = tl.load(modes + slot * modes_stride)
    matched = tl.load(norm_match + slot * norm_match_stride) != 0
    scale = tl.load(scales + slot * scales_stride)
    projection = tl.load(projections + slot * projections_stride)
    is_set = mode == _SET
    directional = (mode == _ABLATE) | (mode == _CLAMP)
    vector_row = bank + slot * bank_row_stride
    along = tl.zeros([BLOCK], dtype=tl.float32)
    square = tl.zeros([BLOCK], dtype=tl.float32)
    if directional | matched:  # the row's projection on its direction, and its squared norm
        for start in range(0, width, BLOCK):
            _, _, _, stream, vector = _row_block(start, offsets, width, hidden_row, hidden_column, residual_row,
                                                 residual_column, vector_row, bank_column, FUSED, DTYPE)
            along += stream * vector
            square += stream * stream
    wide = _rounded(tl.sum(along, axis=0), DTYPE)  # torch's product of the row and the direction, in the dtype
    coefficient = tl.where(mode == _ABLATE, _rounded(-(scale * wide), DTYPE),
                           tl.where(mode == _CLAMP, _rounded(projection - wide, DTYPE), 1.0))
    after = tl.zeros([BLOCK], dtype=tl.float32)
    if matched:  # the edited row's squared norm
        for start in range(0, width, BLOCK):
            _, _, _, stream, vector = _row_block(start, offsets, width, hidden_row, hidden_column, residual_row,
                                                 residual_column, vector_row, bank_column, FUSED, DTYPE)
            edited, _ = _edited_block(stream, vector, coefficient, is_set, DTYPE)
            after += edited * edited
    norm_before = _rounded(tl.sqrt_rn(tl.sum(square, axis=0)), DTYPE)
    norm_after = _rounded(tl.sqrt_rn(tl.sum(after, axis=0)), DTYPE)
    # A row the edit left at zero stays zero: there is no direction to give the old norm to (as `Operation` does).
    divisor = tl.where(norm_after > 0, tl.maximum(norm_after, tiny), 1.0)  # 1: a quotient no row uses
    factor = tl.where(norm_after > 0, _rounded(tl.div_rn(norm_before, divisor), DTYPE), 0.0)
    # The hidden half of a fused stream takes a plain ablate's or clamp's change itself, any other edit
    # ``edited - stream`` (`Summed._edit_rows`, `Operation.add_change`).
    direct = directional & (matched == 0)
    for start in range(0, width, BLOCK):
        columns, inside, half, stream, vector = _row_block(start, offsets, width, hidden_row, hidden_column,
                                                           residual_row, residual_column, vector_row, bank_column,
                                                           FUSED, DTYPE)
        edited, change = _edited_block(stream, vector, coefficient, is_set, DTYPE)
        edited = tl.where(matched, _rounded(edited * factor, DTYPE), edited)
        if FUSED:
            edited = _rounded(half + tl.where(direct, change, _rounded(edited - stream, DTYPE)), DTYPE)
        tl.store(hidden_row + columns * hidden_column, edited.to(DTYPE), mask=inside)  # exact: already rounded
        if HARVEST:  # the edited stream from the registers, rounded as the harvest kernel adds the stored halves
            if target >= 0:
                kept = edited
                if FUSED:
                    residual_block = tl.load(residual_row + columns * residual_column, mask=inside, other=0.0)
                    kept = _rounded(edited + residual_block.to(tl.float32), DTYPE)
                tl.store(kept_row + columns * out_column, kept.to(DTYPE), mask=inside)


@triton.jit
def _edit_rows(hidden, hidden_row_stride, hidden_column, residual, residual_row_stride, residual_column,
               slots, slots_stride, slots_round_stride, bank, bank_row_stride, bank_column, modes, modes_stride,
               scales, scales_stride, projections, projections_stride, norm_match, norm_match_stride, width, tiny,
               out, out_row_stride, out_column, targets, targets_stride,
               FUSED: tl.constexpr, BLOCK: tl.constexpr, HARVEST: tl.constexpr, ROUNDS: tl.constexpr,
               WAIT: tl.constexpr):
    if WAIT:  # launched as a programmatic dependent: the kernel before may still be running until here
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    DTYPE = hidden.dtype.element_ty
    hidden_row = hidden + row * hidden_row_stride
    residual_row = residual + row * residual_row_stride
    offsets = tl.arange(0, BLOCK)
    if HARVEST:  # the row's pool row after the edits (-1: none), the harvest op's work in this launch
        target = tl.load(targets + row * targets_stride).to(tl.int64)
    else:
        target = row * 0 - 1
    kept_row = out + target * out_row_stride
    edits = row * 0
    for round_ in tl.static_range(ROUNDS):  # a site's rounds in order, each over the row as the one before left it
        slot = tl.load(slots + row * slots_stride + round_ * slots_round_stride).to(tl.int64)
        if slot >= 0:
            if round_ > 0:  # the round before stored this row from other threads of the program
                tl.debug_barrier()
            _edit_row(hidden_row, hidden_column, residual_row, residual_column, slot, bank, bank_row_stride,
                      bank_column, modes, modes_stride, scales, scales_stride, projections, projections_stride,
                      norm_match, norm_match_stride, width, tiny, offsets, kept_row, out_column, target,
                      FUSED, BLOCK, HARVEST, DTYPE)
        edits += tl.where(slot >= 0, 1, 0)
    if HARVEST:
        if (target >= 0) & (edits == 0):  # harvested, not edited: its row as it is
            _copy_row(kept_row, out_column, hidden_row, hidden_column, residual_row, residual_column, width,
                      offsets, FUSED, BLOCK, DTYPE)


@triton.jit(do_not_specialize=["lane_0", "lane_1", "lane_2", "lane_3", "harvest_lane_0", "harvest_lane_1",
                               "harvest_lane_2", "harvest_lane_3"])
def _edit_stretch_rows(hidden, hidden_row_stride, hidden_column, residual, residual_row_stride, residual_column,
                       index, index_row_stride, index_column, lane_0, lane_1, lane_2, lane_3, bank, bank_row_stride,
                       bank_column, modes, modes_stride, scales, scales_stride, projections, projections_stride,
                       norm_match, norm_match_stride, width, tiny, pool, pool_row_stride, pool_column,
                       harvest_lane_0, harvest_lane_1, harvest_lane_2, harvest_lane_3,
                       STAGES: tl.constexpr, ROUNDS: tl.constexpr, SLOTS: tl.constexpr, TARGETS: tl.constexpr,
                       FUSED_MASK: tl.constexpr, HARVEST_MASK: tl.constexpr, BLOCK: tl.constexpr,
                       WAIT: tl.constexpr):
    if WAIT:  # launched as a programmatic dependent: the kernel before may still be running until here
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    DTYPE = hidden.dtype.element_ty
    hidden_row = hidden + row * hidden_row_stride
    residual_row = residual + row * residual_row_stride
    offsets = tl.arange(0, BLOCK)
    # Every slot of the stretch (stage by stage, round by round) in one load: an idle row waits for one load, not
    # for one a round after the other; the lanes are arguments, so one compiled kernel serves every stretch.
    entry = tl.arange(0, SLOTS)
    stage_of_entry = entry // ROUNDS
    lane = tl.where(stage_of_entry == 0, lane_0,
                    tl.where(stage_of_entry == 1, lane_1, tl.where(stage_of_entry == 2, lane_2, lane_3)))
    columns_of_entry = (lane + entry % ROUNDS).to(tl.int64)
    slots = tl.load(index + row * index_row_stride + columns_of_entry * index_column, mask=entry < STAGES * ROUNDS,
                    other=-1).to(tl.int64)
    busy = tl.max(slots, axis=0) >= 0
    stage_of_target = tl.arange(0, TARGETS)
    if HARVEST_MASK != 0:  # each harvesting stage's pool row for this row (-1: none): one load, as the slots
        harvest_lane = tl.where(stage_of_target == 0, harvest_lane_0,
                                tl.where(stage_of_target == 1, harvest_lane_1,
                                         tl.where(stage_of_target == 2, harvest_lane_2, harvest_lane_3)))
        harvests = ((tl.full([TARGETS], HARVEST_MASK, tl.int32) >> stage_of_target) & 1) == 1
        targets = tl.load(index + row * index_row_stride + harvest_lane.to(tl.int64) * index_column,
                          mask=harvests, other=-1).to(tl.int64)
        busy = busy | (tl.max(targets, axis=0) >= 0)
    if busy:  # an idle row, unharvested, reads and writes nothing more
        edits = row * 0  # the rounds so far that stored this row
        for stage in tl.static_range(STAGES):
            if (HARVEST_MASK >> stage) & 1 == 1:
                target = tl.max(tl.where(stage_of_target == stage, targets, -1), axis=0)
            else:
                target = row * 0 - 1
            kept_row = pool + target * pool_row_stride
            before = edits
            for round_ in tl.static_range(ROUNDS):  # the stage's rounds in order, as `_edit_rows` runs a site's
                slot = tl.max(tl.where(entry == stage * ROUNDS + round_, slots, -1), axis=0)
                if slot >= 0:
                    if edits > 0:  # an earlier round stored this row from other threads of the program
                        tl.debug_barrier()
                    _edit_row(hidden_row, hidden_column, residual_row, residual_column, slot, bank,
                              bank_row_stride, bank_column, modes, modes_stride, scales, scales_stride, projections,
                              projections_stride, norm_match, norm_match_stride, width, tiny, offsets, kept_row,
                              pool_column, target, (FUSED_MASK >> stage) & 1 == 1, BLOCK,
                              (HARVEST_MASK >> stage) & 1 == 1, DTYPE)
                edits += tl.where(slot >= 0, 1, 0)
            if (HARVEST_MASK >> stage) & 1 == 1:
                if (target >= 0) & (edits == before):  # harvested, not edited at this stage: its row as it is now
                    if edits > 0:  # as an earlier stage left it, stored from other threads
                        tl.debug_barrier()
                    _copy_row(kept_row, pool_column, hidden_row, hidden_column, residual_row, residual_column,
                              width, offsets, (FUSED_MASK >> stage) & 1 == 1, BLOCK, DTYPE)


@triton.jit
def _harvest_rows(out, out_row_stride, out_column, hidden, hidden_row_stride, hidden_column, residual,
                  residual_row_stride, residual_column, targets, targets_stride, width,
                  FUSED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets + row * targets_stride).to(tl.int64)
    if target < 0:  # a row this site does not harvest
        return
    _copy_row(out + target * out_row_stride, out_column, hidden + row * hidden_row_stride, hidden_column,
              residual + row * residual_row_stride, residual_column, width, tl.arange(0, BLOCK), FUSED, BLOCK,
              hidden.dtype.element_ty)


def block_for(width: int, block: Optional[int] = None) -> int:
    """The columns a program reads at once for rows of `width`: the next power of two up to `MAX_BLOCK`, or
    `block` (a power of two) where given."""
    chosen = min(triton.next_power_of_2(max(width, 1)), MAX_BLOCK) if block is None else int(block)
    if chosen < 16 or chosen & (chosen - 1):
        raise ValueError(f"block={block}: a block of columns is a power of two of at least 16.")
    return chosen


def _launchable(kernel: object, tensor: torch.Tensor) -> None:
    if tensor.device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("the graph ops' Triton kernels run on CPU tensors only through Triton's interpreter: set "
                           "TRITON_INTERPRET=1 in the environment before triton is first imported (or keep the CPU "
                           "on the torch body, the default).")


#: A launch: the grid, the kernel's arguments in order, and its constexpr and launch options.
Launch = tuple[tuple[int], tuple[Any, ...], dict[str, Any]]


def edit_launch(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: torch.Tensor,
                modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor, norm_match: torch.Tensor,
                block: Optional[int] = None, out: Optional[torch.Tensor] = None,
                targets: Optional[torch.Tensor] = None, dependent: Optional[bool] = None) -> Launch:
    """How `edit_rows` (and, with `out` and `targets`, `edit_harvest_rows`) launches `_edit_rows` for these
    tensors: one program a row of `hidden`, each running every round of `slots` (a column of slots a round, or one
    column). `dependent`: launched as a programmatic dependent (`DEPENDENT_LAUNCH` when None)."""
    rows, width = hidden.shape
    second = hidden if residual is None else residual  # never read without FUSED
    harvest, kept, where = False, hidden, slots  # never read without HARVEST
    if out is not None and targets is not None:
        harvest, kept, where = True, out, targets
    rounds, round_stride = (slots.shape[1], slots.stride(1)) if slots.dim() == 2 else (1, 0)
    arguments = (hidden, hidden.stride(0), hidden.stride(1), second, second.stride(0), second.stride(1), slots,
                 slots.stride(0), round_stride, bank, bank.stride(0), bank.stride(1), modes, modes.stride(0), scales,
                 scales.stride(0), projections, projections.stride(0), norm_match, norm_match.stride(0), width,
                 torch.finfo(hidden.dtype).tiny, kept, kept.stride(0), kept.stride(1), where, where.stride(0))
    # No fused multiply-adds: each product is rounded as torch's own kernels round it, on the GPU as in the
    # interpreter.
    options: dict[str, Any] = {"FUSED": residual is not None, "BLOCK": block_for(width, block), "HARVEST": harvest,
                               "ROUNDS": rounds, "WAIT": False, "enable_fp_fusion": False}
    if (DEPENDENT_LAUNCH if dependent is None else dependent) and hidden.device.type == "cuda":
        options.update(WAIT=True, launch_pdl=True)
    return (rows,), arguments, options


def stretch_launch(hidden: torch.Tensor, residual: Optional[torch.Tensor], index: torch.Tensor, bank: torch.Tensor,
                   modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor, norm_match: torch.Tensor,
                   pool: torch.Tensor, lanes: Sequence[int], rounds: int, harvest_lanes: Sequence[int],
                   fused: Sequence[bool], block: Optional[int] = None, dependent: Optional[bool] = None) -> Launch:
    """How `edit_stretch_rows` launches `_edit_stretch_rows` for these tensors: one program a row of `hidden`, each
    running every stage's rounds in order. The lanes and the harvest lanes are runtime arguments (one compiled
    kernel for every stretch of the same shape); which stages are fused and which harvest are constexpr masks (bit
    ``s`` for stage ``s``)."""
    rows, width = hidden.shape
    stages = len(lanes)
    if not 1 <= stages <= MAX_STAGES or not len(lanes) == len(harvest_lanes) == len(fused):
        raise ValueError(f"a stretch runs 1 to {MAX_STAGES} stages, each with a lane, a harvest lane and a layout: "
                         f"not lanes {list(lanes)}, harvest_lanes {list(harvest_lanes)}, fused {list(fused)}.")
    second = hidden if residual is None else residual  # never read where no stage is fused
    kept = pool if any(lane >= 0 for lane in harvest_lanes) else hidden  # never read where no stage harvests
    padding = [0] * (MAX_STAGES - stages)
    arguments = (hidden, hidden.stride(0), hidden.stride(1), second, second.stride(0), second.stride(1), index,
                 index.stride(0), index.stride(1), *(list(lanes) + padding), bank, bank.stride(0), bank.stride(1),
                 modes, modes.stride(0), scales, scales.stride(0), projections, projections.stride(0), norm_match,
                 norm_match.stride(0), width, torch.finfo(hidden.dtype).tiny, kept, kept.stride(0), kept.stride(1),
                 *(list(harvest_lanes) + padding))
    options: dict[str, Any] = {
        "STAGES": stages, "ROUNDS": int(rounds), "SLOTS": triton.next_power_of_2(stages * int(rounds)),
        "TARGETS": triton.next_power_of_2(stages),
        "FUSED_MASK": sum(1 << stage for stage, layout in enumerate(fused) if layout),
        "HARVEST_MASK": sum(1 << stage for stage, lane in enumerate(harvest_lanes) if lane >= 0),
        "BLOCK": block_for(width, block), "WAIT": False, "enable_fp_fusion": False}
    if (DEPENDENT_LAUNCH if dependent is None else dependent) and hidden.device.type == "cuda":
        options.update(WAIT=True, launch_pdl=True)
    return (rows,), arguments, options


def harvest_launch(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], targets: torch.Tensor,
                   block: Optional[int] = None) -> Launch:
    """How `harvest_rows` launches `_harvest_rows` for these tensors: one program a stream row of the call,
    whatever the pool's size."""
    width = out.shape[1]
    second = hidden if residual is None else residual
    arguments = (out, out.stride(0), out.stride(1), hidden, hidden.stride(0), hidden.stride(1), second,
                 second.stride(0), second.stride(1), targets, targets.stride(0), width)
    options = {"FUSED": residual is not None, "BLOCK": block_for(width, block), "enable_fp_fusion": False}
    return (hidden.shape[0],), arguments, options


def edit_rows(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor, bank: torch.Tensor,
              modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor, norm_match: torch.Tensor,
              block: Optional[int] = None) -> None:
    """`graph_ops.edit_stream`'s edit by the kernel: the same arguments, already checked by the op; `block`
    overrides the columns a program reads at once (`block_for`). Changes `hidden` in place."""
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        return
    _launchable(_edit_rows, hidden)
    grid, arguments, options = edit_launch(hidden, residual, slots, bank, modes, scales, projections, norm_match,
                                           block)
    _edit_rows[grid](*arguments, **options)


def edit_harvest_rows(hidden: torch.Tensor, residual: Optional[torch.Tensor], slots: torch.Tensor,
                      bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                      norm_match: torch.Tensor, out: torch.Tensor, targets: torch.Tensor,
                      block: Optional[int] = None) -> None:
    """`graph_ops.edit_harvest_stream` by the kernel: `edit_rows`, and each row whose target is a pool row stored
    there after its edit, in the same program. Changes `hidden` and those rows of the pool `out`."""
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        return
    _launchable(_edit_rows, hidden)
    grid, arguments, options = edit_launch(hidden, residual, slots, bank, modes, scales, projections, norm_match,
                                           block, out, targets)
    _edit_rows[grid](*arguments, **options)


def edit_stretch_rows(hidden: torch.Tensor, residual: Optional[torch.Tensor], index: torch.Tensor,
                      bank: torch.Tensor, modes: torch.Tensor, scales: torch.Tensor, projections: torch.Tensor,
                      norm_match: torch.Tensor, pool: torch.Tensor, lanes: Sequence[int], rounds: int,
                      harvest_lanes: Sequence[int], fused: Sequence[bool], block: Optional[int] = None,
                      dependent: Optional[bool] = None) -> None:
    """`graph_ops.edit_stretch` by the kernel: `edit_harvest_rows` (or `edit_rows`) of each stage in order, in one
    launch. Changes `hidden` and the rows of `pool` the harvesting stages' targets name."""
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        return
    _launchable(_edit_stretch_rows, hidden)
    grid, arguments, options = stretch_launch(hidden, residual, index, bank, modes, scales, projections, norm_match,
                                              pool, lanes, rounds, harvest_lanes, fused, block, dependent)
    _edit_stretch_rows[grid](*arguments, **options)


def harvest_rows(out: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor], targets: torch.Tensor,
                 block: Optional[int] = None) -> None:
    """`graph_ops.harvest_stream`'s scatter by the kernel: the same arguments, already checked by the op. Changes
    the rows of the pool `out` the call's rows' targets name."""
    if out.shape[0] == 0 or out.shape[1] == 0 or hidden.shape[0] == 0:
        return
    _launchable(_harvest_rows, hidden)
    grid, arguments, options = harvest_launch(out, hidden, residual, targets, block)
    _harvest_rows[grid](*arguments, **options)
