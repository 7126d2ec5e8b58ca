"""What a round of a campaign sends back to the campaign, and the other messages of a
worker process: plain data, so it crosses the process boundary as it is (a ``FuzzResult``
holds the engine's step records, which need not pickle), and a finished round already
holds everything the merged report prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardkit._run.report import failure_lines, report_document
from shardkit._run.result import FuzzResult

__all__ = [
    "Event",
    "FoundFailure",
    "RoundFinished",
    "RoundOutcome",
    "RoundProgress",
    "WorkerFailed",
    "WorkerReady",
    "WorkerStopped",
    "outcome_of",
]


@dataclass(frozen=True)
class FoundFailure:
    """One round's failure: its entry of the ``--report`` JSON, its printed form, and the
    ``shardkit fuzz`` command that reruns the round that found it."""

    #: The entry of ``report_document``'s ``failures`` list: property, message, steps, trace, …
    entry: dict[str, Any]
    #: The failure as ``shardkit fuzz`` prints it (steps, expected, observed, where the rule is).
    text: str
    rerun_command: str

    @property
    def property(self) -> str:
        return str(self.entry["property"])


@dataclass(frozen=True)
class RoundOutcome:
    """One finished round. ``examples`` and ``steps`` count as ``shardkit fuzz`` does
    (until the first failure); ``work_examples`` and ``work_steps`` count everything the
    round ran, shrinking included, which is what its speed is measured on."""

    worker: int
    round: int
    seed: int
    examples: int
    steps: int
    work_examples: int
    work_steps: int
    elapsed_s: float
    #: Wall-clock (``time.time``) start and end, comparable across the worker processes.
    started_at: float
    ended_at: float
    #: (operation, outcome, count) of the examples until the first failure.
    coverage: tuple[tuple[str, str, int], ...]
    #: (check not made, examples it was skipped in).
    caveats: tuple[tuple[str, int], ...]
    #: (accepted decodes of the longest session epoch, examples).
    longest_session: tuple[tuple[int, int], ...]
    faults: tuple[str, ...]
    failure: FoundFailure | None
    #: Ctrl-C stopped the round after it had found a failure (kept, not minimised).
    interrupted: bool = False
    #: Why the round's trace could not be written (the failure is still reported).
    write_error: str | None = None
    #: The Ray node that ran it (``IP (node ID)``), on a cluster; "" on one machine.
    node: str = ""

    @property
    def coverage_pairs(self) -> frozenset[tuple[str, str]]:
        return frozenset((op, outcome) for op, outcome, _ in self.coverage)


def outcome_of(result: FuzzResult, *, worker: int, round_number: int, started_at: float, ended_at: float) -> RoundOutcome:
    """The round's ``FuzzResult`` as data."""
    assert result.seed is not None  # a campaign always seeds its rounds
    failure = None
    if result.failure is not None:
        entry = report_document(result)["failures"][0]
        violation = result.failure.violation
        text = "\n".join(failure_lines(violation.property, result.failure.records, violation.message))
        failure = FoundFailure(entry=entry, text=text, rerun_command=result.rerun_command)
    return RoundOutcome(
        worker=worker,
        round=round_number,
        seed=result.seed,
        examples=result.examples,
        steps=result.steps,
        work_examples=result.examples + result.shrink_examples,
        work_steps=result.steps + result.shrink_steps,
        elapsed_s=result.elapsed_s,
        started_at=started_at,
        ended_at=ended_at,
        coverage=tuple((op, outcome, count) for (op, outcome), count in sorted(result.coverage.items())),
        caveats=tuple(sorted(result.caveats.items())),
        longest_session=tuple(sorted(result.longest_session.items())),
        faults=tuple(sorted(result.faults)),
        failure=failure,
        interrupted=result.interrupted,
        write_error=result.write_error,
    )


# --- what a worker process tells the campaign, in order -------------------------------------


@dataclass(frozen=True)
class WorkerReady:
    """The worker has imported the kit and starts its first round."""

    worker: int


@dataclass(frozen=True)
class RoundProgress:
    """A round under way: what it ran so far (shrinking included), a few times a second."""

    worker: int
    round: int
    seed: int
    examples: int
    steps: int
    failures: int


@dataclass(frozen=True)
class RoundFinished:
    outcome: RoundOutcome


@dataclass(frozen=True)
class WorkerStopped:
    """The worker started no more rounds: the campaign asked it to stop, or its rounds
    ran out; ``interrupted``: it was stopped inside a round (Ctrl-C)."""

    worker: int
    interrupted: bool = False


@dataclass(frozen=True)
class WorkerFailed:
    """A round ended in an error that is no finding (an engine that cannot be built, a bug of
    the kit): the worker stopped, and the campaign stops the others."""

    worker: int
    round: int
    seed: int
    error: str
    #: The traceback of an unexpected exception (a bug of the kit), for the bug report; "" otherwise.
    details: str = ""


Event = WorkerReady | RoundProgress | RoundFinished | WorkerStopped | WorkerFailed
