"""Top-activating examples of SAE features: for each feature, the tokens of a set of prompts where it fires most.

::

    examples = streamscope.sae.top_examples(model, prompts, sae, features=[12, 40], k=10)
    examples[12]               # feature 12's examples, largest first: Example(prompt, position, activation, ...)
    print(examples.table())    # one line per example: the tokens around it, the max token [bracketed]
    examples.rows              # the same as dicts (feature, rank, prompt, position, token, activation, ...)
    examples.view("features.html")   # an offline page: each example's tokens shaded by the activation

The features are computed where the engine's hooks run (``model.harvest(...,
sae=...)``), a chunk of prompts at a time; only each feature's running top k
stays in memory. For a ReLU or JumpReLU SAE and a few features the engine
computes just those features (each is a function of its own encoder column);
a top-k SAE's features depend on all of them, so it computes every one.
This module reads the SAE by its attributes only (it is duck-typed), so it
runs with any `streamscope.sae.SAE`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from ..bulk.spec import token_ids
from ..display import table, token
from .views import features


@dataclass
class Example:
    """One place a feature fires: the token at `position` of prompt `prompt` and the tokens around it.

    Attributes:
        feature: The feature's index in the SAE.
        rank: 0 for the feature's largest activation over the prompts, then 1, ...
        prompt: The prompt's index in the prompts given. position: The token's index in that prompt.
        activation: The feature's activation on that token (float32, as the engine computed it).
        start: The position of the first token of `tokens`.
        ids: The token ids of the window ``[start, start + len(ids))``, the example's token inside it.
        tokens: Those tokens as text (each decoded on its own).
        activations: The feature's activation on each token of the window.
    """

    feature: int
    rank: int
    prompt: int
    position: int
    activation: float
    start: int
    ids: list[int]
    tokens: list[str]
    activations: list[float]

    @property
    def token(self) -> str:
        """The example's own token as text."""
        return self.tokens[self.position - self.start]


