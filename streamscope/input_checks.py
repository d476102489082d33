"""What streamscope refuses before an engine runs: a missing folder, an unknown dtype, a model that is not a
decoder (at load), and token ids beyond the vocabulary (at a trace), the same way on both engines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

#: dtype names both engines take besides torch's own (``"float32"``, ``"bfloat16"``, ...).
DTYPE_WORDS = ("auto", "half", "float")


def check_load(path: str | Path, kwargs: dict[str, Any]) -> None:
    """Raise a clear error for what would fail later, or load the wrong thing, on either engine."""
    check_dtype(kwargs.get("dtype", kwargs.get("torch_dtype")))
    folder = local_folder(path)
    if folder is not None:
        check_decoder(folder)


def check_dtype(dtype: Any) -> None:
    """A dtype a model's weights can have: a floating torch dtype, its name, or ``"auto"``."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if dtype in DTYPE_WORDS or (isinstance(named, torch.dtype) and named.is_floating_point):
            return
    raise ValueError(
        f"dtype={dtype!r} is not a floating-point dtype: use 'float32' (the default; exact against the "
        f"oracle), 'bfloat16' or 'float16', a torch dtype such as torch.bfloat16, or 'auto' for the checkpoint's own."
    )


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


def check_decoder(folder: Path) -> None:
    """Refuse an encoder (BERT's masked LM) or an encoder-decoder (T5) before any weight is read."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # the engine's own loader says what is wrong with the file
    model_type = config.get("model_type")
    encoder = config.get("is_encoder_decoder") or (
        model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.get("is_decoder"))
    if encoder:
        kind = "an encoder-decoder" if config.get("is_encoder_decoder") else "an encoder (a masked language model)"
        raise ValueError(
            f"{folder} is a {model_type!r} checkpoint, {kind}: streamscope maps decoder-only language models, "
            f"whose blocks run left to right over a residual stream (Llama, GPT-2, Gemma, ...). Load a "
            f"causal LM checkpoint, or use nnsight's NNsight(model) to reach this model's modules directly."
        )


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
