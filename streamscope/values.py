"""Served values: one tensor of the model's computation, read as a private copy, edited in place.

A value is an nnsight `eproperty` whose location is a module's input or output,
named through the family's aliases (``post_attention_layernorm.input``) and
resolved to the module's real path when the value is read. Every value keeps
the same contract:

* a read returns a private copy in the user's layout, so a saved value never
  changes under a kernel that later writes the model's buffer in place;
* an edit of that copy (in place, or by assignment) is copied back into the
  model's own tensor, in place, so every alias of it (a residual held in a
  local variable of the block's forward) sees it;
* a read that edits nothing writes nothing back, so the logits are
  bit-identical with and without it;
* a write of the wrong shape is refused before it reaches the model, with an
  error that names the value, both shapes and the block; so is a write of a
  bool, complex or meta tensor, and one that brings NaN or inf into finite
  values warns, naming the value;
* a saved read keeps what was read: assigning to the value, or reading it
  again to edit it, works on a copy of its own;
* an edit goes back while the read is the worker's latest; an in-place edit
  of a read made after that raises at the end of the block instead of being
  dropped, and a read the model has already passed names both values.

Engines differ only in layout (vLLM flattens tokens) and in where a boundary
sits in a call; the envoy that hosts a value supplies both through
`Host.to_user` / `Host.to_engine`.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable, Optional, Protocol, Union

import torch

from . import gradients, nonfinite
from . import nnsight_seam as seam
from .errors import Unavailable, missing_module, untapped
from .nnsight_seam import LocatedProperty, Mediator, OutOfOrderError, PendingWriteBack

Residual = torch.Tensor
"""A tensor of the residual stream's width, ``[batch, seq, hidden_size]``."""

#: Where a served value sits in a module's call.
INPUT, OUTPUT = "input", "output"
#: Where a root value is read instead of its default: (module path or None for the root, "input" | "output"),
#: and for an input, optionally the argument that holds it, (index, name).
Relocation = Union[tuple[Optional[str], str], tuple[Optional[str], str, tuple[int, str]]]

#: Whether a write is checked for NaN or inf it brings into finite values (a warning names the value).
#: The check costs two reductions on the device per write, read together at the end of the invoke.
WARN_NON_FINITE = True


