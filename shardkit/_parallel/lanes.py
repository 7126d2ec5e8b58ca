"""Run lanes of calls at the same time, each call stamped on one logical clock.

Every lane is a thread. The lanes wait at a barrier so that they start together, and the
interpreter switches threads far more often than usual while they run, so that calls
overlap inside their critical sections, not only between them. The order of events is
read from a counter every lane ticks, never from the wall clock: which call started
before which other ended is what linearizability is defined on.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from shardkit._parallel.linearize import TimedStep

__all__ = ["FAST_SWITCH_SECONDS", "Raised", "run_lanes"]

T = TypeVar("T")

#: The thread switch interval while lanes run (CPython's default is 5 ms): a call of a
#: few microseconds is then interrupted often enough for a race inside it to show.
FAST_SWITCH_SECONDS = 1e-6


@dataclass(frozen=True)
class Raised(Generic[T]):
    """A call that raised instead of answering: the exception, for the caller to judge."""

    error: BaseException


class _Clock:
    """A counter every lane ticks: one tick per invocation and per answer."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def tick(self) -> int:
        with self._lock:
            tick, self._next = self._next, self._next + 1
            return tick


def run_lanes(
    lanes: Sequence[Sequence[Callable[[], T]]], *, switch_seconds: float = FAST_SWITCH_SECONDS
) -> list[TimedStep[T | Raised[T]]]:
    """Run each lane's calls in order, the lanes at the same time; every call's answer (or
    what it raised) with its lane, its place in the lane, and when it started and ended.
    Returns when every lane has finished."""
    clock = _Clock()
    barrier = threading.Barrier(len(lanes))
    results: list[list[TimedStep[T | Raised[T]]]] = [[] for _ in lanes]

    def run(lane: int) -> None:
        barrier.wait()
        for index, call in enumerate(lanes[lane]):
            started = clock.tick()
            answer: T | Raised[T]
            try:
                answer = call()
            except BaseException as error:  # the caller judges it: an engine's exception is a finding
                answer = Raised(error)
            results[lane].append(TimedStep(lane, index, started, clock.tick(), answer))

    threads = [threading.Thread(target=run, args=(lane,), name=f"shardkit-lane-{lane}") for lane in range(len(lanes))]
    with _switching_every(switch_seconds):
        for thread in threads:
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
