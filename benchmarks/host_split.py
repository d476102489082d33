"""Where a bulk run's host time goes, read from the functions it passes through in this process.

`HostSplit` wraps named functions (module attribute or class method) with timers for as long as it is entered;
`measured` runs a callable and hands back the seconds each named function took within that call, with how often it
ran. With the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as `gpu_workloads.py` sets) the worker's
functions are this process's, so a bulk run splits into its begin, each step's planning, its finish, and the rest
(the engine's own work, the device's included).
"""

from __future__ import annotations

import collections
import functools
import statistics
import time
from typing import Any, Callable

#: What `graph_inproc.py` splits a bulk run into: label -> (owner, attribute). Each is patched where its caller
#: looks it up: the worker's RPC methods call `worker_finish` by the name `bulk_worker` imported.
BULK_PARTS = {
    "begin": ("streamscope.vllm.bulk", "_begin"),
    "step plan": ("streamscope.vllm.bulk:WorkerState", "observe"),
    "of which ops' plan": ("streamscope.vllm.graph_backend:GraphBackend", "step"),
    "finish": ("streamscope.vllm.bulk_worker", "worker_finish"),
}


def _owner(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, name) if name else owner


class HostSplit:
    """Timers around `parts` (label -> (owner path, attribute)) while entered; `measured(name, call)` records each
    run of `call`: every part's calls' seconds, and the run's."""

    def __init__(self, parts: dict[str, tuple[str, str]] = BULK_PARTS) -> None:
        self.parts = parts
        self.each: dict[str, list[float]] = collections.defaultdict(list)  # each call's seconds, per part
        self._saved: list[tuple[Any, str, Any]] = []
        self.runs: dict[str, list[tuple[float, dict[str, list[float]]]]] = collections.defaultdict(list)

    def __enter__(self) -> "HostSplit":
        for label, (path, attribute) in self.parts.items():
            owner = _owner(path)
            original = owner.__dict__[attribute]
            self._saved.append((owner, attribute, original))
            setattr(owner, attribute, self._timed(label, original))
        return self

    def __exit__(self, *_: Any) -> None:
        for owner, attribute, original in reversed(self._saved):
            setattr(owner, attribute, original)
        self._saved.clear()

    def _timed(self, label: str, original: Callable) -> Callable:
        each = self.each

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                each[label].append(time.perf_counter() - start)
        return timed

    def measured(self, name: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call`, recording under `name` each run's seconds and its parts' calls."""
        def run() -> Any:
            self.each.clear()
            start = time.perf_counter()
            try:
                return call()
            finally:
                # copies: the timers go on appending to these lists in runs that are not measured
                self.runs[name].append((time.perf_counter() - start,
                                        {label: list(times) for label, times in self.each.items()}))
        return run

    def report(self, skip_first: int = 1) -> list[str]:
        """Per run name, medians over its runs after the first `skip_first` (the warm-up): the run's seconds, and
        each part's in all, with its calls' count, median (a decode step, where a part runs each step) and slowest
        (a prefill step's); a part that never ran is said so, never shown as no time."""
        lines = []
        for name, runs in self.runs.items():
            kept = runs[skip_first:] or runs
            parts = []
            for label in self.parts:
                calls = [each.get(label, []) for _, each in kept]
                if not any(calls):
                    parts.append(f"{label} not called")
                    continue
                total = statistics.median(sum(times) for times in calls)
                count = statistics.median(len(times) for times in calls)
                described = f"{label} {total * 1e3:.1f} ms"
                if count > 1:
                    typical = statistics.median(statistics.median(times) for times in calls if times)
                    slowest = statistics.median(max(times) for times in calls if times)
                    described += (f" ({total / count * 1e6:.0f} us x {count:.0f}; the median call {typical * 1e6:.0f} "
                                  f"us, the slowest {slowest * 1e3:.2f} ms)")
                parts.append(described)
            run_total = statistics.median(total for total, _ in kept)
            lines.append(f"  {name}: total {run_total:.3f} s; " + ", ".join(parts))
        return lines


class HostDelay:
    """While entered, each step's plan in a bulk run (`WorkerState.observe`) holds the host `seconds` longer,
    busy (as the plan's own work holds the GIL): a run's time grows by that times its steps where the plan's host
    time is on the step's critical path, and by less where the engine overlaps it with the device's work."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps = 0
        self._saved: Any = None

    def __enter__(self) -> "HostDelay":
        from streamscope.vllm.bulk import WorkerState

        original = self._saved = WorkerState.__dict__["observe"]
        delay = self

        def delayed(state: Any, scheduler_output: Any) -> None:
            original(state, scheduler_output)
            delay.steps += 1
            until = time.perf_counter() + delay.seconds
            while time.perf_counter() < until:
                pass
        WorkerState.observe = delayed
        return self

    def __exit__(self, *_: Any) -> None:
        from streamscope.vllm.bulk import WorkerState

        WorkerState.observe = self._saved

    def run(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call` with the delay on, counting its steps anew."""
        def delayed() -> Any:
            self.steps = 0
            with self:
                return call()
        return delayed
