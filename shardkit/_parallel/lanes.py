"""Run lanes of calls at the same time, each call stamped on one logical clock.

Every lane is a thread. The lanes wait at a barrier so that they start together, and the
interpreter switches threads far more often than usual while they run, so that calls
overlap inside their critical sections, not only between them. The order of events is
read from a counter every lane ticks, never from the wall clock: which call started
before which other ended is what linearizability is defined on.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from shardkit._core.lane_context import in_parallel_phase, set_lane_clock, yield_point
from shardkit._parallel.linearize import TimedStep
from shardkit._public import settle

__all__ = [
    "FAST_SWITCH_SECONDS",
    "LANES_IN_CALL_SECONDS",
    "YIELD_POINT_SECONDS",
    "Raised",
    "in_parallel_phase",
    "run_lanes",
    "yield_point",
]

T = TypeVar("T")

#: The thread switch interval while lanes run (CPython's default is 5 ms): a call of a
#: few microseconds is then interrupted often enough for a race inside it to show.
FAST_SWITCH_SECONDS = 1e-6
#: The longest a ``yield_point`` waits, once every other lane is inside a call, for one of them
#: to answer or to reach a yield point too: one may be waiting for a lock the caller holds,
#: and then nothing it does can end the wait. Long enough for a lane that a busy machine has
#: descheduled to run again; spent only where a lane waits for such a lock. Scheduling
#: only: which call ran when is read from the logical clock, never from this.
YIELD_POINT_SECONDS = 0.05
#: A safety net only: the longest a ``yield_point`` waits for the other lanes to be inside a
#: call. A lane outside one is between two calls or not yet at its first: it holds nothing
#: and needs nothing, so it comes in as soon as it is scheduled.
LANES_IN_CALL_SECONDS = 10.0

_LEADS = itertools.count()


@dataclass(frozen=True)
class Raised(Generic[T]):
    """A call that raised instead of answering: the exception, for the caller to judge."""

    error: BaseException


class _Clock:
    """A counter every lane ticks: one tick per invocation and per answer."""

    def __init__(self, lanes: int) -> None:
        self._next = 0
        self._answers = 0
        self._running = lanes
        self._between_calls = lanes  # running lanes not inside a call
        self._yielding = 0  # lanes waiting in a yield point
        self._meetings = 0  # times every running lane was in a yield point at once
        self._changed = threading.Condition()

    def tick(self, *, answered: bool = False) -> int:
        with self._changed:
            tick, self._next = self._next, self._next + 1
            self._answers += answered
            self._between_calls += 1 if answered else -1
            self._changed.notify_all()
            return tick

    def lane_done(self) -> None:
        with self._changed:
            self._running -= 1
            self._between_calls -= 1
            self._changed.notify_all()

    def wait_for_an_answer(self) -> None:
        """Called inside a call: first until every other running lane is inside a call too,
        then until one of them answers, or all of them wait in a yield point too (or have, all at
        once, since this one came in), or they have finished (at most ``YIELD_POINT_SECONDS``).
        So the other lanes' calls reach their own windows before this one closes, however late a
        busy machine schedules them."""
        with self._changed:
            self._changed.wait_for(lambda: self._between_calls <= 0, LANES_IN_CALL_SECONDS)
            answers, meetings = self._answers, self._meetings
            self._yielding += 1
            # The last lane in makes a meeting: the others may wake after it has left again.
            self._meetings += self._yielding >= self._running
            self._changed.notify_all()
            try:
                self._changed.wait_for(
                    lambda: self._answers != answers or self._meetings != meetings or self._yielding >= self._running,
                    YIELD_POINT_SECONDS,
                )
            finally:
                self._yielding -= 1


def run_lanes(
    lanes: Sequence[Sequence[Callable[[], T]]], *, switch_seconds: float = FAST_SWITCH_SECONDS
) -> list[TimedStep[T | Raised[T]]]:
    """Run each lane's calls in order, the lanes at the same time; every call's answer (or
    what it raised) with its lane, its place in the lane, and when it started and ended.
    Returns when every lane has finished."""
    clock = _Clock(len(lanes))
    barrier = threading.Barrier(len(lanes))
    results: list[list[TimedStep[T | Raised[T]]]] = [[] for _ in lanes]

    def run(lane: int) -> None:
        set_lane_clock(clock)
        try:
            barrier.wait()
            for index, call in enumerate(lanes[lane]):
                started = clock.tick()
                answer: T | Raised[T]
                try:
                    answer = call()
                except BaseException as error:  # the caller judges it: an engine's exception is a finding
                    answer = Raised(error)
                results[lane].append(TimedStep(lane, index, started, clock.tick(answered=True), answer))
        finally:
            clock.lane_done()
            set_lane_clock(None)

    threads = [threading.Thread(target=run, args=(lane,), name=f"shardkit-lane-{lane}") for lane in range(len(lanes))]
    # The thread that reaches the barrier last runs on at once while the others wake up, so
    # its lane's first call tends to come first. Each run starts the lanes from the next
    # one in turn: over a phase's runs (and a replay's) each lane gets to lead.
    lead = next(_LEADS) % len(lanes)
    with _switching_every(switch_seconds):
        for thread in threads[lead:] + threads[:lead]:
            thread.start()
        for thread in threads:
            thread.join()
    return [timed for lane in results for timed in lane]


@contextmanager
def _switching_every(seconds: float) -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


settle(__name__, globals())
