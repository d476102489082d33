"""Shared fixtures: tiny checkpoints, built once per session, and the oracle's model."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# OpenMP's threads sleep as soon as a parallel region ends, in this process and in every one it starts (servers,
# engine cores, parallel ranks), where GNU OpenMP would spin a while first. The tiny checkpoints' ops are short and
# Python runs between them, so a spinning thread holds a core most of the time: with two test processes (`make test`)
# on two cores, each one's spinners took the other's core. Measured with -n 2 on 2 cores: test_serve_sweeps,
# test_steering and test_taps (tests/vllm) 301 s spinning, 149 s sleeping; transformers/test_transformer_lens,
# vllm/test_engine and vllm/test_graph_backend 523 s, 220 s. Set before torch loads libgomp, which reads it once;
# what is computed, and on how many threads, is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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

    IDLE.step, IDLE.lean, IDLE.columns = False, False, None


class _CollectThenFreeze:
    """The ``gc`` of vLLM's model loader (and teardown: `_COLLECTING`) in the suite's processes: each ``collect``
    also freezes what survives it.

    Every vLLM engine's shutdown unfreezes the whole heap (``gc.unfreeze()``,
    so that the engine's cycles can be freed), and the loader of the next
    engine then runs four full collections, each over the 800,000 objects the
    imports alone leave (0.6 s each on this 2-core machine, more as a test
    process grows), before vLLM freezes the heap again once the engine is up
    (``freeze_gc_heap``). Here the first collection after an unfreeze still
    frees the last engine's cycles; freezing right after it, as vLLM does
    after start-up anyway, makes the loader's later ones cheap. What dies
    while frozen is freed after the next engine's shutdown unfreezes the heap,
    as with vLLM's own freeze (a closed engine among it where the teardown
    froze it: `_COLLECTING`).
    """

    def __init__(self, gc_module: Any) -> None:
        self._gc = gc_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gc, name)

    def collect(self, generation: int = 2) -> int:
        found = self._gc.collect(generation)
        self._gc.freeze()
        return found


#: The vLLM modules given `_CollectThenFreeze`: the model loader; on the CPU also the parallel state's teardown, which
#: collects right after the closing engine's shutdown unfroze the heap (the engine, still referenced by its close, is
#: then frozen and freed at the next engine's shutdown: one engine's memory held a while, too long on a GPU).
_COLLECTING = ("vllm.model_executor.model_loader.base_loader",) + (
    () if precision.ON_GPU else ("vllm.distributed.parallel_state",))


@pytest.fixture(autouse=True)
def vllm_collects_once():
    """`_CollectThenFreeze` given to `_COLLECTING` once a test has imported them (dict lookups a test), where the
    module collects through its own ``gc`` (vLLM 0.22's loader, on the GPU, imports none)."""
    for name in _COLLECTING:
        collector = getattr(sys.modules.get(name), "gc", None)
        if collector is not None and not isinstance(collector, _CollectThenFreeze):
            sys.modules[name].gc = _CollectThenFreeze(collector)


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its matrix record to the controller, which prints the summary. The last
    engine a `_CollectThenFreeze` froze is freed before the interpreter's exit (which would report it leaked)."""
    import gc

    import matrix

    gc.unfreeze()
    gc.collect()

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
