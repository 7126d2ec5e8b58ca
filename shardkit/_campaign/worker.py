"""One worker process of a campaign: rounds of ``shardkit fuzz``, one after another, each
from its own derived seed, until the campaign says stop.

The worker ignores SIGINT: Ctrl-C on a terminal reaches every process of the foreground
group, and a worker cut at a random point by it could lose what it found. The campaign
decides instead, and interrupts a round in flight with ``INTERRUPT_SIGNAL``, once, which
the round takes as Ctrl-C: a failure it had found is kept and sent back, unminimised.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from shardkit._campaign.rounds import (
    Event,
    RoundFinished,
    RoundProgress,
    WorkerFailed,
    WorkerReady,
    WorkerStopped,
    outcome_of,
)
from shardkit._campaign.seeds import round_seed
from shardkit._core.targets import describe_exception
from shardkit._run.options import FuzzOptions
from shardkit.contract import EngineError
from shardkit.errors import EngineLost, ShardkitError

__all__ = ["INTERRUPT_SIGNAL", "WorkerPlan", "failed_round", "work"]

#: What the campaign sends a worker to stop the round in flight (SIGINT is ignored, see above).
INTERRUPT_SIGNAL = getattr(signal, "SIGUSR1", signal.SIGTERM)
#: Seconds between two progress messages of a round: enough for a live display, and a
#: round of fast examples does not flood the queue.
PROGRESS_INTERVAL_S = 0.25


class _Stop(Protocol):
    def is_set(self) -> bool: ...


class _Events(Protocol):
    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None: ...


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker runs: rounds of ``fuzz(target, options)`` from the seeds
    ``round_seed(campaign_seed, worker, 1, 2, …)``, traces under ``out``; at most
    ``max_rounds`` (None: until stopped). ``deadline`` (``time.time``) is a backstop only:
    the campaign's stop decides, but a worker whose campaign died stops there too."""

    target: str
    options: FuzzOptions
    campaign_seed: int
    worker: int
    out: Path
    max_rounds: int | None = None
    deadline: float | None = None


def work(plan: WorkerPlan, events: _Events, stop: _Stop, deadline_passed: _Stop) -> None:
    """The worker process's body (``multiprocessing`` runs it): every round's outcome goes
    to ``events``, then one ``WorkerStopped`` or ``WorkerFailed``. ``stop`` (Ctrl-C, another
    worker's error) forbids any further round; ``deadline_passed`` any round after the
    first, so that every worker contributes a round however slowly it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupts = _Interrupts()
    signal.signal(INTERRUPT_SIGNAL, interrupts.handle)
    sys.unraisablehook = interrupts.quiet(sys.unraisablehook)
    from shardkit._run.runner import fuzz  # after the signals: importing Hypothesis takes a second

    final: Event
    try:
        final = _rounds(plan, events, stop, deadline_passed, interrupts, fuzz)
        interrupts.closed = True  # inside the try: an interrupt before this line is caught below
    except KeyboardInterrupt:
        # Stopped in a round that had found nothing yet, or between rounds: nothing is lost.
        final = WorkerStopped(plan.worker, interrupted=True)
    interrupts.closed = True
    events.put(final)  # the last message: no interrupt may cut it (the process ends with it)


def _rounds(
    plan: WorkerPlan, events: _Events, stop: _Stop, deadline_passed: _Stop, interrupts: _Interrupts, fuzz: Any
) -> Event:
    """Run the rounds, sending each one's outcome; return the message that ends the worker."""
    interrupts.send(events, WorkerReady(plan.worker))
    round_number = 0
    while _another_round(plan, round_number, stop, deadline_passed):
        round_number += 1
        seed = round_seed(plan.campaign_seed, plan.worker, round_number)
        progress = _ProgressSender(events, interrupts, plan.worker, round_number, seed)
        started_at = time.time()
        try:
            result = fuzz(plan.target, plan.options, seed=seed, out=plan.out, progress=progress)
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # whatever ends a round is reported, never lost
            return failed_round(plan.worker, round_number, seed, error)
        ended_at = time.time()
        outcome = outcome_of(result, worker=plan.worker, round_number=round_number, started_at=started_at, ended_at=ended_at)
        interrupts.send(events, RoundFinished(outcome))
        if result.interrupted:
            break
    return WorkerStopped(plan.worker, interrupted=interrupts.received)


def _another_round(plan: WorkerPlan, done: int, stop: _Stop, deadline_passed: _Stop) -> bool:
    if stop.is_set() or (plan.max_rounds is not None and done >= plan.max_rounds):
        return False
    if done and (deadline_passed.is_set() or (plan.deadline is not None and time.time() >= plan.deadline)):
        return False
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


class _Interrupts:
    """The campaign's interrupt, taken once as Ctrl-C, and held back while a message is
    being put on the queue: a message cut in half would lose a finished round.

    Raised from a signal handler, it lands wherever the interpreter is, and Python drops an
    exception raised inside a garbage-collector callback (Hypothesis keeps one), so the
    progress callback raises it again as the next example starts: a round never outlives
    the interrupt by more than one example (or its minimisation, which runs no examples)."""

    def __init__(self) -> None:
        self.received = False
        self.holding = False
        self.pending = False
        #: The worker is sending its last message: nothing is left to interrupt.
        self.closed = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received or self.closed:
            self.received = True
            return  # a second one must not cut the clean-up
        self.received = True
        if self.holding:
            self.pending = True
            return
        raise KeyboardInterrupt

    def quiet(self, default: Callable[[Any], object]) -> Callable[[Any], object]:
        """An ``unraisablehook`` that drops the interrupt Python could not raise (it is raised again)."""

        def hook(unraisable: Any) -> object:
            if self.received and isinstance(unraisable.exc_value, KeyboardInterrupt):
                return None
            return default(unraisable)

        return hook

    def send(self, events: _Events, event: Event) -> None:
        self.holding = True
        try:
            events.put(event)
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


def failed_round(worker: int, round_number: int, seed: int, error: BaseException) -> WorkerFailed:
    """What a round that ended in ``error`` (no finding) tells the campaign."""
    if isinstance(error, ShardkitError | EngineError | EngineLost | OSError):
        # An input error (the engine cannot be built or loaded, the disk is full): its message says it.
        return WorkerFailed(worker, round_number, seed, str(error) or describe_exception(error))
    details = "".join(traceback.format_exception(error))
    return WorkerFailed(worker, round_number, seed, describe_exception(error), details)


class _ProgressSender:
    """``fuzz``'s progress callback: the round's counts to the campaign, a few times a second."""

    def __init__(self, events: _Events, interrupts: _Interrupts, worker: int, round_number: int, seed: int) -> None:
        self.events = events
        self.interrupts = interrupts
        self.worker = worker
        self.round = round_number
        self.seed = seed
        self.sent_at = 0.0

    def __call__(self, examples: int, steps: int, failures: int) -> None:
        if self.interrupts.received:
            raise KeyboardInterrupt  # the interrupt again, in case the handler's was dropped
        now = time.monotonic()
        if now - self.sent_at < PROGRESS_INTERVAL_S:
            return
        self.sent_at = now
        event: Event = RoundProgress(self.worker, self.round, self.seed, examples, steps, failures)
        self.interrupts.send(self.events, event)
