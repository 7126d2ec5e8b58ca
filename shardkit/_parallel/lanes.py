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

from shardkit._parallel.linearize import TimedStep

__all__ = ["FAST_SWITCH_SECONDS", "YIELD_POINT_SECONDS", "Raised", "run_lanes", "yield_point"]

T = TypeVar("T")

#: The thread switch interval while lanes run (CPython's default is 5 ms): a call of a
#: few microseconds is then interrupted often enough for a race inside it to show.
FAST_SWITCH_SECONDS = 1e-6
#: The longest a ``yield_point`` waits for another lane: the others may be waiting for a lock
#: the caller holds, and then nothing they do can end the wait. Scheduling only: which call
#: ran when is read from the logical clock, never from this.
YIELD_POINT_SECONDS = 0.002

_lane = threading.local()
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
        self._changed = threading.Condition()

    def tick(self, *, answered: bool = False) -> int:
        with self._changed:
            tick, self._next = self._next, self._next + 1
            self._answers += answered
            self._changed.notify_all()
            return tick

    def lane_done(self) -> None:
        with self._changed:
            self._running -= 1
            self._changed.notify_all()

    def wait_for_an_answer(self) -> None:
        """Until another lane's call answers or every other lane has finished (at most
        ``YIELD_POINT_SECONDS``)."""
        with self._changed:
            answers = self._answers
            self._changed.wait_for(lambda: self._answers != answers or self._running <= 1, YIELD_POINT_SECONDS)


def yield_point() -> None:
    """Give the other lanes of a parallel phase a turn: called by an engine inside a
    critical section (between reading shared state and writing it back), it waits until
    a call of another lane has answered, so a race there shows on most runs, not once in
    many. It does nothing outside a parallel phase, and costs nothing to leave in an
    engine: a sequential run, a server and production never wait in it."""
    clock = getattr(_lane, "clock", None)
    if clock is not None:
        clock.wait_for_an_answer()


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
        _lane.clock = clock
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
            del _lane.clock

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
