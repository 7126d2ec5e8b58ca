"""Replaying steps that may hold a parallel phase, as many times as a race needs.

A sequential sequence answers the same on every replay; a parallel phase may not: its
calls interleave however the threads were scheduled, and a race shows on some runs
only. Whatever replays steps (the minimiser, ``shardkit replay``, a generated regression
test) replays a sequence with a phase several times, each on a fresh engine, and counts
the runs that failed: the count is the failure's reproduction rate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shardkit._core.driver import Driver, StepFailed
from shardkit._core.outcomes import StepRecord
from shardkit._core.steps import PARALLEL_OP, Action
from shardkit._parallel.phase import run_parallel

__all__ = ["PHASE_RUNS", "execute_step", "holds_phase", "replay_runs", "replay_steps"]

#: Runs of a phase before it counts as passing, while fuzzing and minimising: the racy
#: engines of the self-test fail on most runs, so three runs miss almost none of them,
#: and a passing phase (most of them) costs its prefix twice more, not ten times.
PHASE_RUNS = 3


def holds_phase(actions: Sequence[Action]) -> bool:
    return any(action.op == PARALLEL_OP for action in actions)


def execute_step(driver: Driver, action: Action) -> list[StepRecord]:
    """Run one step, a parallel phase included; ``StepFailed`` for the first problem."""
    if action.op == PARALLEL_OP:
        return run_parallel(driver, action.args["lanes"])
    return [driver.execute(action)]


def replay_steps(driver: Driver, actions: Sequence[Action]) -> StepFailed | None:
    """Run ``actions`` on ``driver``; the failure they end in, if any."""
    for action in actions:
        try:
            execute_step(driver, action)
        except StepFailed as failed:
            return failed
    return None


def replay_runs(driver: Driver, actions: Sequence[Action], runs: int) -> Iterator[tuple[Driver, StepFailed | None]]:
    """Replay ``actions`` ``runs`` times if they hold a parallel phase (once if not): the
    first run on ``driver``, each later one on ``driver.fresh()``. Yields each run's driver
    and failure; the caller stops iterating when it has seen enough."""
    if runs < 1:
        message = f"runs must be 1 or more, got {runs}"
        raise ValueError(message)
    for run in range(runs if holds_phase(actions) else 1):
        if run:
            driver = driver.fresh()
        yield driver, replay_steps(driver, actions)
