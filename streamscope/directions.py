"""Directions in a model's activations: found from contrastive prompts, swept over blocks, saved, steered with.

A researcher's loop, by streamscope's names::

    sweep = streamscope.directions.find(model, happy_prompts, sad_prompts, value="layer_output",
                                        method="mean_difference")        # or "pca", "probe"
    sweep.scores                    # per block: held-out accuracy, separation
    sweep.plot("sweep.png")
    direction = sweep.best          # a Direction: vector, model, value, block, method, scores
    model.generate(prompts, steer=[direction.steer(scale=4.0)])               # add it
    model.generate(prompts, steer=[direction.steer(mode="ablate")])           # remove it
    direction.save("happy")         # happy.safetensors + happy.json
    streamscope.directions.Direction.load("happy", model)   # refused on a model of another shape

The activations come from `model.harvest` (prompts, with a progress bar) or
from `Harvest` objects already made; each prompt's chosen positions are
averaged (``positions="last"``, the default, takes the last token). The
methods, per block, on positive activations ``P`` and negative ``N``
(``[examples, hidden_size]``):

* ``mean_difference``: ``mean(P) - mean(N)`` (for pairs, the mean of the
  paired differences: the same vector);
* ``pca``: the first principal component of the paired differences
  ``P - N`` (centred, as PCA is), signed so the positives project higher;
  its length is the differences' mean projection on it;
* ``probe``: logistic regression (L-BFGS, L2 penalty) with ``P`` as class 1;
  the vector is its weights and `Direction.bias` its bias.

Scores, per block, on a held-out split (a `held_out` fraction of the
examples, pairs kept together; the direction is fit on the rest for scoring,
then on all of them): ``accuracy``, the held-out fraction classified right
(a probe by its own decision; the others by the midpoint of the two training
means' projections), and ``separation``, the held-out classes' difference of
mean projections over their pooled standard deviation. The methods, the
split and the scores are in `streamscope.direction_fits` (re-exported here).

`import_gguf` and `export_gguf` read and write the control-vector GGUF files
of repeng (and llama.cpp): ``direction.N`` added to block ``N``'s output, for
blocks 1 and up (llama.cpp refuses ``direction.0``: `export_gguf` leaves a
sweep's block 0 out with a `ControlVectorWarning`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import gguf
import numpy as np
import torch
from matplotlib.ticker import MaxNLocator
from safetensors.torch import load_file, save_file

from .bulk.dose import CARRIED, carried_entry
from .bulk.norms import fit_norms
from .bulk.results import Harvest
from .bulk.sites import ROOT_VALUES, layer_list, value_names
from .bulk.steer import Steer
from .direction_fits import (METHODS, HeldOutFit, check_examples, fit, fit_held_out, held_out_split, mean_difference,
                             pca, probe)
from .moment_fits import fit_moments
from .workflows.plot import _figure, _save

#: What identifies a model's shape: a direction made on one loads onto another only where all of these agree.
IDENTITY = ("model_type", "hidden_size", "num_layers", "vocab_size")

Examples = Union[Sequence[Any], Harvest]
"""Prompts (strings or token-id lists) to harvest, or a `Harvest` already made."""


def identity(model: Any) -> dict[str, Any]:
    """What a `Direction` records of the model it was made on: its shape, and its name where it has one."""
    config = model.config
    return {"model_type": config.model_type, "hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "vocab_size": model.vocab_size, "name": str(getattr(config, "_name_or_path", "") or "")}


@dataclass
class Direction:
    """A direction in one value of one block of a model, with how it was made.

    Attributes:
        vector: ``[hidden_size]``, float32: the direction (its length is the
            method's: a difference of means, a probe's weights).
        value: The value it lives in (``"layer_output"``, ...), as `model.harvest` names it.
        layer: The block; None for a root value.
        method: ``"mean_difference"``, ``"pca"``, ``"probe"``, ``"gguf"`` (imported), or an SAE's.
        model: The model's `identity`: a load onto a model whose shape differs is refused.
        bias: A probe's bias: it predicts the positive class where ``vector . x + bias > 0``.
        scores: Held-out ``accuracy`` and ``separation``, where they were measured.
        details: Anything else the method states (examples used, explained variance).
        stream_norm: ``||h||`` at its value and block over the prompts it was fit on, as `model.norms` measures it
            (`find` records it; None where unknown): its steer carries it to the dose check (`streamscope.bulk.dose`).
    """

    vector: torch.Tensor
    value: str
    layer: Optional[int]
    method: str
    model: dict[str, Any]
    bias: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    stream_norm: Optional[float] = None

    def __repr__(self) -> str:
        where = self.value if self.layer is None else f"layers[{self.layer}].{self.value}"
        scores = ", ".join(f"{name} {number:.3f}" for name, number in self.scores.items())
        return (f"Direction({self.method} at {where} of {self.model.get('model_type')} "
                f"(hidden {self.vector.shape[0]}), norm {float(self.vector.norm()):.4g}"
                + (f"; {scores}" if scores else "") + ")")

    @property
    def unit(self) -> torch.Tensor:
        """The direction as a unit vector, ``[hidden_size]``."""
        return self.vector / self.vector.norm()

    def project(self, activations: torch.Tensor) -> torch.Tensor:
        """Each activation's projection on the unit direction: ``[..., hidden_size]`` -> ``[...]``."""
        return activations.float() @ self.unit.to(activations.device)

    def check(self, model: Any) -> None:
        """Refuse `model` unless it has the shape this direction was made on, saying what differs and the fix."""
        theirs = identity(model)
        different = [f"{key} {self.model.get(key)!r} here, {theirs[key]!r} on the model"
                     for key in IDENTITY if key in self.model and self.model[key] != theirs[key]]
        if tuple(self.vector.shape) != (theirs["hidden_size"],):
            different.append(f"a vector of shape {tuple(self.vector.shape)} for a stream of width "
                             f"{theirs['hidden_size']}")
        if self.layer is not None and not 0 <= self.layer < theirs["num_layers"]:
            different.append(f"block {self.layer} of a model with {theirs['num_layers']} blocks")
        if different:
            made = self.model.get("name") or self.model.get("model_type")
            raise ValueError(f"this direction ({self.method} at {self.value}, block {self.layer}) was made on "
                             f"another model ({made}): {'; '.join(different)}. Load the model it was made on, "
                             f"or find the direction again on this one (streamscope.directions.find).")

    def steer(self, mode: str = "add", scale: Optional[float] = None, **options: Any) -> Steer:
        """A `streamscope.Steer` with this direction at its value and block (``mode``: add, set, ablate, clamp).

        `scale` left out takes the mode's default (1 for add, set and ablate); clamp takes ``projection=``
        instead, and refuses a scale (`streamscope.Steer`).
        """
        origin: dict[str, Any] = {key: self.model[key] for key in IDENTITY if key in self.model}
        if self.stream_norm is not None:  # the dose check's norm, over any the model measured
            origin[CARRIED] = carried_entry(self.value, self.layer, self.stream_norm)
        return Steer(self.value, self.layer, self.vector.clone(), scale=scale, mode=mode, origin=origin, **options)

    def as_dict(self) -> dict[str, Any]:
        """Everything but the vector, as JSON-ready metadata."""
        return {"format": "streamscope.direction", "version": 1, "value": self.value, "layer": self.layer,
                "method": self.method, "model": self.model, "bias": self.bias, "scores": self.scores,
                "details": self.details, "hidden_size": int(self.vector.shape[0]), "stream_norm": self.stream_norm}

    def save(self, path: Union[str, Path]) -> Path:
        """Write ``<path>.safetensors`` (the vector) and ``<path>.json`` (the rest); returns the safetensors path."""
        stem = _stem(path)
        stem.parent.mkdir(parents=True, exist_ok=True)
        metadata = self.as_dict()
        save_file({"vector": self.vector.detach().float().cpu().contiguous()}, str(stem.with_suffix(".safetensors")),
                  metadata={"streamscope.direction": json.dumps(metadata)})
        stem.with_suffix(".json").write_text(json.dumps(metadata, indent=2))
        return stem.with_suffix(".safetensors")

    @classmethod
    def load(cls, path: Union[str, Path], model: Any = None) -> "Direction":
        """Read a direction `save` wrote; with `model`, refuse it unless the model has the shape it was made on."""
        stem = _stem(path)
        tensors = load_file(str(stem.with_suffix(".safetensors")))
        metadata = json.loads(stem.with_suffix(".json").read_text())
        if metadata.get("format") != "streamscope.direction":
            raise ValueError(f"{stem}.json is not a streamscope direction's metadata (no format field).")
        direction = cls(tensors["vector"], metadata["value"], metadata["layer"], metadata["method"],
                        metadata["model"], metadata.get("bias", 0.0), metadata.get("scores", {}),
                        metadata.get("details", {}), metadata.get("stream_norm"))  # None in older files
        if model is not None:
            direction.check(model)
        return direction


