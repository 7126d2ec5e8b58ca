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


class _Node(Generic[Step]):
    """One step of the order being built, linked to the steps before it: the order shares
    its prefix with every order the search took it from, so keeping one costs one node, not
    a copy of the whole order (the longest order seen is kept this way too)."""

    __slots__ = ("length", "parent", "slot", "timed")

    def __init__(self, timed: TimedStep[Step], slot: int, parent: _Node[Step] | None) -> None:
        self.timed = timed
        self.slot = slot
        self.parent = parent
        self.length: int = 1 if parent is None else parent.length + 1


def _steps_of(node: _Node[Step] | None) -> tuple[TimedStep[Step], ...]:
    steps: list[TimedStep[Step]] = []
    while node is not None:
        steps.append(node.timed)
        node = node.parent
    return tuple(reversed(steps))


@dataclass
class _Frame(Generic[State, Step]):
    """A state the search stands in: the candidates it may place next and how far it got."""

    state: State
    candidates: list[tuple[int, TimedStep[Step]]]
    tried: int = 0
    rejections: list[Rejection[Step]] = field(default_factory=list)


def linearize(
    steps: Sequence[TimedStep[Step]],
    initial: State,
    apply: Callable[[State, Step], State | str],
    key: Callable[[State], Hashable] | None = None,
    *,
    max_states: int = DEFAULT_MAX_STATES,
) -> Linearization[Step]:
    """Search an order of ``steps`` that respects their real-time order and that the model
    accepts from ``initial``; see the module's docstring for ``apply`` and ``key``.

    The search is a depth-first walk with its own stack, never Python's: an order is as
    long as the steps (8 lanes of 1,000 calls, the most a trace may hold, make 8,001 with
    the metrics after them), far deeper than the interpreter's recursion limit. Only the
    first pending step of each lane can be placed next (a lane's later steps started after
    it ended), so each state costs the lanes, not the steps, and is remembered by how many
    steps of each lane it has placed."""
    _check_clock(steps)
    lanes = _lanes_of(steps)
    total = sum(len(lane) for lane in lanes)
    placed = [0] * len(lanes)
    seen: set[tuple[tuple[int, ...], Hashable]] = set()
    explored = 0
    path: _Node[Step] | None = None
    closest: _Node[Step] | None = None
    breaks: tuple[Rejection[Step], ...] = ()
    frames: list[_Frame[State, Step]] = []
    state = initial
    while True:
        # Stand in ``state``, reached by ``path``: the whole order, a state met before, or a new one.
        if (path is not None and path.length == total) or total == 0:
            return Linearization(_steps_of(path), explored)
        state_key = None if key is None else key(state)
        fresh = True
        if state_key is not None:
            memo = (tuple(placed), state_key)
            fresh = memo not in seen
            seen.add(memo)
        if fresh:
            explored += 1
            if explored > max_states:
                return Linearization(None, explored, unknown=True, closest=_steps_of(closest), breaks=breaks)
            frames.append(_Frame(state, _candidates(lanes, placed)))
        elif frames:
            path = _back(path, placed)
        # Place the next candidate of the innermost state that has one; leave each that has none.
        while True:
            frame = frames[-1]
            if frame.tried < len(frame.candidates):
                slot, timed = frame.candidates[frame.tried]
                frame.tried += 1
                after = apply(frame.state, timed.step)
                if isinstance(after, str):
                    frame.rejections.append(Rejection(timed, after))
                    continue
                placed[slot] += 1
                path = _Node(timed, slot, path)
                state = after
                break
            depth = 0 if path is None else path.length
            if frame.rejections and depth >= (0 if closest is None else closest.length):
                closest, breaks = path, tuple(frame.rejections)
            frames.pop()
            if not frames:
                return Linearization(None, explored, closest=_steps_of(closest), breaks=breaks)
            path = _back(path, placed)


def _lanes_of(steps: Sequence[TimedStep[Step]]) -> list[list[TimedStep[Step]]]:
    """The steps lane by lane, each lane in its order."""
    by_lane: dict[int, list[TimedStep[Step]]] = {}
    for timed in steps:
        by_lane.setdefault(timed.lane, []).append(timed)
    return [sorted(by_lane[lane], key=lambda timed: timed.index) for lane in sorted(by_lane)]


def _candidates(lanes: list[list[TimedStep[Step]]], placed: list[int]) -> list[tuple[int, TimedStep[Step]]]:
    """The steps that may come next, by start: each lane's first pending step that started
    before every pending step ended (a step that finished before another started stays
    before it). A lane's later steps started after its first pending one ended."""
    heads = [(slot, lane[placed[slot]]) for slot, lane in enumerate(lanes) if placed[slot] < len(lane)]
    horizon = min(timed.ended for _, timed in heads)
    return sorted(((slot, timed) for slot, timed in heads if timed.started <= horizon), key=lambda head: head[1].started)


def _back(path: _Node[Step] | None, placed: list[int]) -> _Node[Step] | None:
    """Take the last step off the order being built."""
    assert path is not None
    placed[path.slot] -= 1
    return path.parent


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
