"""The logit lens: every block's residual stream read out through the model's own final norm and unembedding.

    result = streamscope.lens(model, "The capital of France is")
    print(result)                       # the top tokens of every block at the last position
    result.plot("lens.png")             # blocks x positions, the top token and its probability
    result.logits                       # [blocks, seq, vocab_size] (None when top_k was asked)

The head is the model's own: its final norm module applied to the stream, then
its unembedding with any final soft cap or scale (Gemma 2/3's
``final_logit_softcapping``, Granite's ``logits_scaling``, Cohere's
``logit_scale``), so the last block's row is the model's own logits. On vLLM it
runs inside the engine's worker with the engine's own ``lm_head`` and logits
processor, the way `prompt_logits` is computed, and only what was asked for
(the logits, or their top k) travels back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..display import png, shape, shortened, table, token
from ..input_checks import indices
from .plot import lens_heatmap
from .views import lens as lens_view

#: What the lens reads by default: the stream each block hands on.
DEFAULT_VALUE = "layer_output"


def unembed(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of a residual stream `hidden` ``[..., hidden_size]`` through the model's own head.

    Call inside a trace (on vLLM the body runs in the worker, where the
    engine's modules are). The final norm module is applied ad hoc (nnsight
    runs it out of order without spending its place in the forward), then the
    unembedding, soft cap and scale. Returns ``[..., vocab_size]``.
    """
    shape = hidden.shape
    # Engines' norm kernels take [tokens, hidden]; a fused vLLM norm called without a residual returns one tensor.
    normed = model.norm(hidden.reshape(-1, shape[-1]))
    if isinstance(normed, tuple):
        normed = normed[0]
    logits = model.engine.unembed(normed)
    return logits.reshape(*shape[:-1], logits.shape[-1])


def _stream(model: Any, layer: int, value: str) -> torch.Tensor:
    return getattr(model.layers[layer], value)


def lens_body(model: Any, layers: Sequence[int], value: str, top_k: Optional[int]) -> tuple:
    """The lens inside a trace: ``(logits [blocks, seq, vocab], None, None)`` or ``(None, top probs, top ids)``.

    Every stream is read first (in the order the model computes them); the
    head is applied to each ad hoc, which leaves the forward's own norm and head untouched.
    """
    streams = [_stream(model, layer, value)[0] for layer in layers]
    logits = torch.stack([unembed(model, stream) for stream in streams])  # [blocks, seq, vocab]
    if top_k is None:
        return logits, None, None
    top = logits.float().softmax(-1).topk(top_k, dim=-1)
    return None, top.values, top.indices


