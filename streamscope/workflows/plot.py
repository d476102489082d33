"""Heatmaps as PNG files (matplotlib, Agg backend): attention patterns, logit lenses, patching effects.

    streamscope.plot.attention(pattern, tokens, "pattern.png")   # one panel per head
    streamscope.plot.lens_heatmap(lens_result, "lens.png")
    streamscope.plot.patching_heatmap(patching_result, "patch.png")

Each function writes the file and returns its path; the image is the figure's
size (`attention_size`, `lens_size`, `patching_size`, in inches) times `dpi` pixels.
Titles carry the prompt (shortened), the block or value and the metric; token labels
show whitespace (a leading space as ``␣``, a newline as ``\n``); the fonts are sized to
be read at the saved size (`FONT`, in points).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from ..display import one_pattern, shortened, token
from ..input_checks import indices


def _figure(size: tuple[float, float], layout: Optional[str] = None) -> Figure:
    # A figure of its own, not pyplot's: nothing global (pyplot's backend, its open figures) changes, and a PNG is
    # drawn by Agg, with no display.
    return Figure(figsize=size, layout=layout)


#: Pixels per inch of the saved PNGs: the fonts below stay legible when a figure is shrunk onto a page.
DPI = 150
#: Font sizes in points: tick labels, axis labels, titles.
FONT = {"ticks": 9, "labels": 10, "title": 12}


def _labels(tokens: Sequence[str]) -> list[str]:
    return [token(text) for text in tokens]


def _prompt(tokens: Sequence[str]) -> str:
    """The prompt the tokens spell, without special tokens such as ``<|bos|>``, shortened for a title."""
    text = "".join(token for token in tokens if not (token.startswith("<") and token.endswith(">") and len(token) > 2))
    return shortened(text.strip())


def _save(figure: Any, path: Any, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)  # the figure's own size: width x height inches times dpi pixels
    return path


def _tenths(inches: float) -> float:
    """`inches` to a tenth of an inch: a whole number of pixels at `DPI` (150 px per inch, 15 per tenth)."""
    return round(inches * 10) / 10


def attention_size(tokens: int, heads: int, columns: int = 4) -> tuple[float, float]:
    """The attention figure's (width, height) in inches: a square panel per head, `columns` to a row."""
    columns = min(columns, heads)
    side = 2.2 + 0.35 * tokens
    return _tenths(side * columns + 1.5), _tenths(side * math.ceil(heads / columns) + 0.6)


def lens_size(positions: int, blocks: int) -> tuple[float, float]:
    """The lens heatmap's (width, height) in inches."""
    return _tenths(3.0 + 0.9 * positions), _tenths(2.0 + 0.3 * blocks)


def patching_size(columns: int, blocks: int) -> tuple[float, float]:
    """The patching heatmap's (width, height) in inches."""
    return _tenths(3.0 + 0.7 * columns), _tenths(2.0 + 0.3 * blocks)


def attention(pattern: torch.Tensor, tokens: Sequence[str], path: Any, *, heads: Optional[Sequence[int]] = None,
              title: str = "", block: Optional[int] = None, drop_first: bool = False, log_scale: bool = False,
              columns: int = 4, dpi: int = DPI) -> Path:
    """Write a block's attention pattern, one heatmap per head, the tokens on both axes.

    Args:
        pattern: ``[heads, q_seq, k_seq]`` or ``[1, heads, q_seq, k_seq]`` (``self_attn.pattern`` of one prompt).
        tokens: The prompt's tokens as text, ``q_seq`` of them.
        path: The PNG file to write.
        heads: Which heads to draw (default: all).
        title: The figure's title (default: the block, when given, and the prompt).
        block: The block the pattern is from, for the default title.
        drop_first: Leave out the first token (the attention sink most heads park on), as key and query,
            so the colour scale shows how the rest is shared.
        log_scale: Colour by the logarithm of the weight (from 1e-4), which shows small weights beside the sink.
    """
    pattern = one_pattern(pattern, tokens, "attention()")

    heads = indices(heads, pattern.shape[0], "head", "plot.attention")
    if not title:
        title = f"{'block ' + str(block) + ' ' if block is not None else ''}attention on {_prompt(tokens)!r}"
    labels = _labels(tokens)
    if drop_first:
        if len(tokens) < 2:
            raise ValueError("drop_first needs a prompt of two tokens or more")
        title += f" (first token {labels[0]} left out)"
        pattern, labels = pattern[:, 1:, 1:], labels[1:]
    columns = min(columns, len(heads))
    rows = math.ceil(len(heads) / columns)
    top = 1.0 if not drop_first else max(float(pattern[heads].max()), 1e-4)
    norm = LogNorm(vmin=1e-4, vmax=top) if log_scale else Normalize(vmin=0.0, vmax=top)
    figure = _figure(attention_size(len(labels), len(heads), columns), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat[len(heads):]:
        axis.axis("off")
    for axis, head in zip(axes.flat, heads):
        values = pattern[head].clamp_min(1e-4) if log_scale else pattern[head]
        image = axis.imshow(values.numpy(), cmap="Blues", norm=norm)
        axis.set_title(f"head {head}", fontsize=FONT["labels"])
        axis.set_xticks(range(len(labels)), labels, rotation=90, fontsize=FONT["ticks"])
        axis.set_yticks(range(len(labels)), labels, fontsize=FONT["ticks"])
        axis.set_xlabel("key", fontsize=FONT["labels"])
        axis.set_ylabel("query", fontsize=FONT["labels"])
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6,
                    label="attention weight" + (" (log scale)" if log_scale else ""))
    figure.suptitle(title, fontsize=FONT["title"])
    return _save(figure, path, dpi)


