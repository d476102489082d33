"""Gradients of served values, by name: ``value.grad`` inside nnsight's ``with loss.backward():`` block.

A read hands out a private copy of the model's tensor (`streamscope.values`),
and nothing in the model uses that copy, so autograd never computes a
gradient for it. Each read made while autograd records (a transformers
trace) therefore notes where its gradient is: the model's own tensor it was
copied from, and where the copy sits in it (the user's layout: a view, an
invoke's rows of a batched trace, a scaled residual). Inside a backward
block, ``copy.grad`` hooks that tensor, serves the part of its gradient that
is the copy's (a private tensor in the copy's shape), and an edit of it, by
assignment or in place, flows on upstream in its stead.

A value that nothing in the model holds (recomputed scores and patterns on a
fused kernel, head results, computed logits) has no gradient in the graph:
``.grad`` on it raises with the reason and what to read instead. An engine
that runs under inference mode (vLLM) refuses a trace that asks for any
gradient before it runs (`refuse_gradients`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import nnsight_seam as seam

#: Why an inference engine serves no gradient, and the fix; formatted with the engine's name and what the trace used.
INFERENCE_ONLY = (
    "this trace asks for gradients ({used}), but the {engine} engine runs its model under torch.inference_mode: "
    "it keeps no autograd graph, so no gradient exists to serve. Load the model on transformers for gradients: "
    "`streamscope.load(path, engine=\"transformers\")`, then `with loss.backward(): value.grad`.")
#: What a trace uses that asks for a gradient.
GRADIENT_ATTRIBUTES = frozenset({"grad", "backward"})
#: Why a value computed for the read has no gradient (its full name fills ``{name}``).
COMPUTED = ("{name} is computed for the read and held by nothing in the model, so no gradient flows through it; "
            "read .grad of the value it is computed from instead.")


def _footprint(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """How many elements of its storage a tensor of this geometry reaches, from the storage's start."""
    if any(size == 0 for size in shape):
        return 0
    return offset + sum((size - 1) * step for size, step in zip(shape, stride)) + 1


