"""The one report of a campaign: the rounds' counts and coverage summed, and their
failures merged, one entry per distinct failure.

Two rounds found the same failure when they broke the same property with the same shrunk
sequence of steps (each step's operation and arguments). What the engine answered is
left out of the comparison: it is the same bug either way, and a message that names a
count or a time must not split it. Each distinct failure keeps the trace and the rerun
command of the first round that found it (by round number, then worker), and counts
the rounds that found it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shardkit._campaign.rounds import FoundFailure, RoundOutcome, WorkerFailed
from shardkit._run.options import FuzzOptions
from shardkit._run.report import coverage_table, report_document, session_lines
from shardkit._run.result import FuzzResult

__all__ = ["CampaignResult", "FailureKey", "MergedFailure", "failure_key", "merge_failures"]

#: (property, ((operation, its arguments as canonical JSON), …)).
FailureKey = tuple[str, tuple[tuple[str, str], ...]]


def failure_key(failure: FoundFailure) -> FailureKey:
    """What makes two rounds' failures the same one: property and shrunk step sequence."""
    steps = tuple((str(step["op"]), json.dumps(step["args"], sort_keys=True)) for step in failure.entry["steps"])
    return failure.property, steps


@dataclass(frozen=True)
class MergedFailure:
    """One distinct failure and every round that found it, the first first."""

    rounds: tuple[RoundOutcome, ...]

    @property
    def first(self) -> FoundFailure:
        found = self.rounds[0].failure
        assert found is not None  # only rounds that found it are merged into it
        return found

    def document(self) -> dict[str, Any]:
        """Its ``failures`` entry: the ``--report`` entry of the first round that found it,
        with that round's rerun command and the rounds that found it."""
        return {
            **self.first.entry,
            "rerun_command": self.first.rerun_command,
            "found_in_rounds": len(self.rounds),
            "found_in": [
                {"worker": outcome.worker, "round": outcome.round, "seed": outcome.seed, "trace": _trace(outcome)}
                for outcome in self.rounds
            ],
        }

    def text(self) -> str:
        lines = [self.first.text]
        lines.append(f"  found in {_count(len(self.rounds), 'round')}: {_where(self.rounds)}")
        if any(outcome.interrupted for outcome in self.rounds):
            lines.append("  (a round was interrupted: its sequence is the best found so far, not minimised)")
        lines.append("reproduce:")
        # The round's own report already holds its replay line (``report.replay_command``).
        replay = self.first.entry.get("replay_command")
        if isinstance(replay, str):
            lines.append(f"  this failure:    {replay}")
        lines.append(f"  its round:       {self.first.rerun_command}")
        return "\n".join(lines)


def merge_failures(outcomes: Iterable[RoundOutcome]) -> list[MergedFailure]:
    """The distinct failures of ``outcomes``, in the order of the first round that found each."""
    found = sorted((outcome for outcome in outcomes if outcome.failure is not None), key=lambda o: (o.round, o.worker))
    groups: dict[FailureKey, list[RoundOutcome]] = {}
    for outcome in found:
        assert outcome.failure is not None
        groups.setdefault(failure_key(outcome.failure), []).append(outcome)
    return [MergedFailure(tuple(group)) for group in groups.values()]