def lens_heatmap(result: Any, path: Any, *, positions: Optional[Sequence[int]] = None, title: str = "",
                 dpi: int = DPI) -> Path:
    """Write a logit lens as blocks x positions: each cell the block's top token there, coloured by its probability."""
    positions = indices(positions, len(result.tokens), "position", "lens_heatmap")
    probabilities = result.top_probs[:, positions, 0].float().cpu()
    figure = _figure(lens_size(len(positions), len(result.layers)), layout="constrained")
    axis = figure.subplots()
    image = axis.imshow(probabilities.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    for row in range(len(result.layers)):
        for column, position in enumerate(positions):
            text = _labels([result.decode(int(result.top_ids[row, position, 0]))])[0][:8]
            color = "black" if probabilities[row, column] > 0.6 else "white"
            axis.text(column, row, text, ha="center", va="center", fontsize=FONT["ticks"] - 1, color=color)
    axis.set_xticks(range(len(positions)), _labels([result.tokens[p] for p in positions]), rotation=45,
                    fontsize=FONT["ticks"])
    axis.set_yticks(range(len(result.layers)), [str(layer) for layer in result.layers], fontsize=FONT["ticks"])
    axis.set_xlabel("input token (the lens predicts the next one)", fontsize=FONT["labels"])
    axis.set_ylabel(f"block ({result.value})", fontsize=FONT["labels"])
    figure.colorbar(image, ax=axis, label="top token's probability")
    prompt = _prompt(result.tokens) if not getattr(result, "prompt", "") else _shortened(result.prompt)
    axis.set_title(title or f"logit lens of {result.value} on {prompt!r}", fontsize=FONT["title"])
    return _save(figure, path, dpi)


def patching_heatmap(result: Any, path: Any, *, title: str = "", dpi: int = DPI) -> Path:
    """Write a patching result's normalized effect as blocks x positions (or heads)."""
    effect = result.normalized.float().cpu()
    bound = max(1.0, float(effect.abs().max())) if effect.numel() else 1.0
    figure = _figure(patching_size(len(result.columns), len(result.layers)), layout="constrained")
    axis = figure.subplots()
    image = axis.imshow(effect.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto", origin="lower")
    labels = result.labels if result.per_head else _labels(result.labels)
    axis.set_xticks(range(len(result.columns)), labels, rotation=45, fontsize=FONT["ticks"])
    axis.set_yticks(range(len(result.layers)), [str(layer) for layer in result.layers], fontsize=FONT["ticks"])
    axis.set_xlabel("head" if result.per_head else "position patched (corrupted prompt's token)",
                    fontsize=FONT["labels"])
    axis.set_ylabel("block", fontsize=FONT["labels"])
    figure.colorbar(image, ax=axis, label=f"normalized {result.metric_name}")
    clean, corrupted = getattr(result, "prompts", ("", ""))
    pair = f"\n{_shortened(clean, 40)!r} into {_shortened(corrupted, 40)!r}" if clean else ""
    axis.set_title(title or f"patching {result.value}: normalized {result.metric_name}{pair}", fontsize=FONT["title"])
    return _save(figure, path, dpi)


def _shortened(text: str, limit: int = 48) -> str:
    return shortened(text, limit)
