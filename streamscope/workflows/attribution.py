"""Attribution patching: activation patching's effects estimated from one backward pass, by name.

    effect = streamscope.patch(model, clean, corrupted, answer=" Paris", wrong=" Rome",
                               value="attention_output", method="attribution")

Attribution patching (Neel Nanda, "Attribution Patching: Activation Patching At Industrial Scale", 2023; Syed,
Rager and Conmy, 2023) replaces each patched run by the first-order Taylor expansion of the metric around the
corrupted run. Patching value ``a`` of one block at one position from the clean run into the corrupted one
changes the metric by about

    (a_clean - a_corrupted) . d metric / d a, the gradient taken on the corrupted run,

the dot product over the value's last axis (over the head's width and the patched positions, for a head). So one
clean run (no gradients), one corrupted run and one backward pass give every block and position at once, where
activation patching runs the model once per patch. The estimate is exact where the metric is linear in the
value between the two runs, and drifts where a patch moves the model far (a whole early residual stream, say).

The result is `patching.Patching`, as activation patching's: ``effects[block, position]`` is the corrupted run's
metric plus that estimated change, so `Patching.normalized` reads as activation patching's does.

Gradients exist on an engine that keeps an autograd graph (transformers, `streamscope.gradients`); an engine that
runs under inference mode (vLLM) is refused before anything runs, with the fix.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import nnsight
import torch

from .. import nnsight_seam as seam


def refuse_without_gradients(model: Any) -> None:
    """Raise ValueError, before anything runs, where `model`'s engine serves no gradients (`Engine.no_gradients`)."""
    engine = getattr(model, "engine", None)
    reason = getattr(engine, "no_gradients", None) if engine is not None else (
        "this model runs behind a server, which returns no gradients. Load the checkpoint on transformers "
        "for gradients: `streamscope.load(path, engine=\"transformers\")`.")
    if reason is not None:
        raise ValueError(f"streamscope.patch(..., method=\"attribution\") takes the metric's gradient on the "
                         f"corrupted run, and {reason} Or run activation patching on this engine: "
                         f"method=\"activation\" (the default).")


@contextmanager
def _gradients_from_the_embeddings(model: Any) -> Iterator[None]:
    """Autograd records from the input embedding's weight on, and no other parameter gets a gradient.

    Every value a patch reads descends from the embeddings, so the graph reaches them all; the other weights are
    leaves the backward would otherwise fill with a model-sized gradient that nobody asked for. Every
    parameter's ``requires_grad`` and the embedding's ``.grad`` are as they were afterwards."""
    parameters = list(seam.module_of(model).parameters())
    embedding = seam.module_of(model.embed_tokens).weight
    flags = [parameter.requires_grad for parameter in parameters]
    kept = embedding.grad
    try:
        for parameter in parameters:
            parameter.requires_grad_(parameter is embedding)
        yield
    finally:
        for parameter, flag in zip(parameters, flags):
            parameter.requires_grad_(flag)
        embedding.grad = kept


#: ``read(model, block, name)``: a block's value by its full name, inside a trace (`patching`'s).
Read = Callable[[Any, int, str], Any]
#: ``clean_run(model, prompt, layers, names)``: ``([blocks, 1, seq, ...] values, [vocab] last logits)`` of a run.
CleanRun = Callable[[Any, str, Sequence[int], dict[int, str]], tuple[torch.Tensor, torch.Tensor]]


def corrupted_gradients(model: Any, prompt: str, layers: Sequence[int], names: dict[int, str],
                        metric: Callable[[torch.Tensor], Any], read: Read) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(values, gradients, metric)`` on a run of `prompt`: value ``names[block]`` of each block,
    ``[blocks, 1, seq, ...]``, the gradient of ``metric(last position's logits)`` with respect to each (the same
    shape), and the metric's value."""
    with _gradients_from_the_embeddings(model), torch.enable_grad():
        with model.trace(prompt):
            reads = [read(model, layer, names[layer]) for layer in layers]
            outcome = metric(model.logits[0, -1])
            if not isinstance(outcome, torch.Tensor) or outcome.numel() != 1:
                raise TypeError(f"method=\"attribution\" needs a metric that returns a one-number tensor computed "
                                f"from the logits (so it has a gradient), not {type(outcome).__name__}: drop any "
                                f".item() or float() from it")
            with outcome.reshape(()).backward():
                # Gradients come back from the metric: the last block's first.
                grads = [reads[index].grad for index in reversed(range(len(reads)))][::-1]
            found = nnsight.save([torch.stack([read.detach() for read in reads]), torch.stack(grads),
                                  outcome.detach().reshape(())])
    values, gradients, value = found
    return values, gradients, float(value)


def attribution_effects(model: Any, clean: str, corrupted: str, metric: Callable[[torch.Tensor], Any],
                        layers: Sequence[int], names: dict[int, str], positions: Sequence[int],
                        heads: bool, read: Read, clean_run: CleanRun) -> tuple[torch.Tensor, float, float]:
    """``(effects, clean metric, corrupted metric)``: attribution patching's estimate of each patch.

    `effects` is ``[blocks, positions]`` for a stream value (the change summed over the value's last axis at
    each position), or ``[blocks, heads]`` for a head value (summed over the head's width and every position in
    `positions`), plus the corrupted run's metric: what activation patching's `effects` holds, estimated. `read`
    and `clean_run` are `streamscope.workflows.patching`'s, which calls this."""
    clean_stacked, clean_logits = clean_run(model, clean, layers, names)
    corrupted_stacked, gradients, corrupted_metric = corrupted_gradients(model, corrupted, layers, names, metric,
                                                                         read)
    change = (clean_stacked.to(gradients.dtype) - corrupted_stacked) * gradients  # [blocks, 1, seq, ...]
    change = change[:, 0, positions]
    if heads:  # [blocks, positions, heads, head_dim] -> [blocks, heads]
        estimate = change.sum(dim=(1, 3))
    else:  # [blocks, positions, width] (a neuron's width is one number per position too)
        estimate = change.reshape(*change.shape[:2], -1).sum(-1)
    with torch.no_grad():
        clean_metric = float(metric(clean_logits.float()))
    return estimate.float() + corrupted_metric, clean_metric, corrupted_metric


def check_method(method: Optional[str]) -> str:
    """`method` if it is one `streamscope.patch` takes, else a ValueError naming them."""
    if method not in ("activation", "attribution"):
        raise ValueError(f"method={method!r}: give \"activation\" (a run per patch) or \"attribution\" (a "
                         f"first-order estimate of every patch from one backward pass; transformers only)")
    return method