@dataclass
class CampaignResult:
    """Every round a campaign finished, and how it ended."""

    #: The engine target's name, as ``shardkit fuzz`` names it.
    target: str
    seed: int
    workers: int
    #: The time limit (None: a fixed number of rounds, ``rounds_per_worker``).
    minutes: float | None
    rounds_per_worker: int | None
    outcomes: list[RoundOutcome] = field(default_factory=list)
    #: Rounds that ended in an error that is no finding; the campaign stopped at the first.
    errors: list[WorkerFailed] = field(default_factory=list)
    #: Ctrl-C stopped it: rounds in flight were cut, what they had found is kept.
    interrupted: bool = False
    elapsed_s: float = 0.0
    #: The options of every round, and the campaign's own command line (the report's ``run``).
    options: FuzzOptions | None = None
    command: str = ""
    #: The Ray cluster the rounds ran on (``--cluster``); None on one machine.
    cluster: str | None = None
    #: Rounds are still running: the document is a snapshot (a live ``--html`` page).
    in_progress: bool = False

    @property
    def failures(self) -> list[MergedFailure]:
        return merge_failures(self.outcomes)

    @property
    def work_steps(self) -> int:
        """Every step the rounds ran, shrinking included."""
        return sum(outcome.work_steps for outcome in self.outcomes)

    def summed(self) -> FuzzResult:
        """The rounds as one run: counts, coverage, caveats and session lengths summed."""
        coverage: Counter[tuple[str, str]] = Counter()
        caveats: Counter[str] = Counter()
        sessions: Counter[int] = Counter()
        faults: set[str] = set()
        for outcome in self.outcomes:
            coverage.update({(op, result): count for op, result, count in outcome.coverage})
            caveats.update(dict(outcome.caveats))
            sessions.update(dict(outcome.longest_session))
            faults.update(outcome.faults)
        return FuzzResult(
            target=self.target,
            seed=self.seed,
            examples=sum(outcome.examples for outcome in self.outcomes),
            steps=sum(outcome.steps for outcome in self.outcomes),
            elapsed_s=self.elapsed_s,
            coverage=coverage,
            caveats=caveats,
            faults=frozenset(faults),
            longest_session=sessions,
            rerun_command=self.command,
        )

    def document(self) -> dict[str, Any]:
        """The campaign's ``--report`` JSON: ``report_document``'s schema over the summed
        rounds (``run.rerun_command`` is the campaign's command), its ``failures`` the
        distinct ones, and a ``campaign`` object."""
        document = report_document(self.summed(), self.options)
        document["failures"] = [failure.document() for failure in self.failures]
        document["campaign"] = {
            "workers": self.workers,
            "minutes": self.minutes,
            "rounds": len(self.outcomes),
            "seeds": [
                {"worker": outcome.worker, "round": outcome.round, "seed": outcome.seed}
                | ({"node": outcome.node} if outcome.node else {})
                for outcome in sorted(self.outcomes, key=lambda o: (o.worker, o.round))
            ],
            "interrupted": self.interrupted,
            "errors": [error.error for error in self.errors],
            "in_progress": self.in_progress,
        }
        if self.cluster is not None:
            document["campaign"]["cluster"] = self.cluster
            document["campaign"]["rounds_per_node"] = dict(sorted(Counter(outcome.node for outcome in self.outcomes).items()))
        return document

    def text(self) -> str:
        """The merged report as printed: what ran, the summed coverage, the distinct failures."""
        summed = self.summed()
        rate = self.work_steps / self.elapsed_s if self.elapsed_s > 0 else 0.0
        by_worker = Counter(outcome.worker for outcome in self.outcomes)
        per_worker = ", ".join(f"worker {worker}: {by_worker[worker]}" for worker in range(1, self.workers + 1))
        limit = f"{self.minutes:g} minutes" if self.minutes is not None else f"{_count(self.rounds_per_worker or 0, 'round')} each"
        where = f" on the Ray cluster at {self.cluster}" if self.cluster is not None else ""
        lines = [
            f"campaign: {_count(self.workers, 'worker')}{where} for {limit}: {_count(len(self.outcomes), 'round')} ({per_worker}) in {self.elapsed_s:.1f}s",
        ]
        if self.cluster is not None:
            by_node = Counter(outcome.node for outcome in self.outcomes)
            lines.append(f"rounds per node: {', '.join(f'{node}: {count}' for node, count in sorted(by_node.items())) or 'none'}")
        if self.outcomes:
            lines.append(
                f"{_count(summed.examples, 'example')} ({summed.steps:,} steps) as shardkit fuzz counts them (until each round's first failure); "
                f"{self.work_steps:,} steps in all with shrinking ({rate:,.0f} steps/s); faults: {', '.join(sorted(summed.faults)) or 'none'}"
            )
            lines.append(f"coverage (operation → outcome counts, summed over the rounds; {_count(len(summed.coverage), 'distinct pair')}):")
            lines += [coverage_table(summed), *session_lines(summed)]
        lines += [f"not checked in {examples} of {summed.examples} examples: {caveat}" for caveat, examples in sorted(summed.caveats.items())]
        if self.interrupted:
            lines.append("interrupted (Ctrl-C): the rounds in flight were stopped; what they had found is kept")
        failures = self.failures
        found_in = sum(1 for outcome in self.outcomes if outcome.failure is not None)
        if not failures:
            lines.append(f"no failure found in {_count(len(self.outcomes), 'round')}")
        else:
            distinct = _count(len(failures), "distinct failure")
            lines.append(f"{distinct}, found in {found_in} of {_count(len(self.outcomes), 'round')}:")
            for failure in failures:
                lines += ["", failure.text()]
        return "\n".join(lines)


def _trace(outcome: RoundOutcome) -> str | None:
    assert outcome.failure is not None
    trace = outcome.failure.entry.get("trace")
    return str(trace) if trace is not None else None


def _where(rounds: tuple[RoundOutcome, ...]) -> str:
    """``worker 1 rounds 1, 3; worker 2 round 2``."""
    by_worker: dict[int, list[int]] = {}
    for outcome in rounds:
        by_worker.setdefault(outcome.worker, []).append(outcome.round)
    parts = []
    for worker, numbers in sorted(by_worker.items()):
        label = "round" if len(numbers) == 1 else "rounds"
        parts.append(f"worker {worker} {label} {', '.join(str(number) for number in sorted(numbers))}")
    return "; ".join(parts)


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"
