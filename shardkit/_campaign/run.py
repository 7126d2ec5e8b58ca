"""A campaign: N worker processes, each running rounds of ``shardkit fuzz`` from derived
seeds, until a time limit or a number of rounds; their outcomes gathered as they end.

The clock decides only when to stop *starting* rounds: at the deadline every worker
finishes the round it is in (shrinking included) and starts no other, so a failure found
just before the deadline is minimised like any other, and a campaign takes its minutes
plus at most one round. Every worker runs at least one round, even one that started up
after the deadline. Ctrl-C stops the rounds in flight (a round that had found a
failure keeps it, unminimised) and the campaign reports what the finished and stopped
rounds found.

The workers are started with ``multiprocessing``'s "spawn" context: a fresh interpreter
each, the same on every platform, with no state of the parent (a Hypothesis run in
progress, open sockets) copied into it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit._campaign.merge import CampaignResult
from shardkit._campaign.rounds import Event, RoundFinished, WorkerFailed, WorkerReady, WorkerStopped
from shardkit._campaign.worker import INTERRUPT_SIGNAL, WorkerPlan, work
from shardkit._run.options import FuzzOptions

__all__ = ["CampaignPlan", "CampaignWork", "measure_campaign_work", "run_campaign"]

#: Seconds the workers get to hand back what they found after Ctrl-C, before they are killed.
INTERRUPT_GRACE_S = 30.0
#: Seconds between two looks at the workers when none has anything to say (the live display's clock ticks at this rate).
POLL_INTERVAL_S = 0.2
#: Seconds past the deadline after which a worker whose campaign is gone stops by itself.
BACKSTOP_S = 60.0


@dataclass(frozen=True)
class CampaignPlan:
    """What a campaign runs: ``workers`` processes fuzzing ``target`` with ``options``
    (``examples`` is the size of each round), round seeds derived from ``seed``, traces
    under ``out``; for ``minutes`` (the rounds in flight at the deadline finish) or, when
    ``rounds_per_worker`` is set, exactly that many rounds each (a fixed amount of work)."""

    target: str
    options: FuzzOptions
    workers: int
    seed: int
    out: Path
    minutes: float | None = None
    rounds_per_worker: int | None = None
    #: The target's name as ``shardkit fuzz`` prints it (default: ``target``).
    target_name: str | None = None
    #: The campaign's command line, for the report.
    command: str = ""
    #: The Ray cluster's address (``--cluster``): the rounds run there as tasks, ``workers``
    #: of them at a time, instead of in worker processes here (``shardkit._campaign.cluster``).
    cluster: str | None = None

    def __post_init__(self) -> None:
        if (self.minutes is None) == (self.rounds_per_worker is None):
            raise ValueError("a campaign runs for some minutes or for some rounds per worker: give exactly one")


def run_campaign(
    plan: CampaignPlan,
    on_event: Callable[[Event | None], None] | None = None,
    on_round: Callable[[CampaignResult], None] | None = None,
) -> CampaignResult:
    """Run the campaign; ``on_event`` sees every event of every worker as it arrives, and
    ``None`` when a moment passed without one; ``on_round`` sees the result so far (marked
    ``in_progress``) each time a round has finished. A worker's error (an engine that cannot
    be built) stops the campaign; ``result.errors`` holds it."""
    result = CampaignResult(
        target=plan.target_name or plan.target,
        seed=plan.seed,
        workers=plan.workers,
        minutes=plan.minutes,
        rounds_per_worker=plan.rounds_per_worker,
        options=plan.options,
        command=plan.command,
        cluster=plan.cluster,
    )
    started = time.monotonic()

    def tell(event: Event | None) -> None:
        if on_event is not None:
            on_event(event)
        if on_round is not None and isinstance(event, RoundFinished):
            result.elapsed_s = time.monotonic() - started
            result.in_progress = True
            try:
                on_round(result)
            finally:
                result.in_progress = False

    if plan.cluster is not None:
        from shardkit._campaign.cluster import run_on_cluster

        run_on_cluster(plan, plan.cluster, result, tell)
        result.elapsed_s = time.monotonic() - started
        return result
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    stop = context.Event()
    deadline_passed = context.Event()
    deadline = started + plan.minutes * 60 if plan.minutes is not None else None
    backstop = time.time() + plan.minutes * 60 + BACKSTOP_S if plan.minutes is not None else None
    processes = {
        worker: context.Process(
            target=work,
            args=(
                WorkerPlan(plan.target, plan.options, plan.seed, worker, plan.out, plan.rounds_per_worker, backstop),
                events,
                stop,
                deadline_passed,
            ),
            name=f"shardkit-campaign-worker-{worker}",
            daemon=True,  # a campaign that dies takes its workers with it
        )
        for worker in range(1, plan.workers + 1)
    }
    gatherer = _Gatherer(processes, events, result, tell)
    try:
        with _children_ignore_ctrl_c():
            for process in processes.values():
                process.start()
        try:
            while gatherer.running:
                if deadline is not None and time.monotonic() >= deadline:
                    deadline_passed.set()
                if result.errors:
                    stop.set()
                gatherer.next_event()
        except KeyboardInterrupt:
            result.interrupted = True
            stop.set()
            gatherer.interrupt()
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting, report what arrived
                gatherer.drain(time.monotonic() + INTERRUPT_GRACE_S)
    finally:
        stop.set()
        for process in processes.values():
            process.join(timeout=5 if result.interrupted or process.exitcode is not None else 10)
            if process.is_alive():
                process.kill()
                process.join()
        events.close()
        events.cancel_join_thread()
    result.outcomes.sort(key=lambda outcome: (outcome.worker, outcome.round))
    result.elapsed_s = time.monotonic() - started
    return result


class _Gatherer:
    """Reads the workers' events into ``result``; tells a worker that died apart from one
    that finished (a dead process said neither ``WorkerStopped`` nor ``WorkerFailed``)."""

    def __init__(
        self,
        processes: dict[int, Any],
        events: Any,
        result: CampaignResult,
        on_event: Callable[[Event | None], None] | None,
    ) -> None:
        self.processes = processes
        self.events = events
        self.result = result
        self.on_event = on_event
        self.running = set(processes)
        self.ready: set[int] = set()
        self.interrupted = False
        self.seen_dead: set[int] = set()

    def interrupt(self) -> None:
        """Stop the rounds in flight. A worker that is not ready yet has no handler for the
        signal (it would die of it): it is interrupted once it says it is ready."""
        self.interrupted = True
        for worker in sorted(self.running & self.ready):
            _interrupt(self.processes[worker])

    def next_event(self) -> None:
        try:
            event: Event | None = self.events.get(timeout=POLL_INTERVAL_S)
        except queue.Empty:
            event = None
            self._check_dead()
        if isinstance(event, WorkerReady):
            self.ready.add(event.worker)
            if self.interrupted:
                _interrupt(self.processes[event.worker])
        elif isinstance(event, RoundFinished):
            self.result.outcomes.append(event.outcome)
        elif isinstance(event, WorkerStopped):
            self.running.discard(event.worker)
        elif isinstance(event, WorkerFailed):
            self.result.errors.append(event)
            self.running.discard(event.worker)
        if self.on_event is not None:
            self.on_event(event)

    def drain(self, until: float) -> None:
        while self.running and time.monotonic() < until:
            self.next_event()

    def _check_dead(self) -> None:
        for worker in sorted(self.running):
            exitcode = self.processes[worker].exitcode
            if exitcode is None:
                continue
            if worker not in self.seen_dead:
                # Its last message may still be in the pipe: look once more before saying it died.
                self.seen_dead.add(worker)
                continue
            self.running.discard(worker)
            message = f"worker {worker} ended without reporting (exit code {exitcode}); the rounds it finished are kept"
            self.result.errors.append(WorkerFailed(worker, 0, 0, message))


@contextlib.contextmanager
def _children_ignore_ctrl_c() -> Iterator[None]:
    """Start the workers with SIGINT ignored from their first instruction: Ctrl-C on a
    terminal reaches the whole process group, and a worker still importing the kit would
    die of it (Python keeps an ignored SIGINT ignored). The campaign alone decides, and
    interrupts its workers itself (``_interrupt``). The parent ignores Ctrl-C only for the
    moment the processes take to start."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change a signal's handler
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt(process: Any) -> None:
    if process.pid is None or process.exitcode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.kill(process.pid, INTERRUPT_SIGNAL)


