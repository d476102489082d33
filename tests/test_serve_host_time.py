"""The serve worker's host-time totals (`streamscope.serve.host_time`): what a load generator reads per run."""

import time
import warnings

import pytest
import torch

from streamscope.serve import host_time


class Clock:
    """A clock the timed functions move on by what they say, so no figure depends on this machine's speed."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_each_part_adds_its_calls_seconds_and_a_step_counts_once(monkeypatch):
    clock, cpu = Clock(), Clock()
    monkeypatch.setattr(host_time.time, "perf_counter", clock)
    monkeypatch.setattr(host_time.time, "thread_time", cpu)
    totals = host_time.HostTime(interval=3600)  # its printing thread stays asleep for the test

    def busy(seconds):
        clock.now += seconds
        cpu.now += seconds
        return seconds

    step = totals.timed("step", busy)
    plan = totals.timed("plan", busy)
    assert step(0.25) == 0.25 and plan(0.125) == 0.125 and step(0.5) == 0.5
    assert totals.steps == 2
    assert totals.totals == {"step": 0.75, "plan": 0.125, "hooks": 0.0, "send": 0.0, "writer": 0.0, "enter": 0.0,
                             "fill": 0.0, "copy": 0.0, "wait": 0.0, "pack": 0.0, "launch": 0.0, "event": 0.0,
                             "plan_cpu": 0.125, "copy_cpu": 0.0, "step_prefill": 0.0, "plan_prefill": 0.0,
                             "rows": 0.0, "requests": 0.0, "prefill_steps": 0.0}


def test_plan_and_copy_are_also_timed_by_the_thread_s_cpu_clock(monkeypatch):
    """A part of `CPU_TIMED` adds its thread's CPU seconds beside its wall seconds: a call that waits (the wall clock
    moves, the thread's CPU clock does not) shows as wall time above CPU time; other parts have no CPU total."""
    wall, cpu = Clock(), Clock()
    monkeypatch.setattr(host_time.time, "perf_counter", wall)
    monkeypatch.setattr(host_time.time, "thread_time", cpu)
    totals = host_time.HostTime(interval=3600)

    def waits_then_works(waited, worked):
        wall.now += waited + worked
        cpu.now += worked

    totals.timed("copy", waits_then_works)(0.375, 0.125)
    totals.timed("plan", waits_then_works)(0.0, 0.5)
    totals.timed("send", waits_then_works)(0.25, 0.25)
    assert totals.totals["copy"] == 0.5 and totals.totals["copy_cpu"] == 0.125
    assert totals.totals["plan"] == 0.5 and totals.totals["plan_cpu"] == 0.5
    assert totals.totals["send"] == 0.5 and "send_cpu" not in totals.totals