def _stem(path: Union[str, Path]) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".safetensors", ".json") else path


# ---------------------------------------------------------------- per block, from prompts or harvests


class UnreliableFitWarning(UserWarning):
    """A swept direction's scores cannot be trusted: too few held-out examples, accuracy at chance, a PCA or
    probe direction nearly orthogonal to the mean difference, or no block steering better than chance."""


#: Fewer held-out examples per class than this and the accuracy moves in steps too coarse to rank blocks by.
MIN_HELD_OUT = 10
#: A PCA or probe direction whose cosine with the mean difference is below this (in absolute value) is warned of.
MIN_COSINE = 0.3
#: The one-sided binomial p-value above which a held-out accuracy is called chance.
CHANCE_P = 0.05


def chance_p_value(right: int, total: int) -> float:
    """``P(X >= right)`` for ``X ~ Binomial(total, 1/2)``: how likely guessing gets `right` of `total` or more."""
    return sum(math.comb(total, k) for k in range(right, total + 1)) / 2 ** total if total else 1.0


@dataclass
class SteeringMeasure:
    """What steering with one block's direction did to held-out negative prompts (`find`'s ``steering``).

    The edit is added to the block's value at every prompt position but the
    first (an attention sink in trained models) of each held-out negative
    prompt; the readout is the next-token log-probabilities after the prompt.
    ``effect`` is the mean, over those prompts, of the change in log-probs
    projected on the classes' gap (the training positives' mean log-probs less
    the training negatives'), over that gap's squared length: 0 is no move,
    1 a move the whole way from the negative to the positive class.

    Attributes:
        layer: The block steered.
        vector: ``[hidden]``: the edit added, the training split's unit direction times ``dose * stream_norm``.
        random_vector: ``[hidden]``: a random direction of the same length (seeded with ``seed + block``).
        stream_norm: The block's mean stream norm at the harvested positions, both classes.
        dose: The edit's length over `stream_norm`.
        prompts: The held-out negative prompts steered.
        gap_prompts: The training positives and negatives whose mean log-probs make the gap.
        effect: The direction's move toward the positive class, as above.
        random_effect: The random direction's, the baseline.
    """

    layer: Optional[int]
    vector: torch.Tensor
    random_vector: torch.Tensor
    stream_norm: float
    dose: float
    prompts: list
    gap_prompts: tuple[list, list]
    effect: float
    random_effect: float


