"""Reductions at the source: a harvest reduced over its positions, and running moments per label.

A direction over many prompts needs, per class, the mean of its rows (a
difference of means) or their second moment (a principal component), not the
rows: `statistics` runs the engine's bulk harvest in chunks and keeps, per
label, a count, a sum and (``second=True``) a sum of outer products, so what
is kept (and what a server sends back) is ``labels x layers x hidden`` numbers
(``x hidden`` again with second moments), whatever the number of prompts.

The arithmetic, stated so that anyone can reproduce it bit for bit from a full
harvest of the same run (the tests do):

* ``reduce="last"``: the last of a prompt's harvested positions, as it is (no arithmetic).
* ``reduce="mean"``: the positions' rows cast to float64, ``torch.sum`` over
  the positions axis, divided by their count, cast to float32 (or kept in
  float64 where the rows are float64).
* The moments: each prompt in prompt order (a pair, with ``pairs=``, in the
  pairs' order, once both its prompts have run), its rows ``x``
  ``[layers, rows, hidden]`` (one row a prompt when reduced, else one a
  harvested position) cast to float64 and added to running sums:
  ``count += rows``, ``sum += x.sum(1)``, ``square += x.mT @ x``. Sequential
  sums make the result independent of how the run is chunked.

How it is computed (the same bits, less work; `Moments.add_each`): where each
prompt is one row, a chunk's rows of one label are stacked, cast to float64 a
few at a time into one buffer, and added row by row in place. A one-row sum is
the row itself (the only rounding is the running sum's), and a one-row
``x.mT @ x`` is the rows' outer product, each entry rounded once; where the
rows' dtype has at most 24 significant bits (float32, bfloat16, float16) that
product is exact in float64, so ``square.addcmul_`` (the product added in place,
rounded once) equals the stated two steps; float64 rows (a paired difference, a
float64 engine) take ``x.mT @ x`` into a scratch buffer, then add it. Nothing of
``hidden x hidden`` is allocated a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..bulk.spec import ROOT_VALUES, layer_list

#: What `model.harvest(reduce=...)` and `statistics(reduce=...)` take (None: every harvested position).
REDUCTIONS = ("last", "mean")
#: The label `statistics` files the paired differences under (``pairs=``).
DIFFERENCE = "difference"
#: Row dtypes whose products are exact in float64: two significands of at most 24 bits fit float64's 53, and the
#: squares of float32's exponent range lie in float64's normal range (`Moments.add_each` adds them fused).
EXACT_PRODUCTS = (torch.float32, torch.bfloat16, torch.float16)
#: The float64 buffer `Moments.add_each` casts a slice of rows into (bytes): allocated once a call, and 32768
#: elements, torch's grain for splitting an op over threads: a cast this small runs on the calling thread (waking
#: threads for it cost milliseconds a cast on a busy host).
CAST_BYTES = 32768 * 8


def check_reduce(reduce: Optional[str]) -> Optional[str]:
    """`reduce` if it is a reduction streamscope knows (or None), else a ValueError naming the choices."""
    if reduce is not None and reduce not in REDUCTIONS:
        raise ValueError(f"reduce={reduce!r}: choose \"last\" (each prompt's last harvested position), \"mean\" "
                         f"(the mean of its harvested positions), or None (every position).")
    return reduce


def reduce_positions(rows: torch.Tensor, reduce: Optional[str]) -> torch.Tensor:
    """`rows` ``[..., positions, width]`` reduced over the positions axis to ``[..., 1, width]`` (None: as it is).

    ``"last"`` keeps (a copy of) the last row; ``"mean"`` sums the rows in float64 and divides by their count,
    then casts to float32 (float64 rows stay float64): a bfloat16 harvest's mean keeps float32's precision.
    """
    if reduce is None:
        return rows
    if reduce == "last":
        # A copy, not a view: a view would keep (and pickle, leaving a worker) every position of the buffer.
        return rows if rows.shape[-2] == 1 else rows[..., -1:, :].clone()
    if reduce != "mean":
        check_reduce(reduce)
    total = rows.to(torch.float64).sum(-2, keepdim=True)
    out = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return (total / rows.shape[-2]).to(out)


def reduce_buffer(buffer: Optional[torch.Tensor], reduce: Optional[str]) -> Optional[torch.Tensor]:
    """A bulk run's prompt buffer ``[sites, positions, width]`` reduced over its positions (None stays None: a
    prompt the run did not read, which `streamscope.bulk.results.assemble` reports)."""
    return buffer if buffer is None or reduce is None else reduce_positions(buffer, reduce)


@dataclass
class Moments:
    """Running first and second moments of one value's rows, per label.

    Attributes:
        value: The value the rows are (``"layer_output"``, ...), as `model.harvest` names it.
        layers: The blocks, in the order of the tensors' first axis (``[None]`` for a root value).
        counts: label -> how many rows were added.
        sums: label -> ``[len(layers), hidden]`` float64: the rows' sum.
        squares: label -> ``[len(layers), hidden, hidden]`` float64: the sum of the rows' outer products
            (empty unless second moments were asked for).
        reduce: How each prompt's positions became rows (``"last"``, ``"mean"``, None: one row a position).
        positions: The positions rule harvested (``"last"``, ``"all"``, ...) as given, for the record.
        model: The `streamscope.directions.identity` of the model the rows came from (empty where unknown).
    """

    value: str
    layers: list[Optional[int]]
    counts: dict[Hashable, int] = field(default_factory=dict)
    sums: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    squares: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    reduce: Optional[str] = "mean"
    positions: Any = "last"
    model: dict[str, Any] = field(default_factory=dict)
    #: Whether second moments are kept (`add` fills `squares`).
    second: bool = False

    @property
    def labels(self) -> list[Hashable]:
        """The labels seen, in the order they were first added."""
        return list(self.counts)

    def add(self, label: Hashable, rows: torch.Tensor) -> None:
        """Add `rows` ``[len(layers), rows, hidden]`` under `label`, in float64 (see the module's arithmetic)."""
        if rows.dim() != 3 or rows.shape[0] != len(self.layers):
            raise ValueError(f"rows of {self.value} are [layers, rows, hidden] with {len(self.layers)} layers; got "
                             f"{tuple(rows.shape)}.")
        if rows.shape[1] == 1:
            self.add_each(label, rows.transpose(0, 1))
            return
        x = rows.to(torch.float64)
        self._open(label, x.shape[2], x.device)
        self.counts[label] += x.shape[1]
        self.sums[label] += x.sum(1)
        if self.second:
            self.squares[label] += x.mT @ x

    def add_each(self, label: Hashable, rows: torch.Tensor) -> None:
        """Add `rows` ``[n, len(layers), hidden]`` under `label`, one row at a time in order: bit for bit `n` calls
        of `add` with one row each (``rows[i].unsqueeze(1)``), without a float64 temporary a row."""
        if rows.dim() != 3 or rows.shape[1] != len(self.layers):
            raise ValueError(f"rows of {self.value} are [rows, layers, hidden] with {len(self.layers)} layers; got "
                             f"{tuple(rows.shape)}.")
        self._open(label, rows.shape[2], rows.device)
        exact = rows.dtype in EXACT_PRODUCTS
        total = self.sums[label]
        square = self.squares.get(label) if self.second else None
        scratch = torch.empty_like(square) if square is not None and not exact else None
        # Cast a slice at a time into one float64 buffer: no float64 copy of the whole chunk, no fresh allocation.
        step = max(1, CAST_BYTES // max(1, rows.shape[1] * rows.shape[2] * 8))
        buffer = None if rows.dtype == torch.float64 else torch.empty(
            (min(step, rows.shape[0]), rows.shape[1], rows.shape[2]), dtype=torch.float64, device=rows.device)
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step]
            if buffer is not None:
                part = buffer[:part.shape[0]].copy_(part)  # exact: every float32, bfloat16, float16 is a float64
            for x in part.unbind(0):
                total.add_(x)  # a one-row sum is the row
                if square is None:
                    continue
                if scratch is None:  # the product is exact: added in place, rounded once, as `add` rounds it
                    square.addcmul_(x.unsqueeze(-1), x.unsqueeze(-2))
                else:  # `add`'s own product (rounded), then its sum
                    torch.matmul(x.unsqueeze(-1), x.unsqueeze(-2), out=scratch)
                    square.add_(scratch)
        self.counts[label] += rows.shape[0]

    def _open(self, label: Hashable, hidden: int, device: torch.device) -> None:
        if label in self.counts:
            return
        self.counts[label] = 0
        self.sums[label] = torch.zeros(len(self.layers), hidden, dtype=torch.float64, device=device)
        if self.second:
            self.squares[label] = torch.zeros(len(self.layers), hidden, hidden, dtype=torch.float64, device=device)

    def _held(self, label: Hashable) -> None:
        if label not in self.counts:
            raise KeyError(f"no rows were added under {label!r}: the labels are {self.labels}.")

    def mean(self, label: Hashable) -> torch.Tensor:
        """``[len(layers), hidden]`` float64: the mean row of `label` (its sum over its count)."""
        self._held(label)
        return self.sums[label] / self.counts[label]

    def covariance(self, label: Hashable) -> torch.Tensor:
        """``[len(layers), hidden, hidden]`` float64: `label`'s rows' covariance (population: over the count, centred
        on their mean), from the second moment. Needs ``second=True``."""
        self._held(label)
        if label not in self.squares:
            raise ValueError("these moments hold no second moments: gather them with second=True (model.statistics"
                             "(..., second=True)) to get a covariance or a principal component.")
        mean = self.mean(label)
        return self.squares[label] / self.counts[label] - mean.unsqueeze(-1) * mean.unsqueeze(-2)

    def slot(self, layer: Optional[int]) -> int:
        """The index of block `layer` on the tensors' first axis."""
        if layer not in self.layers:
            raise KeyError(f"block {layer} is not in these moments (blocks {self.layers}).")
        return self.layers.index(layer)

    def nbytes(self) -> int:
        """The bytes the tensors hold: what sending these moments costs."""
        return sum(tensor.numel() * tensor.element_size() for part in (self.sums, self.squares)
                   for tensor in part.values())

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The moments as safetensors-ready tensors (``"sum/<n>"``, ``"square/<n>"``) and JSON metadata."""
        labels = self.labels
        tensors = {f"sum/{index}": self.sums[label].cpu().contiguous() for index, label in enumerate(labels)}
        tensors.update({f"square/{index}": self.squares[label].cpu().contiguous()
                        for index, label in enumerate(labels) if label in self.squares})
        meta = {"value": self.value, "layers": self.layers, "labels": labels,
                "counts": [self.counts[label] for label in labels], "reduce": self.reduce,
                "positions": self.positions, "model": self.model, "second": self.second}
        return tensors, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Moments":
        """`tensors` undone: the moments a server sent (`streamscope.Client.statistics`)."""
        moments = cls(meta["value"], list(meta["layers"]), reduce=meta["reduce"], positions=meta["positions"],
                      model=dict(meta.get("model") or {}))
        moments.second = bool(meta.get("second"))
        for index, (label, count) in enumerate(zip(meta["labels"], meta["counts"])):
            label = tuple(label) if isinstance(label, list) else label
            moments.counts[label] = int(count)
            moments.sums[label] = tensors[f"sum/{index}"]
            if f"square/{index}" in tensors:
                moments.squares[label] = tensors[f"square/{index}"]
        return moments

    def __repr__(self) -> str:
        held = ", ".join(f"{label!r}: {count}" for label, count in self.counts.items())
        kind = "first and second" if self.second else "first"
        return (f"Moments({kind} moments of {self.value} at blocks {self.layers}, reduce={self.reduce!r}; rows per "
                f"label {{{held}}}; {self.nbytes()} bytes)")


def empty_moments(value: str, layers: Sequence[Optional[int]], second: bool, reduce: Optional[str],
                  positions: Any, model: dict[str, Any]) -> Moments:
    """Moments with nothing added yet (second moments kept where `second`)."""
    return Moments(value, list(layers), reduce=reduce, positions=positions, model=dict(model), second=second)


class Accumulator:
    """Feeds a run's harvested prompts into `Moments`, in prompt order, pairing prompts where asked."""

    def __init__(self, moments: Moments, labels: Sequence[Hashable], pairs: Optional[Sequence[tuple[int, int]]],
                 reduce: Optional[str]) -> None:
        self.moments = moments
        self.labels = list(labels)
        self.pairs = [tuple(pair) for pair in pairs] if pairs is not None else []
        self.reduce = reduce
        self.waiting: dict[int, torch.Tensor] = {}  # a paired prompt's rows until its last pair is added
        self.uses: dict[int, int] = {}
        for pair in self.pairs:
            for index in pair:
                self.uses[index] = self.uses.get(index, 0) + 1
        self.next_pair = 0

    def rows(self, harvest: Any, local: int) -> torch.Tensor:
        """The harvest's `local`-th prompt's rows ``[layers, rows, hidden]``, reduced as the moments say."""
        tensor = harvest[self.moments.value][local]
        if self.moments.layers == [None]:
            tensor = tensor.unsqueeze(0)
        return reduce_positions(tensor, None if getattr(harvest, "reduce", None) else self.reduce)

    def add_part(self, harvest: Any, indices: Sequence[int]) -> None:
        """Add every prompt of `harvest` (a chunk of the run, in prompt order), whose run indices are `indices`."""
        rows = [self.rows(harvest, local) for local in range(len(indices))]
        single = all(row.shape[1] == 1 for row in rows)
        # One row a prompt: each label's rows of the chunk stacked and added in prompt order (`Moments.add_each`);
        # labels are independent sums, and they are opened in the order they first appear, as prompt by prompt.
        groups: dict[Hashable, list[torch.Tensor]] = {}
        for row, index in zip(rows, indices):
            label = self.labels[index]
            if label is not None:
                if single:
                    groups.setdefault(label, []).append(row[:, 0])
                else:
                    self.moments.add(label, row)
            if index in self.uses:
                self.waiting[index] = row
        for label, members in groups.items():
            self.moments.add_each(label, torch.stack(members))
        self._add_pairs()

    def _add_pairs(self) -> None:
        """Add the differences of the pairs whose prompts have both run, in the pairs' order."""
        ready = []
        while self.next_pair < len(self.pairs) and all(index in self.waiting for index in self.pairs[self.next_pair]):
            ready.append(self.pairs[self.next_pair])
            self.next_pair += 1
        if not ready:
            return
        if all(self.waiting[index].shape[1] == 1 for pair in ready for index in pair):
            firsts = torch.stack([self.waiting[first][:, 0] for first, _ in ready]).to(torch.float64)
            seconds = torch.stack([self.waiting[second][:, 0] for _, second in ready]).to(torch.float64)
            self.moments.add_each(DIFFERENCE, firsts - seconds)
        else:
            for first, second in ready:
                self.moments.add(DIFFERENCE, self.waiting[first].to(torch.float64)
                                 - self.waiting[second].to(torch.float64))
        for pair in ready:
            for index in pair:
                self.uses[index] -= 1
                if not self.uses[index]:
                    del self.waiting[index]


def model_identity(model: Any) -> dict[str, Any]:
    """What moments record of the model their rows came from, as `streamscope.directions.identity` states it
    (a direction fit from them is refused on a model of another shape)."""
    config = model.config
    return {"model_type": config.model_type, "hidden_size": model.hidden_size, "num_layers": model.num_layers,
            "vocab_size": model.vocab_size, "name": str(getattr(config, "_name_or_path", "") or "")}


def _label_list(labels: Any, count: int) -> list[Hashable]:
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence):
        raise TypeError("labels takes one label a prompt (a list as long as the prompts; None leaves a prompt out "
                        "of the per-label moments).")
    labels = list(labels)
    if len(labels) != count:
        raise ValueError(f"labels has {len(labels)} entries for {count} prompts: give one label a prompt.")
    for label in labels:
        if label is not None and not isinstance(label, (str, int, bool)):
            raise TypeError(f"label {label!r}: labels are strings or ints (they travel as JSON to and from a "
                            f"server), or None.")
    return labels


