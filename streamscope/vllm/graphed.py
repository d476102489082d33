"""A steer's edit at a tap, captured once into a CUDA graph of its own and replayed with one launch.

An engine started with taps replays CUDA graphs for its decode steps, broken
at each tap, where the bulk run's work runs from Python (`Applier.apply_at`).
An ablation or a clamp at every block is three or four kernels a block a step
(`Operation.add_change`), each launched from Python: at a 256-request decode
step of an 8B model that host work, not the kernels, is what the steer costs.
At a tap the halves are the engine's graph buffers, at the same addresses at
every replay of a batch size, so the kernels of one steer's edit over the
step's first ``count`` rows are captured into a graph keyed by those addresses
and row count, the second time that key comes, and every later step with the
same buffers and count replays it: the same kernels on the same rows, one
launch.

A graph holds the addresses it was captured on, never tensors: its key is
the addresses, strides, row count and dtype of the halves and the operation
it runs, so a replay edits exactly the rows the eager edit would.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger("streamscope.vllm")

#: This process's captures and replays since it started, for a test that the replayed path runs.
COUNTS = {"captured": 0, "replayed": 0}
#: Graphs one run keeps (a steer's edit at a tap, per batch size the engine replays): past this, edits run eagerly.
LIMIT = 4096


class GraphedEdits:
    """One bulk run's captured edits, by the buffers and rows they edit; made per run, released with it."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.graphs: dict[tuple, Any] = {}
        self.seen: set[tuple] = set()  # the keys met once, not captured yet
        self.limit = limit
        self.stream: Optional[torch.cuda.Stream] = None
        self.pool: Any = None
        #: A capture failed (an operation CUDA graphs cannot hold): this run's edits all run eagerly.
        self.broken = False

    def replay(self, operation: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor], count: int) -> bool:
        """Run ``operation.add_change`` on rows ``:count`` of the halves as a replayed graph; False where it cannot
        (nothing done: the caller edits eagerly)."""
        if self.broken or not hidden.is_cuda:
            return False
        key = (id(operation), hidden.data_ptr(), hidden.stride(), tuple(hidden.shape), hidden.dtype, count,
               None if residual is None else (residual.data_ptr(), residual.stride(), residual.dtype))
        graph = self.graphs.get(key)
        if graph is None:
            # Captured the second time a key comes: a batch that shrinks a request at a time (generations that end
            # at their own lengths) meets each row count once, where a capture would cost more than it saves.
            if key not in self.seen:
                self.seen.add(key)
                return False
            if len(self.graphs) >= self.limit:
                return False
            graph = self._capture(operation, hidden[:count], None if residual is None else residual[:count])
            if graph is None:
                return False
            self.graphs[key] = graph
            COUNTS["captured"] += 1
        graph.replay()
        COUNTS["replayed"] += 1
        return True

    def _capture(self, operation: Any, hidden: torch.Tensor, residual: Optional[torch.Tensor]) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(hidden.device)
            # Every graph of the run shares one pool: none leaves a tensor alive past its replay, and the replays
            # run one after another on the engine's stream.
            self.pool = torch.cuda.graph_pool_handle()
            self._warm_up(self.stream, operation, hidden, residual)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self.stream):
                # Thread-local: the engine's other threads may use CUDA while this thread captures.
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    operation.add_change(hidden, hidden, residual)  # recorded, not run
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001  (the run goes on eagerly, as it would with no graphs at all)
            logger.warning("streamscope: a steer's edit could not be captured in a CUDA graph; this run's edits at "
                           "taps run eagerly", exc_info=True)
            self.broken = True
            return None
        return graph

    @staticmethod
    def _warm_up(stream: torch.cuda.Stream, operation: Any, hidden: torch.Tensor,
                 residual: Optional[torch.Tensor]) -> None:
        # The kernels' libraries set themselves up on their first call on a stream (a cuBLAS handle and its
        # workspace), which a capture must not record: one call on scratch rows of the same dtype first.
        scratch = torch.zeros((2, hidden.shape[-1]), dtype=hidden.dtype, device=hidden.device)
        other = None if residual is None else torch.zeros_like(scratch)
        stream.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(stream):
            operation.add_change(scratch, scratch, other)
        stream.synchronize()
