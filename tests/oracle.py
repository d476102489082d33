"""The oracle: transformers' own forward in float32, read and edited with plain torch hooks.

Nothing here imports streamscope's serving code. Where each family's
transformers modules compute each value is `streamscope.testing.oracle`'s map
(shared with `streamscope check`): in the module names of the transformers
implementation, never in streamscope's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

from streamscope.testing.oracle import (BOUNDARIES, CONTRIBUTIONS, NEURONS, OPT_POST_LN, ORACLE,  # noqa: F401
                                        UnknownFamily,
                                        module_at as _module, site, sites)


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value[0]


def _as_stream(tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Blocks that flatten tokens for their MLP (OPT) give [batch*seq, hidden]: reshape."""
    return tensor.reshape(*shape[:2], tensor.shape[-1])


@contextmanager
def hooked(module: torch.nn.Module, where: str, function: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `function` on the tensor `module` is called with ("in") or returns ("out")."""
    if where == "in":
        handle = module.register_forward_pre_hook(
            lambda _, args, kwargs: function(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
    else:
        handle = module.register_forward_hook(lambda _, args, output: function(_tensor(output)))
    try:
        yield
    finally:
        handle.remove()


def num_layers(model: torch.nn.Module, family: str) -> int:
    return len(_module(model, ORACLE[family]["layers"]))


@torch.no_grad()
def values(model: torch.nn.Module, family: str, input_ids: torch.Tensor) -> dict[str, Any]:
    """Every value the oracle knows: root values as tensors, block values as lists (None where absent).

    ``order`` lists (name, block) in the order the model computed them, the
    order a trace must read them in.
    """
    shape = input_ids.shape
    found: dict[str, Any] = {}
    order: list[tuple[str, Optional[int]]] = []
    handles = []

    def record(key, index, where, module, factor):
        def store(tensor):
            tensor = _as_stream(tensor.detach().clone(), shape)
            found.setdefault(key, {})[index] = tensor * factor if factor is not None else tensor
            order.append((key, index))
        return hooked(module, where, store)

    contexts = []
    for name in ("token_embeddings", "final_norm_output"):
        located = site(model, family, name)
        if located is not None:
            contexts.append(record(name, None, located[1], located[0], located[2]))
    count = num_layers(model, family)
    for block in range(count):
        for name in (*BOUNDARIES, *CONTRIBUTIONS, *NEURONS):
            located = site(model, family, name, block)
            if located is not None:
                contexts.append(record(name, block, located[1], located[0], located[2]))
    for context in contexts:
        context.__enter__()
        handles.append(context)
    try:
        logits = model(input_ids).logits
    finally:
        for context in reversed(handles):
            context.__exit__(None, None, None)
    result: dict[str, Any] = {"logits": logits, "order": [*order, ("logits", None)]}
    for name, by_block in found.items():
        if None in by_block:
            result[name] = by_block[None]
        else:
            result[name] = [by_block.get(block) for block in range(count)]
    return result


@torch.no_grad()
def logits_with_addition(model, family: str, input_ids, name: str, block: Optional[int], vector) -> torch.Tensor:
    """The logits with `vector` added, in place, to value `name` of `block` (None for a root value)."""
    module, where, factor = site(model, family, name, block)
    shape = input_ids.shape

    def add(tensor):
        stream = _as_stream(tensor, shape)
        # A scaled value is what the stream receives: add vector/factor to the tensor before scaling.
        stream.add_(vector / factor if factor is not None else vector)

    with hooked(module, where, add):
        return model(input_ids).logits


@torch.no_grad()
def logits_with_identity_block(model, family: str, input_ids, block: int) -> torch.Tensor:
    """The logits of the model whose block `block` hands its input on unchanged."""
    layer = _module(model, f"{ORACLE[family]['layers']}.{block}")

    def identity(_, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = layer.register_forward_hook(identity, with_kwargs=True)
    try:
        return model(input_ids).logits
    finally:
        handle.remove()
