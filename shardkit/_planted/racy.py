"""Planted racy engines: each answers correctly one call at a time and wrongly when two
calls overlap, so only ``--concurrency`` finds it (a sequential run never flags it; the
self-tests check both).

Most open their race window with ``time.sleep(0)`` (one with a millisecond's sleep), which
gives up the interpreter as a real engine's I/O, native call or lock would, so that the
race shows in a good share of the runs, not once in thousands: the kit must find those
without the engine's help. The three whose shrinking and replay the self-tests follow mark
their window with ``yield_point`` instead when a lane of the kit's calls them in process
(``FreeDuringPrefill`` makes its two sides wait for each other through it): their race then
shows on every run of a phase where the racing calls meet, on a busy machine as on an idle
one, where a bare thread switch showed it in fewer runs the busier the machine was. Served
(a server's threads are no lanes) they switch threads as the others do. Each declares
``concurrent_calls``, as the fake it wraps does: the claim is the bug.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, ClassVar

from shardkit import (
    DecodeRequest,
    EngineCapabilities,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit._parallel.lanes import in_parallel_phase, yield_point
from shardkit._planted.base import DelegatingEngine
from shardkit.engines.base import StepInput

__all__ = [
    "RACY",
    "CancelFreesUnderARunningStep",
    "DecodeCounterLostUpdate",
    "FreeDuringPrefill",
    "LastSlotCheckThenAct",
    "NonAtomicEpochBump",
    "RacyEngine",
    "SharedScratchToken",
]

LINEARIZABILITY = "§2 linearizability"
#: How long ``NonAtomicEpochBump`` spends out of its lock, allocating the new epoch's cache.
ALLOCATION_SECONDS = 0.001


class RacyEngine(DelegatingEngine):
    """What a racy planted engine states: its race and what the kit must name."""

    RACE: ClassVar[str]
    #: The properties a found failure may name (a race shows through the first check it breaks).
    PROPERTIES: ClassVar[tuple[str, ...]] = (LINEARIZABILITY,)
    #: The shortest failure that shows the race: its steps (sequential steps before the
    #: phase, and the phase) and the calls the phase's lanes hold.
    MINIMUM: ClassVar[tuple[int, int]]


class DecodeCounterLostUpdate(RacyEngine):
    RACE = "counts decodes itself: reads the count, decodes, writes the count back; an overlapping decode is lost"
    #: Two decodes at once, of sessions nobody opened: it counts calls, answered or refused.
    MINIMUM = (1, 2)

    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0

    def decode(self, request: DecodeRequest) -> StepResult:
        seen = self.decodes
        _window()
        self.decodes = seen + 1
        return super().decode(request)

    def metrics(self) -> MetricsResult:
        counted = super().metrics()
        return MetricsResult(counted.prefill_calls, self.decodes, counted.active_sessions, counted.kv_tokens)


class SharedScratchToken(RacyEngine):
    RACE = "writes each decoded token into one scratch slot every session shares, then answers what the slot holds"
    #: A session opened, then two of its decodes at once.
    MINIMUM = (2, 2)
    PROPERTIES = ("§3 determinism",)

    def __init__(self) -> None:
        super().__init__()
        self.scratch = 0

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        if not isinstance(result.output, TokenOutput):
            return result
        self.scratch = result.output.token_id
        _window()
        return StepResult(result.status, result.cache, TokenOutput(self.scratch))


class LastSlotCheckThenAct(RacyEngine):
    """Admits sessions itself, into fewer slots than the fake has: it checks for a free slot,
    then opens the session, and two openings between the check and the act both get in.
    One call at a time it is right: an opening past its slots that the fake admits is
    released again and refused, one the fake refuses keeps the fake's answer."""

    RACE = "checks for a free session slot, then opens the session: two openings both take the last slot"
    #: Three openings, two of them in one lane: two slots to take, and a third opening races in.
    MINIMUM = (1, 3)
    SLOTS = 2

    def __init__(self) -> None:
        super().__init__()
        self.holding: set[str] = set()

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), max_sessions=self.SLOTS)

    def prefill(self, request: PrefillRequest) -> StepResult:
        opening = request.step == 0 and request.session_id not in self.holding
        full = opening and len(self.holding) >= self.SLOTS
        time.sleep(0)
        result = super().prefill(request)
        if full and result.status.ok:
            super().release(request.session_id)
            where = f"prefill of session {request.session_id!r} epoch {request.epoch} step {request.step}"
            message = f"{where}: all {self.SLOTS} session slots are taken; release one and retry"
            return StepResult(StructuredStatus(StatusCode.RESOURCE_EXHAUSTED, message, retryable=True), result.cache)
        if opening and result.status.ok:
            self.holding.add(request.session_id)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        status = super().release(session_id)
        if status.ok:
            self.holding.discard(session_id)
        return status


