"""The oracle: transformers' own forward in float32, read and edited with plain torch hooks.

Nothing here imports streamscope. Each family's entry says, in the module
names of its transformers implementation, where each value is computed:
``(module path relative to the block, "in" | "out")``, a tuple of such
alternatives where blocks differ (the first module the block has is used),
``None`` where the block has no such value, and an optional third element, a
function of the config that scales the tensor (Granite's residual multiplier).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

BOUNDARIES = ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output")
CONTRIBUTIONS = ("attention_output", "mlp_output")

_PRE_NORM = {
    "layer_input": ("", "in"),
    "attention_norm_output": ("input_layernorm", "out"),
    "attention_output": ("self_attn", "out"),
    "layer_mid": ("post_attention_layernorm", "in"),
    "mlp_norm_output": ("post_attention_layernorm", "out"),
    "mlp_input": ("mlp", "in"),
    "mlp_output": ("mlp", "out"),
    "layer_output": ("", "out"),
}
_LLAMA_ROOT = {"layers": "model.layers", "token_embeddings": ("model.embed_tokens", "out"),
               "final_norm_output": ("model.norm", "out")}
_SANDWICH = {**_PRE_NORM, "attention_output": ("post_attention_layernorm", "out"),
             "layer_mid": ("pre_feedforward_layernorm", "in"),
             "mlp_norm_output": ("pre_feedforward_layernorm", "out"),
             "mlp_output": ("post_feedforward_layernorm", "out")}
_POST_NORM = {**_PRE_NORM, "attention_norm_output": None, "mlp_norm_output": None,
              "attention_output": ("post_attention_layernorm", "out"), "layer_mid": ("mlp", "in"),
              "mlp_output": ("post_feedforward_layernorm", "out")}
_residual = lambda config: config.residual_multiplier  # noqa: E731

ORACLE: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_ROOT, **_PRE_NORM},
    "mistral": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen2": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen3": {**_LLAMA_ROOT, **_PRE_NORM},
    "qwen3_moe": {**_LLAMA_ROOT, **_PRE_NORM},
    "mixtral": {**_LLAMA_ROOT, **_PRE_NORM},
    "gemma": {**_LLAMA_ROOT, **_PRE_NORM},
    "gemma2": {**_LLAMA_ROOT, **_SANDWICH},
    "gemma3_text": {**_LLAMA_ROOT, **_SANDWICH},
    "phi3": {**_LLAMA_ROOT, **_PRE_NORM},
    "granite": {**_LLAMA_ROOT, **_PRE_NORM, "token_embeddings": ("model.layers.0", "in"),
                "attention_output": ("self_attn", "out", _residual), "mlp_output": ("mlp", "out", _residual)},
    "olmo2": {**_LLAMA_ROOT, **_POST_NORM},
    "exaone4": {**_LLAMA_ROOT, **_POST_NORM},
    "cohere": {**_LLAMA_ROOT, **_PRE_NORM, "layer_mid": None, "mlp_norm_output": ("input_layernorm", "out")},
    "stablelm": {**_LLAMA_ROOT, **_PRE_NORM},
    "llama4_text": {**_LLAMA_ROOT, **_PRE_NORM, "mlp_input": ("feed_forward", "in"),
                    "mlp_output": ("feed_forward", "out")},
    "qwen3_next": {**_LLAMA_ROOT, **_PRE_NORM,
                   "attention_output": (("self_attn", "out"), ("linear_attn", "out"))},
    "gpt2": {"layers": "transformer.h", "token_embeddings": ("transformer.wte", "out"),
             "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
             "attention_norm_output": ("ln_1", "out"), "attention_output": ("attn", "out"),
             "layer_mid": ("ln_2", "in"), "mlp_norm_output": ("ln_2", "out")},
    "gptj": {"layers": "transformer.h", "token_embeddings": ("transformer.wte", "out"),
             "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
             "attention_norm_output": ("ln_1", "out"), "attention_output": ("attn", "out"),
             "layer_mid": None, "mlp_norm_output": ("ln_1", "out")},
    "gpt_neox": {"layers": "gpt_neox.layers", "token_embeddings": ("gpt_neox.embed_in", "out"),
                 "final_norm_output": ("gpt_neox.final_layer_norm", "out"), **_PRE_NORM,
                 "attention_output": ("attention", "out"), "layer_mid": None},
    "opt": {"layers": "model.decoder.layers", "token_embeddings": ("model.decoder.embed_tokens", "out"),
            "final_norm_output": ("model.decoder.final_layer_norm", "out"), **_PRE_NORM,
            "attention_norm_output": ("self_attn_layer_norm", "out"),
            "layer_mid": ("final_layer_norm", "in"), "mlp_norm_output": ("final_layer_norm", "out"),
            "mlp_input": ("fc1", "in"), "mlp_output": ("fc2", "out")},
    # three layouts, by the norms a block has: ln_attn and ln_mlp (parallel, the new layout), input_layernorm
    # alone (parallel, one norm: Falcon-7B), input_layernorm and post_attention_layernorm (sequential: Falcon-RW)
    "falcon": {"layers": "transformer.h", "token_embeddings": ("transformer.word_embeddings", "out"),
               "final_norm_output": ("transformer.ln_f", "out"), **_PRE_NORM,
               "attention_norm_output": (("ln_attn", "out"), ("input_layernorm", "out")),
               "attention_output": ("self_attention", "out"), "layer_mid": ("post_attention_layernorm", "in"),
               "mlp_norm_output": (("ln_mlp", "out"), ("post_attention_layernorm", "out"), ("input_layernorm", "out"))},
    "mamba": {"layers": "backbone.layers", "token_embeddings": ("backbone.embeddings", "out"),
              "final_norm_output": ("backbone.norm_f", "out"), **_PRE_NORM,
              "attention_norm_output": ("norm", "out"), "attention_output": ("mixer", "out"),
              "layer_mid": None, "mlp_norm_output": None, "mlp_input": None, "mlp_output": None},
}

#: OPT with ``do_layer_norm_before=False`` (OPT-350m): a norm after each residual add, none at the end. The
#: stream between the halves is the attention half's norm output; what each sublayer adds is not a tensor of
#: the forward (the norm comes after the add).
OPT_POST_LN = {**ORACLE["opt"], "final_norm_output": None, "attention_norm_output": None, "mlp_norm_output": None,
               "attention_output": None, "mlp_output": None, "layer_mid": ("self_attn_layer_norm", "out")}


def _module(root: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    module: Any = root
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if not isinstance(module, torch.nn.Module):
            return None
    return module


def sites(model: torch.nn.Module, family: str) -> dict[str, Any]:
    """The family's map for this model: OPT's post-LN layout (``do_layer_norm_before=False``) has its own."""
    if family == "opt" and not model.config.do_layer_norm_before:
        return OPT_POST_LN
    return ORACLE[family]


def site(model: torch.nn.Module, family: str, name: str, block: Optional[int] = None):
    """(module, "in" | "out", scale) where `name` is computed, or None where the model has no such value."""
    spec = sites(model, family)[name]
    if spec is None:
        return None
    alternatives = spec if isinstance(spec[0], tuple) else (spec,)
    prefix = "" if block is None else f"{ORACLE[family]['layers']}.{block}."
    for alternative in alternatives:
        path, where, *scale = alternative
        module = _module(model, (prefix + path).rstrip("."))
        if module is not None:
            factor = scale[0](model.config) if scale else None
            return module, where, factor
    return None


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
        for name in (*BOUNDARIES, *CONTRIBUTIONS):
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
