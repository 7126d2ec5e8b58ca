"""What a campaign shows while it runs: per worker and in total, the examples and steps
run, the steps per second, the distinct operation → outcome pairs reached and the
failures found. On a terminal, a block of lines redrawn in place; elsewhere (a CI log), one
plain line each time a round ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

from shardkit._campaign.merge import FailureKey, failure_key
from shardkit._campaign.rounds import (
    Event,
    RoundFinished,
    RoundOutcome,
    RoundProgress,
    WorkerFailed,
    WorkerReady,
    WorkerStopped,
)

__all__ = ["LiveBoard", "RoundLines", "Tally"]

#: Seconds between two redraws of the live board.
REDRAW_INTERVAL_S = 0.2


@dataclass
class WorkerTally:
    """One worker's counts: its finished rounds, plus the round in flight."""

    state: str = "starting"
    round: int = 0
    finished_examples: int = 0
    finished_steps: int = 0
    live_examples: int = 0
    live_steps: int = 0
    failures: int = 0
    pairs: set[tuple[str, str]] = field(default_factory=set)
    ready_at: float | None = None

    @property
    def examples(self) -> int:
        return self.finished_examples + self.live_examples

    @property
    def steps(self) -> int:
        return self.finished_steps + self.live_steps

    def rate(self, now: float) -> float:
        return self.steps / (now - self.ready_at) if self.ready_at is not None and now > self.ready_at else 0.0


class Tally:
    """The campaign's running counts, from its workers' events. Examples and steps count
    everything run (shrinking included); coverage pairs and failures count finished rounds."""

    def __init__(self, workers: int) -> None:
        self.workers = {worker: WorkerTally() for worker in range(1, workers + 1)}
        self.rounds = 0
        self.pairs: set[tuple[str, str]] = set()
        self.distinct: set[FailureKey] = set()
        self.started_at: float | None = None

    def apply(self, event: Event, now: float) -> None:
        if isinstance(event, WorkerReady):
            worker = self.workers[event.worker]
            worker.state, worker.ready_at = "running", now
            self.started_at = now if self.started_at is None else self.started_at
        elif isinstance(event, RoundProgress):
            worker = self.workers[event.worker]
            worker.round, worker.live_examples, worker.live_steps = event.round, event.examples, event.steps
        elif isinstance(event, RoundFinished):
            self._finished(event.outcome)
        elif isinstance(event, WorkerStopped):
            self.workers[event.worker].state = "interrupted" if event.interrupted else "done"
        elif isinstance(event, WorkerFailed):
            self.workers[event.worker].state = "error"

    def _finished(self, outcome: RoundOutcome) -> None:
        worker = self.workers[outcome.worker]
        worker.round = outcome.round
        worker.finished_examples += outcome.work_examples
        worker.finished_steps += outcome.work_steps
        worker.live_examples = worker.live_steps = 0
        worker.pairs |= outcome.coverage_pairs
        self.pairs |= outcome.coverage_pairs
        self.rounds += 1
        if outcome.failure is not None:
            worker.failures += 1
            self.distinct.add(failure_key(outcome.failure))

    @property
    def failures(self) -> int:
        return sum(worker.failures for worker in self.workers.values())

    def total_rate(self, now: float) -> float:
        steps = sum(worker.steps for worker in self.workers.values())
        return steps / (now - self.started_at) if self.started_at is not None and now > self.started_at else 0.0

    def totals(self, now: float) -> str:
        examples = sum(worker.examples for worker in self.workers.values())
        steps = sum(worker.steps for worker in self.workers.values())
        return (
            f"{self.rounds} round{'' if self.rounds == 1 else 's'}  examples {examples:,}  steps {steps:,}  {self.total_rate(now):,.0f} steps/s  "
            f"coverage pairs {len(self.pairs)}  failures {self.failures} ({len(self.distinct)} distinct)"
        )


class LiveBoard:
    """One line per worker and a total line, redrawn in place on an interactive stream."""

    def __init__(self, stream: TextIO, tally: Tally, minutes: float | None) -> None:
        self.stream = stream
        self.tally = tally
        self.minutes = minutes
        self.opened_at = time.monotonic()
        self.drawn_lines = 0
        self.drawn_at = 0.0

    def __call__(self, event: Event | None) -> None:
        now = time.monotonic()
        if not isinstance(event, RoundFinished) and now - self.drawn_at < REDRAW_INTERVAL_S:
            return
        self.drawn_at = now
        lines = self.lines(now)
        up = f"\x1b[{self.drawn_lines}F" if self.drawn_lines else "\r"
        self.stream.write(up + "".join(f"{line}\x1b[K\n" for line in lines))
        self.stream.flush()
        self.drawn_lines = len(lines)

    def lines(self, now: float) -> list[str]:
        lines = []
        for number, worker in self.tally.workers.items():
            lines.append(
                f"worker {number}  round {worker.round or '-'}  examples {worker.examples:,}  steps {worker.steps:,}  "
                f"{worker.rate(now):,.0f} steps/s  coverage pairs {len(worker.pairs)}  failures {worker.failures}  {worker.state}"
            )
        elapsed = now - self.opened_at
        clock = _clock(elapsed)
        if self.minutes is not None:
            limit = self.minutes * 60
            clock += f" of {_clock(limit)}" if elapsed < limit else f" (past {_clock(limit)}: finishing the rounds in flight)"
        lines.append(f"total     {self.tally.totals(now)}  {clock}")
        return lines

    def clear(self) -> None:
        if self.drawn_lines:
            self.stream.write(f"\x1b[{self.drawn_lines}F\x1b[J")
            self.stream.flush()
            self.drawn_lines = 0


class RoundLines:
    """A plain line at the end of each round, for a stream that is not a terminal."""

    def __init__(self, stream: TextIO, tally: Tally) -> None:
        self.stream = stream
        self.tally = tally

    def __call__(self, event: Event | None) -> None:
        if not isinstance(event, RoundFinished):
            return
        outcome = event.outcome
        rate = outcome.work_steps / outcome.elapsed_s if outcome.elapsed_s > 0 else 0.0
        found = outcome.failure
        what = f"failure ({found.property}) in {len(found.entry['steps'])} steps" if found is not None else "no failure"
        line = (
            f"worker {outcome.worker} round {outcome.round} (seed {outcome.seed}): {outcome.work_examples:,} examples, "
            f"{outcome.work_steps:,} steps in {outcome.elapsed_s:.1f}s ({rate:,.0f} steps/s), {what} | "
            f"total: {self.tally.totals(time.monotonic())}"
        )
        print(line, file=self.stream, flush=True)

    def clear(self) -> None:
        pass


def _clock(seconds: float) -> str:
    whole = max(0, round(seconds))
    return f"{whole // 60}:{whole % 60:02d}"