@dataclass
class Sweep:
    """The same method's direction at every block swept, with its scores: ``sweep[block]`` is a `Direction`.

    Each direction's ``scores`` hold ``accuracy`` and ``separation`` (held
    out) and, where `find` measured it, ``steering``: its `SteeringMeasure`'s
    effect less the random direction's, the fraction of the way from the
    negative class to the positive one that steering at that block moved
    held-out negative prompts' next tokens, beyond chance. `measures` holds
    each block's measure.
    """

    directions: list[Direction]
    value: str
    method: str
    measures: dict[Optional[int], SteeringMeasure] = field(default_factory=dict)

    def __getitem__(self, layer: int) -> Direction:
        for direction in self.directions:
            if direction.layer == layer:
                return direction
        raise KeyError(f"block {layer} was not swept: the sweep has blocks {self.layers}.")

    def __len__(self) -> int:
        return len(self.directions)

    def __iter__(self) -> Any:
        return iter(self.directions)

    @property
    def layers(self) -> list[Optional[int]]:
        return [direction.layer for direction in self.directions]

    @property
    def scores(self) -> dict[Optional[int], dict[str, float]]:
        """block -> its held-out ``accuracy``, ``separation`` and (where measured) ``steering``."""
        return {direction.layer: dict(direction.scores) for direction in self.directions}

    @property
    def best(self) -> Direction:
        """The direction that steers best: the block with the largest ``steering`` score (its direction's
        effect on held-out negative prompts' next tokens, less a random direction's at the same dose; see
        `SteeringMeasure`). Where no steering was measured (`find` got `Harvest` objects, or
        ``steering=False``), the highest held-out accuracy, with an `UnreliableFitWarning` saying so.
        ``best_by("accuracy")`` selects by accuracy (then separation) always."""
        if self.measures:
            return self.best_by("steering")
        warnings.warn("no steering effect was measured for this sweep (find got Harvest objects, or "
                      "steering=False): sweep.best falls back to held-out accuracy, which does not say which block "
                      "steers. Pass prompts to find to measure it, or use best_by('accuracy') to say you mean it.",
                      UnreliableFitWarning, stacklevel=2)
        return self.best_by("accuracy")

    def best_by(self, score: str) -> Direction:
        """The direction with the highest `score`: ``"steering"``, ``"accuracy"`` (then separation) or
        ``"separation"``."""
        if not all(direction.scores for direction in self.directions):
            raise ValueError("the sweep has no scores (held_out=0): pick a block by hand, sweep[block].")
        if score not in self.directions[0].scores:
            raise ValueError(f"the sweep has no {score!r} score: it has {', '.join(self.directions[0].scores)}"
                             + (" (find measures steering from prompts, not Harvest objects)"
                                if score == "steering" else ""))
        if score == "accuracy":
            return max(self.directions, key=lambda d: (d.scores["accuracy"], d.scores["separation"]))
        return max(self.directions, key=lambda d: d.scores[score])

    def table(self) -> str:
        """One line per block: held-out accuracy, separation and steering; the sample sizes in the header."""
        details = self.directions[0].details
        lines = [f"{self.method} at {self.value}: block, held-out accuracy, separation, steering (a random "
                 f"direction's); {details.get('positives', '?')} positives, {details.get('negatives', '?')} "
                 f"negatives; held out {details.get('held_out_positives', 0)} positives and "
                 f"{details.get('held_out_negatives', 0)} negatives"]
        for direction in self.directions:
            scores = direction.scores
            measure = self.measures.get(direction.layer)
            steering = (f"{scores['steering']:+.3f} ({measure.random_effect:+.3f})" if measure is not None
                        else "steering not measured")
            block = "root" if direction.layer is None else str(direction.layer)
            lines.append(f"  block {block:>4}: {scores.get('accuracy', float('nan')):.3f}  "
                         f"{scores.get('separation', float('nan')):+7.2f}  {steering}")
        return "\n".join(lines)

    def plot(self, path: Union[str, Path], *, dpi: int = 100) -> Path:
        """A PNG of the scores per block: held-out accuracy (left axis) and separation (right)."""
        figure = _figure((max(6.0, 0.25 * len(self.directions) + 2), 3.4))
        accuracy_axis = figure.subplots()
        blocks = [d.layer if d.layer is not None else -1 for d in self.directions]
        accuracy_axis.plot(blocks, [d.scores.get("accuracy", float("nan")) for d in self.directions], "o-",
                           color="tab:blue", label="held-out accuracy")
        accuracy_axis.set_ylim(0, 1.05)
        accuracy_axis.set_xlabel("block")
        accuracy_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        accuracy_axis.set_ylabel("held-out accuracy", color="tab:blue")
        separation_axis = accuracy_axis.twinx()
        separation_axis.plot(blocks, [d.scores.get("separation", float("nan")) for d in self.directions], "s--",
                             color="tab:orange", label="separation")
        separation_axis.set_ylabel("separation (pooled std)", color="tab:orange")
        accuracy_axis.set_title(f"{self.method} direction at {self.value}, per block", fontsize=10)
        figure.tight_layout()
        return _save(figure, path, dpi)


