"""A stretch of sites for `graph_ops.edit_stretch`'s tests: tests/test_graph_ops.py runs its torch body,
tests/test_graph_kernels.py its kernel, both against the single-site ops called one after another.

A stretch is the sites a block holds with nothing between their module
calls, which see the same (hidden, residual) pair: in vLLM's Llama block the
attention output (the hidden half, whole) then the fused stream after it,
and the MLP output, the block's output and the next block's input. Each
stage runs its rounds (two columns of a plan's index) and, at some stages,
a harvest into its own rows of one pool (`pooled`: a column of targets a
harvesting stage).
"""

from __future__ import annotations

from typing import Optional

import torch

from streamscope.bulk.operations import DIRECTIONAL, prepare
from streamscope.vllm import graph_ops

MODES = ("add", "set", "ablate", "clamp")
SETTINGS = {"add": (0.7, 0.0), "set": (1.3, 0.0), "ablate": (0.6, 0.0), "clamp": (1.0, 2.5)}
#: Stretches by name: (each stage's lane in the index, whether it harvests, whether it sees the fused stream).
#: Three stages (a whole stream, then fused twice; harvests at the first and the last) and two (fused, then whole).
STRETCHES = {"three-stages": ([1, 4, 7], [True, False, True], [False, True, True]),
             "two-stages": ([5, 2], [False, True], [True, False])}
ROUNDS = 2
#: Rows no stage edits (the first harvested, the second not); a row every round of every stage edits.
IDLE, EVERYWHERE = (5, 6), 15
#: A row the first stage edits and the last harvests without an edit: its copy must see the first stage's edit.
EDITED_THEN_COPIED = 7
COLUMNS = 10
#: Each harvesting stage's targets (stream row -> pool row), the last stage's last: rows of its own in one pool,
#: EVERYWHERE at two stages (edited between), at the last the row the first edits.
STAGE_TARGETS = ({0: 5, 3: 1, 9: 8, IDLE[0]: 10, EVERYWHERE: 2},
                 {EDITED_THEN_COPIED: 4, 3: 0, 13: 9, 2: 6, EVERYWHERE: 11})
#: The pool's rows: those above, rows no stage names (3, 7, 12 to 14; the index's padding rows name 3) and the spare.
POOL = 16


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def every_mode(width: int, rows: int, dtype: torch.dtype, fused: bool,
               seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Optional[torch.Tensor]]:
    """A slot for every mode, plain and norm-matched (8, in `MODES` order), as the bank's buffers, and a stream of
    `rows` rows (with its residual half where `fused`), all from seeds `seed` on."""
    kinds = [(mode, norm_match) for mode in MODES for norm_match in (False, True)]
    ops = [prepare(mode, torch.randn(width, generator=generator(seed + number)), *SETTINGS[mode], norm_match, dtype,
                   "cpu") for number, (mode, norm_match) in enumerate(kinds)]
    buffers = (torch.stack([op.unit if op.mode in DIRECTIONAL else op.delta for op in ops]),
               torch.tensor([graph_ops.MODE_CODES[op.mode] for op in ops], dtype=torch.int32),
               torch.tensor([op.scale for op in ops]), torch.tensor([op.projection for op in ops]),
               torch.tensor([op.norm_match for op in ops]))
    hidden = (torch.randn(rows, width, generator=generator(seed + 1)) * 3).to(dtype)
    residual = (torch.randn(rows, width, generator=generator(seed + 2)) * 5).to(dtype) if fused else None
    return buffers, hidden, residual


class Stretch:
    """A stretch's index (the stages' rounds among other columns, padding rows past the call marked) and a stream of
    `rows` rows with the slots of `every_mode`."""

    def __init__(self, name: str, rows: int, width: int, dtype: torch.dtype, seed: int = 70) -> None:
        self.lanes, self.harvests, self.fused = STRETCHES[name]
        self.slot_buffers, self.hidden, residual = every_mode(width, rows, dtype, True, seed)
        self.residual: Optional[torch.Tensor] = residual
        self.index = torch.zeros((rows + 4, COLUMNS), dtype=torch.int32)  # padding rows marked: never read
        for row in range(rows):
            for column in range(COLUMNS):
                self.index[row, column] = (row * (column + 2) + column) % 9 - 1  # -1 (idle) and 0..7, mixed
        for lane in self.lanes:
            self.index[list(IDLE), lane:lane + ROUNDS] = -1
            self.index[EVERYWHERE, lane:lane + ROUNDS] = torch.tensor([1, 6], dtype=torch.int32)
        first, last = self.lanes[0], self.lanes[-1]
        self.index[EDITED_THEN_COPIED, first:first + ROUNDS] = torch.tensor([0, 6], dtype=torch.int32)
        self.index[EDITED_THEN_COPIED, last:last + ROUNDS] = -1
        edited = torch.stack([(self.slots(lane)[:rows] >= 0).any(dim=1) for lane in self.lanes], dim=1)
        assert not edited[IDLE[0]].any() and edited[EVERYWHERE].all()
        assert ((edited.sum(dim=1) > 0) & (edited.sum(dim=1) < len(self.lanes))).any()  # rows edited at some stages

    def slots(self, lane: int) -> torch.Tensor:
        """A stage's rounds: a strided ``[max_rows, rounds]`` view of the index."""
        return self.index[:, lane:lane + ROUNDS]


def pool_of(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A harvest pool of `rows` rows, its last (the spare) holding NaN, -0.0 and inf: bits a rewrite would show."""
    pool = torch.randn(rows, width, generator=generator(seed)).to(dtype)
    pool[-1, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return pool


def pooled(stretch: Stretch) -> tuple[torch.Tensor, torch.Tensor, list[int], tuple[dict[int, int], ...]]:
    """`stretch` harvesting into one pool: its index with a column of targets after it for each harvesting stage
    (`STAGE_TARGETS`), the pool, each stage's column of targets (-1: none) and the targets in use."""
    rows, width = stretch.hidden.shape
    harvesting = [stage for stage, harvests in enumerate(stretch.harvests) if harvests]
    maps = STAGE_TARGETS[len(STAGE_TARGETS) - len(harvesting):]
    columns = torch.full((stretch.index.shape[0], len(maps)), 3, dtype=torch.int32)  # the padding's: never read
    columns[:rows] = -1
    for number, targets in enumerate(maps):
        columns[list(targets), number] = torch.tensor(list(targets.values()), dtype=torch.int32)
    harvest_lanes = [-1] * len(stretch.lanes)
    for number, stage in enumerate(harvesting):
        harvest_lanes[stage] = stretch.index.shape[1] + number
    return (torch.cat([stretch.index, columns], dim=1), pool_of(POOL, width, stretch.hidden.dtype, 80), harvest_lanes,
            maps)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({4: torch.int32, 2: torch.int16}[tensor.element_size()])
