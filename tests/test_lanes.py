"""Lanes of calls run at the same time: every call stamped on one logical clock, the
lanes really overlapping, and a racy counter caught by the linearizability check."""

from __future__ import annotations

import sys
import threading
import time

from shardkit._parallel.lanes import Raised, run_lanes, yield_point
from shardkit._parallel.linearize import TimedStep, linearize


def test_each_lane_runs_its_calls_in_order_and_every_event_has_its_own_tick() -> None:
    calls = [[lambda lane=lane, index=index: (lane, index) for index in range(4)] for lane in range(3)]
    steps = run_lanes(calls)
    assert sorted(timed.step for timed in steps) == [(lane, index) for lane in range(3) for index in range(4)]
    assert all(timed.step == (timed.lane, timed.index) for timed in steps)
    ticks = sorted(tick for timed in steps for tick in (timed.started, timed.ended))
    assert ticks == list(range(24))


def test_lanes_start_together_and_overlap() -> None:
    # Each first call waits for the other lane's first call to have started: they can only
    # both finish if the lanes run at the same time.
    both_started = threading.Barrier(2)
    steps = run_lanes([[lambda: both_started.wait(timeout=60)] for _ in range(2)])
    first, second = sorted(steps, key=lambda timed: timed.lane)
    assert first.started < second.ended
    assert second.started < first.ended


def test_an_exception_is_recorded_as_the_calls_answer_and_the_lane_goes_on() -> None:
    def broken() -> int:
        raise KeyError("session")

    steps = run_lanes([[broken, lambda: 7]])
    assert isinstance(steps[0].step, Raised)
    assert isinstance(steps[0].step.error, KeyError)
    assert steps[1].step == 7


def test_the_switch_interval_is_restored() -> None:
    before = sys.getswitchinterval()
    run_lanes([[lambda: None]], switch_seconds=1e-5)
    assert sys.getswitchinterval() == before


class RacyCounter:
    """Read, then write: an increment that two threads can both base on the same value."""

    def __init__(self) -> None:
        self.value = 0

    def increment(self) -> int:
        seen = self.value
        time.sleep(0)  # gives up the interpreter: the window a real engine's I/O or native call opens
        self.value = seen + 1
        return self.value


class LockedCounter(RacyCounter):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def increment(self) -> int:
        with self.lock:
            return super().increment()


def apply_increment(value: int, answer: int | Raised[int]) -> int | str:
    if isinstance(answer, Raised):
        return f"raised {answer.error!r}"
    return value + 1 if answer == value + 1 else f"answered {answer} after {value}"


def test_a_lost_update_is_caught_by_running_lanes_and_linearizing() -> None:
    # A race shows only sometimes: count the runs that lose an update out of 50, as the
    # parallel phase repeats a suffix. A correct counter is never flagged.
    lost = 0
    for _ in range(50):
        counter = RacyCounter()
        steps = run_lanes([[counter.increment] * 5 for _ in range(2)])
        lost += not linearize(steps, 0, apply_increment, lambda value: value).linearizable
    assert lost > 0

    for _ in range(50):
        locked = LockedCounter()
        steps: list[TimedStep[int | Raised[int]]] = run_lanes([[locked.increment] * 5 for _ in range(2)])
        assert linearize(steps, 0, apply_increment, lambda value: value).linearizable


class YieldingCounter(RacyCounter):
    """The racy counter whose window is a ``yield_point`` instead of a bare thread switch."""

    def increment(self) -> int:
        seen = self.value
        yield_point()
        self.value = seen + 1
        return self.value


class LockedYieldingCounter(LockedCounter, YieldingCounter):
    """The yielding counter under the lock (``LockedCounter.increment`` calls the next one)."""


def test_a_yield_point_makes_a_race_show_on_every_run() -> None:
    # Each lane's read waits at the yield point until the other lane answers or the wait
    # runs out; both then write what they read: one update is lost on every run, where a
    # bare thread switch loses it on most (test above).
    for _ in range(20):
        counter = YieldingCounter()
        steps = run_lanes([[counter.increment] for _ in range(2)])
        assert not linearize(steps, 0, apply_increment, lambda value: value).linearizable


def test_a_yield_point_under_a_lock_waits_at_most_its_bound_and_stays_correct() -> None:
    # The other lane waits for the lock the yielding one holds, so nothing answers while
    # it waits: the wait ends at its bound, and the locked counter loses nothing.
    for _ in range(10):
        locked = LockedYieldingCounter()
        steps: list[TimedStep[int | Raised[int]]] = run_lanes([[locked.increment] * 3 for _ in range(2)])
        assert linearize(steps, 0, apply_increment, lambda value: value).linearizable


def test_a_yield_point_outside_a_phase_does_nothing() -> None:
    counter = YieldingCounter()
    assert [counter.increment() for _ in range(3)] == [1, 2, 3]
    # A thread of its own that is not a lane does not wait either (a server's worker).
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(counter.increment()))
    thread.start()
    thread.join(timeout=60)
    assert done == [4]