def _activations(harvest: Harvest, value: str, layers: list[int]) -> torch.Tensor:
    """``[layers, prompts, hidden]``: each prompt's harvested positions averaged, at the chosen blocks."""
    if value not in harvest:
        raise ValueError(f"the harvest holds {', '.join(harvest.keys())}, not {value!r}: harvest {value!r}, "
                         f"or ask for one of those.")
    tensors = harvest[value]
    if value in ROOT_VALUES:
        return torch.stack([tensor.float().mean(-2) for tensor in tensors]).unsqueeze(0)
    missing = [layer for layer in layers if layer not in harvest.layers]
    if missing:
        raise ValueError(f"blocks {missing} are not in the harvest (it has {harvest.layers}): harvest them, or "
                         f"sweep layers={harvest.layers}.")
    slots = [harvest.layers.index(layer) for layer in layers]
    return torch.stack([tensor[slots].float().mean(-2) for tensor in tensors], dim=1)


def find(model: Any, positive: Examples, negative: Examples, value: str = "layer_output", layers: Any = None,
         method: str = "mean_difference", positions: Any = "last", held_out: float = 0.25, seed: int = 0,
         progress: bool = True, steering: bool = True, dose: float = 0.5, **harvest_options: Any) -> Sweep:
    """The `method`'s direction at `value` of every block in `layers`, with held-out scores: a `Sweep`.

    Args:
        model: A streamscope model (either engine): it harvests the prompts
            and names the directions' model.
        positive, negative: Prompts (harvested here, with a progress bar), or
            `Harvest` objects holding `value` at `layers`. Pairs for ``pca``.
        value: A block's value, or a root value (then `layers` is ignored).
        layers: Blocks to sweep (None: every block; an int for one).
        method: ``"mean_difference"``, ``"pca"`` or ``"probe"``.
        positions: Which prompt positions to harvest; each prompt's are averaged.
        held_out: Fraction of the examples kept out of the fit to score it (0: no scores).
        seed: The split's seed (and the random baseline directions').
        steering: Measure each block's steering effect on the held-out
            negative prompts (`SteeringMeasure`; ``scores["steering"]``, what
            `Sweep.best` selects by). Needs prompts (not `Harvest` objects) and
            `held_out` > 0; it runs two one-token generations per block.
        dose: The steering edit's length over the block's mean stream norm.

    Each direction records its block's `model.norms` over both classes' prompts (``stream_norm``: one more
    harvest, of every position; None from `Harvest` objects), which its steer carries to the dose check.

    Warns (`UnreliableFitWarning`, once per kind, naming the blocks) where
    fewer than `MIN_HELD_OUT` examples per class are held out, where a
    block's held-out accuracy is not above chance (one-sided binomial p >
    `CHANCE_P`), where a ``pca`` or ``probe`` direction's cosine with the
    mean difference is below `MIN_COSINE`, and where no block steers better
    than its random baseline.
    """
    if value not in value_names():
        raise ValueError(f"unknown value {value!r}: choose one of {', '.join(value_names())}.")
    if isinstance(dose, bool) or not isinstance(dose, (int, float)) or not 0 < dose < math.inf:
        raise ValueError(f"dose={dose!r}: the steering edit's length over the block's stream norm, a positive "
                         f"number (0.5 by default).")
    root = value in ROOT_VALUES
    blocks = [] if root else layer_list(model, layers)
    # Check what can be checked without running: the classes and the method.
    counts = [len(positive.positions) if isinstance(positive, Harvest) else len(positive),
              len(negative.positions) if isinstance(negative, Harvest) else len(negative)]
    width = model.hidden_size
    check_examples(torch.zeros(counts[0], width), torch.zeros(counts[1], width), method, held_out)
    harvests = []
    for examples in (positive, negative):
        if isinstance(examples, Harvest):
            harvests.append(examples)
        else:
            if isinstance(examples, str):
                raise TypeError("give a list of prompts for each class, not a single string.")
            harvests.append(model.harvest(list(examples), value, layers=None if root else blocks, positions=positions,
                                          progress=progress, **harvest_options))
    per_class = [_activations(harvest, value, blocks) for harvest in harvests]
    if per_class[0].shape[-1] != width or per_class[1].shape[-1] != width:
        raise ValueError(f"the harvests are {per_class[0].shape[-1]} and {per_class[1].shape[-1]} wide, the model "
                         f"{width}: harvest them from this model.")
    made_on = identity(model)
    stream_norms = fit_norms(model, positive, negative, value, blocks)
    directions, held_fits = [], []
    for slot, layer in enumerate(blocks or [None]):
        vector, bias, scores, details = fit(per_class[0][slot], per_class[1][slot], method, held_out, seed)
        directions.append(Direction(vector, value, layer, method, made_on, bias, scores,
                                    {**details, "positions": positions if isinstance(positions, str) else "chosen"},
                                    None if stream_norms is None else stream_norms[slot]))
        held_fits.append(fit_held_out(per_class[0][slot], per_class[1][slot], method, held_out, seed)
                         if held_out > 0 else None)
    measures: dict[Optional[int], SteeringMeasure] = {}
    if steering and held_out > 0 and not isinstance(positive, Harvest) and not isinstance(negative, Harvest):
        measures = _steering_measures(model, list(positive), list(negative), value, directions, held_fits,
                                      per_class, dose, seed)
        for direction in directions:
            measure = measures[direction.layer]
            direction.scores["steering"] = measure.effect - measure.random_effect
            direction.details["steering_dose"] = dose
    for message in _unreliable(directions, method, measures):
        warnings.warn(message, UnreliableFitWarning, stacklevel=2)
    return Sweep(directions, value, method, measures)