class Host(Protocol):
    """What a value needs of the envoy it lives on (`streamscope.blocks.envoy.StreamEnvoy` is the one there is).

    A value is a descriptor on the host's class; every read and write passes
    the host in. The host names itself for messages, says what it cannot
    serve and where a value sits elsewhere than its kind declares, and
    converts between the engine's layout and the user's. Its ``__dict__``
    keeps the value's resolved location, and ``parent`` leads to the
    sibling modules a value may name (``..mlp``).
    """

    path: str
    parent: Any

    def where(self) -> str:
        """The user's name of this envoy in messages: ``model.layers[3].self_attn``."""

    def reason(self, name: str) -> Optional[str]:
        """Why this envoy cannot serve the value `name`, or None where it can."""

    def relocated(self) -> dict:
        """Values served from another ``(module, where[, (index, name)])`` than their kind declares."""

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The model's tensor for `name` in the user's layout, as a view."""

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        """`value` (the user's layout) in the layout of the model's tensor `live`."""


def argument(inputs: tuple, index: int, name: str) -> Any:
    """One argument of a call's ``(args, kwargs)``, however the caller passed it; None when absent."""
    args, kwargs = inputs
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else None


def with_argument(inputs: tuple, index: int, name: str, value: Any) -> tuple:
    """``(args, kwargs)`` with that argument replaced by `value`, where the caller passed it."""
    args, kwargs = inputs
    if name in kwargs or index >= len(args):
        return args, {**kwargs, name: value}
    return (*args[:index], value, *args[index + 1:]), kwargs


def first_tensor(value: Any) -> torch.Tensor:
    """The tensor a module call hands on: its first input, or its output's first element."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        args, kwargs = value  # a call's (args, kwargs)
        if args:
            return args[0]
        return kwargs.get("hidden_states", next(iter(kwargs.values()), None))
    if isinstance(value, (tuple, list)):
        return value[0]
    if hasattr(value, "logits"):
        return value.logits
    raise TypeError(f"no tensor to serve in a {type(value).__name__}")


def resolve(envoy: Host, module: str) -> Any:
    """The envoy `module` names from `envoy`: dotted (aliased) names; a leading ``..`` starts at the parent."""
    target = envoy
    path = module.lstrip(".")
    for _ in range(max(len(module) - len(path) - 1, 0)):
        target = target.parent
    for part in path.split("."):
        child = target.__dict__.get(part)
        if child is None:
            where = envoy.where()
            raise Unavailable(part, where, missing_module(part, "model" if where == "model" else "block"))
        target = child
    return target


def require_tapped(host: Host, name: str, location: str) -> str:
    """`location`, where the running trace's engine serves it; `Unavailable` with the fix on a tapped vLLM
    engine (one that replays CUDA graphs, `streamscope.vllm.taps`) that was not started with it."""
    taps = seam.running_taps()
    if taps and location not in taps:
        raise Unavailable(name, host.where(), untapped(f"{host.where()}.{name}", location, len(taps)))
    return location


class StreamValue(LocatedProperty):
    """A tensor at one module's input or output, served as a private copy and written back in place.

    Args:
        module: The module whose call holds the value, named from the host
            envoy (``"post_attention_layernorm"``, ``"..mlp"`` for a sibling);
            ``None`` for the host's own module.
        where: ``"input"`` (the call's first tensor argument) or ``"output"``
            (its first returned tensor).
        shape: The value's shape as documented, for error messages.
        factor: A multiplier the model applies to the tensor before it adds it
            to the stream (Granite's residual multiplier); the value is served
            scaled, and an edit is divided by it on the way back.
        argument: Where the value sits in an input call, as ``(index, name)``,
            or the name of a host attribute holding that pair (a block's
            ``STREAM``); by default the call's first argument.
        description: One sentence of meaning, shown in the envoy's repr.
    """

    def __init__(
        self,
        module: Optional[str],
        where: str,
        *,
        shape: str = "[batch, seq, hidden_size]",
        factor: Optional[Callable[[Host], float]] = None,
        argument: tuple[int, str] | str | None = None,
        description: Optional[str] = None,
    ) -> None:
        super().__init__(key=f"{module}.{where}" if module else where, description=description)
        self.description: Optional[str] = description  # as nnsight's eproperty keeps it, with its type
        self.module = module
        self.where = where
        self.shape = shape
        self.factor = factor
        self.argument = argument
        seam.set_callbacks(self, self._read_served, self._write_back, self._assign)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __call__(self, function: Callable) -> "StreamValue":
        """Decorating a stub adopts its docstring (the stub's body is never run)."""
        self.__doc__ = function.__doc__
        if self.description is None and function.__doc__:
            self.description = function.__doc__.strip().splitlines()[0]
        return self

    def site(self, host: Host) -> tuple[Optional[str], str, Any]:
        """(module, where, argument) of this value on `host`: the declared ones unless the host relocates it.

        A relocation is ``(module, where)`` or ``(module, "input", (index, name))``
        for a value that sits in another argument of the call (the stream
        argument of a block's call).
        """
        relocated = host.relocated().get(self.name)
        if relocated is None:
            return self.module, self.where, self.argument
        return relocated[0], relocated[1], relocated[2] if len(relocated) > 2 else None

    def located(self, host: Host) -> Any:
        """The envoy whose call holds this value on `host`, or raise Unavailable."""
        reason = host.reason(self.name)
        if reason is not None:
            raise Unavailable(self.name, host.where(), reason)
        module = self.site(host)[0]
        return resolve(host, module) if module else host

    def location(self, host: Host) -> str:
        """The nnsight location that holds this value on `host` (a module call's input or output, or a call
        inside its forward); `Unavailable` where the host cannot serve it."""
        # Resolved once per envoy: aliases, relocations and reasons do not change while it lives.
        cache = host.__dict__.get("_streamscope_locations")
        if cache is None:
            cache = host.__dict__["_streamscope_locations"] = {}
        location = cache.get(self.name)
        if location is None:
            location = cache[self.name] = seam.location(self.located(host).path, self.site(host)[1])
        return require_tapped(host, self.name, location)

    def named(self, host: Host) -> str:
        """This value's name on `host` in messages: ``model.layers[3].layer_output``."""
        # Kept per envoy beside its locations: a read at every step of every invoke names its value for the
        # mediator's notes, and a block's name is rebuilt from its path each time it is asked.
        names = host.__dict__.get("_streamscope_names")
        if names is None:
            names = host.__dict__["_streamscope_names"] = {}
        name = names.get(self.name)
        if name is None:
            name = names[self.name] = f"{host.where()}.{self.name}"
        return name

    def __get__(self, host: Optional[Host], owner: Any = None) -> Any:
        if host is None:
            return self
        # The location is resolved before anything waits on the model, so an
        # unavailable value raises Unavailable at once.
        location = self.location(host)
        name = self.named(host)
        mediator = in_trace(name, "read")
        held = seam.held_view(mediator, self, location)
        if held is not None and seam.is_saved(held):
            # A saved read keeps what was read: a second read of the value (to
            # edit it in place) gets a copy of its own, which is what goes back.
            copy = _copy(held, edited=is_edited(held))
            gradients.inherit(copy, held)
            self.rebind(host, mediator, copy)
            _retire(mediator, held, name)
        mediator.streamscope_wanted = (location, name)
        # nnsight's eproperty read, given the location and mediator found above rather than asking again.
        value = seam.read_located(self, host, location, mediator)
        mediator.streamscope_read = name
        return value

    def live(self, host: Host, raw: Any) -> torch.Tensor:
        """The model's own tensor for this value, in what the location served."""
        _, where, position = self.site(host)
        if where == INPUT and position is not None:
            position = getattr(host, position) if isinstance(position, str) else position
            return argument(raw, *position)
        return first_tensor(raw)

    # The three callbacks of the eproperty, in the order a read and an edit use them.

    def _read_served(self, host: Host, raw: Any) -> torch.Tensor:
        value = self._read(host, raw)
        if gradients.recording():  # a trace that records autograd: the read's .grad may be asked for
            gradients.note(value, self.gradient(host, raw))
        return value

    def gradient(self, host: Host, raw: Any) -> gradients.Source:
        """Where the gradient of this value's read from the call `raw` is: the model's tensor it was copied from
        (`gradients.GradientSource`), or why it has none (`gradients.NoGradient`)."""
        live = self.live(host, raw)
        factor = self.factor(host) if self.factor is not None else None
        return gradients.GradientSource(self.named(host), live, host.to_user(live, self.name), factor)

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        view = host.to_user(self.live(host, raw), self.name)
        if view.is_inference():
            # vLLM runs in inference mode: copy outside it, so the copy keeps a version counter.
            with torch.inference_mode(False):
                return self._private(host, view)
        return self._private(host, view)

    def _private(self, host: Host, view: torch.Tensor) -> torch.Tensor:
        if self.factor is not None:
            return view * self.factor(host)  # a new tensor: already private
        return view.clone()

    def _write_back(self, host: Host, view: torch.Tensor, raw: Any) -> Any:
        # A fresh copy starts at version 0 and every in-place op bumps it: an
        # unedited read writes nothing, so it cannot change the model's result.
        if is_edited(view):
            self.write(host, raw, self.checked(host, raw, view))
        return raw

    def __set__(self, host: Host, value: Any) -> None:
        self.location(host)
        mediator = in_trace(f"{host.where()}.{self.name}", "written")
        held = self.held(host)
        if held is None:
            mediator.streamscope_wanted = (self.location(host), f"{host.where()}.{self.name}")
            return super().__set__(host, value)
        # Read earlier in this block and not yet written back: the assignment
        # takes the place of that read's copy and goes back the way an in-place
        # edit does. The read itself keeps what it read (it may be saved).
        # (Asking the model for the value again would write the copy back first,
        # and an engine that splices it into a new tensor, as nnsight's vLLM
        # batcher does, would leave the block's own aliases of the old one.)
        if value is held:  # `value += x` edited the read in place and assigns it back
            return
        # Shape and type now, at the user's line; the NaN scan once, when the copy goes back to the model.
        self.validate(host, tuple(held.shape), value, held, warn=False)
        _retire(mediator, held, f"{host.where()}.{self.name}")
        self.rebind(host, mediator, _copy(value.to(held.dtype), edited=True))

    def rebind(self, host: Host, mediator: Mediator, view: torch.Tensor) -> None:
        """Make `view` the copy this value's pending write-back sends to the model (and later reads answer with)."""
        seam.redirect_write_back(mediator, self, host, view)

    def held(self, host: Host) -> Optional[torch.Tensor]:
        """This value's copy that a read on `host` handed out and nnsight has not written back yet."""
        location = self.location(host)
        return seam.held_view(seam.mediator_at(location), self, location)

    def _assign(self, host: Host, value: Any) -> Any:
        raw = seam.read_at(self.location(host))
        self.write(host, raw, self.checked(host, raw, value))
        return raw

    def expected_shape(self, host: Host, raw: Any) -> tuple[int, ...]:
        return tuple(host.to_user(self.live(host, raw), self.name).shape)

    def checked(self, host: Host, raw: Any, value: Any) -> torch.Tensor:
        """`value` if it can be written here, else a clear refusal naming the value, both shapes and the block."""
        live = host.to_user(self.live(host, raw), self.name)
        self.validate(host, tuple(live.shape), value, live)
        return value

    def validate(self, host: Host, expected: tuple[int, ...], value: Any, current: Optional[torch.Tensor],
                 warn: bool = True) -> None:
        """Refuse what cannot be written here; warn (where `warn`) where `value` brings NaN or inf into finite numbers."""
        check_write(self.named(host), self.shape, expected, value, current, warn=warn)

    def refuse(self, host: Host, expected: tuple[int, ...], value: Any) -> None:
        refuse_write(f"{host.where()}.{self.name}", self.shape, expected, value)

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        """Copy `value` (the user's layout) into the model's tensor, in place."""
        if torch.is_grad_enabled():  # vLLM runs in inference mode, where grad is off already
            with torch.no_grad():
                return self.write(host, raw, value)
        live = self.live(host, raw)
        if self.factor is not None:
            value = value / self.factor(host)
        live.copy_(host.to_engine(in_dtype(value, live.dtype), live, self.name))


def refuse_write(name: str, shape: str, expected: tuple[int, ...], value: Any) -> None:
    """Raise the refusal of `value` as a write of the value `name`, ``expected`` ``shape`` on this run."""
    short = name.rsplit(".", 1)[-1]
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} takes a tensor of shape {expected} {shape}, "
            f"not a {type(value).__name__}; to set every entry, edit in place: "
            f"`...{short}[:] = value`."
        )
    raise ValueError(
        f"{name} cannot take a tensor of shape {tuple(value.shape)}: "
        f"it is {expected} {shape} on this run. Write a tensor of that shape, or edit "
        f"a slice in place (`...{short}[:, -1] = vector`)."
    )


def check_write(name: str, shape: str, expected: tuple[int, ...], value: Any,
                current: Optional[torch.Tensor] = None, warn: bool = True) -> None:
    """Refuse `value` as a write of `name` unless it is a real tensor of numbers of the `expected` shape.

    A bool or complex tensor is not a value of the stream, and a meta tensor
    has no numbers at all. Where `value` holds NaN or inf and `current` (the
    model's own value) held none, it is written, with a warning naming the
    value, at the end of the invoke: every later position that attends to it
    is poisoned.
    """
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
        refuse_write(name, shape, expected, value)
    if value.dtype == torch.bool or value.is_complex():
        raise TypeError(
            f"{name} takes real numbers, not a {value.dtype} tensor; write `mask.float()` for 0/1 values, "
            f"or keep the model's values where a mask is false: `torch.where(mask, new, {name})`."
        )
    if value.is_meta:
        raise ValueError(
            f"{name} cannot take a meta tensor: it has a shape but no numbers (it was made on the "
            f"'meta' device, as under `init_empty_weights` or `device='meta'`). Make it on the model's "
            f"device instead, e.g. `torch.zeros(..., device={name}.device)`."
        )
    if warn and WARN_NON_FINITE and value.is_floating_point():
        # Left on the device and read with the others of the invoke (`streamscope.nonfinite`): no wait per write.
        nonfinite.scan_write(name, value, current)


class ReadOnly:
    """Mixed in before a `StreamValue` kind whose reads nothing in the model holds: every write is refused.

    An assignment and an in-place edit of a read both end in `write`, which
    raises ValueError with `refusal`: why the value cannot be written and
    what to edit instead. A write is not shape-checked first (`checked`
    passes it on), so the refusal is the reason that matters.
    """

    name: str  # the value's attribute name, set on the `StreamValue` it is mixed into

    #: Why a write is refused, and what to edit instead; formatted with the value's full name (``name``).
    READ_ONLY: str = ("{name} is computed for the read and held by nothing in the model, so it cannot be written; "
                      "edit the value it is computed from instead.")

    def refusal(self, host: Host) -> str:
        """The message refusing a write of this value on `host`."""
        return self.READ_ONLY.format(name=f"{host.where()}.{self.name}")

    def write(self, host: Host, raw: Any, value: torch.Tensor) -> None:
        raise ValueError(self.refusal(host))

    def checked(self, host: Host, raw: Any, value: Any) -> torch.Tensor:
        return value


class ComputedValue(ReadOnly, StreamValue):
    """A read-only value computed for the read from the tensor at one location (recomputed scores, all-position logits).

    Decorate a function ``(host, tensor) -> value``; the tensor is the
    location's in the user's layout. Nothing of the model holds the result,
    so it cannot be written: an assignment or an in-place edit is refused
    with the reason (`ReadOnly.READ_ONLY`, or the ``read_only=`` given).
    """

    #: Why the read has no gradient (nothing in the model holds it); formatted with the value's full name.
    NO_GRADIENT: str = gradients.COMPUTED

    def __init__(self, *args: Any, read_only: Optional[str] = None, no_gradient: Optional[str] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if read_only is not None:
            self.READ_ONLY = read_only
        if no_gradient is not None:
            self.NO_GRADIENT = no_gradient

    def gradient(self, host: Host, raw: Any) -> gradients.Source:
        name = self.named(host)
        return gradients.NoGradient(name, self.NO_GRADIENT.format(name=name))

    def __call__(self, function: Callable) -> "ComputedValue":
        self.compute = function
        return super().__call__(function)

    def _read(self, host: Host, raw: Any) -> torch.Tensor:
        tensor = host.to_user(self.live(host, raw), self.name)
        with torch.inference_mode(False):
            return self.compute(host, tensor)


def in_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`value` in `dtype`: itself where it is already (no dispatch to torch), else a converted copy."""
    return value if value.dtype == dtype else value.to(dtype)


def in_trace(name: str, done: str) -> Mediator:
    """The running trace's mediator, or a clear error: `name` can only be `done` (read, written) inside a trace."""
    mediator = seam.running_mediator()
    if mediator is None:
        raise ValueError(
            f"{name} can only be {done} inside a trace, while the model runs: "
            f"`with model.trace(prompt): value = {name}.save()`, then use `value` after the block."
        )
    return mediator


def _copy(tensor: torch.Tensor, *, edited: bool) -> torch.Tensor:
    """A private copy of `tensor`; one that counts as edited (its version is not 0) where `edited`."""
    with torch.inference_mode(False):
        if not edited:
            return tensor.clone()
        copy = torch.empty_like(tensor)
        copy.copy_(tensor)
        return copy


def _retire(mediator: Mediator, view: torch.Tensor, name: str) -> None:
    """Remember a read whose write-back is gone, so an in-place edit of it later is not dropped without a word."""
    retired = mediator.__dict__.setdefault("streamscope_retired", [])
    try:
        version = view._version
    except RuntimeError:  # an inference tensor keeps no version, and cannot be edited outside inference mode
        return
    wanted = mediator.__dict__.get("streamscope_wanted")  # what the mediator moves on to, where a value asks
    retired.append((weakref.ref(view), version, name, wanted[1] if wanted else None))


def _check_retired(mediator: Mediator) -> None:
    """Raise where a read was edited in place after its write-back had gone to the model."""
    retired = mediator.__dict__.get("streamscope_retired")
    if not retired:
        return
    alive = []
    for reference, version, name, then in retired:
        view = reference()
        if view is None:
            continue
        if view._version != version:
            mediator.streamscope_retired = []
            raise OutOfOrderError(
                f"{name} was edited in place after the trace had gone on"
                f"{f' to read {then}' if then and then != name else ''}: an edit of a read goes back to the "
                f"model only until the trace reads the next value, so this one would be dropped. Make the "
                f"edit before reading anything later, or edit a copy (`{name.rsplit('.', 1)[-1]}.clone()`) "
                f"to keep it to yourself."
            )
        alive.append((reference, version, name, then))
    mediator.streamscope_retired = alive


def _skip_unedited_write_backs() -> None:
    """Let nnsight drop a streamscope value's pending write-back when the view was not edited.

    nnsight swaps a pending write-back into the model whenever the mediator moves
    on, edited or not: one more round trip between the mediator and the model per
    read. A streamscope value's write-back is the identity on an unedited view
    (its version counter says so), so the swap is skipped and an unedited read
    costs what raw nnsight's read of the same tensor plus a copy costs.

    Either way the read is retired: an in-place edit of it from then on could
    not reach the model, so when the block ends such an edit raises instead of
    vanishing (checked once, at the end, so a block of many reads stays linear).
    """
    def retire(mediator: Mediator, pending: PendingWriteBack) -> None:
        _retire(mediator, pending.view, pending.value.named(pending.host))

    seam.filter_write_backs(StreamValue, lambda pending: is_edited(pending.view), retire)


def is_edited(view: torch.Tensor) -> bool:
    """Whether a served copy was edited since it was handed out: its version counter moved (an in-place op)."""
    try:
        return view._version != 0
    except RuntimeError:  # an inference tensor keeps no version: assume edited
        return True


def _explain_out_of_order() -> None:
    """Name streamscope's values in nnsight's out-of-order error: which value was read after which.

    nnsight reports the module location a mediator was still waiting for when the
    run ended (``'model.model.layers.0.output.i0' was requested but the model
    already ran past it``). Each streamscope read records the value it asks for
    and the last one it was served, so the error can say it in the user's names.
    """
    def message(mediator: Mediator, location: str) -> Optional[str]:
        gradient = gradients.asked_gradient(mediator, location)
        if gradient is not None:
            return gradients.never_came(gradient)
        wanted = mediator.__dict__.get("streamscope_wanted")
        if wanted is None or location != wanted[0]:
            return None
        return out_of_order(wanted[1], mediator.__dict__.get("streamscope_read"))

    seam.rename_out_of_order(message)


def out_of_order(wanted: str, last: Optional[str]) -> str:
    """The message for `wanted`, asked for after the model had run past it; `last` is the value read before it."""
    order = ("Read values in the order the model computes them: model.support() lists each block's values "
             "in that order, and the blocks run in index order.")
    if wanted.endswith(".skip"):
        after = f" after the trace read {last}" if last else ""
        return (f"{wanted}() came{after}, once the block had already run: skip a block before reading any "
                f"of its values or a later one. {order}")
    if last is None:
        return (f"{wanted} was asked for after the model had already computed it (or this run never computes "
                f"it). {order}")
    return (f"{wanted} was read after {last}, but the model computes it first, so the run had already gone "
            f"past it. {order}")


def _explain_edit_errors() -> None:
    """Name the value in torch's broadcasting error when an in-place edit of a read has the wrong width;
    at the end of a block, raise for a read edited in place after its write-back had gone (`_check_retired`).
    When an invoke's code ends, warn for its writes that brought NaN or inf (`streamscope.nonfinite`).

    ``model.layers[1].layer_mid += vector`` fails inside torch ("The size of
    tensor a (64) must match the size of tensor b (32)"); the read being edited
    is the mediator's pending write-back, so the message can say which value it
    was, its shape, and how to edit it.
    """
    def explain(mediator: Mediator, error: RuntimeError) -> None:
        waiting = seam.pending_write_back(mediator)
        message = str(error)
        sizes = re.search(r"size of tensor a \((\d+)\)|expanded size of the tensor \((\d+)\)", message)
        if (waiting is not None and isinstance(waiting.value, StreamValue) and sizes is not None
                and len(error.args) == 1 and int(sizes.group(1) or sizes.group(2)) in waiting.view.shape):
            value = waiting.value
            name = f"{waiting.host.where()}.{value.name}"
            error.args = (
                f"{name} is {tuple(waiting.view.shape)} {value.shape} on this run, and the tensor used "
                f"to edit it in place does not fit: {message.strip()}. Use a tensor that broadcasts to "
                f"the part edited: a vector of the last dimension's width at one position is "
                f"`...{value.name}[:, -1] += vector`.",
            )

    def ended(raised: bool) -> None:
        nonfinite.warn_pending(raising=not raised)

    seam.around_mediator_run(_check_retired, explain, ended)


_skip_unedited_write_backs()
_explain_out_of_order()
_explain_edit_errors()
