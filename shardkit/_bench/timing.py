"""Timing a comparison: each side run once a round, the order turned each round, and the
median round picked, so that a machine growing busier or quieter shifts every side alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Timed", "interleaved", "median_round", "spread", "timed"]


@dataclass(frozen=True)
class Timed:
    """One run of a comparison: the steps it took, its wall time and its CPU time."""

    steps: int
    wall_s: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.steps / self.wall_s


_Run = TypeVar("_Run")


def timed(run: Callable[[], int]) -> Timed:
    wall, cpu = time.perf_counter(), time.process_time()
    steps = run()
    return Timed(steps, time.perf_counter() - wall, time.process_time() - cpu)


def interleaved(runs: dict[str, Callable[[], _Run]], rounds: int) -> dict[str, list[_Run]]:
    """Every one of ``runs`` once a round, the order turned by one each round (A B C, B C A,
    C A B, …): a machine that grows busier or quieter during the bench shifts every side of a
    comparison alike, and no side always runs first. Each run returns its measure."""
    names = list(runs)
    measured: dict[str, list[_Run]] = {name: [] for name in names}
    for round_number in range(rounds):
        turn = round_number % len(names)
        for name in names[turn:] + names[:turn]:
            measured[name].append(runs[name]())
    return measured


def median_round(rounds: Sequence[_Run], key: Callable[[_Run], float]) -> int:
    """The index of the median round by ``key`` (with an even number, the lower of the two
    middle ones): a row shows that one round's figures, so its rates and ratio agree."""
    order = sorted(range(len(rounds)), key=lambda index: key(rounds[index]))
    return order[(len(order) - 1) // 2]


def spread(values: list[float]) -> dict[str, float]:
    """The median of ``values``, with the lowest and highest: how far one round may be from it."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}