def _next_token_log_probs(model: Any, prompts: list, steer: Sequence[Steer]) -> torch.Tensor:
    """``[prompts, vocab]``: the log-probabilities of the token after each prompt, with `steer` applied."""
    result = model.generate(prompts, max_tokens=1, steer=list(steer), return_logits=True, progress=False)
    return torch.stack([torch.log_softmax(logits[0].float().cpu(), -1) for logits in result.logits])


def _steering_measures(model: Any, positive: list, negative: list, value: str, directions: list[Direction],
                       held_fits: list[Optional[HeldOutFit]], per_class: list[torch.Tensor], dose: float,
                       seed: int) -> dict[Optional[int], SteeringMeasure]:
    """Each direction's `SteeringMeasure`: its training split's direction and a random one, added at `dose`
    times the block's stream norm to the held-out negative prompts (the split is the same at every block)."""
    first = held_fits[0]
    assert first is not None
    train_p, _, train_n, held_n = first.split
    gap_prompts = ([positive[i] for i in train_p], [negative[i] for i in train_n])
    gap = (_next_token_log_probs(model, gap_prompts[0], []).mean(0)
           - _next_token_log_probs(model, gap_prompts[1], []).mean(0))
    held_prompts = [negative[i] for i in held_n]
    plain = _next_token_log_probs(model, held_prompts, [])
    squared_gap = float(gap @ gap)

    def effect(layer: Optional[int], edit: torch.Tensor) -> float:
        # positions 1 on: the first prompt token is an attention sink in trained models (see `Steer`)
        steer = Steer(value, layer, edit, scale=1.0, mode="add", positions=slice(1, None), generated=False)
        moved = _next_token_log_probs(model, held_prompts, [steer]) - plain
        return float((moved @ gap).mean()) / squared_gap if squared_gap > 0 else 0.0

    measures = {}
    for slot, (direction, held) in enumerate(zip(directions, held_fits)):
        assert held is not None
        stream_norm = float(torch.cat([per_class[0][slot], per_class[1][slot]]).norm(dim=-1).mean())
        length = dose * stream_norm
        edit = held.vector.float() / held.vector.float().norm().clamp_min(1e-30) * length
        generator = torch.Generator().manual_seed(seed + (direction.layer or 0))
        random = torch.randn(edit.shape[0], generator=generator)
        random = random / random.norm() * length
        measures[direction.layer] = SteeringMeasure(direction.layer, edit, random, stream_norm, dose, held_prompts,
                                                    gap_prompts, effect(direction.layer, edit),
                                                    effect(direction.layer, random))
    return measures


