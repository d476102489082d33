"""The envoy every streamscope value lives on: where it is, what it cannot serve, and its layout."""

from __future__ import annotations

import difflib
import weakref
from typing import Any, Callable, ClassVar, Optional

import torch
from nnsight import Envoy

from .. import nnsight_seam as seam
from ..values import Relocation, StreamValue


class StreamEnvoy(seam.RebindingEnvoy):
    """An envoy that hosts `StreamValue`s.

    A family's subclass states what it cannot serve in `UNSERVED` (value name to
    reason), or overrides `reason` where the answer depends on the module's
    config. An engine's subclass states its layout in `to_user`/`to_engine`.
    """

    #: Values this kind never serves, with the reason.
    UNSERVED: ClassVar[dict[str, str]] = {}
    #: Whether this kind is a decoder block (`blocks.layer.Layer`): a sublayer names itself from its block.
    IS_BLOCK: ClassVar[bool] = False

    def reason(self, name: str) -> Optional[str]:
        """Why this envoy cannot serve `name`, or None where it can."""
        return self.UNSERVED.get(name)

    def relocated(self) -> dict[str, Relocation]:
        """Values this envoy serves from another (module, where) than their kind declares."""
        return {}

    def where(self) -> str:
        """The user's name of this envoy in messages: ``model.layers[3].self_attn``."""
        return self.path

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "_module" not in self.__dict__:
                raise
            raise NoSuchName(self, name, self._served_values) from None

    def _served_values(self) -> list[str]:
        """The values this envoy serves, for a message: what the kind declares while the tree is still being built."""
        try:
            return [value for value, reason in self.value_reasons().items() if reason is None]
        except Exception:  # noqa: BLE001
            return self.value_names()

    def to_user(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The model's tensor for `name` in the user's layout, as a view.

        A tensor without a batch dimension, ``[tokens, width]``, is one of two
        things. On transformers, a block that flattens its tokens for a
        sublayer (OPT's MLP, Llama 4's mixture of experts) records its stream's
        shape, and the value is served in it, ``[batch, seq, width]``: in an
        invoke of a batched trace, that invoke's rows only, as nnsight serves
        a batch-leading value (it cannot narrow the flattened tensor itself,
        whose leading dimension is ``batch * seq``). On vLLM, it is one
        request's tokens, served as ``[1, tokens, width]``.
        """
        if tensor.dim() == 2:
            stream = as_stream(self, tensor)
            if stream is not None:
                return seam.invoke_rows(stream)
            return tensor.unsqueeze(0)
        return tensor

    def to_engine(self, value: torch.Tensor, live: torch.Tensor, name: str) -> torch.Tensor:
        """A value in the user's layout, in the layout of the model's tensor `live`.

        A flattened tensor `live` holds every invoke's rows of a batched trace,
        and `value` only this invoke's: the result is `live` with those rows
        replaced (a new tensor, to be copied into `live`).
        """
        stream = as_stream(self, live) if live.dim() == 2 else None
        if stream is not None:
            value = seam.with_invoke_rows(stream, value)
        return value.reshape(live.shape)

    @classmethod
    def value_names(cls) -> list[str]:
        """The names of the values this kind declares, in the order the model computes them."""
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            for name, attribute in vars(klass).items():
                if isinstance(attribute, StreamValue) and name not in names:
                    names.append(name)
        return sorted(names, key=lambda name: cls.ORDER.index(name) if name in cls.ORDER else len(cls.ORDER))

    #: The order of computation, for support tables.
    ORDER: ClassVar[tuple[str, ...]] = ()

    def value_reasons(self) -> dict[str, Optional[str]]:
        """Every value of this envoy: None where it is served, else the reason it is not."""
        table: dict[str, Optional[str]] = {}
        for name in self.value_names():
            descriptor = getattr(type(self), name)
            try:
                descriptor.located(self)
                table[name] = None
            except Exception as error:  # Unavailable, with its reason
                table[name] = getattr(error, "reason", str(error))
        return table


class Blocks(Envoy):
    """`model.layers`: the decoder blocks, indexed from 0 (or from -num_layers), sliced, iterated."""

    def where(self) -> str:
        return "model.layers"

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            count = len(self)
            if not -count <= key < count:
                raise IndexError(
                    f"model.layers[{key}] is out of range: this model has {count} blocks, model.layers[0] to "
                    f"model.layers[{count - 1}] (or model.layers[-{count}] to model.layers[-1])."
                )
        return super().__getitem__(key)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            raise NoSuchName(self, name, list) from None


class NoSuchName(AttributeError):
    """A name an envoy neither serves nor has as a module. Its message, with the nearest names, is written when it is
    read: a probe (``hasattr``, ``getattr(envoy, name, None)``, nnsight's binding of a family's renames, which tries
    each alias on every envoy it builds) catches it unread, and the difflib search would cost it about a millisecond
    each time. Made from a message alone, it is that message (an error that crossed from an engine's worker)."""

    def __init__(self, envoy: Envoy | str, name: str = "", served: Optional[Callable[[], list[str]]] = None) -> None:
        message = envoy if isinstance(envoy, str) else None
        super().__init__(message or name)
        self._message, self._envoy, self._served = message, envoy, served
        if message is None:
            self.name = name

    def __str__(self) -> str:
        if self._message is None:
            self._message = no_such_name(self._envoy, self.name, self._served())  # type: ignore[arg-type,misc]
        return self._message

    def __reduce__(self) -> tuple:
        return NoSuchName, (str(self),)  # across processes with its message written, not its envoy


def no_such_name(envoy: Envoy, name: str, values: list[str]) -> str:
    """The message for a name `envoy` neither serves nor has as a module: the nearest names it does have."""
    where = envoy.where() if hasattr(type(envoy), "where") else envoy.path
    modules = [key for key, child in envoy.__dict__.items() if isinstance(child, Envoy) and not key.startswith("_")]
    public = [key for key in dir(type(envoy)) if not key.startswith("_")]
    near = difflib.get_close_matches(name, list(dict.fromkeys([*values, *modules, *public])), n=3, cutoff=0.6)
    guess = f" Did you mean {' or '.join(near)}?" if near else ""
    served = f" It serves {', '.join(values)}" if values else ""
    listed = f"{served}{';' if served else ' Its modules:'} {', '.join(modules)}." if modules else (
        f"{served}." if served else "")
    hint = " See model.support() for every value of every block." if values else ""
    return f"{where} has no value or module {name!r}.{guess}{listed}{hint}"


#: The attribute a block module keeps its stream's leading shape on, set as the block is called.
STREAM_SHAPE = "_streamscope_stream_shape"


def record_stream_shape(module: torch.nn.Module) -> None:
    """Keep the leading shape (batch, seq) of what `module` is called with, for values it flattens."""
    global _RECORDERS_INSTALLED
    _RECORDERS_INSTALLED += 1  # also for a module hooked before: it may be newly bound under another envoy
    if getattr(module, "_streamscope_shape_hook", None) is not None:
        return

    def record(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor):
            object.__setattr__(module, STREAM_SHAPE, hidden.shape[:-1])

    module._streamscope_shape_hook = module.register_forward_pre_hook(record, with_kwargs=True)


#: How many times `record_stream_shape` has been called in this process: a change tells `stream_shape` that the
#: envoys it noted as recording (per envoy, as the count stood) may be out of date.
_RECORDERS_INSTALLED = 0
#: Per envoy: (the count above when noted, the envoys of its chain whose module records a shape). Kept off the
#: envoy, whose attributes travel with a pickled trace, so a note never outlives the process that took it.
_RECORDING_CHAINS: "weakref.WeakKeyDictionary[Envoy, tuple[int, tuple]]" = weakref.WeakKeyDictionary()


def _recording_chain(envoy: Envoy) -> tuple:
    """The envoys from `envoy` up to the root whose module records its stream's shape, noted per envoy.

    Only a module that `record_stream_shape` hooked ever holds the shape, and every hook bumps the count, so
    the note stands until the next hook anywhere (a block bound to a new module, another model loaded).
    Without it a read on an engine whose blocks record nothing (vLLM: every value is a request's tokens)
    walks the envoy's whole chain of parents at every read of every invoke at every step.
    """
    noted = _RECORDING_CHAINS.get(envoy)
    if noted is not None and noted[0] == _RECORDERS_INSTALLED:
        # An empty chain (every block on vLLM) is the common answer: returned as noted, with nothing to call.
        return tuple(node() for node in noted[1]) if noted[1] else ()
    chain = []
    node: Optional[Envoy] = envoy
    while node is not None:
        if getattr(seam.module_of(node), "_streamscope_shape_hook", None) is not None:
            chain.append(node)
        node = node.parent
    # Weak: the chain holds the envoy itself or its ancestors, which hold it; strong, the note would keep
    # the key alive and the model with it.
    _RECORDING_CHAINS[envoy] = (_RECORDERS_INSTALLED, tuple(weakref.ref(node) for node in chain))
    return tuple(chain)


def stream_shape(envoy: Envoy) -> Optional[torch.Size]:
    """The leading shape of the stream of the block `envoy` is in, where the block records it."""
    for node in _recording_chain(envoy):
        if node is None:  # an ancestor gone while `envoy` lives: nothing to read on it
            continue
        shape = seam.module_of(node).__dict__.get(STREAM_SHAPE)
        if shape is not None:
            return shape
    return None


def as_stream(envoy: Envoy, tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """`tensor`, a block's tokens flattened to ``[batch * seq, width]``, viewed ``[batch, seq, width]`` in the
    shape the block recorded; None where `tensor` is not the block's flattened tokens (or no block records it)."""
    shape = stream_shape(envoy)
    if shape is None:
        return None
    if shape.numel() == tensor.shape[0]:
        return tensor.view(*shape, tensor.shape[-1])
    if len(shape) == 2 and shape[1] == 1 and tensor.shape[0] < shape[0]:
        # One position a prompt (a step of generation): the flattened tokens lead with the batch, so nnsight has
        # narrowed them to the invoke's prompts already.
        return tensor.unsqueeze(1)
    return None


def module_config(envoy: Envoy) -> Any:
    """The config the module of `envoy` (or its nearest ancestor) was built from."""
    node: Optional[Envoy] = envoy
    while node is not None:
        config = getattr(seam.module_of(node), "config", None)
        if config is not None:
            return config
        node = node.parent
    return None
