"""Linearizability: whether steps that ran at the same time, observed with their answers,
are explained by some sequential order of them that the reference model accepts.

The search is Wing and Gong's, with Lowe's memoisation as Porcupine does it: build the
order one step at a time, taking only a step that started before every pending step
ended (a step that finished before another started stays before it), and never visit the
same set of placed steps with the same model state twice. The search is bounded by a
counted number of visited states, never by the wall clock; running out of that budget is
"unknown", which is never reported as a failure.

Generic in the model: ``apply(state, step)`` returns the state after ``step`` when its
observed answer is what the model predicts from ``state``, or a sentence saying why not;
it must not change ``state``. ``key(state)`` returns a hashable value equal for states
that predict the same answers from here on, or None where it cannot tell (that state is
not memoised); no ``key`` at all memoises nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["DEFAULT_MAX_STATES", "Linearization", "Rejection", "TimedStep", "linearize"]

State = TypeVar("State")
Step = TypeVar("Step")

#: Visited states before the search gives up as "unknown". 3 lanes × 5 steps visit a few
#: hundred at most with memoisation; the bound only stops a pathological model key.
DEFAULT_MAX_STATES = 200_000


@dataclass(frozen=True)
class TimedStep(Generic[Step]):
    """One step of a parallel run: its lane, its place in the lane, and when it was
    invoked and answered, as positions on one logical clock that every lane ticks (never
    wall-clock times: the same run orders its events the same way on any machine)."""

    lane: int
    index: int
    started: int
    ended: int
    step: Step

    def __post_init__(self) -> None:
        if self.ended <= self.started:
            message = (
                f"lane {self.lane} step {self.index} ended at {self.ended}, not after it started at {self.started}"
            )
            raise ValueError(message)

    @property
    def name(self) -> str:
        return f"{chr(ord('A') + self.lane) if self.lane < 26 else self.lane}{self.index + 1}"


@dataclass(frozen=True)
class Rejection(Generic[Step]):
    """A step the model refused to place next, and why."""

    step: TimedStep[Step]
    why: str


@dataclass(frozen=True)
class Linearization(Generic[Step]):
    """The verdict on a parallel history.

    ``order`` is a sequential order the model accepts (None when there is none, or when the
    search ran out of budget: ``unknown``). Otherwise ``closest`` is the longest order the
    model accepted and ``breaks`` the steps that could come next there, each with the
    reason the model refused it. ``explored`` counts the states visited."""

    order: tuple[TimedStep[Step], ...] | None
    explored: int
    unknown: bool = False
    closest: tuple[TimedStep[Step], ...] = ()
    breaks: tuple[Rejection[Step], ...] = field(default_factory=tuple)

    @property
    def linearizable(self) -> bool:
        return self.order is not None


class _Budget(Exception):
    """The search visited ``max_states`` states without a verdict."""


def linearize(
    steps: Sequence[TimedStep[Step]],
    initial: State,
    apply: Callable[[State, Step], State | str],
    key: Callable[[State], Hashable] | None = None,
    *,
    max_states: int = DEFAULT_MAX_STATES,
) -> Linearization[Step]:
    """Search an order of ``steps`` that respects their real-time order and that the model
    accepts from ``initial``; see the module's docstring for ``apply`` and ``key``."""
    _check_clock(steps)
    ordered = sorted(steps, key=lambda timed: timed.started)
    seen: set[tuple[int, Hashable]] = set()
    explored = 0
    closest: tuple[TimedStep[Step], ...] = ()
    breaks: tuple[Rejection[Step], ...] = ()
    everything = (1 << len(ordered)) - 1

    def search(done: int, state: State, order: tuple[TimedStep[Step], ...]) -> tuple[TimedStep[Step], ...] | None:
        nonlocal explored, closest, breaks
        if done == everything:
            return order
        state_key = None if key is None else key(state)
        if state_key is not None:
            if (done, state_key) in seen:
                return None
            seen.add((done, state_key))
        explored += 1
        if explored > max_states:
            raise _Budget
        pending = [(bit, timed) for bit, timed in enumerate(ordered) if not done >> bit & 1]
        horizon = min(timed.ended for _, timed in pending)
        rejections: list[Rejection[Step]] = []
        for bit, timed in pending:
            if timed.started > horizon:
                break  # sorted by start: every later step started after a pending one ended
            after = apply(state, timed.step)
            if isinstance(after, str):
                rejections.append(Rejection(timed, after))
                continue
            found = search(done | 1 << bit, after, (*order, timed))
            if found is not None:
                return found
        if rejections and len(order) >= len(closest):
            closest, breaks = order, tuple(rejections)
        return None

    try:
        found = search(0, initial, ())
    except _Budget:
        return Linearization(None, explored, unknown=True, closest=closest, breaks=breaks)
    return Linearization(found, explored, closest=() if found else closest, breaks=() if found else breaks)


def _check_clock(steps: Sequence[TimedStep[Step]]) -> None:
    """Every event has its own tick, and a lane's steps do not overlap."""
    ticks = [tick for timed in steps for tick in (timed.started, timed.ended)]
    if len(set(ticks)) != len(ticks):
        message = "two events share a tick of the logical clock: each invocation and answer needs its own"
        raise ValueError(message)
    lanes: dict[int, list[TimedStep[Step]]] = {}
    for timed in steps:
        lanes.setdefault(timed.lane, []).append(timed)
    for lane in lanes.values():
        lane.sort(key=lambda timed: timed.index)
        for before, after in itertools.pairwise(lane):
            if after.started < before.ended:
                message = f"steps {before.name} and {after.name} overlap, and a lane runs its steps one at a time"
                raise ValueError(message)
