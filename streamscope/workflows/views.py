"""Interactive views in the browser: self-contained HTML pages, offline, inline in Jupyter.

    view = streamscope.views.attention(pattern, tokens, block=3)   # hover a token: what it attends to, per head
    view.save("attention.html")
    view = streamscope.views.lens(lens_result)                      # hover a cell: the top k tokens there
    view = streamscope.views.features(examples)   # SAE features' top examples (streamscope.sae.top_examples)
    view                                                            # in Jupyter: shown inline

Each page carries its data as JSON and a small script of its own: it fetches nothing, so it opens
from a file with no network. In a notebook the page is shown in an ``<iframe srcdoc>`` so its
script and styles stay its own. Numbers are shown to three decimals.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..display import one_pattern, shortened, token
from ..input_checks import indices

_STYLE = """
body { font-family: system-ui, sans-serif; font-size: 14px; margin: 12px; color: #222; }
h1 { font-size: 16px; margin: 0 0 10px 0; }
.tok { display: inline-block; padding: 2px 4px; margin: 1px; border: 1px solid #ccc; border-radius: 3px;
       font-family: ui-monospace, monospace; white-space: pre; }
.tok.active { outline: 2px solid #d33; }
.head { margin: 4px 0; } .head b { display: inline-block; width: 64px; }
table.grid { border-collapse: collapse; } table.grid td, table.grid th { border: 1px solid #ddd; padding: 2px 4px;
  font-family: ui-monospace, monospace; font-size: 12px; white-space: pre; }
table.grid td.cell:hover { outline: 2px solid #d33; }
#readout { margin-top: 10px; min-height: 40px; font-family: ui-monospace, monospace; }
#readout table { border-collapse: collapse; } #readout td, #readout th { border: 1px solid #ddd; padding: 2px 6px; }
"""

_ATTENTION_SCRIPT = """
const data = JSON.parse(document.getElementById('data').textContent);
const readout = document.getElementById('readout');
function shade(w) { const v = Math.round(255 * (1 - Math.min(1, w))); return `rgb(${v},${v},255)`; }
function show(q) {
  document.querySelectorAll('.tok').forEach(el => el.classList.remove('active'));
  document.querySelectorAll(`.query [data-query="${q}"]`).forEach(el => el.classList.add('active'));
  data.heads.forEach((head, h) => {
    document.querySelectorAll(`.head[data-head="${h}"] .tok`).forEach(el => {
      const k = Number(el.dataset.key);
      el.style.background = k <= q || data.pattern[h][q][k] > 0 ? shade(data.pattern[h][q][k]) : '#eee';
    });
  });
  let rows = `<tr><th>head</th>${data.labels.map((l, k) => `<th>${escape(l)}</th>`).join('')}</tr>`;
  data.heads.forEach((head, h) => {
    rows += `<tr data-head="${head}"><th>${head}</th>` + data.pattern[h][q].map((w, k) =>
      `<td data-key="${k}">${w.toFixed(3)}</td>`).join('') + '</tr>';
  });
  readout.innerHTML = `<div>query ${q} <b id="query-label">${escape(data.labels[q])}</b> attends to:</div>` +
                      `<table id="weights">${rows}</table>`;
  readout.dataset.query = q;
}
function escape(s) { const d = document.createElement('div'); d.textContent = s; return d.innerHTML; }
document.querySelectorAll('.query .tok').forEach(el =>
  el.addEventListener('mouseenter', () => show(Number(el.dataset.query))));
show(data.labels.length - 1);
"""

_LENS_SCRIPT = """
const data = JSON.parse(document.getElementById('data').textContent);
const readout = document.getElementById('readout');
function escape(s) { const d = document.createElement('div'); d.textContent = s; return d.innerHTML; }
document.querySelectorAll('td.cell').forEach(el => el.addEventListener('mouseenter', () => {
  const b = Number(el.dataset.row), p = Number(el.dataset.position);
  const rows = data.top[b][p].map(([text, prob], i) =>
    `<tr data-rank="${i}"><td class="token">${escape(text)}</td><td class="probability">${prob.toFixed(3)}</td></tr>`);
  readout.innerHTML = `<div>block <b id="block">${data.layers[b]}</b>, after <b id="position-label">` +
    `${escape(data.labels[p])}</b> (position ${p}): top ${data.top[b][p].length}</div>` +
    `<table id="top">${rows.join('')}</table>`;
  readout.dataset.block = data.layers[b]; readout.dataset.position = p;
}));
"""


class View:
    """A self-contained interactive HTML page: `save` it, or show it in Jupyter (inline, in an iframe)."""

    def __init__(self, page: str, title: str, height: int = 480) -> None:
        self.html, self.title, self.height = page, title, height

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (open it in any browser; it fetches nothing)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html, encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" style="width: 100%; height: {self.height}px; '
                f'border: 1px solid #ddd" sandbox="allow-scripts"></iframe>')

    def __repr__(self) -> str:
        return f"View({self.title!r}, {len(self.html)} characters of HTML)"


def _page(title: str, body: str, data: dict, script: str) -> str:
    # "</" inside the JSON would end the script element early.
    payload = json.dumps(data).replace("</", "<\\/")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}<div id='readout'></div>"
            f"<script type='application/json' id='data'>{payload}</script><script>{script}</script></body></html>")


def attention(pattern: torch.Tensor, tokens: Sequence[str], path: Optional[str | Path] = None, *,
              heads: Optional[Sequence[int]] = None, block: Optional[int] = None, title: str = "") -> View:
    """An attention-pattern view: hover a token (as the query) to see what each head attends to.

    Args:
        pattern: ``[heads, q_seq, k_seq]`` or ``[1, heads, q_seq, k_seq]`` (one prompt's ``self_attn.pattern``).
        tokens: The prompt's tokens as text.
        path: Where to write the page (also returned as a `View` either way).
        heads: Which heads to show (default: all).
        block: The block the pattern is from, for the title.
    """
    pattern = one_pattern(pattern, tokens, "views.attention")
    heads = indices(heads, pattern.shape[0], "head", "views.attention")
    labels = [token(text) for text in tokens]
    prompt = shortened("".join(tokens))
    title = title or f"{'block ' + str(block) + ' ' if block is not None else ''}attention on {prompt!r}"

    def row(attribute: str) -> str:
        return "".join(f"<span class='tok' data-{attribute}='{index}'>{html.escape(label)}</span>"
                       for index, label in enumerate(labels))

    body = ("<div class='query tokens'><b>hover a query token:</b><br>" + row("query") + "</div><hr>"
            + "".join(f"<div class='head tokens' data-head='{h}'><b>head {h}</b>{row('key')}</div>" for h in heads))
    data = {"labels": labels, "heads": heads, "pattern": pattern[heads].tolist()}
    view = View(_page(title, body, data, _ATTENTION_SCRIPT), title, height=200 + 70 * len(heads))
    if path is not None:
        view.save(path)
    return view


def lens(result: Any, path: Optional[str | Path] = None, *, k: int = 5, title: str = "") -> View:
    """A logit-lens view: blocks x positions, each cell its top token; hover a cell for the top `k` tokens."""
    k = min(k, result.top_ids.shape[-1])
    labels = [token(text) for text in result.tokens]
    top = [[[(token(result.decode(int(i))), float(p)) for p, i in zip(probs[:k], ids[:k])]
            for probs, ids in zip(block_probs, block_ids)]
           for block_probs, block_ids in zip(result.top_probs, result.top_ids)]
    prompt = shortened(getattr(result, "prompt", "") or "".join(result.tokens))
    title = title or f"logit lens of {result.value} on {prompt!r}"
    header = "<tr><th>block</th>" + "".join(f"<th>{html.escape(label)}</th>" for label in labels) + "</tr>"
    rows = []
    for row in reversed(range(len(result.layers))):  # the last block on top, as the heatmap reads upwards
        cells = "".join(
            f"<td class='cell' data-row='{row}' data-position='{position}' style='background: "
            f"rgba(68, 1, 84, {top[row][position][0][1]:.3f}); color: "
            f"{'white' if top[row][position][0][1] > 0.5 else 'black'}'>{html.escape(top[row][position][0][0])}</td>"
            for position in range(len(labels)))
        rows.append(f"<tr><th>{result.layers[row]}</th>{cells}</tr>")
    body = f"<table class='grid'>{header}{''.join(rows)}</table>"
    data = {"labels": labels, "layers": list(result.layers), "top": top}
    view = View(_page(title, body, data, _LENS_SCRIPT), title, height=200 + 24 * len(result.layers))
    if path is not None:
        view.save(path)
    return view


_FEATURES_SCRIPT = """
const data = JSON.parse(document.getElementById('data').textContent);
const readout = document.getElementById('readout');
function escape(s) { const d = document.createElement('div'); d.textContent = s; return d.innerHTML; }
document.querySelectorAll('.example .tok').forEach(el => el.addEventListener('mouseenter', () => {
  const e = data.examples[Number(el.dataset.example)], i = Number(el.dataset.index);
  readout.innerHTML = `feature <b id="feature">${e.feature}</b>, prompt ${e.prompt}, position ` +
    `<b id="position">${e.start + i}</b> <b id="token">${escape(e.tokens[i])}</b>: activation ` +
    `<b id="activation">${e.activations[i].toFixed(3)}</b>`;
}));
"""


def features(examples: Any, path: Optional[str | Path] = None, *, title: str = "") -> View:
    """A top-activating-examples view (`streamscope.sae.top_examples`): per feature, each example's tokens shaded
    by the feature's activation (the darkest its largest over the page's examples), the example's own token
    outlined; hover a token for its activation."""
    title = title or f"top {examples.k} examples of {len(examples)} features, {examples.sae!r}"
    flat: list[Any] = []  # every example in page order: its number in the page's data
    sections = []
    for feature in examples:
        rows = examples[feature]
        top = max([value for example in rows for value in example.activations] + [1e-12])
        lines = []
        for example in rows:
            number = len(flat)
            flat.append(example)
            spans = "".join(
                f"<span class='tok{' active' if example.start + index == example.position else ''}' "
                f"data-example='{number}' data-index='{index}' style='background: rgba(220, 80, 0, "
                f"{max(0.0, value) / top:.3f})'>{html.escape(token(text))}</span>"
                for index, (text, value) in enumerate(zip(example.tokens, example.activations)))
            lines.append(f"<div class='example' data-feature='{feature}' data-rank='{example.rank}'>"
                         f"<b class='activation'>{example.activation:.3f}</b> <small>prompt {example.prompt}, "
                         f"position {example.position}</small> {spans}</div>")
        empty = "" if rows else "<div class='none'>it never fires on these prompts</div>"
        sections.append(f"<section data-feature='{feature}'><h2>feature {feature}</h2>{''.join(lines)}{empty}"
                        f"</section>")
    data = {"examples": [{"feature": e.feature, "prompt": e.prompt, "start": e.start,
                          "tokens": [token(text) for text in e.tokens],
                          "activations": e.activations} for e in flat]}
    view = View(_page(title, "".join(sections), data, _FEATURES_SCRIPT), title, height=240 + 28 * len(flat))
    if path is not None:
        view.save(path)
    return view
