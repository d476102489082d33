"""Which prompt positions a bulk request reads or a steer edits: the rules, and each prompt's positions."""

from __future__ import annotations

from typing import Any, Sequence, Union, cast

from .dose import SteerError

Positions = Union[str, slice, Sequence[int], Sequence[Sequence[int]]]
"""``"last"``, ``"all"``, ``"all_but_first"``, a slice of the prompt, one list of indices for every prompt, or one
list per prompt."""

#: A steer's default positions: every prompt position but the first. The first token of a prompt is an attention
#: sink in most trained models (its stream's norm can be a hundred times the others': about 24,000 on
#: SmolLM2-135M), so a clamp, ablation or set there changes the run in ways that have nothing to do with the
#: direction. ``positions="all"`` edits it too.
SKIP_FIRST = "all_but_first"
#: The positions rules a string may name.
RULES = ("all", SKIP_FIRST, "last", "none")


def prompt_positions(positions: Positions, length: int, prompt: int) -> list[int]:
    """The positions of a `length`-token prompt that `positions` selects, in order; a clear error if out of range."""
    if isinstance(positions, str):
        if positions == "last":
            return [length - 1]
        if positions == "all":
            return list(range(length))
        if positions == SKIP_FIRST:
            return list(range(1, length))
        if positions == "none":
            return []
        raise ValueError(f"positions={positions!r}: use 'last', 'all', 'all_but_first', 'none', a slice, or a list "
                         f"of indices.")
    if isinstance(positions, slice):
        return list(range(length))[positions]
    if isinstance(positions, int):
        positions = [positions]
    chosen = []
    for index in positions:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"positions: an index is an int, not a {type(index).__name__}.")
        if not -length <= index < length:
            raise IndexError(f"positions: index {index} is out of range for prompt {prompt}, "
                             f"which has {length} tokens.")
        chosen.append(index % length)
    return chosen


def per_prompt_positions(positions: Positions, lengths: Sequence[int]) -> list[list[int]]:
    """Each prompt's positions: per-prompt lists (one list per prompt) or one rule for all of them."""
    nested = (isinstance(positions, (list, tuple)) and len(positions) > 0
              and all(isinstance(item, (list, tuple, range)) for item in positions))
    if nested:
        positions = cast(Sequence[Sequence[int]], positions)
        if len(positions) != len(lengths):
            raise ValueError(f"positions has {len(positions)} lists for {len(lengths)} prompts: "
                             f"give one list per prompt, or one rule for every prompt.")
        return [prompt_positions(list(chosen), length, prompt)
                for prompt, (chosen, length) in enumerate(zip(positions, lengths))]
    return [prompt_positions(positions, length, prompt) for prompt, length in enumerate(lengths)]


def check_rule(positions: Any, name: str) -> None:
    """Refuse a steer's positions that are no rule (`Positions`, one rule for every prompt), naming the fix."""
    if isinstance(positions, str):
        if positions not in RULES:
            raise SteerError(f"{name}: positions={positions!r} is not a rule: use {', '.join(map(repr, RULES))}, a "
                             f"slice, or a list of indices (negative from the prompt's end).", "positions")
        return
    if isinstance(positions, slice):
        parts = (positions.start, positions.stop, positions.step)
        if not all(part is None or (isinstance(part, int) and not isinstance(part, bool)) for part in parts):
            raise SteerError(f"{name}: positions={positions!r}: a slice's bounds are ints or None.", "positions")
        if positions.step == 0:
            raise SteerError(f"{name}: positions={positions!r}: a slice's step cannot be 0.", "positions")
        return
    if isinstance(positions, int) and not isinstance(positions, bool):
        return
    if isinstance(positions, (list, tuple, range)):
        if any(isinstance(item, (list, tuple, range)) for item in positions):
            raise SteerError(f"{name}: a steer takes one positions rule for every prompt it steers, not one list "
                             f"per prompt: give one steer per prompt (prompts=[i]) with its own positions.",
                             "positions")
        if all(isinstance(item, int) and not isinstance(item, bool) for item in positions):
            return
    raise SteerError(f"{name}: positions={positions!r} is not a rule: use {', '.join(map(repr, RULES))}, a slice, "
                     f"or a list of int indices (negative from the prompt's end).", "positions")


__all__ = ["Positions", "RULES", "SKIP_FIRST", "check_rule", "per_prompt_positions", "prompt_positions"]
