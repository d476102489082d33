"""What a bulk run asks for: the values to harvest, the steers to apply, the positions, checked before anything runs.

A bulk request names values the way a trace does (``"layer_output"``,
``"self_attn.attention_output"``) and blocks by index. Each name is resolved
here, once, on the engine's own envoy tree, to a `Site`: the module whose call
holds the value and the served value's descriptor, so the bulk path reads and
writes exactly what the trace's envoys read and write (the fused halves'
sum on vLLM, Granite's multiplier, a parallel block's relocated stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union, cast

import torch

from ..errors import Unavailable
from ..values import ComputedValue, Host, StreamValue, resolve

#: The residual stream's boundaries on every block.
BOUNDARIES = ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output")
#: What each sublayer adds to the stream, under the sublayer that adds it.
CONTRIBUTIONS = ("self_attn.attention_output", "linear_attn.attention_output", "mlp.mlp_output")
#: Values of the model's root: one per model, not per block.
ROOT_VALUES = ("token_embeddings", "final_norm_output")
#: Short spellings of the contributions: the mixer a block has, its MLP.
SHORT = {"attention_output": ("self_attn", "linear_attn"), "mlp_output": ("mlp",)}

Positions = Union[str, slice, Sequence[int], Sequence[Sequence[int]]]
"""``"last"``, ``"all"``, a slice of the prompt, one list of indices for every prompt, or one list per prompt."""


def value_names() -> tuple[str, ...]:
    """Every name a bulk request accepts."""
    return (*BOUNDARIES, *CONTRIBUTIONS, *SHORT, *ROOT_VALUES)


@dataclass
class Steer:
    """Add (or set) a vector at one value of one block, at chosen positions, on the prompt and every generated token.

    Args:
        value: A block's value (``"layer_output"``, ``"mlp.mlp_output"``, ...)
            or a root value (``"token_embeddings"``), as `model.harvest` names them.
        layer: The block's index (negative counts from the end); None for a root value.
        vector: ``[hidden_size]``, the direction to add (or the value to set).
        scale: The vector is multiplied by it once, before the run.
        positions: Which prompt positions: ``"all"``, ``"last"``, a slice, or
            indices (negative from the prompt's end).
        mode: ``"add"`` (``value[pos] += scale * vector``) or ``"set"``
            (``value[pos] = scale * vector``).
        generated: Whether every generated token is steered too.
        prompts: The indices of the prompts this steer applies to; None for all.
    """

    value: str
    layer: Optional[int]
    vector: torch.Tensor
    scale: float = 1.0
    positions: Positions = "all"
    mode: str = "add"
    generated: bool = True
    prompts: Optional[Sequence[int]] = None

    def delta(self, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """The vector the run adds (or sets): ``scale * vector`` in the engine's dtype, on its device."""
        return (self.vector.detach().to(device=device, dtype=torch.float32) * self.scale).to(dtype)


def host_and_name(model: Any, value: str, layer: Optional[int]) -> tuple[Any, str]:
    """The envoy that serves `value` at block `layer` of `model`, and the value's name on it."""
    if value in ROOT_VALUES:
        if layer is not None:
            raise ValueError(f"{value} is a root value (one per model, not per block): pass layer=None for it.")
        return model, value
    if value not in value_names():
        raise ValueError(
            f"unknown value {value!r} for a bulk request: choose one of {', '.join(value_names())}."
        )
    if layer is None:
        raise ValueError(f"{value} is a block's value: name the block with layer=<index>.")
    block = model.layers[layer]
    if value in BOUNDARIES:
        return block, value
    if value in SHORT:
        hosts = [role for role in SHORT[value] if block.__dict__.get(role) is not None]
        if not hosts:
            raise Unavailable(value, block.where(), f"no {' or '.join(SHORT[value])} module on this block")
        return block.__dict__[hosts[0]], value
    role, name = value.split(".")
    return resolve(block, role), name


def block_index(model: Any, layer: int, what: str) -> int:
    """`layer` as a non-negative block index, or a clear error naming the range."""
    count = len(model.layers)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise TypeError(f"{what}: a block index is an int, not a {type(layer).__name__}.")
    if not -count <= layer < count:
        raise IndexError(f"{what}: block {layer} is out of range: the model has {count} blocks (0-{count - 1}).")
    return layer % count


@dataclass
class Site:
    """A served value on one block (or the root), where its module's call holds it.

    `read`/`edit` use the value's own descriptor on its own envoy, so a bulk
    read is the trace's read: the same arithmetic, bit for bit.
    """

    value: str
    layer: Optional[int]
    host: Host
    descriptor: StreamValue
    module: torch.nn.Module
    where: str
    location: str  # nnsight's name for the call's point: what a tapped vLLM engine's replay serves

    @property
    def key(self) -> tuple[int, str]:
        """Which module call holds it: sites on the same call share one hook."""
        return id(self.module), self.where

    def user(self, raw: Any) -> torch.Tensor:
        """The whole batch's value, in the user's layout, as a private tensor."""
        return self.descriptor._read(self.host, raw)

    def read_rows(self, raw: Any, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened batch, ``[rows, hidden]``: the trace's read, at those rows only."""
        view = self.user(raw)
        picked = view.reshape(-1, view.shape[-1])[rows]
        # A slice is a view of the whole batch's copy: keep only its rows.
        return picked.clone() if isinstance(rows, slice) else picked

    def edit_rows(self, raw: Any, rows: torch.Tensor, delta: torch.Tensor, mode: str) -> None:
        """Add `delta` to (or set it at) rows of the flattened batch, written back as a trace's edit is."""
        view = self.user(raw)
        flat = view.reshape(-1, view.shape[-1])
        if mode == "add":
            flat[rows] += delta
        else:
            flat[rows] = delta
        descriptor = self.descriptor
        if descriptor.factor is None:
            # The other rows go back as they were read (a copy of themselves, or a zero change
            # to a fused block's hidden half), so other requests are untouched, bit for bit.
            descriptor.write(self.host, raw, view)
            return
        # A scaled value ((x * f) / f need not be x): write the edited rows only.
        live = descriptor.live(self.host, raw)
        engine = live.view(-1, live.shape[-1])
        with torch.no_grad():
            engine[rows] = (flat[rows] / descriptor.factor(self.host)).to(live.dtype)


def locate(model: Any, value: str, layer: Optional[int]) -> Site:
    """The `Site` of `value` at block `layer` on `model`'s envoy tree; a clear error where it is not served."""
    if layer is not None:
        layer = block_index(model, layer, value)
    host, name = host_and_name(model, value, layer)
    descriptor = getattr(type(host), name, None)
    if not isinstance(descriptor, StreamValue) or isinstance(descriptor, ComputedValue):
        raise ValueError(f"{host.where()}.{name} is not a value a bulk request can read or write.")
    target = descriptor.located(host)  # raises Unavailable with the family's reason
    where = descriptor.site(host)[1]
    return Site(value, layer, host, descriptor, target._module, where, descriptor._location(host))


def layer_list(model: Any, layers: Any) -> list[int]:
    """`layers` (None for every block, an int, a range, a list) as a list of block indices."""
    if layers is None:
        return list(range(len(model.layers)))
    if isinstance(layers, int):
        layers = [layers]
    return [block_index(model, layer, "layers") for layer in layers]


def prompt_positions(positions: Positions, length: int, prompt: int) -> list[int]:
    """The positions of a `length`-token prompt that `positions` selects, in order; a clear error if out of range."""
    if isinstance(positions, str):
        if positions == "last":
            return [length - 1]
        if positions == "all":
            return list(range(length))
        raise ValueError(f"positions={positions!r}: use 'last', 'all', a slice, or a list of indices.")
    if isinstance(positions, slice):
        return list(range(length))[positions]
    if isinstance(positions, int):
        positions = [positions]
    chosen = []
    for index in positions:
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"positions: an index is an int, not a {type(index).__name__}.")
        if not -length <= index < length:
            raise IndexError(f"positions: index {index} is out of range for prompt {prompt}, "
                             f"which has {length} tokens.")
        chosen.append(index % length)
    return chosen


def per_prompt_positions(positions: Positions, lengths: Sequence[int]) -> list[list[int]]:
    """Each prompt's positions: per-prompt lists (one list per prompt) or one rule for all of them."""
    nested = (isinstance(positions, (list, tuple)) and len(positions) > 0
              and all(isinstance(item, (list, tuple, range)) for item in positions))
    if nested:
        positions = cast(Sequence[Sequence[int]], positions)
        if len(positions) != len(lengths):
            raise ValueError(f"positions has {len(positions)} lists for {len(lengths)} prompts: "
                             f"give one list per prompt, or one rule for every prompt.")
        return [prompt_positions(list(chosen), length, prompt)
                for prompt, (chosen, length) in enumerate(zip(positions, lengths))]
    return [prompt_positions(positions, length, prompt) for prompt, length in enumerate(lengths)]


def check_steer(model: Any, steer: Steer, prompts: int) -> Site:
    """The steer's `Site`, after checking its vector, mode and prompts; errors name the steer and the fix."""
    if not isinstance(steer, Steer):
        raise TypeError(f"steer takes streamscope.Steer objects, not a {type(steer).__name__}.")
    site = locate(model, steer.value, steer.layer)
    width = model.hidden_size
    vector = steer.vector
    if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (width,):
        shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise ValueError(f"Steer({steer.value!r}, layer={steer.layer}) has a vector of shape {shape}: "
                         f"it must be [hidden_size] = ({width},).")
    if steer.mode not in ("add", "set"):
        raise ValueError(f"Steer mode {steer.mode!r}: use 'add' or 'set'.")
    if steer.prompts is not None:
        for index in steer.prompts:
            if not 0 <= index < prompts:
                raise IndexError(f"Steer prompts: {index} is out of range for {prompts} prompts.")
    return site


@dataclass
class HarvestSpec:
    """A harvest: which values, at which blocks, at which positions of each prompt."""

    values: list[str]
    layers: list[int]
    positions: list[list[int]] = field(default_factory=list)

    def sites(self, model: Any) -> list[Site]:
        """Every (value, block) `Site`, root values once."""
        return [locate(model, value, None) if value in ROOT_VALUES else locate(model, value, layer)
                for value in self.values for layer in ([None] if value in ROOT_VALUES else self.layers)]


def harvest_spec(model: Any, values: Any, layers: Any, positions: Positions, lengths: Sequence[int]) -> HarvestSpec:
    """Check a harvest's values, blocks and positions on `model`, before anything runs."""
    if isinstance(values, str):
        values = [values]
    values = list(values)
    if not values:
        raise ValueError("harvest needs at least one value name.")
    spec = HarvestSpec(values, layer_list(model, layers), per_prompt_positions(positions, lengths))
    spec.sites(model)  # every site resolves, or the error says which does not
    return spec


__all__ = ["Steer", "Site", "HarvestSpec", "harvest_spec", "check_steer", "locate", "value_names"]


def generation_harvest(model: Any, harvest: Any, lengths: Sequence[int]) -> Optional[HarvestSpec]:
    """The harvest a generation reads along (``harvest={"values": ..., "layers": ..., "positions": ...}``), or None."""
    if harvest is None:
        return None
    options = dict(harvest)
    spec = harvest_spec(model, options.pop("values"), options.pop("layers", None),
                        options.pop("positions", "last"), lengths)
    if options:
        raise TypeError(f"harvest= takes values, layers and positions; not {', '.join(options)}.")
    return spec


def plain_generation(inputs: tuple, kwargs: dict[str, Any]) -> tuple[list, dict[str, Any]]:
    """`model.generate(...)` called outside a ``with`` block, as the bulk path's (prompts, settings).

    One prompt (a string) is a list of one; transformers' spellings are taken too: ``max_new_tokens`` is
    ``max_tokens``, ``do_sample=False`` greedy (``temperature=0``), ``do_sample=True`` sampling at temperature 1
    unless one is given.
    """
    if len(inputs) != 1:
        raise TypeError(f"model.generate takes the prompts as one argument (a string or a list); got {len(inputs)}")
    prompts = inputs[0]
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    settings = dict(kwargs)
    if "max_new_tokens" in settings:
        if "max_tokens" in settings:
            raise TypeError("give max_tokens or max_new_tokens, not both")
        settings["max_tokens"] = settings.pop("max_new_tokens")
    if "do_sample" in settings:
        sample = settings.pop("do_sample")
        if not sample:
            if settings.get("temperature", 0.0) != 0.0:
                raise ValueError("do_sample=False is greedy: leave temperature out, or sample with do_sample=True")
            settings["temperature"] = 0.0
        else:
            settings.setdefault("temperature", 1.0)
    return prompts, settings
