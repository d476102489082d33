"""A stretch of sites for `graph_ops.edit_stretch`'s tests: tests/test_graph_ops.py runs its torch body,
tests/test_graph_kernels.py its kernel, both against the single-site ops called one after another.

A stretch is the sites a block holds with nothing between their module
calls, which see the same (hidden, residual) pair: in vLLM's Llama block the
attention output (the hidden half, whole) then the fused stream after it,
and the MLP output, the block's output and the next block's input. Each
stage runs its rounds (two columns of a plan's index) and, at some stages,
a harvest into its buffer of the plan's harvest buffers.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from streamscope.bulk.operations import DIRECTIONAL, prepare
from streamscope.vllm import graph_ops

MODES = ("add", "set", "ablate", "clamp")
SETTINGS = {"add": (0.7, 0.0), "set": (1.3, 0.0), "ablate": (0.6, 0.0), "clamp": (1.0, 2.5)}
#: Stretches by name: (each stage's lane in the index, its harvest buffer or -1, whether it sees the fused stream).
#: Three stages (a whole stream, then fused twice; harvests at the first and the last) and two (fused, then whole).
STRETCHES = {"three-stages": ([1, 4, 7], [2, -1, 0], [False, True, True]),
             "two-stages": ([5, 2], [-1, 1], [True, False])}
ROUNDS = 2
#: Rows no stage edits (the first harvested, the second not); a row every round of every stage edits.
IDLE, EVERYWHERE = (5, 6), 15
#: A row the first stage edits and the last harvests without an edit: its copy must see the first stage's edit.
EDITED_THEN_COPIED = 7
HARVESTED = [EDITED_THEN_COPIED, 0, 3, 9, 2, 13, IDLE[0], EVERYWHERE]
CAPACITY, HARVEST_SITES, COLUMNS = 10, 3, 10


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


#: A single-site op as the test runs it: edit (hidden, residual, slots) -> the edited hidden; edit and harvest
#: (hidden, residual, slots, out) -> the edited hidden and the filled buffer.
Edit = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]
EditHarvest = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor]]


class Stretch:
    """A stretch's index (the stages' rounds among other columns, padding rows past the call marked), its harvest
    buffers and maps, and a stream of `rows` rows with the slots of `every_mode`."""

    def __init__(self, name: str, rows: int, width: int, dtype: torch.dtype, seed: int = 70) -> None:
        self.lanes, self.buffers, self.fused = STRETCHES[name]
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
        self.sources = torch.full((CAPACITY,), -1, dtype=torch.int32)
        self.sources[:len(HARVESTED)] = torch.tensor(HARVESTED, dtype=torch.int32)
        self.targets = torch.full((rows,), -1, dtype=torch.int32)
        self.targets[HARVESTED] = torch.arange(len(HARVESTED), dtype=torch.int32)
        self.harvested = torch.randn(HARVEST_SITES, CAPACITY, width, generator=generator(seed + 9)).to(dtype)
        edited = torch.stack([(self.slots(lane)[:rows] >= 0).any(dim=1) for lane in self.lanes], dim=1)
        assert not edited[IDLE[0]].any() and edited[EVERYWHERE].all()
        assert ((edited.sum(dim=1) > 0) & (edited.sum(dim=1) < len(self.lanes))).any()  # rows edited at some stages

    def slots(self, lane: int) -> torch.Tensor:
        """A stage's rounds: a strided ``[max_rows, rounds]`` view of the index."""
        return self.index[:, lane:lane + ROUNDS]

    def arguments(self) -> tuple:
        """`edit_stretch`'s arguments after the stream's halves (whose copies the caller passes)."""
        return (self.index, *self.slot_buffers, self.harvested.clone(), self.sources, self.targets, self.lanes,
                ROUNDS, self.buffers, self.fused)

    def stages(self) -> Iterator[tuple[torch.Tensor, Optional[torch.Tensor], int]]:
        """Each stage's slots, the residual it sees (None for a whole stage) and its harvest buffer (-1: none)."""
        for lane, buffer, fused in zip(self.lanes, self.buffers, self.fused):
            yield self.slots(lane), self.residual if fused else None, buffer

    def one_by_one(self, edit: Edit, edit_harvest: EditHarvest) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream's hidden half and the harvest buffers after the single-site ops, stage after stage."""
        hidden, harvested = self.hidden.clone(), self.harvested.clone()
        for slots, residual, buffer in self.stages():
            if buffer >= 0:
                hidden, harvested[buffer] = edit_harvest(hidden, residual, slots, harvested[buffer].clone())
            else:
                hidden = edit(hidden, residual, slots)
        return hidden, harvested

    def check_harvest(self, hidden: torch.Tensor, harvested: torch.Tensor) -> None:
        """What the comparison with the ops one by one cannot show: a row edited at the first stage and harvested
        unedited at the last is copied with the edit; buffers no stage names, and rows no row fills, keep their
        bits. (`hidden` is the stretch's result.)"""
        last, residual = self.buffers[-1], self.residual if self.fused[-1] else None
        row = EDITED_THEN_COPIED
        stream = hidden[row] if residual is None else hidden[row] + residual[row]
        before = self.hidden[row] if residual is None else self.hidden[row] + residual[row]
        copied = harvested[last, HARVESTED.index(row)]
        assert torch.equal(copied, stream) and not torch.equal(copied, before)
        kept = [buffer for buffer in range(HARVEST_SITES) if buffer not in self.buffers]
        assert torch.equal(bits(harvested[kept]), bits(self.harvested[kept]))
        assert torch.equal(bits(harvested[:, len(HARVESTED):]), bits(self.harvested[:, len(HARVESTED):]))


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({4: torch.int32, 2: torch.int16}[tensor.element_size()])
