"""Family modules for the transformers engine, found by ``config.model_type``.

A family module states ``SPEC``, a `streamscope.families.FamilySpec`, derived
from the family's engine-neutral spec (`streamscope.families.neutral.NEUTRAL`,
which holds ``rename`` and ``envoys``) with what only transformers has (a
kernel-call attention kind, a router, ``logit_scaling``). Its fields:

* ``rename``: nnsight ``rename=`` map from the family's module names to
  streamscope's (``layers``, ``embed_tokens``, ``norm``; on a block
  ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``).
* ``envoys``: nnsight ``envoys=`` map from module classes (or aliased path
  suffixes) to the block kinds of `streamscope.blocks`.
* optionally ``root_sites`` (a root value read elsewhere than its default,
  as ``{name: (module, "input" | "output")}``), ``unserved`` (root values the
  family cannot serve, with the reason; size names too, as Mamba's heads),
  ``check(model)``, called once the tree is built (the default warns there
  what it could not map), and ``engine_defaults``.

It is checked when a model loads: a wrong field is an error naming the
module and the field.

Which model types have one is `streamscope.families.FAMILIES`. A model type
with no module gets `default`, which maps what it can find and
says what it could not.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from ... import blocks
from ...families import TRANSFORMERS, find_family, named_family
from ..attention import attention_kind

if TYPE_CHECKING:
    from ...families.spec import FamilySpec


def family_for(model_type: str) -> ModuleType:
    """The family module of `model_type`, or the best-effort default."""
    return find_family(TRANSFORMERS, model_type) or named_family(TRANSFORMERS, "default")


def family_called(name: str) -> ModuleType:
    """The family module a user named (``family="gpt2"``, ``"default"``); a ValueError listing the known ones."""
    return named_family(TRANSFORMERS, name)


def envoys_for(spec: "FamilySpec") -> dict:
    """The family's ``envoys=`` on transformers: each attention kind composed with the kernel call's internals
    (`transformers.attention.attention_kind`); the block kinds and the rest as stated."""
    return {key: attention_kind(kind) if isinstance(kind, type) and issubclass(kind, blocks.Attention) else kind
            for key, kind in spec.envoys.items()}