def _unreliable(directions: list[Direction], method: str, measures: dict) -> list[str]:
    """One sentence per kind of unreliable fit in the sweep, naming the blocks and what to do."""
    found = []
    first = directions[0].details
    held_p, held_n = first.get("held_out_positives", 0), first.get("held_out_negatives", 0)
    if directions[0].scores and min(held_p, held_n) < MIN_HELD_OUT:
        found.append(f"only {held_p} positive and {held_n} negative examples are held out: a held-out accuracy "
                     f"moves in steps of {1 / (held_p + held_n):.2f} and cannot rank blocks. Give at least "
                     f"{MIN_HELD_OUT} per class held out (more prompts, or a larger held_out).")
    at_chance = []
    for direction in directions:
        if "accuracy" not in direction.scores:
            continue
        total = direction.details.get("held_out_positives", 0) + direction.details.get("held_out_negatives", 0)
        right = round(direction.scores["accuracy"] * total)
        if chance_p_value(right, total) > CHANCE_P:
            at_chance.append(f"{direction.layer} ({right}/{total})")
    if at_chance:
        found.append(f"the held-out accuracy cannot be told from chance (one-sided binomial p > {CHANCE_P}) at "
                     f"blocks {', '.join(at_chance)} (right/held out): those directions are not shown to separate "
                     f"the classes on unseen examples. Hold out more examples.")
    if method in ("pca", "probe"):
        apart = [f"{d.layer} ({d.details['cosine_to_mean_difference']:+.2f})" for d in directions
                 if abs(d.details.get("cosine_to_mean_difference", 1.0)) < MIN_COSINE]
        if apart:
            found.append(f"the {method} direction is nearly orthogonal to the mean difference (cosine below "
                         f"{MIN_COSINE}) at blocks {', '.join(apart)}: it follows variance other than the classes' "
                         f"difference. Compare with method='mean_difference'.")
    if measures and all(measure.effect <= measure.random_effect for measure in measures.values()):
        found.append("no block's direction steered the held-out negative prompts further toward the positive "
                     "class than a random direction of the same dose: the steering scores rank noise.")
    return found