def _pair_list(pairs: Any, count: int, reduce: Optional[str]) -> Optional[list[tuple[int, int]]]:
    if pairs is None:
        return None
    checked = []
    for pair in pairs:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2
                or not all(isinstance(index, int) and not isinstance(index, bool) and 0 <= index < count
                           for index in pair)):
            raise ValueError(f"pairs holds (positive, negative) prompt indices in 0..{count - 1}; got {pair!r}.")
        checked.append((int(pair[0]), int(pair[1])))
    if reduce is None:
        raise ValueError("pairs= subtracts one prompt's row from another's: reduce each prompt to one row "
                         "(reduce=\"last\" or \"mean\").")
    return checked


def statistics(model: Any, prompts: Sequence[Any], labels: Sequence[Hashable], value: str = "layer_output",
               layers: Any = None, positions: Any = "last", *, reduce: Optional[str] = "mean", second: bool = False,
               pairs: Optional[Sequence[tuple[int, int]]] = None, chunk_size: int = 1024, progress: bool = True,
               **harvest_options: Any) -> Moments:
    """Running moments of `value`'s rows per label, from the engine's bulk harvest in chunks: a `Moments`.

    Args:
        model: A streamscope model (either engine).
        prompts: The prompts (strings or token-id lists).
        labels: One label a prompt (a string or an int; None: the prompt is in no label, only in `pairs`).
        value: One value, as `model.harvest` takes it (a block's value, or a root value).
        layers: The blocks (None: every block; ignored for a root value).
        positions: Which prompt positions to harvest (`streamscope.bulk.spec.Positions`).
        reduce: ``"mean"`` (the default: each prompt's positions averaged, one row a prompt, as
            `streamscope.directions.find` does), ``"last"`` (its last harvested position), or None (one
            row a harvested position).
        second: Keep second moments too (``[layers, hidden, hidden]`` float64 a label): what a principal
            component needs; a difference of means needs only the first. Each prompt's outer product is
            added in place where the rows are (the host): ``layers x hidden x hidden`` float64 read and
            written once a prompt, which at a large hidden size costs more than the harvest's forward.
        pairs: ``(positive, negative)`` prompt indices: each pair's difference of rows (the first's less
            the second's, in float64) is added under the label ``"difference"`` (a paired principal
            component: `streamscope.directions.from_moments` with ``method="pca"``).
        chunk_size: Prompts per bulk run: the rows held at once are one chunk's.
        harvest_options: Passed to `model.harvest` (``steer=``, ``batch_size=``, ...).

    The arithmetic is the module's: a full harvest of the same prompts (same chunking, same batches)
    reduced that way gives these moments bit for bit.
    """
    if not isinstance(value, str):
        raise TypeError(f"statistics reads one value (a name such as \"layer_output\"); got {value!r}.")
    check_reduce(reduce)
    if isinstance(prompts, str):
        raise TypeError("statistics takes a list of prompts; wrap a single prompt in a list.")
    prompts = list(prompts)
    label_list = _label_list(labels, len(prompts))
    pair_list = _pair_list(pairs, len(prompts), reduce)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: the prompts a bulk run takes, a positive int.")
    for option in ("out", "sae", "reduce"):
        if option in harvest_options:
            raise TypeError(f"statistics keeps moments in memory from a dense harvest: it takes no {option}=.")
    root = value in ROOT_VALUES
    blocks: list[Optional[int]] = [None] if root else list(layer_list(model, layers))
    nested = (isinstance(positions, (list, tuple)) and len(positions) > 0
              and all(isinstance(item, (list, tuple, range)) for item in positions))
    if nested and len(positions) != len(prompts):
        raise ValueError(f"positions has {len(positions)} lists for {len(prompts)} prompts: give one list per prompt, "
                         f"or one rule for every prompt.")
    moments = empty_moments(value, blocks, second, reduce, positions if not nested else "chosen", model_identity(model))
    accumulator = Accumulator(moments, label_list, pair_list, reduce)

    bar = tqdm(total=len(prompts), desc="statistics", unit="prompt", disable=not progress)
    try:
        for start in range(0, len(prompts), chunk_size):
            indices = list(range(start, min(start + chunk_size, len(prompts))))
            chosen = [positions[index] for index in indices] if nested else positions
            part = model.harvest([prompts[index] for index in indices], value, layers=None if root else blocks,
                                 positions=chosen, reduce=reduce, progress=False, **harvest_options)
            accumulator.add_part(part, indices)
            bar.update(len(indices))
    finally:
        bar.close()
    return moments
