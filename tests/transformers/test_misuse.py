"""Misuse on the transformers engine: the shared table of `tests/misuse.py`, and 200 traces with failures."""

from __future__ import annotations

import pytest

import streamscope
from misuse import *  # noqa: F401,F403  (the shared tests, collected here against this engine)
from misuse import Runner


@pytest.fixture(scope="module")
def runner(checkpoints):
    return Runner("transformers", streamscope.load(checkpoints("llama")))


@pytest.fixture(scope="module")
def baseline(runner):
    return runner.baseline()
