"""TransformerLens 4.3's keys and slices, by duck typing (no TransformerLens import): ``get_act_name``'s
shorthand (`act_name`), what its ``Slice`` takes (`as_index`, `apply_slice`), and ``cache_dict`` (`CacheDict`).

Re-exported by `streamscope.workflows.tl` and `streamscope.tl`, the import paths to use.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Union

import torch


#: What a ``pos_slice``, ``batch_slice`` or ``neuron_slice`` argument takes (`as_index`); ``Any`` admits
#: TransformerLens's own ``Slice``, read by duck typing.
SliceInput = Union[None, int, tuple, slice, list, torch.Tensor, Any]

#: TransformerLens's shorthand (`get_act_name`) aliases.
_ACT_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
                "mlp_pre": "pre", "mlp_mid": "mid", "mlp_post": "post"}
_LAYER_TYPE_ALIASES = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_ATTN_NAMES = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores", "attn_in")
_MLP_NAMES = ("pre", "post", "mid", "pre_linear")


def act_name(name: str, layer: Optional[int] = None, layer_type: Optional[str] = None) -> str:
    """The full TransformerLens hook name of a shorthand, as TransformerLens 4.3's ``utilities.get_act_name``.

    ``act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``; ``act_name("scale", 2, "ln1")``
    is ``"blocks.2.ln1.hook_scale"``; ``act_name("scale")`` is ``"ln_final.hook_scale"``.
    """
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    match = re.match(r"([a-z_]+?)(\d+)([a-z]?.*)$", name)
    if match is not None and layer is None:
        name, layer, layer_type = match.group(1), int(match.group(2)), match.group(3) or None
    name = _ACT_ALIASES.get(name, name)
    full = "" if layer is None else f"blocks.{layer}."
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPE_ALIASES:
        layer_type = _LAYER_TYPE_ALIASES[layer_type]
    if layer_type:
        full += f"{layer_type}."
    full += f"hook_{name}"
    if name in ("scale", "normalized") and layer is None:
        full = f"ln_final.{full}"
    return full


def as_index(index: Any, argument: str = "pos_slice") -> Any:
    """`index` as TransformerLens 4.3's ``Slice(index)`` reads it, in a form torch indexes with: None (every
    entry), an int (one entry, the axis dropped), a `slice`, or a long or bool tensor of entries.

    Takes what TransformerLens's ``Slice`` takes: None, an int (a numpy integer or a 0-d integer tensor counts as
    one), a ``(stop,)``, ``(start, stop)`` or ``(start, stop, step)`` tuple, a `slice`, a list, tensor or numpy
    array of indices (booleans: a mask), and a TransformerLens ``Slice`` itself, read by its ``mode`` and
    ``slice`` attributes (duck typing: streamscope does not import TransformerLens). Anything else is refused
    with a `ValueError` naming `argument`.
    """
    if _is_tl_slice(index):
        mode, chosen = index.mode, index.slice
        if mode == "identity":
            return None
        if mode == "int":
            return int(chosen)
        if mode == "slice":
            return chosen
        if mode == "array":
            return _index_tensor(chosen, argument)
        raise ValueError(f"{argument}: a TransformerLens Slice of mode {mode!r}, which streamscope does not know "
                         f"(it reads 'identity', 'int', 'slice' and 'array'): pass the indices themselves")
    if index is None or isinstance(index, slice):
        return index
    scalar = _integer(index)
    if scalar is not None:
        return scalar
    if isinstance(index, tuple):
        if not 1 <= len(index) <= 3 or not all(item is None or _integer(item) is not None for item in index):
            raise ValueError(f"{argument}={index!r}: a tuple is (stop,), (start, stop) or (start, stop, step) of "
                             f"ints, as TransformerLens's Slice reads it")
        return slice(*(None if item is None else _integer(item) for item in index))
    if isinstance(index, (list, torch.Tensor)) or type(index).__module__ == "numpy":
        return _index_tensor(index, argument)
    raise ValueError(f"{argument}={index!r:.80}: give None, an int, a (start, stop[, step]) tuple, a slice, a list "
                     f"or tensor of indices, or a TransformerLens Slice")


def keep_axis(index: Any) -> Any:
    """TransformerLens 4.3's ``Slice.unwrap``: a plain int (a numpy integer, a 0-d tensor) becomes ``[int]``, so
    the axis stays with one entry; a TransformerLens ``Slice(int)`` is left as it is, and drops the axis. What
    ``run_with_cache(pos_slice=...)`` and ``stack_neuron_results(neuron_slice=...)`` do with an int."""
    if not _is_tl_slice(index) and _integer(index) is not None:
        return [_integer(index)]
    return index


def _is_tl_slice(index: Any) -> bool:
    return hasattr(index, "mode") and hasattr(index, "slice") and not isinstance(index, torch.Tensor)


def _integer(value: Any) -> Optional[int]:
    """The int of an integer scalar (Python, numpy, or a 0-d integer tensor), else None; a bool is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.dtype.is_floating_point and not value.dtype.is_complex \
                and value.dtype != torch.bool:
            return int(value)
        return None
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "dtype") \
            and value.dtype.kind in "iu":
        return int(value)
    return None