@dataclass
class Lens:
    """A logit lens over one prompt.

    Attributes:
        tokens: The prompt's tokens as text, one per position.
        layers: The blocks read, in order (row i of every tensor is block layers[i]).
        value: The streamscope value read on each block (``layer_output`` by default).
        logits: ``[blocks, seq, vocab_size]``, or None when only the top k came back.
        top_probs, top_ids: ``[blocks, seq, k]``: the k most likely next tokens at each block and position.
        final_logits: The model's own logits ``[seq, vocab_size]`` (None on a top-k lens).
    """

    tokens: list[str]
    layers: list[int]
    value: str
    top_probs: torch.Tensor
    top_ids: torch.Tensor
    decode: Any = field(repr=False)
    logits: Optional[torch.Tensor] = None
    prompt: str = ""

    def __repr__(self) -> str:
        text, probability = self.top_tokens(-1)[-1][0]
        logits = f", logits {shape(self.logits)}" if self.logits is not None else ""
        return (f"Lens({self.value}, {len(self.layers)} blocks x {len(self.tokens)} positions, top "
                f"{self.top_ids.shape[-1]}{logits}; block {self.layers[-1]} at the last position: "
                f"{token(text)} {probability:.3f})")

    def _repr_html_(self) -> str:
        k = min(3, self.top_ids.shape[-1])
        rows = [[layer, *(f"{token(text)} {probability:.3f}" for text, probability in row[:k])]
                for layer, row in zip(self.layers, self.top_tokens(-1))]
        caption = (f"logit lens of {self.value} on {shortened(self.prompt)!r}: top {k} at the last position "
                   f"({token(self.tokens[-1])})")
        return table(caption, ["block", *(f"top {i + 1}" for i in range(k))], rows)

    def _repr_png_(self) -> bytes:
        return png(self.plot)

    def top_tokens(self, position: int = -1) -> list[list[tuple[str, float]]]:
        """For each block, its top tokens at `position` with their probabilities."""
        return [[(self.decode(int(i)), float(p)) for p, i in zip(probs, ids)]
                for probs, ids in zip(self.top_probs[:, position], self.top_ids[:, position])]

    def probability(self, token: int) -> torch.Tensor:
        """``[blocks, seq]``: the lens probability of token id `token` (needs the full logits)."""
        if self.logits is None:
            raise ValueError("this lens kept only the top k tokens; run lens(..., top_k=None) for every token's probability")
        return self.logits.float().softmax(-1)[..., token]

    def rank(self, token: int) -> torch.Tensor:
        """``[blocks, seq]``: the rank of token id `token` (0 = the top token) at every block and position."""
        if self.logits is None:
            raise ValueError("this lens kept only the top k tokens; run lens(..., top_k=None) for ranks")
        own = self.logits[..., token : token + 1]
        return (self.logits > own).sum(-1)

    def table(self, position: int = -1, k: int = 3) -> str:
        """A printable table: one row per block, the top k tokens at `position` with their probabilities."""
        k = min(k, self.top_ids.shape[-1])
        where = self.tokens[position]
        lines = [f"logit lens of {self.value} at position {position % len(self.tokens)} ({where!r}), top {k}:"]
        for layer, row in zip(self.layers, self.top_tokens(position)):
            cells = "  ".join(f"{text!r:>12} {probability:.3f}" for text, probability in row[:k])
            lines.append(f"  block {layer:>3}  {cells}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def view(self, path: Any = None, k: int = 5) -> Any:
        """An interactive page (`streamscope.views.lens`): hover a cell for its top `k` tokens; inline in Jupyter."""
        return lens_view(self, path, k=k)

    def plot(self, path: Any, **kwargs: Any) -> Any:
        """Write a heatmap PNG: blocks x positions, each cell the top token, coloured by its probability."""
        return lens_heatmap(self, path, **kwargs)


def lens(model: Any, prompt: str | Sequence[str], *, layers: Optional[Sequence[int]] = None,
         value: str = DEFAULT_VALUE, top_k: Optional[int] = 10, keep_logits: bool = False) -> Any:
    """Read every block's stream (`value`, ``layer_output`` by default) through the model's own head.

    Args:
        model: A streamscope model on either engine, or a `streamscope.Client` (the streams harvested over
            HTTP, the server's engine applying its own final norm and head to them in its worker).
        prompt: The prompt text; or a list of prompts, for a list of `Lens`, one per prompt (on vLLM one
            trace runs them all, batched by the engine; on transformers each is its own run).
        layers: The blocks to read (default: all; negative indices count from the last).
        value: A boundary served on those blocks (``layer_input``, ``layer_mid``, ...).
        top_k: How many top tokens to keep per block and position; None keeps every token's logits
            (as `keep_logits`), with the top 10 for the table.
        keep_logits: Also return the whole ``[blocks, seq, vocab_size]`` logits (on vLLM they travel
            from the worker; for large vocabularies keep it False).

    Returns:
        A `Lens` (a list of them for a list of prompts); print it for the table, `.plot(path)` for the heatmap.
    """
    several = isinstance(prompt, (list, tuple))
    if not isinstance(prompt, str):
        if not (several and prompt and all(isinstance(item, str) for item in prompt)):
            raise TypeError(f"streamscope.lens takes a prompt (a string) or a non-empty list of them; got {prompt!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r}: give a positive number of top tokens, or None for every token's logits")
    layers = indices(layers, model.num_layers, "block", "streamscope.lens")
    keep_logits = keep_logits or top_k is None
    k = min(top_k or 10, model.vocab_size)
    prompts = list(prompt) if several else [prompt]

    def body() -> list[torch.Tensor]:  # each [1, blocks, seq, ...]: one prompt's
        logits, probs, ids = lens_body(model, layers, value, None if keep_logits else k)
        return [logits[None]] if keep_logits else [probs[None], ids[None]]

    engine = model.engine
    found_all: list = []
    if not engine.runs_traces:  # a server: the streams harvested, the engine's own head applied where it runs
        found_all = engine.lens(prompts, layers, value, k, keep_logits)
    else:
        batch = engine.batch(None, 1, len(prompts))  # vLLM: every prompt in one trace; transformers: one at a time
        for start in range(0, len(prompts), batch):
            with torch.no_grad():
                found_all += engine.run(prompts[start:start + batch], body, [(2,)] if keep_logits else [(2,), (2,)])
    lenses = [_lens(model, text, [tensor[0] for tensor in found], layers, value, k, keep_logits)
              for text, found in zip(prompts, found_all)]
    return lenses if several else lenses[0]


def _lens(model: Any, prompt: str, found: list, layers: list, value: str, k: int, keep_logits: bool) -> Lens:
    """One prompt's `Lens` from what its run brought back (its logits, or its top probabilities and ids)."""
    logits = None
    if keep_logits:
        (logits,) = found
        top = logits.float().softmax(-1).topk(k, dim=-1)
        probs, ids = top.values, top.indices
    else:
        probs, ids = found
    ids_of_prompt = model.tokenizer(prompt)["input_ids"]
    tokens = [model.tokenizer.decode([token]) for token in ids_of_prompt]
    decode = lambda token: model.tokenizer.decode([token])  # noqa: E731
    return Lens(tokens, layers, value, probs.detach(), ids.detach(), decode,
                logits.detach() if keep_logits else None, prompt)
