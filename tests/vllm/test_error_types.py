"""A worker's error comes home as the class the user raised, found by its name among the classes loaded here.

The worker sends only the type's name and message (nnsight's error record), so the client finds the class by name;
these tests need no engine: they hand `_retyped` the record a worker sends.
"""

from __future__ import annotations

import sys
import types

import pytest

from streamscope.bulk.dose import SteerError
from streamscope.vllm.model import _retyped


class RequestRefused(Exception):
    """A user's class named as one of streamscope's internal ones (`streamscope.serve.refusals.RequestRefused`)."""


class Ambiguous(Exception):
    pass


def _module_with_its_own_ambiguous() -> types.ModuleType:
    """A second loaded module holding another class named `Ambiguous` (two users' modules, one name)."""
    module = types.ModuleType("another_users_errors")
    module.Ambiguous = type("Ambiguous", (Exception,), {"__module__": module.__name__})
    sys.modules[module.__name__] = module
    return module


SECOND = _module_with_its_own_ambiguous()


def record(kind: str, message: str = "why") -> dict:
    return {"type_name": kind, "message": message, "traceback": "File 'worker', line 1"}


def test_a_users_class_wins_over_an_internal_class_of_the_same_name():
    import streamscope.serve.refusals as refusals
    assert refusals.RequestRefused is not RequestRefused  # both are loaded: the name alone is ambiguous
    raised = _retyped(record("RequestRefused"), invoke=2)
    assert type(raised) is RequestRefused
    assert str(raised) == "why [invoke 2 of this trace]"
    assert any("Intervention traceback" in note for note in raised.__notes__)


def test_builtins_and_streamscope_errors_come_back_as_themselves():
    assert type(_retyped(record("ValueError"))) is ValueError
    assert type(_retyped(record("SteerError"))) is SteerError
    key = _retyped(record("KeyError", "'layer_output'"), invoke=0)
    assert type(key) is KeyError and key.args == ("layer_output",)
    assert any("Raised in invoke 0 of this trace." in note for note in key.__notes__)


@pytest.mark.parametrize("kind", ["Ambiguous", "NoSuchErrorAnywhere"])
def test_a_name_two_user_classes_share_or_none_has_is_a_runtime_error_naming_it(kind):
    raised = _retyped(record(kind, "the message"))
    assert type(raised) is RuntimeError
    assert str(raised) == f"{kind}: the message"
