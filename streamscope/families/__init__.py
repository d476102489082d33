"""The families streamscope maps, in one list, and finding an engine's module for one by ``config.model_type``.

`FAMILIES` is the one list the engines, the checkpoint factory
(`streamscope.testing`) and the tests draw from; ``tests/test_structure.py``
fails where a family lacks what the list says it has. What a model type is,
whichever engine runs it, is stated once (`streamscope.families.neutral.NEUTRAL`,
a `FamilySpec` each); each engine's family module derives its ``SPEC`` from
that (`derive`), adding only what is the engine's, checked when a model loads
(`spec_of`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

from .spec import FamilySpec, FamilySpecError, derive, spec_of

TRANSFORMERS, VLLM = "transformers", "vllm"
ENGINES = (TRANSFORMERS, VLLM)
_ENGINE_NAMES = {TRANSFORMERS: "transformers", VLLM: "vLLM"}


@dataclass(frozen=True)
class Family:
    """A family streamscope maps, and what it has.

    A model type's family has a module on each of its `engines`
    (``streamscope.<engine>.families.<name>``, stating a `FamilySpec`), a tiny
    checkpoint recipe (`streamscope.testing.FAMILY_CONFIGS`) and an entry in
    the tests' oracle (``tests/oracle.py``).
    """

    #: The ``config.model_type`` (or ``default``), and the family module's name.
    name: str
    #: The engines with a module for it.
    engines: tuple[str, ...] = ENGINES
    #: Whether `name` is a model type, with a checkpoint recipe and an oracle entry (not the best-effort default).
    model_type: bool = True
    #: Why vLLM's CPU build cannot run it, where it cannot: its vLLM module is then tested on GPUs only.
    not_on_vllm_cpu: Optional[str] = None


FAMILIES: tuple[Family, ...] = (
    Family("llama"), Family("mistral"), Family("qwen2"), Family("qwen3"), Family("qwen3_moe"), Family("mixtral"),
    Family("gemma"), Family("gemma2"), Family("gemma3_text"), Family("phi3"), Family("granite"), Family("olmo2"),
    Family("cohere"), Family("exaone4"), Family("stablelm"), Family("gpt2"), Family("gptj"), Family("gpt_neox"),
    Family("opt"), Family("falcon"), Family("llama4_text"),
    Family("mamba", not_on_vllm_cpu="vLLM has no selective-scan kernel on CPU"),
    Family("qwen3_next"),
    # What a model type with no module of its own gets on transformers; vLLM needs a family module.
    Family("default", engines=(TRANSFORMERS,), model_type=False),
)

#: The model types streamscope has a family for, in `FAMILIES`' order: each has a tiny checkpoint and an oracle entry.
MODEL_TYPES: tuple[str, ...] = tuple(family.name for family in FAMILIES if family.model_type)


def on(engine: str) -> tuple[str, ...]:
    """The families with a module on `engine` (``"transformers"`` or ``"vllm"``), in `FAMILIES`' order."""
    return tuple(family.name for family in FAMILIES if engine in family.engines)


def find_family(engine: str, name: str) -> Optional[ModuleType]:
    """The module ``streamscope.<engine>.families.<name>``, or None where `FAMILIES` lists none for the engine."""
    if name not in on(engine):
        return None
    return importlib.import_module(f"streamscope.{engine}.families.{name}")


def known_families(engine: str) -> list[str]:
    """The families with a module on `engine`, sorted."""
    return sorted(on(engine))


def named_family(engine: str, name: str) -> ModuleType:
    """The family module called `name`; a ValueError listing the known ones where there is none."""
    family = find_family(engine, name)
    if family is None:
        default = ", or pass family='default' for the best-effort default" if engine == TRANSFORMERS else ""
        raise ValueError(
            f"streamscope has no {_ENGINE_NAMES[engine]} family called {name!r}. Known families: "
            f"{', '.join(known_families(engine))}. Leave `family` out to use the checkpoint's own model type"
            f"{default}."
        )
    return family


__all__ = ["ENGINES", "FAMILIES", "MODEL_TYPES", "TRANSFORMERS", "VLLM", "Family", "FamilySpec", "FamilySpecError",
           "derive", "find_family", "known_families", "named_family", "on", "spec_of"]