# ---------------------------------------------------------------- repeng's control-vector GGUF files


class ControlVectorWarning(UserWarning):
    """A direction left out of a control-vector file because llama.cpp would refuse or ignore it there."""


def _llama_cpp_blocks(directions: list[Direction], from_sweep: bool, path: Path) -> list[Direction]:
    """The directions llama.cpp's control-vector loader takes: blocks 1 to num_layers - 1.

    llama.cpp (common/common.cpp, ``common_control_vector_load_one``) refuses the whole file at a tensor
    ``direction.0`` ("invalid (zero) direction tensor layer index"), and ``llama_adapter_cvec::apply``
    (src/llama-adapter.cpp) fills its per-block tensors from block 1 on ("buffer doesn't have data for layer 0"),
    adding ``direction.N`` to block N's output for 1 <= N < n_layer. A sweep's block 0 is left out with a
    `ControlVectorWarning`; a direction given by hand at block 0 is refused.
    """
    at_zero = [d for d in directions if d.layer == 0]
    if at_zero and not from_sweep:
        raise ValueError("a llama.cpp control vector cannot hold block 0: llama.cpp refuses a file with a "
                         "direction.0 tensor ('invalid (zero) direction tensor layer index') and never adds to "
                         "block 0's output. Export directions of blocks 1 and up (find(..., layers=range(1, n))), "
                         "or steer block 0 in streamscope (direction.steer()).")
    kept = [d for d in directions if d.layer != 0]
    if not kept:
        raise ValueError("the sweep holds only block 0, which a llama.cpp control vector cannot hold: sweep blocks "
                         "1 and up (find(..., layers=range(1, n))).")
    if at_zero:
        warnings.warn(f"{path.name}: block 0's direction is left out: llama.cpp refuses a control vector with a "
                      f"direction.0 tensor (it never adds to block 0's output). The file holds blocks "
                      f"{[d.layer for d in kept]}; steer block 0 in streamscope "
                      f"(sweep[0].steer()) if you need it.", ControlVectorWarning, stacklevel=3)
    beyond = [d.layer for d in directions if d.layer is not None and "num_layers" in d.model
              and d.layer >= d.model["num_layers"]]
    if beyond:
        raise ValueError(f"blocks {beyond} are past the model's last block ({directions[0].model['num_layers'] - 1})"
                         f": llama.cpp would ignore them. Export directions of this model's blocks.")
    return kept


