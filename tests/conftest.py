"""Shared fixtures: tiny checkpoints, built once per session, and the oracle's model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from streamscope.testing import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """build(family, **overrides) -> the folder of its tiny checkpoint, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict = {}

    def build(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            suffix = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
            built[key] = build_checkpoint(family, root / (family + ("-" + suffix if suffix else "")), **overrides)
        return built[key]

    return build


def pytest_terminal_summary(terminalreporter):
    """The value x family matrix's closest call per engine and family (tests/matrix.py), for the run record."""
    import matrix

    lines = matrix.summary()
    if lines:
        terminalreporter.section("value x family: the value nearest its tolerance")
        for line in lines:
            terminalreporter.write_line(line)