class CancelFreesUnderARunningStep(RacyEngine):
    """The fake without its lock, giving up the interpreter while it computes a step: a
    cancel, release or second opening that lands meanwhile is undone or doubled when the
    step writes its result back (freed cache written into, a slot taken twice)."""

    RACE = "runs its calls without a lock: a cancel or release during a step's compute is overwritten when it writes back"
    #: A session opened, then two decodes of its next step at once: both are admitted.
    MINIMUM = (2, 2)
    #: Its dictionaries change under a running call too, which may raise instead.
    PROPERTIES = (LINEARIZABILITY, "unexplained exception")

    def __init__(self) -> None:
        super().__init__()
        self.inner._calls = nullcontext()  # type: ignore[assignment]  # a lock that locks nothing
        compute = self.inner.forward

        def forward_yielding(cache: list[bytes], step: StepInput) -> tuple[list[bytes], object]:
            time.sleep(0)
            return compute(cache, step)

        self.inner.forward = forward_yielding  # type: ignore[method-assign,assignment]


class FreeDuringPrefill(RacyEngine):
    """Books each session's cached tokens in a table of its own, for its metrics, every
    entry written under the fake's lock; but it books a prefill's tokens only after the
    prefill's compute, out of the lock. A release (or cancel) that lands in between
    leaves the tokens it freed booked: the table shows a cache no session holds."""

    RACE = "books a prefill's tokens after the prefill: a release or cancel that lands in between leaves them booked"
    #: An opening prefill and, at once, a cancel or a release of the session it opens.
    MINIMUM = (1, 2)

    #: The most turns a prefill's window or a free waits for the other side of the race in a
    #: parallel phase: a turn is a ``yield_point``, which ends when another lane's call answers
    #: or waits in a yield point too, and at once when the other lanes have finished.
    TURNS = 200

    def __init__(self) -> None:
        super().__init__()
        self.booked: dict[str, int] = {}
        # The two sides of the race wait for each other, so that when a phase holds a prefill
        # and a free of one session on two lanes, the free lands in the window on every run
        # however the threads are scheduled (on a busy machine, sleep(0) showed it in 1 of 5).
        # A waiter gives up as soon as another waits for something else: no two wait on each other.
        self.freed: set[str] = set()
        self.waiting: list[tuple[str, str]] = []  # ("window" or "free", session), one per waiter

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        result, cached = self._stepped(session, lambda: super(FreeDuringPrefill, self).prefill(request))
        if result.status.ok:
            # The prefill's compute, out of the lock: a free of the session lands in it.
            if in_parallel_phase():
                self.freed.discard(session)
                self._wait(("window", session), lambda: session in self.freed, ("free", session))
            else:
                time.sleep(0)  # a server's thread: a bare thread switch, as the other engines'
            self._book(session, cached)
        return result

    def _free_lands_in_a_window(self, session: str) -> None:
        if in_parallel_phase():
            self._wait(("free", session), lambda: ("window", session) in self.waiting)

    def _wait(self, waiter: tuple[str, str], ready: Callable[[], bool], partner: tuple[str, str] | None = None) -> None:
        """Give the other lanes of a parallel phase turns until ``ready()``, or until another
        call waits here for something other than this one (``partner`` may keep waiting:
        it waits for this one)."""
        self.waiting.append(waiter)
        try:
            turns = 0
            while turns < self.TURNS:
                others = list(self.waiting)
                others.remove(waiter)
                if ready() or any(other != partner for other in others):
                    return
                # A partner that waits is ready (this waiter is what it waits for): it leaves on
                # its next turn, so the turns it takes to be scheduled do not count.
                turns += partner not in others
                yield_point()
        finally:
            self.waiting.remove(waiter)

    def decode(self, request: DecodeRequest) -> StepResult:
        with self.inner._calls:
            result, cached = self._stepped(request.session_id, lambda: super(FreeDuringPrefill, self).decode(request))
            self._book(request.session_id, cached)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._free_lands_in_a_window(session_id)
        with self.inner._calls:
            status = super().cancel(session_id, epoch)
            if status.ok:
                self.booked[session_id] = 0
            self.freed.add(session_id)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self._free_lands_in_a_window(session_id)
        with self.inner._calls:
            self.booked.pop(session_id, None)
            self.freed.add(session_id)
            return super().release(session_id)

    def metrics(self) -> MetricsResult:
        with self.inner._calls:
            return replace(super().metrics(), kv_tokens=sum(self.booked.values()))

    def _stepped(self, session_id: str, step: Callable[[], StepResult]) -> tuple[StepResult, int]:
        """The step's result and the tokens it cached (what the session holds after it,
        less what it held before: a restart gives its old epoch's back)."""
        with self.inner._calls:
            before = self._held(session_id)
            result = step()
            return result, self._held(session_id) - before

    def _book(self, session_id: str, cached: int) -> None:
        with self.inner._calls:
            if cached:
                self.booked[session_id] = self.booked.get(session_id, 0) + cached

    def _held(self, session_id: str) -> int:
        session = self.inner._sessions.get(session_id)
        return 0 if session is None else session.kv_tokens


