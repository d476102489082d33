"""Activation patching: run a corrupted prompt with one value taken from a clean run, and measure the change.

    effect = streamscope.patch(model, "The Eiffel Tower is in the city of",
                               "The Colosseum is in the city of",
                               answer=" Paris", wrong=" Rome", value="layer_output")
    effect.effects          # [blocks, positions]: the metric with the patch
    effect.normalized       # 0 = the corrupted run, 1 = the clean run
    effect.plot("patch.png")

Each patch is one run of the corrupted prompt in which value `value` of one
block at one position (or one head's output at every position) is replaced by
the clean run's. Patches run in groups: on transformers as invokes of one
batched forward; on vLLM as requests of one engine run on the bulk path, each
with its own ``set`` steer of the clean value at its block and position
(`Engine.set_each`: no trace, so the patches run at the engine's speed), or,
for what that path cannot write, as invokes (requests) of one trace
(`_trace_route`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from ..display import png, shape, shortened, table, token
from ..errors import Unavailable
from ..input_checks import indices, one_prompt
from .attribution import attribution_effects, check_method, refuse_without_gradients
from .plot import patching_heatmap

#: Values a patch can replace: streamscope's block values (short names for the contributions).
_CONTRIBUTIONS = {"attention_output": "self_attn.attention_output", "mlp_output": "mlp.mlp_output",
                  "head_outputs": "self_attn.head_outputs", "head_results": "self_attn.head_outputs",
                  "neurons": "mlp.neurons", "neurons_pre": "mlp.neurons_pre"}
#: Values patched one head at a time (a column per head). A head's result (TransformerLens's attn.hook_result,
#: its output times its rows of the output projection) is linear in the head's output and has no bias, so
#: putting the clean run's result of one head in place of the corrupted run's changes the attention's output by
#: exactly what putting the clean head output there does: ``head_results`` is patched at head_outputs.
HEAD_VALUES = ("head_outputs", "head_results")


def logit_difference(answer: int, wrong: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A metric: the last position's logit of `answer` minus that of `wrong` (token ids)."""
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[..., answer] - logits[..., wrong]
    metric.__name__ = "logit difference"
    return metric


@dataclass
class Patching:
    """The result of `patch`.

    Attributes:
        effects: ``[blocks, positions]`` (or ``[blocks, heads]`` for `HEAD_VALUES`): the metric of the
            corrupted run with that one value patched from the clean run.
        clean, corrupted: The metric of the unpatched clean and corrupted runs.
        layers: The blocks patched (row i is block layers[i]).
        columns: The positions (or heads) patched.
        labels: Column labels: the corrupted prompt's tokens at those positions, or ``head h``.
        value: The value patched.
    """

    effects: torch.Tensor
    clean: float
    corrupted: float
    layers: list[int]
    columns: list[int]
    labels: list[str]
    value: str
    metric_name: str
    prompts: tuple[str, str] = ("", "")

    def __repr__(self) -> str:
        columns = "heads" if self.per_head else "positions"
        return (f"Patching({self.value}, effects {shape(self.effects)} blocks x {columns}, {self.metric_name}: "
                f"clean {self.clean:.3f}, corrupted {self.corrupted:.3f})")

    def _repr_html_(self) -> str:
        caption = (f"patching {self.value} from {shortened(self.prompts[0])!r} into {shortened(self.prompts[1])!r}: "
                   f"normalized {self.metric_name} (clean {self.clean:.3f}, corrupted {self.corrupted:.3f})")
        labels = self.labels if self.per_head else [token(label) for label in self.labels]
        rows = [[layer, *(f"{float(x):.2f}" for x in row)] for layer, row in zip(self.layers, self.normalized)]
        return table(caption, ["block", *labels], rows)

    def _repr_png_(self) -> bytes:
        return png(self.plot)

    @property
    def per_head(self) -> bool:
        """Whether each column is a head (`HEAD_VALUES`) rather than a position."""
        return self.value in HEAD_VALUES

    @property
    def normalized(self) -> torch.Tensor:
        """``(effects - corrupted) / (clean - corrupted)``: 0 where a patch does nothing, 1 where it restores the clean run."""
        return (self.effects - self.corrupted) / (self.clean - self.corrupted)

    def plot(self, path: Any, **kwargs: Any) -> Any:
        """Write the heatmap of `normalized` as a PNG."""
        return patching_heatmap(self, path, **kwargs)

    def table(self) -> str:
        lines = [f"patching {self.value}: normalized {self.metric_name} (clean {self.clean:.3f}, "
                 f"corrupted {self.corrupted:.3f})",
                 "block " + " ".join(f"{label[:8]:>8}" for label in self.labels)]
        for layer, row in zip(self.layers, self.normalized):
            lines.append(f"{layer:>5} " + " ".join(f"{float(x):>8.2f}" for x in row))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _full_name(model: Any, layer: int, value: str) -> str:
    """The block's name for `value`: a contribution's short name is its mixer's (self_attn or linear_attn)."""
    rows = model.layers[layer].support().rows
    missing = "no such row"
    if value == "attention_output" and rows.get("self_attn.attention_output", missing) is not None \
            and rows.get("linear_attn.attention_output", missing) is None:
        return "linear_attn.attention_output"
    return _CONTRIBUTIONS.get(value, value)


