"""Shared fixtures: tiny checkpoints, built once per session, and the oracle's model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import precision  # noqa: E402
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
            built[key] = build_checkpoint(family, root / (family + ("-" + suffix if suffix else "")),
                                          seed=precision.SEED, **overrides)
        return built[key]

    return build


@pytest.fixture(autouse=True)
def no_idle_step_left_over():
    """The graph ops' idle switch is one a process, which an engine sets before each of its steps: a test that calls
    the ops itself starts with it off and no plan's marks in it, whatever an engine of an earlier test in this
    process left."""
    from streamscope.vllm.graph_ops import IDLE

    IDLE.step, IDLE.columns = False, None


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its matrix record to the controller, which prints the summary."""
    import matrix

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["matrix"] = {"|".join(key): entry for key, entry in matrix.RECORD.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller's side of `pytest_sessionfinish`: each worker's closest calls join its own record."""
    import matrix

    for key, entry in getattr(node, "workeroutput", {}).get("matrix", {}).items():
        if "value" in entry:
            matrix.record(*key.split("|"), entry["value"], entry["error"], entry["tolerance"])


def pytest_terminal_summary(terminalreporter):
    """The value x family matrix's closest call per engine and family (tests/matrix.py), for the run record."""
    import matrix

    lines = matrix.summary()
    if lines:
        terminalreporter.section("value x family: the value nearest its tolerance")
        for line in lines:
            terminalreporter.write_line(line)