class GradientSource:
    """Where a served copy's gradient is: the model's tensor it was read from, and the copy's place in it.

    Args:
        name: The value's full name, for messages (``model.layers[3].layer_mid``).
        tensor: The model's tensor the value was read from (as nnsight served it: an invoke's rows of a batched
            trace are traced back to the whole batch's tensor, which is the one in the graph).
        view: The value in the user's layout, before it was copied: a view of `tensor`'s storage.
        factor: What the value is scaled by when served (Granite's residual multiplier), or None.
    """

    __slots__ = ("name", "tensor", "node", "geometry", "shares", "factor")

    def __init__(self, name: str, tensor: torch.Tensor, view: torch.Tensor, factor: Optional[float] = None) -> None:
        self.name = name
        self.tensor = seam.batch_whole(tensor)
        self.node = self.tensor.grad_fn
        self.geometry = (tuple(view.shape), view.stride(), view.storage_offset())
        self.shares = view.untyped_storage().data_ptr() == self.tensor.untyped_storage().data_ptr()
        self.factor = factor

    def target(self) -> torch.Tensor:
        """The tensor in the autograd graph whose gradient holds the copy's; ValueError where there is none."""
        if not self.shares:
            raise ValueError(f"{self.name} is served in a layout that is a copy of the model's tensor, so "
                             f"streamscope cannot place its gradient; read .grad of a value it is computed from.")
        if not self.tensor.requires_grad:
            raise ValueError(
                f"{self.name} carries no gradient: the model computed it without gradient tracking (under "
                f"torch.no_grad() or inference mode, as in model.generate, or with parameters that do not "
                f"require grad), or it is not differentiable (integer ids). Run `model.trace(...)` with "
                f"gradients on and read .grad of a floating-point value.")
        if self.tensor.grad_fn is not self.node:
            raise ValueError(
                f"{self.name}: the model changed the tensor it was read from in place after the read, so its "
                f"gradient now would be that of the changed tensor, not of the value read. Read .grad of the "
                f"next value the model computes from it instead.")
        return self.tensor

    def _laid_out(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` (the target's gradient, any strides) in a fresh buffer laid out as the target's storage."""
        tensor = self.tensor
        whole = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        size = max(_footprint(*whole), _footprint(*self.geometry))
        buffer = grad.new_zeros(size)
        buffer.as_strided(*whole).copy_(grad)
        return buffer

    def served(self, grad: torch.Tensor) -> torch.Tensor:
        """The copy's gradient, a private tensor of the copy's shape, from `grad`, the target's."""
        part = self._laid_out(grad).as_strided(*self.geometry)
        return part / self.factor if self.factor is not None else part.clone()

    def returned(self, grad: torch.Tensor, edited: Any) -> torch.Tensor:
        """The target's gradient `grad` with the copy's part replaced by `edited` (the copy's shape)."""
        shape = self.geometry[0]
        if not isinstance(edited, torch.Tensor) or tuple(edited.shape) != shape:
            got = tuple(edited.shape) if isinstance(edited, torch.Tensor) else type(edited).__name__
            raise ValueError(f"{self.name}.grad takes a tensor of the value's shape {shape}, not {got}: edit a "
                             f"slice in place (`value.grad[:, -1] = 0`) or assign a tensor of that shape.")
        if edited.is_complex() or edited.dtype == torch.bool:
            raise TypeError(f"{self.name}.grad takes real numbers, not a {edited.dtype} tensor.")
        buffer = self._laid_out(grad)
        edited = edited.to(buffer.dtype) if self.factor is None else edited.to(buffer.dtype) * self.factor
        buffer.as_strided(*self.geometry).copy_(edited)
        return buffer.as_strided(tuple(self.tensor.shape), self.tensor.stride(), self.tensor.storage_offset())


class NoGradient:
    """A served copy that has no gradient in the graph: ``.grad`` on it raises ValueError with `reason`."""

    __slots__ = ("name", "reason")

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def target(self) -> torch.Tensor:
        raise ValueError(self.reason)


Source = Union[GradientSource, NoGradient]

#: Each served copy's source, while the copy lives.
_SOURCES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def recording() -> bool:
    """Whether autograd records the running computation, so a read now may later be asked for its gradient."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def note(copy: Any, source: Source) -> None:
    """Remember where `copy` (a served read) has its gradient."""
    if isinstance(copy, torch.Tensor):
        _SOURCES[copy] = source


def inherit(copy: torch.Tensor, original: torch.Tensor) -> None:
    """`copy` (a second copy of a read) has its gradient where `original` has it."""
    source = _SOURCES.get(original)
    if source is not None:
        _SOURCES[copy] = source


def source_of(tensor: Any) -> Optional[Source]:
    """Where a served copy has its gradient; None for any other tensor (nnsight's own ``.grad`` serves it)."""
    return _SOURCES.get(tensor)


def _named(mediator: Any, location: str, source: Source) -> None:
    mediator.__dict__.setdefault("streamscope_gradients", {})[location] = source.name


def asked_gradient(mediator: Any, location: str) -> Optional[str]:
    """The value whose gradient `mediator` asked for at `location` (``"<id>.grad"``), or None."""
    return mediator.__dict__.get("streamscope_gradients", {}).get(location)


def never_came(name: str) -> str:
    """The message for a gradient asked for and never computed by the backward."""
    return (f"{name}.grad never came: the backward pass ended without computing it. Either the loss does not "
            f"depend on {name} (it is computed from earlier values only, or from a copy that was detached), or "
            f"gradients were asked for out of order: they flow from the loss back, so read .grad of later values "
            f"first (the last block before the first).")


def refuse_gradients(model: Any, engine: str) -> None:
    """Raise ValueError, before `model` (an engine that runs under inference mode) runs its trace, where the
    trace's code reads or sets ``.grad`` or calls ``.backward``; the message names the fix."""
    used = seam.codes_use_attributes(seam.trace_mediators(model), GRADIENT_ATTRIBUTES)
    if used:
        raise ValueError(INFERENCE_ONLY.format(used=", ".join(f".{name}" for name in used), engine=engine))


seam.serve_gradients(source_of, _named)