@dataclass(frozen=True)
class CampaignWork:
    """What one campaign of a fixed number of rounds did: its rounds, their steps (shrinking
    included) and the seconds from the first round's start to the last round's end."""

    rounds: int
    steps: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0


def measure_campaign_work(
    target: str = "shardkit:FakeShardEngine",
    options: FuzzOptions | None = None,
    *,
    workers: int,
    rounds_per_worker: int = 2,
    seed: int = 1,
    cluster: str | None = None,
) -> CampaignWork:
    """One campaign of ``workers`` workers, each running the same fixed number of rounds (no
    clock involved: more workers, more work, the same work per worker), for ``shardkit bench``.

    The time runs from the first round's start to the last round's end, over all workers:
    the workers' start-up (a fresh interpreter importing the kit) is left out, since a
    campaign of minutes pays it once. On N free cores, N workers' rate approaches N times
    one worker's for an engine that holds no lock. ``cluster``: the rounds run on that Ray
    cluster, ``workers`` at a time (``shardkit bench --cluster``)."""
    options = options if options is not None else FuzzOptions(examples=50, steps=30)
    with tempfile.TemporaryDirectory(prefix="shardkit-campaign-bench-") as out:
        plan = CampaignPlan(target, options, workers, seed, Path(out), rounds_per_worker=rounds_per_worker, cluster=cluster)
        result = run_campaign(plan)
    if result.errors:
        raise RuntimeError(f"the campaign with {workers} workers failed: {result.errors[0].error}")
    span = max(o.ended_at for o in result.outcomes) - min(o.started_at for o in result.outcomes)
    return CampaignWork(len(result.outcomes), result.work_steps, span)