def export_gguf(directions: Union[Sweep, Direction, Sequence[Direction]], path: Union[str, Path]) -> Path:
    """Write directions at ``layer_output`` as a repeng / llama.cpp control-vector GGUF file; returns its path.

    ``direction.N`` (float32, ``[hidden_size]``) is block N's vector, which
    llama.cpp adds to block N's output (0-based), ``controlvector.model_hint``
    the model type, ``controlvector.layer_count`` the number of directions.
    llama.cpp takes blocks 1 to num_layers - 1 only: a `Sweep`'s block 0 is
    left out with a `ControlVectorWarning` that says so, and a `Direction`
    (or a list) at block 0 is refused with the reason.
    """
    path = Path(path)
    from_sweep = isinstance(directions, Sweep)
    directions = [directions] if isinstance(directions, Direction) else list(directions)
    if not directions:
        raise ValueError("export_gguf needs at least one direction.")
    wrong = [f"{d.value} at block {d.layer}" for d in directions if d.value != "layer_output" or d.layer is None]
    if wrong:
        raise ValueError(f"a control vector adds to blocks' outputs: these directions are elsewhere ({', '.join(wrong)})."
                         f" Find them at value='layer_output'.")
    layers = [d.layer for d in directions]
    if len(set(layers)) != len(layers):
        raise ValueError(f"one direction per block in a control vector: blocks {layers} repeat.")
    hints = {d.model.get("model_type") for d in directions}
    if len(hints) != 1:
        raise ValueError(f"the directions come from models of types {sorted(map(str, hints))}: export one model's.")
    directions = _llama_cpp_blocks(directions, from_sweep, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "controlvector")
    writer.add_string("controlvector.model_hint", str(hints.pop()))
    writer.add_uint32("controlvector.layer_count", len(directions))
    for direction in sorted(directions, key=lambda d: d.layer or 0):
        writer.add_tensor(f"direction.{direction.layer}", direction.vector.detach().float().cpu().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def import_gguf(path: Union[str, Path], model: Any, check_hint: bool = True) -> list[Direction]:
    """The directions of a repeng / llama.cpp control-vector GGUF file, for `model`'s blocks' outputs.

    Refused, with the reason, where the file's width or blocks do not fit the
    model, or (unless ``check_hint=False``) its model hint names another type.
    Steer with all of them: ``[d.steer(scale=coefficient) for d in directions]``.
    """
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields

    def text(name: str) -> Optional[str]:
        found = fields.get(name)
        return None if found is None else bytes(found.parts[found.data[0]]).decode("utf-8")

    if text("general.architecture") != "controlvector":
        raise ValueError(f"{path} is not a control-vector GGUF (general.architecture is "
                         f"{text('general.architecture')!r}, not 'controlvector').")
    hint = text("controlvector.model_hint")
    made_on = identity(model)
    if check_hint and hint is not None and hint != made_on["model_type"]:
        raise ValueError(f"{path} was made for a {hint!r} model, and this is a {made_on['model_type']!r} one. Load "
                         f"the model it was made for, or pass check_hint=False where the types are the same "
                         f"architecture under two names.")
    directions = []
    for tensor in reader.tensors:
        if not tensor.name.startswith("direction."):
            continue
        layer = int(tensor.name.split(".", 1)[1])
        vector = torch.tensor(tensor.data.astype("float32")).reshape(-1)
        if vector.shape[0] != made_on["hidden_size"]:
            raise ValueError(f"{path}: {tensor.name} is {vector.shape[0]} wide and the model's stream "
                             f"{made_on['hidden_size']}: it was made for another model.")
        if not 0 <= layer < made_on["num_layers"]:
            raise ValueError(f"{path}: {tensor.name} names block {layer}, and the model has {made_on['num_layers']} "
                             f"blocks: it was made for another model.")
        directions.append(Direction(vector, "layer_output", layer, "gguf", {**made_on, "name": str(path)},
                                    details={"model_hint": hint}))
    if not directions:
        raise ValueError(f"{path} holds no direction.N tensors.")
    return sorted(directions, key=lambda d: d.layer or 0)


def steers(directions: Union[Sweep, Sequence[Direction]], mode: str = "add", scale: Optional[float] = None,
           **options: Any) -> list[Steer]:
    """One `Steer` per direction (a control vector's blocks, a sweep's), all with the same settings."""
    return [direction.steer(mode=mode, scale=scale, **options) for direction in directions]



def from_moments(moments: Any, positive: Any = None, negative: Any = None, method: str = "mean_difference") -> Sweep:
    """Directions at every block from running moments (`model.statistics`), not rows: a `Sweep` without held-out
    scores. ``mean_difference`` takes the `positive` and `negative` labels; ``pca`` the paired differences'
    moments (``pairs=``, ``second=True``); a probe needs rows. See `streamscope.moment_fits`."""
    return Sweep([Direction(vector, moments.value, layer, method, dict(moments.model), 0.0, {}, details)
                  for layer, vector, details in fit_moments(moments, positive, negative, method)], moments.value, method)


__all__ = ["Direction", "Sweep", "SteeringMeasure", "HeldOutFit", "UnreliableFitWarning", "ControlVectorWarning",
           "find", "fit", "from_moments", "fit_held_out", "held_out_split", "mean_difference", "pca", "probe", "export_gguf",
           "import_gguf", "steers", "identity", "METHODS", "MIN_HELD_OUT", "MIN_COSINE", "CHANCE_P"]
