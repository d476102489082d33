"""The best-effort family of a model type with no module: the usual spellings, and a warning for the rest.

It maps the decoder blocks, the embedding, the final norm and the blocks'
sublayers and norms under the names most transformers families use, and reads
every block as Llama's pre-norm block (parallel where the config says so).
Whatever it cannot find it names in a warning at load; the values keyed on it
report ``no <module> module on this block`` in `support()` and on reading.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
from typing import Any

import torch

from ... import nnsight_seam as seam
from ...blocks import Attention, Mlp
from ...blocks.parallel import ConfigParallelLayer
from ...families import TRANSFORMERS, FamilySpec, find_family
from ...families.logits import as_the_config_says

# Keys that do not resolve are skipped, so every spelling can be listed. A
# `*` stands for the backbone (`model`, `transformer`, ...); names that blocks
# also use (`norm`, `final_layer_norm`) are spelled out from the root, where a
# `*` would also reach into each block.
_BLOCKS = {key: "layers" for key in ("*.layers", "*.h", "*.blocks", "*.decoder.layers")}
_EMBEDDING = {key: "embed_tokens" for key in (
    "*.embed_tokens", "*.wte", "*.embed_in", "*.word_embeddings", "*.tok_embeddings", "*.decoder.embed_tokens",
    "backbone.embeddings")}
_FINAL_NORM = {key: "norm" for key in (
    "model.norm", "transformer.norm", "backbone.norm", "*.ln_f", "*.norm_f", "*.final_layernorm",
    "*.final_norm", "gpt_neox.final_layer_norm", "model.final_layer_norm", "model.decoder.final_layer_norm")}
_SUBLAYERS = {"attn": "self_attn", "attention": "self_attn", "self_attention": "self_attn",
              "feed_forward": "mlp", "ffn": "mlp", "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}

RENAME: dict[str, str] = {**_BLOCKS, **_EMBEDDING, **_FINAL_NORM, "embed_out": "lm_head", **_SUBLAYERS}


@functools.lru_cache(maxsize=None)
def returns_tuple(block_class: type) -> bool:
    """Whether the forward of `block_class` returns a tuple literal (``return hidden_states, weights``)."""
    try:
        source = textwrap.dedent(inspect.getsource(block_class.forward))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    returns = [node for node in ast.walk(function) if isinstance(node, ast.Return) and node.value is not None]
    return bool(returns) and all(isinstance(node.value, ast.Tuple) for node in returns)


class DefaultLayer(ConfigParallelLayer):
    """Llama's pre-norm block, or a parallel one where the config says the block is parallel."""

    def pack(self, hidden: torch.Tensor) -> Any:
        return (hidden, None) if returns_tuple(type(seam.module_of(self))) else hidden


ENVOYS = {"layers.*": DefaultLayer, "self_attn": Attention, "mlp": Mlp}

_ROOT = {"layers": "the decoder blocks (a ModuleList)", "embed_tokens": "the token embedding",
         "norm": "the final norm", "lm_head": "the unembedding"}
_BLOCK = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def unmapped(model: Any) -> list[str]:
    """What the default could not find on `model`, in words: root modules, then the blocks' modules."""
    missing = [f"{name} ({meaning})" for name, meaning in _ROOT.items() if name not in model.__dict__]
    blocks = model.__dict__.get("layers")
    if blocks is not None:
        for name in _BLOCK:
            lacking = [index for index, block in enumerate(blocks) if name not in block.__dict__]
            if lacking:
                which = "every block" if len(lacking) == len(blocks) else f"blocks {lacking}"
                missing.append(f"{name} on {which}")
    return missing


def unread(model: Any) -> list[str]:
    """The blocks' modules with weights that no streamscope name reaches (a norm the default does not know)."""
    names: list[str] = []
    for block in model.__dict__.get("layers") or []:
        mapped = {id(block.__dict__[name]) for name in _BLOCK if name in block.__dict__}
        for name, child in seam.children(block).items():
            has_weights = any(True for _ in seam.module_of(child).parameters())
            if id(child) not in mapped and has_weights and name not in names:
                names.append(name)
    return names


def check(model: Any) -> None:
    """Warn that the default family is in use, what it could not map, and what it does not read."""
    model_type = model.config.model_type
    if find_family(TRANSFORMERS, model_type) is None:
        lines = [f"streamscope has no family module for model type {model_type!r}: the default family "
                 f"reads its blocks as pre-norm blocks (parallel where the config says so)."]
    else:
        lines = [f"The default family reads this {model_type!r} model, as asked (family='default'; streamscope's "
                 f"own family for it is {model_type!r}): it reads the blocks as pre-norm blocks (parallel where "
                 f"the config says so)."]
    missing = unmapped(model)
    if missing:
        lines.append(f"Could not map: {', '.join(missing)}; the values keyed on these are unavailable "
                     f"(see model.support()).")
    others = unread(model)
    if others:
        lines.append(f"The blocks also hold {', '.join(others)}, which the default does not read: "
                     f"values next to them may not be what their names say.")
    warnings.warn(" ".join(lines), stacklevel=3)


SPEC = FamilySpec(rename=RENAME, envoys=ENVOYS, check=check, logit_scaling=as_the_config_says)