class NonAtomicEpochBump(RacyEngine):
    """The fake, whose admitted restart wipes the old epoch's cache (its blocks go back to
    empty, for the new epoch to reuse), then gives up its lock (as an engine that allocates
    outside it would) before the session moves to the new epoch: a step of the old epoch
    admitted in that window runs on the wiped cache and answers as if the session had no
    history."""

    RACE = "a restart wipes the old epoch's cache and lets other calls in before it bumps the epoch: an old-epoch step in between runs on the wiped cache"
    #: A session opened, then a decode of it and its restart at once.
    MINIMUM = (2, 2)
    PROPERTIES = (LINEARIZABILITY, "§3 determinism")

    def __init__(self) -> None:
        super().__init__()
        fake = self.inner
        advance = fake._advance
        restarting = threading.local()

        def advance_marking_restarts(request: Any, served: Any, session: Any, where: str) -> StepResult:
            restarting.now = session is not None and session.epoch != request.epoch
            return advance(request, served, session, where)

        def wipe_then_let_others_in(cache: list[bytes]) -> None:
            cache[:] = fake.fresh_cache()
            if getattr(restarting, "now", False):
                restarting.now = False
                fake._calls.release()
                try:
                    # Longer than the others' windows: the step that races in must take the
                    # lock in it, and a thread that was not already waiting for it rarely does.
                    time.sleep(ALLOCATION_SECONDS)
                finally:
                    fake._calls.acquire()

        fake._advance = advance_marking_restarts  # type: ignore[method-assign]
        fake.release_cache = wipe_then_let_others_in  # type: ignore[method-assign]


def _window() -> None:
    """A race window: in a lane of the kit's, a ``yield_point``; called from any other thread
    (a server's, behind ``shardkit serve`` or ``--isolate``), a bare thread switch."""
    if in_parallel_phase():
        yield_point()
    else:
        time.sleep(0)


RACY: tuple[type[RacyEngine], ...] = (
    DecodeCounterLostUpdate,
    SharedScratchToken,
    LastSlotCheckThenAct,
    CancelFreesUnderARunningStep,
    FreeDuringPrefill,
    NonAtomicEpochBump,
)
