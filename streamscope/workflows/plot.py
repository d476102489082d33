"""Heatmaps as PNG files (matplotlib, Agg backend): attention patterns, logit lenses, patching effects.

    streamscope.plot.attention(pattern, tokens, "pattern.png")   # one panel per head
    streamscope.plot.lens_heatmap(lens_result, "lens.png")
    streamscope.plot.patching_heatmap(patching_result, "patch.png")

Each function writes the file and returns its path; the image is the figure's
size (`attention_size`, `lens_size`, `patching_size`, in inches) times `dpi` pixels.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _labels(tokens: Sequence[str]) -> list[str]:
    return [repr(token)[1:-1] or "·" for token in tokens]


def _save(figure: Any, path: Any, dpi: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)  # the figure's own size: width x height inches times dpi pixels
    _pyplot().close(figure)
    return path


def attention_size(tokens: int, heads: int, columns: int = 4) -> tuple[float, float]:
    """The attention figure's (width, height) in inches: a square panel per head, `columns` to a row."""
    columns = min(columns, heads)
    side = 2.0 + 0.3 * tokens
    return side * columns + 1.0, side * math.ceil(heads / columns)


def lens_size(positions: int, blocks: int) -> tuple[float, float]:
    """The lens heatmap's (width, height) in inches."""
    return 3.0 + 0.9 * positions, 2.0 + 0.3 * blocks


def patching_size(columns: int, blocks: int) -> tuple[float, float]:
    """The patching heatmap's (width, height) in inches."""
    return 3.0 + 0.7 * columns, 2.0 + 0.3 * blocks


def attention(pattern: torch.Tensor, tokens: Sequence[str], path: Any, *, heads: Optional[Sequence[int]] = None,
              title: str = "", columns: int = 4, dpi: int = 100) -> Path:
    """Write a block's attention pattern, one heatmap per head, the tokens on both axes.

    Args:
        pattern: ``[heads, q_seq, k_seq]`` or ``[1, heads, q_seq, k_seq]`` (``self_attn.pattern`` of one prompt).
        tokens: The prompt's tokens as text, ``q_seq`` of them.
        path: The PNG file to write.
        heads: Which heads to draw (default: all).
    """
    pattern = pattern.detach().float().cpu()
    if pattern.dim() == 4:
        pattern = pattern[0]
    if pattern.dim() != 3 or pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] != len(tokens):
        raise ValueError(f"attention() takes one prompt's pattern [heads, seq, seq] and its {len(tokens)} tokens; "
                         f"got a pattern of shape {tuple(pattern.shape)}")
    heads = list(range(pattern.shape[0])) if heads is None else list(heads)
    columns = min(columns, len(heads))
    rows = math.ceil(len(heads) / columns)
    plt = _pyplot()
    figure, axes = plt.subplots(rows, columns, figsize=attention_size(len(tokens), len(heads), columns),
                                squeeze=False, layout="constrained")
    labels = _labels(tokens)
    for axis in axes.flat[len(heads):]:
        axis.axis("off")
    for axis, head in zip(axes.flat, heads):
        image = axis.imshow(pattern[head].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        axis.set_title(f"head {head}", fontsize=9)
        axis.set_xticks(range(len(tokens)), labels, rotation=90, fontsize=7)
        axis.set_yticks(range(len(tokens)), labels, fontsize=7)
        axis.set_xlabel("key", fontsize=8)
        axis.set_ylabel("query", fontsize=8)
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention")
    if title:
        figure.suptitle(title)
    return _save(figure, path, dpi)


def lens_heatmap(result: Any, path: Any, *, positions: Optional[Sequence[int]] = None, dpi: int = 100) -> Path:
    """Write a logit lens as blocks x positions: each cell the block's top token there, coloured by its probability."""
    positions = list(range(len(result.tokens))) if positions is None else list(positions)
    probabilities = result.top_probs[:, positions, 0].float().cpu()
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=lens_size(len(positions), len(result.layers)), layout="constrained")
    image = axis.imshow(probabilities.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", origin="lower")
    for row in range(len(result.layers)):
        for column, position in enumerate(positions):
            text = repr(result.decode(int(result.top_ids[row, position, 0])))[1:-1][:8]
            color = "black" if probabilities[row, column] > 0.6 else "white"
            axis.text(column, row, text, ha="center", va="center", fontsize=7, color=color)
    axis.set_xticks(range(len(positions)), _labels([result.tokens[p] for p in positions]), rotation=45, fontsize=8)
    axis.set_yticks(range(len(result.layers)), [str(layer) for layer in result.layers], fontsize=7)
    axis.set_xlabel("input token (the lens predicts the next one)")
    axis.set_ylabel(f"block ({result.value})")
    figure.colorbar(image, ax=axis, label="top token's probability")
    axis.set_title("logit lens")
    return _save(figure, path, dpi)


def patching_heatmap(result: Any, path: Any, *, dpi: int = 100) -> Path:
    """Write a patching result's normalized effect as blocks x positions (or heads)."""
    effect = result.normalized.float().cpu()
    bound = max(1.0, float(effect.abs().max())) if effect.numel() else 1.0
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=patching_size(len(result.columns), len(result.layers)), layout="constrained")
    image = axis.imshow(effect.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto", origin="lower")
    axis.set_xticks(range(len(result.columns)), _labels(result.labels), rotation=45, fontsize=8)
    axis.set_yticks(range(len(result.layers)), [str(layer) for layer in result.layers], fontsize=7)
    axis.set_xlabel("head" if result.value == "head_outputs" else "position patched (corrupted prompt's token)")
    axis.set_ylabel("block")
    figure.colorbar(image, ax=axis, label=f"normalized {result.metric_name}")
    axis.set_title(f"activation patching: {result.value}")
    return _save(figure, path, dpi)
