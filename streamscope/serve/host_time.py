"""Where a server's engine spends host time on streamscope's work, step by step (for `benchmarks/serve_load.py`).

With ``STREAMSCOPE_SERVE_HOST_TIME=1`` in the server's environment, the
worker times its parts of every step: planning the step (``plan``: the
scheduler's new and finished requests, each hook's rows), the hooks' edits
and reads (``hooks``), handing the step's harvested rows to host memory
(``send``), and, on its own thread, storing rows and writing harvest files
(``writer``), beside the whole ``execute_model`` call (``step``); within
``plan``, the requests that came in (``enter``) and, with graph ops, the
plan's index filled (``fill``) and copied to the device (``copy``: on a GPU
its wait for a staging buffer, ``wait``, the buffer's fill, ``pack``, the
copies' launch, ``launch``, and their event, ``event``); ``plan`` and
``copy`` also by the thread's CPU clock (``plan_cpu``, ``copy_cpu``: wall
time above it is time the thread waited, for the GIL or a blocking call);
``step`` and ``plan`` also over the steps that run prompt rows alone
(``step_prefill``, ``plan_prefill``, and their count, ``prefill_steps``). Every
`INTERVAL` seconds, while the counts move, it prints one line of running totals to
stderr with the wall clock::

    streamscope host time 1733100000.123 steps=812 step=9.41 plan=0.21 hooks=0.05 send=0.00 writer=0.00 enter=0.02 fill=0.10 copy=0.04

(seconds, except ``steps``). A load generator that knows when each of its
runs began and ended takes the difference of the last lines before and after
it: the counts move only while the engine steps. Off by default: the timing
is a clock read around each part.

The front end's middleware, with the same variable set, prints its own
totals (`FrontTime`): per kind of completion request, the time from its
arrival to its hand-over to vLLM and from there to its first body bytes.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable

import torch

#: The environment variable that turns the timing on in the engine's processes.
ENVIRONMENT = "STREAMSCOPE_SERVE_HOST_TIME"
#: The start of each printed line, for a reader of the server's log.
PREFIX = "streamscope host time"
PARTS = ("step", "plan", "hooks", "send", "writer", "enter", "fill", "copy", "wait", "pack", "launch", "event",
         "plan_cpu", "copy_cpu", "step_prefill", "plan_prefill")
#: The parts also timed by the thread's own CPU clock (``<part>_cpu``): where a part's wall time is well above it, its
#: thread waited inside it (for the GIL another thread held, or in a blocking call), not computed.
CPU_TIMED = ("plan", "copy")
#: The parts also totalled over the steps that run prompt rows (``<part>_prefill``: a step of more rows than requests;
#: the rest decode one row a request): a request's time to its first token is spent in those.
PREFILL_SPLIT = ("step", "plan")
#: Counts summed over the steps beside the seconds: the batch's rows (scheduled tokens), its requests, and whether it
#: ran prompt rows. A run whose steps are more for the same tokens ran smaller batches: its requests reached the
#: engine later, or left it later.
COUNTS = ("rows", "requests", "prefill_steps")
#: Seconds between the checks that print the totals when they have changed.
INTERVAL = 0.5


def wanted() -> bool:
    return os.environ.get(ENVIRONMENT, "") not in ("", "0")


#: The environment variable that has the engine's process say where the host waits for the device (`watch_syncs`).
SYNC_ENVIRONMENT = "STREAMSCOPE_SERVE_SYNC_DEBUG"
#: The start of each printed stack.
SYNC_PREFIX = "streamscope device wait"


def watch_syncs() -> None:
    """Print each distinct Python stack at which the host waits for the device (torch's sync debug mode) to stderr,
    at its 1st, 10th, 100th, ... time: a wait on the engine's thread leaves the device idle until the host has
    queued the next work. A diagnostic for a load generator's run (its own waits cost a stack walk each)."""
    counts: dict[tuple[str, ...], int] = {}
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            shown(message, category, filename, lineno, file, line)
            return
        stack = tuple(f"{frame.filename}:{frame.lineno} {frame.name}" for frame in traceback.extract_stack()[:-1]
                      if not frame.filename.endswith("warnings.py"))[-14:]
        count = counts[stack] = counts.get(stack, 0) + 1
        if count in (1, 10, 100, 1000, 10000, 100000):
            print(f"{SYNC_PREFIX} (time {count}, thread {threading.current_thread().name}): {message}\n    "
                  + "\n    ".join(stack), file=sys.stderr, flush=True)

    warnings.showwarning = show
    warnings.filterwarnings("always", message=".*synchroniz.*")
    torch.cuda.set_sync_debug_mode("warn")


class HostTime:
    """Running totals of host seconds per part, printed twice a second while they change."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.totals = dict.fromkeys(PARTS + COUNTS, 0.0)
        self.steps = 0
        #: Whether the step being timed runs prompt rows (`counted` sets it from the step's schedule).
        self.prefill = False
        self.interval = interval
        self.printed: tuple = ()
        threading.Thread(target=self._print_while_changing, name="streamscope-host-time", daemon=True).start()

    def timed(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function`, adding the seconds of each call to `part`'s total (and a step to the count for "step"); for a
        part of `CPU_TIMED`, its thread's CPU seconds to ``<part>_cpu`` too."""
        totals, clock, thread = self.totals, time.perf_counter, time.thread_time
        on_cpu = f"{part}_cpu" if part in CPU_TIMED else None
        split = f"{part}_prefill" if part in PREFILL_SPLIT else None

        def call(*args: Any, **kwargs: Any) -> Any:
            if part == "step":
                self.prefill = False  # until the step's schedule says (a step with none runs no prompt row)
            start, began = clock(), (thread() if on_cpu else 0.0)
            try:
                return function(*args, **kwargs)
            finally:
                seconds = clock() - start
                totals[part] += seconds
                if split and self.prefill:
                    totals[split] += seconds
                if on_cpu:
                    totals[on_cpu] += thread() - began
                if part == "step":
                    self.steps += 1
                    totals["prefill_steps"] += self.prefill

        return call

    def counted(self, function: Callable[[Any], Any], batch: Callable[[Any], tuple[int, int]]) -> Callable[[Any], Any]:
        """`function` of a step's scheduler output, adding the step's rows and requests (`batch` of the output) to
        their totals, and noting whether the step runs prompt rows (more rows than requests) for `PREFILL_SPLIT`."""
        totals = self.totals

        def call(scheduler_output: Any) -> Any:
            rows, requests = batch(scheduler_output)
            totals["rows"] += rows
            totals["requests"] += requests
            self.prefill = rows > requests
            return function(scheduler_output)

        return call

    def line(self) -> str:
        parts = " ".join(f"{part}={self.totals[part]:.6f}" for part in PARTS + COUNTS)
        return f"{PREFIX} {time.time():.3f} steps={self.steps} {parts}"

    def _print_while_changing(self) -> None:
        while True:
            time.sleep(self.interval)
            now = (self.steps, *self.totals.values())
            if now != self.printed:
                self.printed = now
                print(self.line(), file=sys.stderr, flush=True)


def install(state: Any, batch: Callable[[Any], tuple[int, int]]) -> HostTime:
    """Time the parts of a server worker's steps (`streamscope.serve.worker.ServeState` `state`), on the instance:
    ``plan`` (the step's plan, within it ``enter``, the requests that came in, and with graph ops ``fill``, the
    plan's index filled on the host, and ``copy``, its copy to the device, within it ``wait``, for the staging
    buffer of two steps before, ``pack``, ``launch`` and ``event``, its parts on a GPU), ``hooks``, ``send`` (the
    step's harvest handed over) and ``writer`` (the writer thread's work); and each step's rows and requests
    (`batch` of its scheduler output)."""
    clock = HostTime()
    state.observe = clock.counted(clock.timed("plan", state.observe), batch)
    state.admit = clock.timed("enter", state.admit)
    state.admit_live = clock.timed("enter", state.admit_live)
    state.apply = clock.timed("hooks", state.apply)
    state.send = clock.timed("send", state.send)
    state.send_graph = clock.timed("send", state.send_graph)
    state.writer_thread.take = clock.timed("writer", state.writer_thread.take)
    plan = getattr(state.graph, "plan", None)
    if plan is not None:
        plan._fill_rows = clock.timed("fill", plan._fill_rows)
        plan._copy = clock.timed("copy", plan._copy)
        plan._wait_for = clock.timed("wait", plan._wait_for)
        plan._pack = clock.timed("pack", plan._pack)
        plan._launch = clock.timed("launch", plan._launch)
        plan._mark = clock.timed("event", plan._mark)
    return clock


# Every field with its full count of decimals: the engine's other processes write to the same log, and a line of
# theirs may start right after ours without a newline between them.
LINE = re.compile(re.escape(PREFIX) + r" (\d+\.\d{3}) steps=(\d+)"
                  + "".join(rf" {part}=(\d+\.\d{{6}})" for part in PARTS + COUNTS))


def parse(line: str) -> tuple[float, dict[str, float]] | None:
    """A printed line's wall clock and totals (``steps`` among them); None for a line another process broke."""
    found = LINE.search(line)
    if found is None:
        return None
    stamp, steps, *seconds = found.groups()
    return float(stamp), {"steps": float(steps), **{part: float(value) for part, value in zip(PARTS + COUNTS, seconds)}}


#: The start of the front end's lines (`FrontTime`).
FRONT_PREFIX = "streamscope front time"
#: The kinds of completion request the front end times: with no streamscope field, and with one.
KINDS = ("plain", "streamscope")


class FrontTime:
    """Per kind of completion request through the front end's middleware (`streamscope.serve.server`), running
    totals of the seconds from its arrival to its hand-over to vLLM's app (``admit``: reading its body, checking its
    streamscope field, the plan) and from there to its answer's first body bytes (``first``: vLLM and the engine,
    the time to its first token for a stream); printed like `HostTime`'s::

        streamscope front time 1733100000.123 plain=256,0.031000,120.500000 streamscope=256,0.290000,131.200000

    (requests, then the two totals in seconds, per kind).
    """

    def __init__(self, interval: float = INTERVAL) -> None:
        self.totals = {kind: [0, 0.0, 0.0] for kind in KINDS}
        self.interval = interval
        self.printed: tuple = ()
        threading.Thread(target=self._print_while_changing, name="streamscope-front-time", daemon=True).start()

    def handed(self, kind: str, arrived: float, send: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Count a request of `kind` that arrived at `arrived` (``time.perf_counter()``) and is handed to vLLM now;
        the `send` that adds its time to its first body bytes."""
        now = time.perf_counter()
        totals = self.totals[kind]
        totals[0] += 1
        totals[1] += now - arrived
        first = True

        async def timed(message: Any) -> None:
            nonlocal first
            if first and message.get("type") == "http.response.body":
                first = False
                totals[2] += time.perf_counter() - now
            await send(message)

        return timed

    def line(self) -> str:
        parts = " ".join(f"{kind}={count},{admit:.6f},{first:.6f}" for kind, (count, admit, first)
                         in self.totals.items())
        return f"{FRONT_PREFIX} {time.time():.3f} {parts}"

    def _print_while_changing(self) -> None:
        while True:
            time.sleep(self.interval)
            now = tuple(value for totals in self.totals.values() for value in totals)
            if now != self.printed:
                self.printed = now
                print(self.line(), file=sys.stderr, flush=True)


FRONT_LINE = re.compile(re.escape(FRONT_PREFIX) + r" (\d+\.\d{3})"
                        + "".join(rf" {kind}=(\d+),(\d+\.\d{{6}}),(\d+\.\d{{6}})" for kind in KINDS))


def parse_front(line: str) -> tuple[float, dict[str, tuple[int, float, float]]] | None:
    """A front-end line's wall clock and totals per kind, ``(requests, admit, first)``; None for a broken line."""
    found = FRONT_LINE.search(line)
    if found is None:
        return None
    stamp, *values = found.groups()
    return float(stamp), {kind: (int(values[3 * number]), float(values[3 * number + 1]), float(values[3 * number + 2]))
                          for number, kind in enumerate(KINDS)}
