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

#: What `graph_serve.py --in-process` splits a bulk run into: label -> (owner, attribute).
BULK_PARTS = {
    "begin": ("streamscope.vllm.bulk", "_begin"),
    "step plan": ("streamscope.vllm.bulk:WorkerState", "observe"),
    "of which ops' plan": ("streamscope.vllm.graph_backend:GraphBackend", "step"),
    "finish": ("streamscope.vllm.bulk", "worker_finish"),
}


def _owner(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, name) if name else owner


class HostSplit:
    """Timers around `parts` (label -> (owner path, attribute)) while entered; `measured(call)` splits one call."""

    def __init__(self, parts: dict[str, tuple[str, str]] = BULK_PARTS) -> None:
        self.parts = parts
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.each: dict[str, list[float]] = collections.defaultdict(list)  # each call's seconds, per part
        self._saved: list[tuple[Any, str, Any]] = []
        self.runs: dict[str, list[dict[str, float]]] = collections.defaultdict(list)

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
        seconds, calls, each = self.seconds, self.calls, self.each

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                seconds[label] += took
                calls[label] += 1
                each[label].append(took)
        return timed

    def measured(self, name: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call`, recording under `name` each run's seconds in every part and in all (``"total"``)."""
        def run() -> Any:
            self.seconds.clear()
            self.calls.clear()
            self.each.clear()
            start = time.perf_counter()
            try:
                return call()
            finally:
                record = {label: self.seconds.get(label, 0.0) for label in self.parts}
                record.update({f"{label} calls": float(self.calls.get(label, 0)) for label in self.parts})
                # the median call (a decode step, where a part runs each step) and the slowest (a prefill step's)
                record.update({f"{label} median": statistics.median(self.each[label]) if self.each.get(label) else 0.0
                               for label in self.parts})
                record.update({f"{label} max": max(self.each[label], default=0.0) for label in self.parts})
                record["total"] = time.perf_counter() - start
                self.runs[name].append(record)
        return run

    def report(self, skip_first: int = 1) -> list[str]:
        """Per run name, the median of each part over its runs after the first `skip_first` (the warm-up)."""
        lines = []
        for name, runs in self.runs.items():
            kept = runs[skip_first:] or runs
            median = {key: statistics.median(run[key] for run in kept) for key in kept[0]}
            parts = []
            for label in self.parts:
                calls = median[f"{label} calls"]
                each = (f" ({median[label] / calls * 1e6:.0f} us x {calls:.0f}; the median call "
                        f"{median[f'{label} median'] * 1e6:.0f} us, the slowest {median[f'{label} max'] * 1e3:.2f} ms)"
                        if calls > 1 else "")
                parts.append(f"{label} {median[label] * 1e3:.1f} ms{each}")
            lines.append(f"  {name}: total {median['total']:.3f} s; " + ", ".join(parts))
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