def _envoy(model: Any, layer: int, value: str) -> Any:
    envoy = model.layers[layer]
    for part in value.split("."):
        envoy = getattr(envoy, part)
    return envoy


def clean_values(model: Any, prompt: str, layers: Sequence[int], names: dict[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([blocks, 1, seq, ...], [vocab])``: value ``names[block]`` of each block on a run, and its last logits."""

    # Read in the order the model computes (a trace waits for each value in turn), given back in `layers`' order.
    order = sorted(range(len(layers)), key=lambda index: layers[index])

    def body() -> list[torch.Tensor]:  # [1, blocks, 1, seq, ...] and the logits
        read = [_envoy(model, layers[index], names[layers[index]]) for index in order]
        return [torch.stack(read)[None], model.logits[..., -1, :]]

    with torch.no_grad():
        ((stacked, logits),) = model.engine.run([prompt], body, [(), ()])  # one prompt: nothing padded to cut
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return stacked[0][back], _last(logits)


def _last(logits: torch.Tensor) -> torch.Tensor:
    """``[vocab]``: the last row of `model.logits` read at its last position (on vLLM, the sampled one)."""
    return logits.reshape(-1, logits.shape[-1])[-1]


def _trace_route(model: Any, layers: Sequence[int], names: dict[int, str], heads: bool) -> set[int]:
    """The blocks whose patches run as invokes of a trace (`Engine.run_each`) rather than through `Engine.set_each`.

    `set_each` sets one vector over one position's row of a block value (vLLM's bulk path). A head's patch is
    not that: it writes one head's slice of ``head_outputs`` (``[1, heads, tokens, head_dim]``) at every patched
    position, each with its own clean value, and ``head_outputs`` is no value of the bulk path, so head values
    take the trace; so does every value the engine's `settable` refuses (the reason it gives), and every patch
    on an engine without the route (transformers, whose invokes already share one padded forward).
    """
    if heads:
        return set(layers)
    return {layer for layer in layers if model.engine.settable(names[layer], layer) is not None}


def _patched_logits(model: Any, prompt: str, patches: list[tuple[int, int, torch.Tensor]], names: dict[int, str],
                    heads: Optional[list[int]], traced: set[int]) -> list[torch.Tensor]:
    """The last position's logits of `prompt` under each patch ``(block, position or head, clean value)``.

    `heads` is None for a stream value, else the positions a head's output is patched at. Patches of blocks in
    `traced` run as invokes of one trace, the others as requests of one `Engine.set_each` run.
    """
    found: dict[int, torch.Tensor] = {}
    direct = [index for index, (layer, _, _) in enumerate(patches) if layer not in traced]
    if direct:
        edits = [(names[patches[index][0]], patches[index][0], patches[index][1], patches[index][2])
                 for index in direct]
        found.update(zip(direct, model.engine.set_each(prompt, edits)))
    traced_patches = [index for index in range(len(patches)) if index not in found]
    if traced_patches:
        found.update(zip(traced_patches, _traced_logits(model, prompt, [patches[index] for index in traced_patches],
                                                        names, heads)))
    return [found[index] for index in range(len(patches))]


def _traced_logits(model: Any, prompt: str, patches: list[tuple[int, int, torch.Tensor]], names: dict[int, str],
                   heads: Optional[list[int]]) -> list[torch.Tensor]:
    """`_patched_logits` as invokes of one trace, a patch each."""
    def bodies() -> list:
        return [partial(_patched, model, names[layer], layer, heads, column, replacement)
                for layer, column, replacement in patches]

    with torch.no_grad():
        return [_last(logits) for (logits,) in model.engine.run_each(prompt, bodies())]


def _patched(model: Any, name: str, layer: int, heads: Any, column: Any, replacement: torch.Tensor) -> list:
    """Inside an invoke: one patch written, and the logits it gives."""
    _write_patch(_envoy(model, layer, name), heads, column, replacement)
    return [model.logits[..., -1, :]]


def _write_patch(target: Any, heads: Any, column: Any, replacement: torch.Tensor) -> None:
    """Write `replacement` into a value read inside an invoke: a stream's column, or a head's output there."""
    if heads is not None:
        target[:, heads, column] = replacement
    else:
        target[:, column] = replacement


def patch(model: Any, clean: str, corrupted: str, metric: Optional[Callable[[torch.Tensor], Any]] = None, *,
          answer: Optional[str | int] = None, wrong: Optional[str | int] = None, value: str = "layer_output",
          layers: Optional[Sequence[int]] = None, positions: Optional[Sequence[int]] = None,
          batch_size: Optional[int] = None, progress: Optional[bool] = None,
          method: str = "activation") -> Patching:
    """Patch `value` from the clean run into the corrupted one, block by block and position by position.

    Args:
        model: A streamscope model on either engine.
        clean, corrupted: Two prompts of the same number of tokens.
        metric: A function of the last position's logits ``[vocab_size]`` returning a number; or give
            `answer` and `wrong` (token ids or one-token strings) for their logit difference.
        value: A block value: a boundary (``layer_output``, ``layer_input``, ``layer_mid``, ...), a
            contribution (``attention_output``, ``mlp_output``), ``head_outputs`` to patch each
            head's output (before the output projection) at every position in `positions`, or
            ``head_results`` to patch each head's result there (after the output projection, TL's
            ``attn.hook_result``; the same patch, `HEAD_VALUES`), or an MLP's ``mlp.neurons``.
        layers: The blocks to patch (default: all).
        positions: The positions to patch (default: all); per head, the positions each
            head's output is patched at (default: all), one column per head.
        batch_size: Patches per forward (transformers, default 16) or per engine run (vLLM, default: every
            patch in one run, which the engine schedules into its steps as its batch allows).
        method: ``"activation"`` runs the corrupted prompt once per patch; ``"attribution"`` estimates every
            patch at once from one clean run, one corrupted run and one backward pass: the corrupted run's
            metric plus ``(clean value - corrupted value) . d metric / d value`` at the corrupted run, summed
            over the value's last axis (attribution patching, `streamscope.workflows.attribution`; the metric
            must return a tensor; transformers only: an engine without gradients refuses it before running).

    Returns:
        A `Patching`: the metric under each patch, ``[blocks, positions]`` or ``[blocks, heads]``.
    """
    if check_method(method) == "attribution":
        refuse_without_gradients(model)  # before any run, a server's sweep included
    remote = getattr(model, "patch_sweep", None)
    if remote is not None:  # a server runs the sweep itself (`streamscope.serve.sweeps`), with its noise floor
        return remote(clean, corrupted, metric, answer=answer, wrong=wrong, value=value, layers=layers,
                      positions=positions, batch_size=batch_size, progress=progress)
    clean, corrupted, corrupted_ids, metric = _checked_prompts(model, clean, corrupted, metric, answer, wrong)
    layers = indices(layers, model.num_layers, "block", "streamscope.patch")
    names = _checked_names(model, value, layers)
    heads = value in HEAD_VALUES
    positions = indices(positions, len(corrupted_ids), "position", "streamscope.patch")

    if method == "attribution":
        return _attribution(model, (clean, corrupted), metric, layers, names, positions, value)
    stacked, clean_logits = clean_values(model, clean, layers, names)
    _, corrupted_logits = clean_values(model, corrupted, layers[:1], names)
    patches, columns, labels = _patches(model, stacked, layers, positions, heads, corrupted_ids)
    outcomes = _patch_outcomes(model, corrupted, patches, names, positions if heads else None, metric, batch_size,
                               progress, _trace_route(model, layers, names, heads))
    effects = torch.tensor(outcomes).reshape(len(layers), len(columns))
    return Patching(effects, float(metric(clean_logits.float())), float(metric(corrupted_logits.float())),
                    layers, columns, labels, value, getattr(metric, "__name__", "metric"), (clean, corrupted))


def _checked_prompts(model: Any, clean: str, corrupted: str, metric: Optional[Callable[[torch.Tensor], Any]],
                     answer: Optional[str | int], wrong: Optional[str | int]
                     ) -> tuple[str, str, list[int], Callable[[torch.Tensor], Any]]:
    """`patch`'s two prompts (one each, of one token count), the corrupted one's token ids, and the metric (the
    answer's logit difference where none is given); a clear error naming the fix otherwise."""
    several = "Patch each pair of prompts with its own call."
    clean, corrupted = (one_prompt(prompt, "streamscope.patch", several) for prompt in (clean, corrupted))
    tokenizer = model.tokenizer
    clean_ids, corrupted_ids = tokenizer(clean)["input_ids"], tokenizer(corrupted)["input_ids"]
    if len(clean_ids) != len(corrupted_ids):
        raise ValueError(f"the clean and corrupted prompts must have the same number of tokens to patch position "
                         f"by position: {len(clean_ids)} and {len(corrupted_ids)}. Reword one of them.")
    if metric is None:
        if answer is None or wrong is None:
            raise ValueError("give a metric (a function of the last position's logits), or answer= and wrong= "
                             "for their logit difference")
        metric = logit_difference(_token_id(tokenizer, answer), _token_id(tokenizer, wrong))
    return clean, corrupted, corrupted_ids, metric


def _checked_names(model: Any, value: str, layers: Sequence[int]) -> dict[int, str]:
    """Each block's full name of `value`, after refusing (`Unavailable`, with the reason) a value a block does not
    serve, before anything runs."""
    gated = model.family_spec.gated_head_outputs
    if value == "head_results" and gated is not None:
        raise Unavailable(value, "streamscope.patch", f"{gated}, and a patch of head_results is made at head_outputs: "
                          f"patch value='head_outputs' (each head's output before the gate), or edit "
                          f"self_attn.head_results in a trace")
    names = {layer: _full_name(model, layer, value) for layer in layers}
    for layer in layers:
        reason = model.layers[layer].support().rows.get(names[layer], "not a value of this block")
        if reason is not None:
            raise Unavailable(value, f"model.layers[{layer}]", reason)
    return names


def _patches(model: Any, stacked: torch.Tensor, layers: Sequence[int], positions: list[int], heads: bool,
             corrupted_ids: list[int]) -> tuple[list[tuple[int, int, torch.Tensor]], list[int], list[str]]:
    """Every patch, ``(block, column, clean value)`` in row order, with the columns and their labels."""
    patches: list[tuple[int, int, torch.Tensor]] = []
    if heads:
        columns = list(range(stacked.shape[3]))
        labels = [f"head {h}" for h in columns]
        for row, layer in enumerate(layers):
            for head in columns:
                # [1, positions, head_dim]: this head's clean output at `positions` (the corrupted run's elsewhere).
                patches.append((layer, head, stacked[row][:, positions, head]))
    else:
        columns = positions
        labels = [model.tokenizer.decode([corrupted_ids[p]]) for p in positions]
        for row, layer in enumerate(layers):
            for position in positions:
                patches.append((layer, position, stacked[row, :, position]))
    return patches, columns, labels


def _patch_outcomes(model: Any, corrupted: str, patches: list[tuple[int, int, torch.Tensor]], names: dict[int, str],
                    heads: Optional[list[int]], metric: Callable[[torch.Tensor], Any], batch_size: Optional[int],
                    progress: Optional[bool], traced: set[int]) -> list[float]:
    """The metric of the corrupted run under each patch, in order, `batch_size` patches a run."""
    batch_size = model.engine.batch(batch_size, 16, len(patches))
    show = progress if progress is not None else len(patches) > batch_size
    outcomes: list[float] = []
    for start in tqdm(range(0, len(patches), batch_size), desc="patch", unit="step", disable=not show):
        for logits in _patched_logits(model, corrupted, patches[start : start + batch_size], names, heads, traced):
            outcomes.append(float(metric(logits.float())))
    return outcomes


def _attribution(model: Any, prompts: tuple[str, str], metric: Callable[[torch.Tensor], Any], layers: Sequence[int],
                 names: dict[int, str], positions: Sequence[int], value: str) -> Patching:
    """`patch` by attribution (`streamscope.workflows.attribution`): the same axes, columns and labels."""
    heads = value in HEAD_VALUES
    effects, clean_metric, corrupted_metric = attribution_effects(model, *prompts, metric, layers, names, positions,
                                                                  heads, _envoy, clean_values)
    columns = list(range(effects.shape[1])) if heads else list(positions)
    ids = model.tokenizer(prompts[1])["input_ids"]
    labels = [f"head {h}" for h in columns] if heads else [model.tokenizer.decode([ids[p]]) for p in positions]
    return Patching(effects, clean_metric, corrupted_metric, list(layers), columns, labels, value,
                    getattr(metric, "__name__", "metric"), prompts)


def _token_id(tokenizer: Any, token: str | int) -> int:
    if isinstance(token, int):
        return token
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{token!r} is {len(ids)} tokens for this tokenizer; give one token (or its id)")
    return ids[0]
