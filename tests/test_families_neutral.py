"""Each family is stated once, engine-neutral (`streamscope.families.neutral.NEUTRAL`); each engine adds its own.

A field (or a key of a mapping field) that both engines' specs state alike
belongs in the neutral spec: the test fails where both engines restate it
instead, and where an engine's family module builds its spec from scratch.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import pytest

from streamscope.families import MODEL_TYPES, TRANSFORMERS, VLLM, FamilySpec, derive, on
from streamscope.families.neutral import NEUTRAL

#: What only an engine states: how it calls blocks, what it refuses or sets, its own head and checks.
ENGINE_ONLY = ("layout", "cannot_run", "engine_defaults", "checkpoint_defaults", "logit_scaling", "check")
#: What is the model's whichever engine runs it: every engine's spec has the neutral value.
MODEL_ONLY = ("learned_positions", "unserved", "gated_head_outputs")


def _spec(engine: str, family: str) -> FamilySpec:
    return importlib.import_module(f"streamscope.{engine}.families.{family}").SPEC


def _stated(value: Any) -> bool:
    return value not in (None, False, {}) if not isinstance(value, Mapping) else bool(value)


def restated(neutral: FamilySpec, one: FamilySpec, other: FamilySpec) -> list[str]:
    """The fields, and the keys of mapping fields, that `one` and `other` state alike and `neutral` does not."""
    found = []
    for field in dataclasses.fields(FamilySpec):
        mine, theirs, base = (getattr(spec, field.name) for spec in (one, other, neutral))
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            found += [f"{field.name}[{key!r}]" for key in mine
                      if key in theirs and mine[key] == theirs[key] and base.get(key) != mine[key]]
        elif _stated(mine) and mine == theirs and base != mine:
            found.append(field.name)
    return found


def test_each_model_type_has_one_neutral_spec_with_nothing_of_an_engine():
    assert set(NEUTRAL) == set(MODEL_TYPES), (
        f"streamscope.families.neutral.NEUTRAL lacks {set(MODEL_TYPES) - set(NEUTRAL)}, "
        f"has unlisted {set(NEUTRAL) - set(MODEL_TYPES)}")
    for name, spec in NEUTRAL.items():
        assert spec.problems() == [], (name, spec.problems())
        engine_fields = [field for field in ENGINE_ONLY if _stated(getattr(spec, field))]
        assert not engine_fields, f"NEUTRAL[{name!r}] states what is an engine's: {engine_fields}"


@pytest.mark.parametrize("family", [name for name in MODEL_TYPES if {TRANSFORMERS, VLLM} <= set(
    engine for engine in (TRANSFORMERS, VLLM) if name in on(engine))])
def test_what_both_engines_state_alike_is_stated_once(family):
    neutral, transformers, vllm = NEUTRAL[family], _spec(TRANSFORMERS, family), _spec(VLLM, family)
    twice = restated(neutral, transformers, vllm)
    assert not twice, (f"both engines' {family} modules state {twice} alike: state it once, in "
                       f"streamscope.families.neutral.NEUTRAL[{family!r}]")
    for engine, spec in ((TRANSFORMERS, transformers), (VLLM, vllm)):
        differs = [field for field in MODEL_ONLY if getattr(spec, field) != getattr(neutral, field)]
        assert not differs, f"the {engine} {family} module restates the model's own {differs}"


def test_the_restatement_check_finds_one():
    from streamscope.blocks import Attention, Layer, Mlp

    base = FamilySpec(rename={"model.layers": "layers"}, envoys={"layers.*": Layer})
    one = derive(base, rename={"attn": "self_attn"}, envoys={"self_attn": Attention}, learned_positions=True)
    other = derive(base, rename={"attn": "self_attn"}, envoys={"self_attn": Attention, "mlp": Mlp},
                   learned_positions=True)
    assert restated(base, one, other) == ["rename['attn']", "envoys['self_attn']", "learned_positions"]
    assert restated(derive(one, envoys={"mlp": Mlp}), one, other) == []
    assert derive(one, rename={"attn": None}).rename == {"model.layers": "layers"}


def _builds_from_scratch(module: Any) -> bool:
    tree = ast.parse(inspect.getsource(module))
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "FamilySpec"
               for node in ast.walk(tree))


@pytest.mark.parametrize("engine", [TRANSFORMERS, VLLM])
def test_engine_family_modules_derive_from_the_neutral_spec(engine):
    scratch = [name for name in MODEL_TYPES if name in on(engine)
               and _builds_from_scratch(importlib.import_module(f"streamscope.{engine}.families.{name}"))]
    assert not scratch, (f"{engine} family modules {scratch} build a FamilySpec of their own: derive it from "
                         f"streamscope.families.neutral.NEUTRAL (`derive(NEUTRAL[name], ...)`)")
