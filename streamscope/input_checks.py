"""What streamscope refuses before an engine runs, the same way on both engines: a missing checkpoint folder, and
token ids beyond the vocabulary (at a trace); what `streamscope.load` refuses besides is `streamscope.loading`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def local_folder(path: str | Path) -> Path | None:
    """The checkpoint folder `path` names, or None for a hub repository id; an error where a folder is missing."""
    folder = Path(path).expanduser()
    text = str(path)
    looks_local = (folder.is_absolute() or text.startswith((".", "~")) or text.endswith(("/", os.sep))
                   or text.count("/") > 1 or os.sep != "/" and os.sep in text)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{text} holds no config.json, so it is not a checkpoint folder: point at the folder with "
                f"config.json and the weights (streamscope.testing.build_checkpoint(family, folder) writes a tiny one)."
            )
        return folder
    if looks_local or folder.exists():
        raise FileNotFoundError(
            f"no checkpoint folder at {text}: check the path (it is read from {Path.cwd()} when relative). "
            f"A hub repository is named 'organisation/model'; streamscope.testing.build_checkpoint(family, folder) "
            f"writes a tiny checkpoint."
        )
    return None


def check_token_ids(ids: Any, vocab_size: int) -> None:
    """Refuse token ids outside ``[0, vocab_size)``: the embedding would fail on them, or read past its table."""
    if isinstance(ids, torch.Tensor):
        if ids.numel() == 0 or ids.is_floating_point():
            return
        low, high = int(ids.min()), int(ids.max())
    else:
        flat = list(_flatten(ids))
        if not flat:
            return
        low, high = min(flat), max(flat)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"token id {bad} is outside this model's vocabulary: its ids run from 0 to {vocab_size - 1} "
            f"(model.vocab_size = {vocab_size}). Encode text with the model's own tokenizer "
            f"(model.tokenizer), or pass the prompt as a string."
        )


def _flatten(ids: Any):
    for item in ids:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            yield item


# What the workflows (cache, lens, patch) refuse rather than silently read something else.


def indices(asked: Any, count: int, what: str, call: str) -> list[int]:
    """`asked` (None for all, one int, or ints in ``[-count, count)``) as indices in ``[0, count)``.

    An index out of range is refused: wrapped modulo `count` it would read another block or position
    under the asked one's label.
    """
    if asked is None:
        return list(range(count))
    items = [asked] if isinstance(asked, int) else list(asked)
    found = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, torch.Tensor)) or (
                isinstance(item, torch.Tensor) and (item.numel() != 1 or item.is_floating_point())):
            raise TypeError(f"{call}: {what}s are given as integers; got {item!r}")
        index = int(item)
        if not -count <= index < count:
            raise IndexError(f"{call}: {what} {index} is out of range: there are {count} (0 to {count - 1}, "
                             f"or -{count} to -1 from the end)")
        found.append(index % count)
    if not found:
        raise ValueError(f"{call}: no {what}s asked for (an empty list); leave it out for all")
    return found


def one_prompt(prompt: Any, call: str, several: str) -> str:
    """`prompt` when it is one string; otherwise a TypeError saying what to do with several."""
    if isinstance(prompt, str):
        return prompt
    raise TypeError(f"{call} takes one prompt (a string); got {type(prompt).__name__}. {several}")


def names(values: Any) -> Any:
    """Value names as a list: one name given as a string is one name, not its characters."""
    return [values] if isinstance(values, str) else values