class FeatureExamples:
    """Each feature's top-activating examples over a set of prompts (`top_examples`).

    ``examples[f]`` is feature f's list of `Example`, largest activation first
    (ties: the earlier prompt, then the earlier position), at most `k` of them
    and only where the feature fires (activation > 0): a feature that never
    fires has none.
    """

    def __init__(self, examples: dict[int, list[Example]], k: int, context: tuple[int, int], sae: Any,
                 prompts: int) -> None:
        self.examples, self.k, self.context, self.sae, self.prompts = examples, k, context, sae, prompts

    @property
    def features(self) -> list[int]:
        """The features asked for, in the order given."""
        return list(self.examples)

    def __getitem__(self, feature: int) -> list[Example]:
        if feature not in self.examples:
            raise KeyError(f"feature {feature} was not asked for; these examples hold features {self.features}.")
        return self.examples[feature]

    def __iter__(self) -> Any:
        return iter(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One dict per example: feature, rank, prompt, position, token, activation, and the text before and
        after the token in its window (``before``, ``after``)."""
        rows = []
        for examples in self.examples.values():
            for example in examples:
                at = example.position - example.start
                rows.append({"feature": example.feature, "rank": example.rank, "prompt": example.prompt,
                             "position": example.position, "token": example.token, "activation": example.activation,
                             "before": "".join(example.tokens[:at]), "after": "".join(example.tokens[at + 1:])})
        return rows

    def to_pandas(self) -> Any:
        """`rows` as a pandas DataFrame."""
        import pandas

        return pandas.DataFrame(self.rows, columns=["feature", "rank", "prompt", "position", "token", "activation",
                                                    "before", "after"])

    def table(self) -> str:
        """A printable table: per feature, one line per example, its window with the example's token bracketed."""
        lines = []
        for feature, examples in self.examples.items():
            lines.append(f"feature {feature}: {len(examples)} examples over {self.prompts} prompts"
                         + ("" if examples else " (it never fires on them)"))
            for example in examples:
                at = example.position - example.start
                marked = "".join(example.tokens[:at]) + "[" + token(example.token) + "]" + "".join(
                    example.tokens[at + 1:])
                lines.append(f"  {example.rank:>3}  {example.activation:9.3f}  prompt {example.prompt:>4} "
                             f"pos {example.position:>4}  {marked!r}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        found = sum(len(examples) for examples in self.examples.values())
        return f"FeatureExamples({len(self.examples)} features, {found} examples, top {self.k}, {self.sae!r})"

    def _repr_html_(self) -> str:
        rows = [[row["feature"], row["rank"], f"{row['activation']:.3f}", row["prompt"], row["position"],
                 row["before"][-40:] + "[" + token(row["token"]) + "]" + row["after"][:20]] for row in self.rows]
        return table(f"top {self.k} examples of {len(self.examples)} features, {self.sae!r}",
                     ["feature", "rank", "activation", "prompt", "position", "context"], rows)

    def view(self, path: Union[str, Path, None] = None, *, title: str = "") -> Any:
        """An offline HTML page of the examples (`streamscope.views.features`): each example's window, each token
        shaded by the feature's activation on it; hover a token for its activation. Written to `path` if given."""
        return features(self, path, title=title)


def _chosen(features: Any, d_sae: int) -> list[int]:
    if features is None:
        return list(range(d_sae))
    chosen = [features] if isinstance(features, int) and not isinstance(features, bool) else list(features)
    for feature in chosen:
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < d_sae:
            raise IndexError(f"feature {feature!r} is out of range: the SAE has features 0-{d_sae - 1}.")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"features={chosen} names a feature twice; give each once.")
    if not chosen:
        raise ValueError("features=[] names no feature; give some, or None for every feature.")
    return chosen


def _reader(sae: Any, chosen: list[int]) -> Any:
    """An SAE computing only `chosen`'s activations, where each is a function of its own weights (ReLU, JumpReLU)."""
    if sae.activation == "topk" or len(chosen) == sae.d_sae:
        return sae
    index = torch.tensor(chosen)
    narrowed = {"W_enc": sae.W_enc[:, index].contiguous(), "b_enc": sae.b_enc[index], "W_dec": sae.W_dec[index],
                "threshold": None if sae.threshold is None else sae.threshold[index]}
    if getattr(sae, "log_sparsity", None) is not None:
        narrowed["log_sparsity"] = sae.log_sparsity[index]
    return dataclasses.replace(sae, **narrowed)


def _best(values: torch.Tensor, k: int) -> list[list[int]]:
    """For each column of `values` ``[rows, features]``, the rows of its `k` largest positive entries, largest first,
    ties by the earlier row (the same order wherever a chunk's rows are cut)."""
    count = min(k, values.shape[0])
    kth = values.topk(count, dim=0).values[-1]
    rows, cols = ((values >= kth) & (values > 0)).nonzero(as_tuple=True)  # row-major: rows ascending
    order = torch.sort(-values[rows, cols], stable=True).indices
    order = order[torch.sort(cols[order], stable=True).indices]
    best: list[list[int]] = [[] for _ in range(values.shape[1])]
    for row, col in zip(rows[order].tolist(), cols[order].tolist()):
        if len(best[col]) < k:
            best[col].append(row)
    return best


def top_examples(model: Any, prompts: Sequence[Any], sae: Any, features: Union[int, Sequence[int], None] = None,
                 k: int = 10, *, context: tuple[int, int] = (8, 4), skip_special_tokens: bool = True,
                 chunk: int = 64, **options: Any) -> FeatureExamples:
    """Each feature's `k` top-activating tokens over `prompts`, with the tokens around each.

    Args:
        model: A streamscope model (either engine).
        prompts: Texts or lists of token ids. Every token of every prompt is a candidate.
        sae: A `streamscope.sae.SAE`; its features are computed at its site in the engine.
        features: A feature index or a list of them (default: every feature of the SAE).
        k: How many examples per feature, at most (only tokens where the feature fires, activation > 0).
        context: Tokens shown before and after each example's token (the window is cut at the prompt's ends).
        skip_special_tokens: Leave out tokens the tokenizer calls special (BOS, EOS, padding) as examples:
            a BOS often carries a large activation that says nothing of the feature. They still show in windows.
        chunk: Prompts harvested at a time (memory: a chunk's activations of the features asked for).
        options: Passed to ``model.harvest`` (``batch_size``, ``progress``).
    Returns:
        `FeatureExamples`: ``examples[f]``, a list of `Example` per feature, largest activation first.
    """
    if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
        raise ValueError(f"k={k!r}: give how many examples per feature, an int of 1 or more.")
    if not (len(context) == 2 and all(isinstance(n, int) and n >= 0 for n in context)):
        raise ValueError(f"context={context!r}: give (tokens before, tokens after), two ints of 0 or more.")
    if not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"chunk={chunk!r}: give how many prompts to harvest at a time, an int of 1 or more.")
    sae.check(model)
    chosen = _chosen(features, sae.d_sae)
    ids = token_ids(model, prompts)
    special = set(getattr(model.tokenizer, "all_special_ids", []) or []) if skip_special_tokens else set()
    reader = _reader(sae, chosen)
    columns = None if reader is not sae else torch.tensor(chosen)
    best: dict[int, list[Example]] = {feature: [] for feature in chosen}
    options.setdefault("progress", False)
    try:
        for first in range(0, len(ids), chunk):
            part = ids[first:first + chunk]
            harvested = model.harvest(part, sae=reader, positions="all", **options)["sae_features"]
            rows = [tensor[0].float().cpu() for tensor in harvested]
            values = torch.cat(rows)
            values = values if columns is None else values[:, columns]
            owner = [(first + index, position) for index, row in enumerate(part) for position in range(len(row))]
            ranked = values.clone()
            skip = [row for row, (prompt, position) in enumerate(owner) if ids[prompt][position] in special]
            ranked[skip] = 0.0
            starts = [0]
            for row in part:
                starts.append(starts[-1] + len(row))
            for col, found in enumerate(_best(ranked, k)):
                feature = chosen[col]
                fresh = [_example(model, ids, owner[row], values[:, col], starts[owner[row][0] - first], feature,
                                  context) for row in found]
                merged = sorted(best[feature] + fresh, key=lambda e: (-e.activation, e.prompt, e.position))[:k]
                best[feature] = merged
    finally:
        if reader is not sae:
            reader.release(model)
    for examples in best.values():
        for rank, example in enumerate(examples):
            example.rank = rank
    return FeatureExamples(best, k, context, sae, len(ids))


def _example(model: Any, ids: list[list[int]], where: tuple[int, int], column: torch.Tensor, offset: int,
             feature: int, context: tuple[int, int]) -> Example:
    prompt, position = where
    start, stop = max(0, position - context[0]), min(len(ids[prompt]), position + context[1] + 1)
    window = ids[prompt][start:stop]
    return Example(feature, 0, prompt, position, float(column[offset + position]), start, list(window),
                   [model.tokenizer.decode([token_id]) for token_id in window],
                   column[offset + start:offset + stop].tolist())


__all__ = ["top_examples", "FeatureExamples", "Example"]