def _index_tensor(index: Any, argument: str) -> torch.Tensor:
    """A list, tensor or numpy array of indices as a long tensor (a bool one stays a mask)."""
    tensor = torch.as_tensor(index)
    if tensor.numel() == 0:
        return tensor.to(torch.long)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise ValueError(f"{argument}: indices must be integers (or booleans, a mask), not {tensor.dtype}")
    return tensor if tensor.dtype == torch.bool else tensor.to(torch.long)


def apply_slice(tensor: torch.Tensor, index: Any, dim: int) -> torch.Tensor:
    """`tensor` sliced along `dim` as TransformerLens's ``Slice(index).apply(tensor, dim)`` (`as_index`): None
    keeps all, an int drops the axis, a tuple is ``slice(*tuple)``, a list or tensor picks those indices."""
    index = as_index(index)
    if index is None:
        return tensor
    where: list[Any] = [slice(None)] * tensor.dim()
    where[dim] = index
    return tensor[tuple(where)]


class CacheDict(dict):
    """A cache's keys and tensors as a plain ``dict``: TransformerLens 4.3's ``ActivationCache.cache_dict``.

    Holds every key of `TransformerLensCache.keys` (streamscope's names, then the TransformerLens hook names that
    answer) and its tensor, the TransformerLens values computed from served ones (a norm's scale, ``hook_attn_in``)
    made when the dict is made. Assigning a key writes through to the cache (`TransformerLensCache.write`), as
    assigning TL's ``cache.cache_dict[key]`` changes what ``cache[key]`` gives; so does deleting one.
    """

    def __init__(self, cache: Any) -> None:  # a TransformerLensCache (tl.py imports this module)
        super().__init__((key, cache[key]) for key in cache.keys())
        self._cache = cache

    def __missing__(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str):
            raise KeyError(f"cache_dict is keyed by full names ('blocks.0.hook_resid_pre', 'layers.0.layer_input'), "
                           f"not {key!r}: cache[{key!r}] reads TransformerLens's shorthand")
        raise KeyError(f"{key!r} is not in cache_dict (cache.keys() lists its keys; cache[{key!r}] says why a "
                       f"name is missing)")

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(key, str):
            raise KeyError(f"cache_dict is keyed by full names ('blocks.0.hook_resid_pre', 'layers.0.layer_input'), "
                           f"not {key!r}: cache[{key!r}] reads TransformerLens's shorthand")
        self._cache.write(key, value)
        super().__setitem__(key, value)
        self._cache._dict_state = self._cache._state()

    def __delitem__(self, key: str) -> None:
        self._cache.write(key, None)
        super().__delitem__(key)
        self._cache._dict_state = self._cache._state()

    # dict's own update, setdefault, pop, popitem and clear skip __setitem__ and __delitem__: they go through here.

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        if key not in self and default:
            return default[0]
        value = self[key]
        del self[key]
        return value

    def popitem(self) -> tuple:
        key = next(reversed(list(self)))
        return key, self.pop(key)

    def clear(self) -> None:
        for key in list(self):
            del self[key]
