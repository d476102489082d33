"""streamscope's CUDA graph sets (`streamscope.vllm_seam.keep_graph_sets`), through vLLM's own `CUDAGraphWrapper` on
this CPU.

A GPU engine with graph ops captures each batch once more per set in vLLM's capture loop: once as vLLM does (every
graph op in the graph), once with the ops' switch in the idle set's capture (none of them), once in the lean set's
(only the ops at the lean sites' columns), and replays the idle set on a step that marks no row, the lean set on a
step that marks lean columns only. This CPU cannot capture a CUDA graph, so the tests run vLLM's real wrapper class
(its capture and replay code, its dict of graphs) with the CUDA calls it makes replaced by a stand-in graph that
records what the forward launched while it was captured (which ops) and which graph each replay ran. The forward is
three piecewise graphs in a row, each of which "launches" its op (at a column of its own) where the switch lets it,
as the ops' bodies do (`graph_ops.IdleSwitch.leaves`). Every CUDA call is a stand-in, so the tests run alike on a
CPU and a GPU; real captures are the GPU suite's graph part (tests/vllm/test_graph_families.py).
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import pytest
import torch
from vllm.compilation import cuda_graph
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
from vllm.compilation.monitor import set_cudagraph_capturing_enabled
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import BatchDescriptor
from vllm.platforms import current_platform

from streamscope import vllm_seam
from streamscope.vllm.graph_ops import IDLE_SET, LEAN_SET, IdleSwitch

CUDA = torch.device("cuda")
#: The batches the stand-in runner captures, as vLLM's dispatcher names them.
BATCHES = [BatchDescriptor(num_tokens=8, num_reqs=8, uniform=False), BatchDescriptor(num_tokens=4, num_reqs=4)]
PIECES = 3
#: Each piece's op's index column, as the ops' switch sees it (an address), and the lean set's: the middle piece's.
COLUMNS = [1000 + 8 * number for number in range(PIECES)]
LEAN = frozenset({COLUMNS[1]})
IDLE_ONLY = {IDLE_SET: frozenset()}
BOTH = {IDLE_SET: frozenset(), LEAN_SET: LEAN}


class Graph:
    """A CUDA graph's stand-in: what the forward launched while it was captured, and its replays."""

    capturing: Optional["Graph"] = None
    replayed: list["Graph"] = []

    def __init__(self) -> None:
        self.launched: list[tuple[int, bool]] = []  # (piece, whether its op ran)

    def replay(self) -> None:
        Graph.replayed.append(self)


@contextlib.contextmanager
def capture(graph: Graph, pool: Any = None, stream: Any = None) -> Iterator[None]:
    Graph.capturing = graph
    try:
        yield
    finally:
        Graph.capturing = None


class Runner:
    """vLLM's GPU runner as far as `keep_graph_sets` reads it: three piecewise graphs a forward, a capture loop."""

    device = CUDA

    def __init__(self, switch: IdleSwitch, context: SimpleNamespace, ubatching: bool = False) -> None:
        self.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
        self.parallel_config = SimpleNamespace(use_ubatching=ubatching)
        self.switch, self.context = switch, context
        self.model: Any = None  # the wrapper vLLM put around the model at load (none here: piecewise graphs only)
        self.pieces = [cuda_graph.CUDAGraphWrapper(self.piece(number), VllmConfig(), CUDAGraphMode.PIECEWISE)
                       for number in range(PIECES)]

    def piece(self, number: int) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            ran = not self.switch.leaves(CUDA, (COLUMNS[number],))  # as an op's body decides
            if Graph.capturing is not None:
                Graph.capturing.launched.append((number, ran))
            return x + 1
        return run

    def forward(self, batch: BatchDescriptor, mode: CUDAGraphMode) -> torch.Tensor:
        self.context.batch_descriptor, self.context.cudagraph_runtime_mode = batch, mode
        x = torch.zeros(1)
        for wrapper in self.pieces:
            x = wrapper(x)
        return x

    def _warmup_and_capture(self, batch: BatchDescriptor, cudagraph_runtime_mode: CUDAGraphMode) -> None:
        self.forward(batch, CUDAGraphMode.NONE)  # vLLM's warm-up run, uncaptured
        self.forward(batch, cudagraph_runtime_mode)

    def capture_model(self) -> int:
        set_cudagraph_capturing_enabled(True)
        try:
            for batch in BATCHES:
                self._warmup_and_capture(batch, CUDAGraphMode.PIECEWISE)
        finally:
            set_cudagraph_capturing_enabled(False)
        return 0


