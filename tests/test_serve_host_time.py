"""The serve worker's host-time totals (`streamscope.serve.host_time`): what a load generator reads per run."""

import time

from streamscope.serve import host_time


def test_each_part_adds_its_calls_seconds_and_a_step_counts_once():
    clock = host_time.HostTime(interval=3600)  # its printing thread stays asleep for the test

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return seconds

    step = clock.timed("step", busy)
    plan = clock.timed("plan", busy)
    assert step(0.02) == 0.02 and plan(0.01) == 0.01 and step(0.02) == 0.02
    assert clock.steps == 2
    assert 0.04 <= clock.totals["step"] < 0.2 and 0.01 <= clock.totals["plan"] < 0.1
    assert clock.totals["hooks"] == clock.totals["send"] == clock.totals["writer"] == 0.0


def test_a_part_that_raises_is_still_timed():
    clock = host_time.HostTime(interval=3600)

    def fails():
        raise KeyError("x")

    try:
        clock.timed("send", fails)()
    except KeyError:
        pass
    assert clock.totals["send"] > 0.0


def test_a_printed_line_reads_back_as_its_clock_and_totals():
    clock = host_time.HostTime(interval=3600)
    clock.totals.update(step=1.5, plan=0.25, hooks=0.125, send=0.0625, writer=2.0)
    clock.steps = 7
    before = time.time()
    stamp, totals = host_time.parse("engine log prefix: " + clock.line())
    assert before - 1 <= stamp <= time.time() + 1
    assert totals == {"steps": 7.0, "step": 1.5, "plan": 0.25, "hooks": 0.125, "send": 0.0625, "writer": 2.0}


def test_the_timing_is_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(host_time.ENVIRONMENT, raising=False)
    assert not host_time.wanted()
    monkeypatch.setenv(host_time.ENVIRONMENT, "0")
    assert not host_time.wanted()
    monkeypatch.setenv(host_time.ENVIRONMENT, "1")
    assert host_time.wanted()
