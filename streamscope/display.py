"""Short text and rich (HTML, PNG) displays of streamscope's results, for a terminal and for Jupyter.

A result's ``repr`` names its shapes, never its tensors' numbers; in a notebook ``_repr_html_`` shows a
small table and, where the result has a figure, ``_repr_png_`` the figure.
"""

from __future__ import annotations

import html
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence


def shape(value: Any) -> str:
    """``[2, 9, 64]`` for a tensor, the type's name otherwise."""
    size = getattr(value, "shape", None)
    return f"[{', '.join(str(int(n)) for n in size)}]" if size is not None else type(value).__name__


def token(text: str) -> str:
    """A token as text with its whitespace visible: a leading space as ``␣``, a newline as ``\\n``, empty as ``∅``."""
    if text == "":
        return "∅"
    shown = text.encode("unicode_escape").decode("ascii", "backslashreplace") if any(
        ord(char) < 32 for char in text) else text
    stripped = shown.lstrip(" ")
    return "␣" * (len(shown) - len(stripped)) + stripped


def table(caption: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table (escaped text), for `_repr_html_`."""
    head = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return (f"<table><caption style='text-align:left'>{html.escape(caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def png(draw: Callable[[Path], Any]) -> bytes:
    """The bytes of the PNG `draw(path)` writes (a result's ``plot``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "figure.png"
        draw(path)
        return path.read_bytes()


def shortened(text: str, limit: int = 48) -> str:
    """`text` cut to `limit` characters with an ellipsis (a prompt in a title)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_pattern(pattern: Any, tokens: Any, caller: str) -> Any:
    """One prompt's attention pattern ``[heads, seq, seq]`` as float32 on the CPU (a batch of one is unwrapped),
    refused with the shape where it is not one matching `tokens`."""
    pattern = pattern.detach().float().cpu()
    if pattern.dim() == 4:
        pattern = pattern[0]
    if pattern.dim() != 3 or pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] != len(tokens):
        raise ValueError(f"{caller} takes one prompt's pattern [heads, seq, seq] and its {len(tokens)} tokens; "
                         f"got a pattern of shape {tuple(pattern.shape)}")
    return pattern