@pytest.fixture
def switch(monkeypatch: pytest.MonkeyPatch) -> IdleSwitch:
    """A switch of its own, vLLM's wrapper patched for this test only, its CUDA calls replaced by the stand-ins."""
    monkeypatch.setattr(cuda_graph.CUDAGraphWrapper, "__call__", cuda_graph.CUDAGraphWrapper.__call__)
    monkeypatch.setattr(cuda_graph.CUDAGraphWrapper, "clear_graphs", cuda_graph.CUDAGraphWrapper.clear_graphs)
    monkeypatch.setattr(vllm_seam, "_graph_switch", None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: Graph.capturing is not None)
    monkeypatch.setattr(cuda_graph, "capture_pool", lambda *args: contextlib.nullcontext(), raising=False)
    monkeypatch.setattr(cuda_graph, "set_graph_pool_id", lambda *args: None, raising=False)
    monkeypatch.setattr(cuda_graph, "current_stream", lambda: None)
    monkeypatch.setattr(cuda_graph, "weak_ref_tensors", lambda tensors: tensors)
    monkeypatch.setattr(current_platform, "get_global_graph_pool", lambda: None)
    context = SimpleNamespace(batch_descriptor=None, cudagraph_runtime_mode=CUDAGraphMode.NONE)
    monkeypatch.setattr(cuda_graph, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(cuda_graph, "get_forward_context", lambda: context)
    monkeypatch.setattr(Graph, "replayed", [])
    made = IdleSwitch()
    made.context = context  # type: ignore[attr-defined]
    return made


def graphs(wrapper: Any, kind: Optional[str]) -> dict[Any, Graph]:
    """A wrapper's graphs by batch: vLLM's own (`kind` None) or those of streamscope's set `kind`."""
    sets = wrapper.__dict__.get(vllm_seam.SET_ENTRIES, {})
    entries = sets.get(kind, {}) if kind else wrapper.concrete_cudagraph_entries
    return {batch: entry.cudagraph for batch, entry in entries.items()}


def test_each_batch_is_captured_with_the_ops_and_without_and_an_idle_step_replays_the_second(switch) -> None:
    runner = Runner(switch, switch.context)
    assert vllm_seam.keep_graph_sets(runner, switch, IDLE_ONLY) is None
    switch.step = True  # an earlier engine's idle step, left set: vLLM's own graphs must still hold the ops
    runner.capture_model()
    assert switch.step and switch.capturing is None  # as it was
    for number, wrapper in enumerate(runner.pieces):
        ops, idle = graphs(wrapper, None), graphs(wrapper, IDLE_SET)
        assert set(ops) == set(idle) == set(BATCHES)
        assert all(graph.launched == [(number, True)] for graph in ops.values())
        assert all(graph.launched == [(number, False)] for graph in idle.values())
    for batch in BATCHES:
        for step, kind in ((False, None), (True, IDLE_SET), (False, None)):  # a steered step after an idle one
            switch.step = step
            Graph.replayed.clear()
            runner.forward(batch, CUDAGraphMode.PIECEWISE)
            assert Graph.replayed == [graphs(wrapper, kind)[batch] for wrapper in runner.pieces], (batch, step)
    assert len(vllm_seam.captured_graphs()["idle"]) >= PIECES * len(BATCHES)



def test_the_lean_set_holds_its_columns_ops_only_and_replays_a_step_that_marks_no_other(switch) -> None:
    """With both sets kept, each batch has three graphs a piece: vLLM's (every op), the idle one (none) and the lean
    one (the middle piece's op only). A step marking lean columns only replays the lean set; an idle step the idle
    one; any other step vLLM's. A lean step left set by an earlier engine does not leak into vLLM's capture."""
    runner = Runner(switch, switch.context)
    assert vllm_seam.keep_graph_sets(runner, switch, BOTH) is None
    switch.lean = True
    runner.capture_model()
    assert switch.lean and switch.capturing is None and switch.kept == frozenset()
    for number, wrapper in enumerate(runner.pieces):
        ops, idle, lean = graphs(wrapper, None), graphs(wrapper, IDLE_SET), graphs(wrapper, LEAN_SET)
        assert set(ops) == set(idle) == set(lean) == set(BATCHES)
        assert all(graph.launched == [(number, True)] for graph in ops.values())
        assert all(graph.launched == [(number, False)] for graph in idle.values())
        assert all(graph.launched == [(number, number == 1)] for graph in lean.values())
    for batch in BATCHES:
        for step, lean, kind in ((False, True, LEAN_SET), (False, False, None), (True, True, IDLE_SET),
                                 (False, True, LEAN_SET), (True, False, IDLE_SET)):
            switch.step, switch.lean = step, lean
            Graph.replayed.clear()
            runner.forward(batch, CUDAGraphMode.PIECEWISE)
            assert Graph.replayed == [graphs(wrapper, kind)[batch] for wrapper in runner.pieces], (batch, step, lean)
    ours = {id(wrapper) for wrapper in runner.pieces}  # (other tests' wrappers may still be alive in this process)
    captured = {kind: {key for key in keys if key[0] in ours} for kind, keys in vllm_seam.captured_graphs().items()}
    assert len(captured["lean"]) == len(captured["idle"]) == len(captured["ops"]) == PIECES * len(BATCHES)


def test_without_the_idle_set_an_idle_step_replays_the_lean_one(switch) -> None:
    """An idle step changes nothing at any op, so the lean graphs (fewer launches than vLLM's) replay it where the
    engine keeps no idle set."""
    runner = Runner(switch, switch.context)
    vllm_seam.keep_graph_sets(runner, switch, {LEAN_SET: LEAN})
    runner.capture_model()
    assert all(not graphs(wrapper, IDLE_SET) for wrapper in runner.pieces)
    switch.step = True
    Graph.replayed.clear()
    runner.forward(BATCHES[1], CUDAGraphMode.PIECEWISE)
    assert Graph.replayed == [graphs(wrapper, LEAN_SET)[BATCHES[1]] for wrapper in runner.pieces]
    assert [graph.launched for graph in Graph.replayed] == [[(0, False)], [(1, True)], [(2, False)]]

class Bypassing(Runner):
    """A runner whose capture takes one batch more past `_warmup_and_capture` (the class's own, not the instance's
    wrapped one): that batch gets vLLM's graph and no idle one."""

    def capture_model(self) -> int:
        super().capture_model()
        set_cudagraph_capturing_enabled(True)
        try:
            Runner._warmup_and_capture(self, BatchDescriptor(num_tokens=2, num_reqs=2), CUDAGraphMode.PIECEWISE)
        finally:
            set_cudagraph_capturing_enabled(False)
        return 0


def test_a_batch_captured_in_one_set_only_drops_the_sets_whole(switch, caplog) -> None:
    runner = Bypassing(switch, switch.context)
    vllm_seam.keep_graph_sets(runner, switch, BOTH)
    with caplog.at_level(logging.WARNING, logger="streamscope"):
        runner.capture_model()
    assert "idle CUDA graphs are dropped" in caplog.text and "lean CUDA graphs are dropped" in caplog.text
    assert all(not wrapper.__dict__.get(vllm_seam.SET_ENTRIES) for wrapper in runner.pieces)
    switch.step = True
    Graph.replayed.clear()
    runner.forward(BATCHES[0], CUDAGraphMode.PIECEWISE)  # a batch that had both: vLLM's graphs now, ops and all
    assert Graph.replayed == [graphs(wrapper, None)[BATCHES[0]] for wrapper in runner.pieces]
    assert all(graph.launched[0][1] for graph in Graph.replayed)


def test_clearing_vllm_s_graphs_clears_every_set(switch) -> None:
    runner = Runner(switch, switch.context)
    vllm_seam.keep_graph_sets(runner, switch, BOTH)
    runner.capture_model()
    assert all(graphs(wrapper, LEAN_SET) for wrapper in runner.pieces)
    cuda_graph.CUDAGraphWrapper.clear_all_graphs()  # as vLLM's memory profile does after its trial capture
    assert all(not graphs(wrapper, kind) for wrapper in runner.pieces for kind in (None, IDLE_SET, LEAN_SET))


def test_another_engine_s_wrappers_replay_their_own_graphs_on_an_idle_step(switch) -> None:
    ours, theirs = Runner(switch, switch.context), Runner(switch, switch.context)
    vllm_seam.keep_graph_sets(ours, switch, IDLE_ONLY)
    ours.capture_model()
    Runner.capture_model(theirs)  # a plain engine's capture in the same process: vLLM's set only
    switch.step = True
    Graph.replayed.clear()
    theirs.forward(BATCHES[1], CUDAGraphMode.PIECEWISE)
    assert Graph.replayed == [graphs(wrapper, None)[BATCHES[1]] for wrapper in theirs.pieces]


def test_where_the_idle_graphs_are_not_kept_the_reason_is_given(switch) -> None:
    runner = Runner(switch, switch.context)
    runner.device = torch.device("cpu")
    assert "captures no CUDA graph" in vllm_seam.keep_graph_sets(runner, switch, IDLE_ONLY)
    runner.device = CUDA
    runner.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    assert "captures no CUDA graph" in vllm_seam.keep_graph_sets(runner, switch, IDLE_ONLY)
    ubatching = Runner(switch, switch.context, ubatching=True)
    assert "micro-batching" in vllm_seam.keep_graph_sets(ubatching, switch, IDLE_ONLY)
    breakable = Runner(switch, switch.context)
    breakable.model = object.__new__(BreakableCUDAGraphWrapper)  # as vLLM wraps it where its breakable graphs are on
    assert "BREAKABLE" in vllm_seam.keep_graph_sets(breakable, switch, IDLE_ONLY)
    kept = Runner(switch, switch.context)
    assert vllm_seam.keep_graph_sets(kept, switch, IDLE_ONLY) is None
    with pytest.raises(RuntimeError, match="one switch a process"):
        vllm_seam.keep_graph_sets(Runner(switch, switch.context), IdleSwitch(), IDLE_ONLY)