def test_a_part_that_raises_is_still_timed(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(host_time.time, "perf_counter", clock)
    totals = host_time.HostTime(interval=3600)

    def fails():
        clock.now += 0.5
        raise KeyError("x")

    with pytest.raises(KeyError):
        totals.timed("send", fails)()
    assert totals.totals["send"] == 0.5


def test_a_printed_line_reads_back_as_its_clock_and_totals():
    clock = host_time.HostTime(interval=3600)
    clock.totals.update(step=1.5, plan=0.25, hooks=0.125, send=0.0625, writer=2.0, enter=0.5, fill=0.75, copy=0.375,
                        wait=0.03125, pack=0.0075, launch=0.015, event=0.002, plan_cpu=0.125, copy_cpu=0.25,
                        step_prefill=0.5, plan_prefill=0.0625, rows=4096.0, requests=70.0, prefill_steps=2.0)
    clock.steps = 7
    before = time.time()
    stamp, totals = host_time.parse("engine log prefix: " + clock.line())
    assert before - 1 <= stamp <= time.time() + 1
    assert totals == {"steps": 7.0, "step": 1.5, "plan": 0.25, "hooks": 0.125, "send": 0.0625, "writer": 2.0,
                      "enter": 0.5, "fill": 0.75, "copy": 0.375, "wait": 0.03125, "pack": 0.0075,
                      "launch": 0.015, "event": 0.002, "plan_cpu": 0.125, "copy_cpu": 0.25, "step_prefill": 0.5,
                      "plan_prefill": 0.0625, "rows": 4096.0, "requests": 70.0, "prefill_steps": 2.0}


def test_a_step_s_batch_is_counted_beside_its_plan_s_time():
    clock = host_time.HostTime(interval=3600)
    seen = []
    observe = clock.counted(clock.timed("plan", seen.append), lambda output: (output["rows"], output["requests"]))
    observe({"rows": 576, "requests": 64})
    observe({"rows": 63, "requests": 63})
    assert len(seen) == 2 and clock.totals["rows"] == 639.0 and clock.totals["requests"] == 127.0
    assert host_time.parse(clock.line())[1]["rows"] == 639.0


def test_steps_that_run_prompt_rows_are_totalled_apart(monkeypatch):
    """A step of more rows than requests runs prompt rows: its step and plan seconds also go to ``step_prefill`` and
    ``plan_prefill`` and it counts in ``prefill_steps``; a decode step (a row a request), and a step whose schedule
    never came, do not."""
    clock = Clock()
    monkeypatch.setattr(host_time.time, "perf_counter", clock)
    monkeypatch.setattr(host_time.time, "thread_time", clock)
    totals = host_time.HostTime(interval=3600)

    def planned(output):
        clock.now += 0.125

    observe = totals.counted(totals.timed("plan", planned), lambda output: (output["rows"], output["requests"]))

    def run(output, seconds):
        if output is not None:
            observe(output)
        clock.now += seconds

    step = totals.timed("step", run)
    step({"rows": 576, "requests": 64}, 1.0)  # prompt rows beside decodes
    step({"rows": 63, "requests": 63}, 0.5)  # decodes only
    step(None, 0.25)  # no schedule seen: not a prefill step, whatever the last was
    assert totals.steps == 3 and totals.totals["prefill_steps"] == 1.0
    assert totals.totals["step"] == 2.0 and totals.totals["step_prefill"] == 1.125  # each plan within its step
    assert totals.totals["plan"] == 0.25 and totals.totals["plan_prefill"] == 0.125


def test_a_line_run_into_by_another_process_still_reads_and_a_cut_one_is_skipped():
    clock = host_time.HostTime(interval=3600)
    clock.totals.update(writer=1.201501)
    clock.steps = 3
    joined = clock.line() + "(APIServer pid=12) INFO 12-02 04:45:01 [loggers.py:123] Engine 000: ..."
    _, totals = host_time.parse(joined)
    assert totals["writer"] == 1.201501 and totals["steps"] == 3.0
    assert host_time.parse(clock.line()[:-3]) is None
    assert host_time.parse("(APIServer pid=12) INFO unrelated") is None


def test_the_timing_is_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(host_time.ENVIRONMENT, raising=False)
    assert not host_time.wanted()
    monkeypatch.setenv(host_time.ENVIRONMENT, "0")
    assert not host_time.wanted()
    monkeypatch.setenv(host_time.ENVIRONMENT, "1")
    assert host_time.wanted()


def test_the_front_end_counts_each_request_its_time_here_and_to_its_first_bytes(monkeypatch):
    """A request's time from its arrival to vLLM (`handed`), then to its answer's first body bytes (not its start,
    not a later chunk), per kind; the printed line reads back the same."""
    import asyncio

    clock = Clock()
    monkeypatch.setattr(host_time.time, "perf_counter", clock)
    front = host_time.FrontTime(interval=3600)
    sent = []

    async def send(message):
        sent.append(message["type"])

    async def request():
        clock.now += 0.25  # (checks) between its arrival at 100.0 and its hand-over
        timed = front.handed("streamscope", 100.0, send)
        clock.now += 0.5
        await timed({"type": "http.response.start"})
        clock.now += 1.0
        await timed({"type": "http.response.body", "body": b"data: 1", "more_body": True})
        clock.now += 8.0
        await timed({"type": "http.response.body", "body": b"", "more_body": False})

    asyncio.run(request())
    assert sent == ["http.response.start", "http.response.body", "http.response.body"]
    assert front.totals == {"plain": [0, 0.0, 0.0], "streamscope": [1, 0.25, 1.5]}
    _, totals = host_time.parse_front("front end log: " + front.line())
    assert totals == {"plain": (0, 0.0, 0.0), "streamscope": (1, 0.25, 1.5)}
    assert host_time.parse_front(front.line()[:-4]) is None


def test_a_wait_for_the_device_prints_its_stack_once_then_at_each_power_of_ten(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)  # (no device here)

    def waits_for_the_device():
        warnings.warn("called a synchronizing CUDA operation")

    with warnings.catch_warnings():  # (restores the hook and the filters it changes)
        host_time.watch_syncs()
        for _ in range(12):
            waits_for_the_device()
        warnings.warn("something else")
    printed = capsys.readouterr().err
    assert printed.count(host_time.SYNC_PREFIX) == 2  # its 1st and 10th time
    assert "(time 1, thread MainThread)" in printed and "(time 10," in printed
    assert "waits_for_the_device\n" in printed and "warnings.py" not in printed
    assert "something else" not in printed  # another warning goes on to the hook before it
