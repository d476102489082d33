"""Which of a request's rows a steer edits, by position: the graph ops' plan reads a request's steers' rules each
step (`streamscope.vllm.graph_plan.GraphPlan.step`).

A rule is a frozen value, made once for each distinct rule (`rule_of`): a
request's steers at every block share one, and so do requests of one length;
the rules of every row and of every row but the first are one each for every
length (`EVERY_ROW`, `EVERY_ROW_BUT_FIRST`).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..bulk.steer import steer_positions


@dataclass(frozen=True)
class RowRule:
    """Which of one request's rows a steer edits, by position: prompt ranges, then generated tokens.

    Args:
        length: The prompt's token count (positions past it are generated).
        prompt: The prompt positions edited, as sorted disjoint ranges
            ``(start, stop)``.
        generated: Whether generated tokens are edited.
        from_step: The first generated token edited (0: the first).
    """

    length: int
    prompt: tuple[tuple[int, int], ...]
    generated: bool = True
    from_step: int = 0
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_starts", tuple(start for start, _ in self.prompt))

    @classmethod
    def of(cls, positions: Sequence[int], length: int, generated: bool = True, from_step: int = 0) -> "RowRule":
        """The rule for the prompt positions `positions` (any order, non-negative, below `length`)."""
        if isinstance(positions, range) and positions.step == 1:  # every position, or all but the first: one range
            if positions and not 0 <= positions.start <= positions.stop <= length:
                outside = positions.start if positions.start < 0 else positions.stop - 1
                raise ValueError(f"position {outside} is not in a {length}-token prompt.")
            return cls(length, ((positions.start, positions.stop),) if positions else (), bool(generated),
                       int(from_step))
        ranges: list[tuple[int, int]] = []
        for position in sorted(set(positions)):
            if not 0 <= position < length:
                raise ValueError(f"position {position} is not in a {length}-token prompt.")
            if ranges and ranges[-1][1] == position:
                ranges[-1] = (ranges[-1][0], position + 1)
            else:
                ranges.append((position, position + 1))
        return cls(length, tuple(ranges), bool(generated), int(from_step))

    @classmethod
    def of_steer(cls, steer: Any, length: int, prompt: int) -> "RowRule":
        """The rule of a bulk `Steer` (`streamscope.bulk.steer`) for prompt number `prompt` of `length` tokens."""
        return cls.of(steer_positions(steer, length, prompt), length, steer.generated, steer.from_step)

    @property
    def every_from(self) -> float:
        """The first position from which the rule edits every row (`covers` every span that starts there or
        later): 0 for a rule of every row, 1 for every row but the first; `math.inf` where generated tokens are
        not edited."""
        if not self.generated:
            return math.inf
        if self.from_step:
            return self.length + self.from_step
        if self.prompt and self.prompt[-1][1] == self.length:
            return self.prompt[-1][0]
        return self.length

    def covers(self, first: int, count: int) -> bool:
        """Whether the steer edits every row of a span of `count` rows from position `first` (a decode step's row,
        a prefill of every position), which the step's fill writes with one gather."""
        end = first + count
        if first >= self.length:
            return self.generated and first >= self.length + self.from_step
        index = bisect.bisect_right(self._starts, first) - 1
        if index < 0 or self.prompt[index][1] < min(end, self.length):
            return False
        return end <= self.length or (self.generated and self.from_step == 0)

    def ranges(self, start: int, count: int, first: int) -> list[tuple[int, int]]:
        """The edited rows of a span (rows ``start .. start + count`` at positions ``first ..``), as row ranges."""
        end = first + count
        found: list[tuple[int, int]] = []
        top = min(end, self.length)
        if first < top:
            index = max(bisect.bisect_right(self._starts, first) - 1, 0)
            for low, high in self.prompt[index:]:
                if low >= top:
                    break
                low, high = max(low, first), min(high, top)
                if low < high:
                    found.append((start + low - first, start + high - first))
        if self.generated:
            low = max(first, self.length + self.from_step)
            if low < end:
                row = start + low - first
                if found and found[-1][1] == row:
                    found[-1] = (found[-1][0], start + count)
                else:
                    found.append((row, start + count))
        return found


#: Every row of a request, whatever its prompt's length (no prompt range; generated tokens from position 0 on).
EVERY_ROW = RowRule(0, (), True, 0)
#: Every row but its prompt's first position's (the default positions), whatever the length.
EVERY_ROW_BUT_FIRST = RowRule(1, (), True, 0)


@functools.lru_cache(maxsize=4096)
def rule_of(rule: tuple) -> RowRule:
    """A `SteerEntry.rule`'s `RowRule` (``(chosen, skip_first, generated, from_step, length)``), one for each
    rule: the rules of every row, and of every row but the first, are one each for every length, so that requests
    of any length share their plan (`streamscope.vllm.graph_backend.GraphBackend._planned`)."""
    chosen, skip_first, generated, from_step, length = rule
    if chosen is None and generated and from_step == 0:
        return EVERY_ROW_BUT_FIRST if skip_first else EVERY_ROW
    positions = range(int(skip_first), length) if chosen is None else chosen
    return RowRule.of(positions, length, generated, from_step)
