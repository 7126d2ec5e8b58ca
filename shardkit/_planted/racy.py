"""Planted racy engines: each answers correctly one call at a time and wrongly when two
calls overlap, so only ``--concurrency`` finds it (a sequential run never flags it; the
self-tests check both).

Two open their race window with a bare thread switch (``CancelFreesUnderARunningStep``,
``time.sleep(0)``) or a millisecond's sleep (``NonAtomicEpochBump``), which gives up the
interpreter as a real engine's I/O, native call or lock would, so that the race shows in
a good share of the runs, not once in thousands: the kit must find those without the
engine's help. The others, whose finding at every seed, shrinking and replay the
self-tests follow, mark their window with ``yield_point`` when a lane of the kit's calls
them in process (``FreeDuringPrefill``, ``ReleaseFreesByIdLater`` and
``CancelOnFinalDecodePinsKv`` make their two sides wait for each other through it,
``_Meeting``): their race then shows on every run of a phase where the racing calls meet, on a
busy machine as on an idle one, where a bare thread switch showed it in fewer runs the
busier the machine was. Served (a server's threads are no lanes) they switch threads as
the others do. Each declares ``concurrent_calls``, as the fake it wraps does: the claim
is the bug.

Four race at the edge of capacity, where the phase must start with every session slot or
KV token but one (or none) taken: two openings for the last slot, two steps for the last
tokens, a release racing the reopening of its id, and a cancel racing the decode that
takes the last token.
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
    FakeShardEngine,
    FakeShardEngineConfig,
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
    "CancelOnFinalDecodePinsKv",
    "DecodeCounterLostUpdate",
    "FreeDuringPrefill",
    "LastSlotCheckThenAct",
    "LastTokensCheckThenAct",
    "NonAtomicEpochBump",
    "RacyEngine",
    "ReleaseFreesByIdLater",
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
    """Admits sessions itself, into half the slots of the fake it wraps: it checks for a
    free slot, then opens the session, and two openings between the check and the act both
    get in. One call at a time it is right: an opening past its slots that the fake admits
    is released again and refused, one the fake refuses keeps the fake's answer. With four
    slots, the race needs three taken first: two openings meet at the fourth."""

    RACE = "checks for a free session slot, then opens the session: two openings both take the last slot"
    #: Three sessions opened, then two openings at once for the fourth and last slot.
    MINIMUM = (4, 2)
    SLOTS = 4

    def __init__(self) -> None:
        super().__init__()
        self.inner = FakeShardEngine(FakeShardEngineConfig(max_sessions=2 * self.SLOTS))
        self.holding: set[str] = set()

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), max_sessions=self.SLOTS)

    def prefill(self, request: PrefillRequest) -> StepResult:
        opening = request.step == 0 and request.session_id not in self.holding
        full = opening and len(self.holding) >= self.SLOTS
        _window()
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

    def __init__(self) -> None:
        super().__init__()
        self.booked: dict[str, int] = {}
        # The two sides of the race wait for each other, so that when a phase holds a prefill
        # and a free of one session on two lanes, the free lands in the window on every run
        # however the threads are scheduled (on a busy machine, sleep(0) showed it in 1 of 5).
        self.freed: set[str] = set()
        self.meeting = _Meeting()

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        result, cached = self._stepped(session, lambda: super(FreeDuringPrefill, self).prefill(request))
        if result.status.ok:
            # The prefill's compute, out of the lock: a free of the session lands in it.
            if in_parallel_phase():
                self.freed.discard(session)
                self.meeting.wait(("window", session), lambda: session in self.freed, ("free", session))
            else:
                time.sleep(0)  # a server's thread: a bare thread switch, as the other engines'
            self._book(session, cached)
        return result

    def _free_lands_in_a_window(self, session: str) -> None:
        if in_parallel_phase():
            self.meeting.wait(("free", session), lambda: ("window", session) in self.meeting.waiting)

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


class LastTokensCheckThenAct(RacyEngine):
    """The fake, whose admission of a step reads how many KV tokens are taken under its lock,
    then lets the lock go and takes it again to run the step against that reading (as an
    engine that sizes its allocation before it queues the step): two steps that want the
    last free tokens both fit, and the cache holds more than ``max_kv_tokens``. One call at a
    time the reading is exact."""

    RACE = "reads the free KV tokens, then runs the step against that reading: two steps both take the last tokens"
    #: A session prefilled to all but one free KV token, then its decode and the opening of
    #: another session at once (the kit found it so at seed 10 of seeds 1 to 25; at most
    #: others with two sessions opened first, one step longer).
    MINIMUM = (2, 2)

    def __init__(self) -> None:
        super().__init__()
        fake = self.inner
        count = fake._kv_tokens_used
        self.reading = threading.local()

        def read_before_the_step() -> int:
            used: int | None = getattr(self.reading, "used", None)
            return count() if used is None else used

        def stepped(step: Callable[[], StepResult]) -> StepResult:
            with fake._calls:
                self.reading.used = count()
            _window()
            try:
                return step()
            finally:
                self.reading.used = None

        self.stepped = stepped
        fake._kv_tokens_used = read_before_the_step  # type: ignore[method-assign]

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self.stepped(lambda: super(LastTokensCheckThenAct, self).prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.stepped(lambda: super(LastTokensCheckThenAct, self).decode(request))


class ReleaseFreesByIdLater(RacyEngine):
    """Takes a released session out of its table at once, and frees its KV blocks a moment
    later, looking them up by the session's id (as an engine that hands frees to its
    allocator's thread would): a session opened under the same id in between loses its
    blocks, its cache emptied under it and its tokens no longer counted. One call at a
    time the id names nothing by then."""

    RACE = "frees a released session's KV blocks a moment later, by id: a session reopened under the id in between loses them"
    #: A release and an opening of one id at once (a release of an unknown id is OK, and
    #: the opening lands between the release and its free).
    MINIMUM = (1, 2)
    #: The reopened session's tokens go uncounted (its metrics), and its cache is emptied
    #: under it: a decode of it that follows in its lane answers as if it had no history.
    PROPERTIES = (LINEARIZABILITY, "§3 determinism")

    def __init__(self) -> None:
        super().__init__()
        # In a parallel phase, an opening of an id and a release of it wait for each other,
        # so that the opening lands in the release's window on every run (``_Meeting``).
        self.meeting = _Meeting()
        self.opened: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        if request.step == 0 and in_parallel_phase():
            self.meeting.wait(("open", session), lambda: ("window", session) in self.meeting.waiting)
        result = super().prefill(request)
        self.opened.add(session)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        self.opened.discard(session_id)
        status = super().release(session_id)
        if in_parallel_phase():
            self.meeting.wait(("window", session_id), lambda: session_id in self.opened, ("open", session_id))
        else:
            time.sleep(0)  # a server's thread: a bare thread switch
        fake = self.inner
        with fake._calls:
            reopened = fake._sessions.get(session_id)
            if reopened is not None and reopened.cache is not None:
                reopened.cache, reopened.kv_tokens = fake.fresh_cache(), 0
        return status


class CancelOnFinalDecodePinsKv(RacyEngine):
    """Writes a decode's result back after the step, out of the lock; a cancel that lands
    meanwhile leaves the freeing of the session's KV to the step. A step that took the
    last free KV token is the request's final one, and finishes down another path, which
    frees nothing: the cancelled session's tokens stay pinned (counted in its metrics)
    until its release or restart. One call at a time no cancel meets a running step."""

    RACE = "a cancel during a decode leaves the free to the step, and the final step (the last KV token) skips it: the KV stays pinned"
    #: An opening that takes all but one free KV token, then the session's decode and its cancel at once.
    MINIMUM = (2, 2)

    def __init__(self) -> None:
        super().__init__()
        self.running: set[str] = set()
        self.cancelled_while_running: dict[str, int] = {}
        #: Tokens of cancelled sessions that were never freed, by session.
        self.pinned: dict[str, int] = {}
        # In a parallel phase, a decode writing back and a cancel of its session wait for
        # each other, so that the cancel lands in the decode's window on every run (``_Meeting``).
        self.meeting = _Meeting()
        self.cancelled: set[str] = set()

    def decode(self, request: DecodeRequest) -> StepResult:
        fake, session = self.inner, request.session_id
        with fake._calls:
            self.running.add(session)
            self.cancelled.discard(session)
            result = super().decode(request)
            final = result.status.ok and fake._kv_tokens_used() >= fake._max_kv_tokens
        # The result written back, out of the lock.
        if in_parallel_phase() and result.status.ok:
            self.meeting.wait(("window", session), lambda: session in self.cancelled, ("cancel", session))
        elif not in_parallel_phase():
            time.sleep(0)  # a server's thread: a bare thread switch
        with fake._calls:
            self.running.discard(session)
            held = self.cancelled_while_running.pop(session, None)
            if held is not None and final:
                self.pinned[session] = held
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        if in_parallel_phase():
            self.meeting.wait(("cancel", session_id), lambda: ("window", session_id) in self.meeting.waiting)
        fake = self.inner
        with fake._calls:
            before = fake._sessions.get(session_id)
            held = before.kv_tokens if before is not None else 0
            status = super().cancel(session_id, epoch)
            if status.ok and session_id in self.running:
                self.cancelled_while_running[session_id] = held
            self.cancelled.add(session_id)
            return status

    def prefill(self, request: PrefillRequest) -> StepResult:
        with self.inner._calls:
            result = super().prefill(request)
            if result.status.ok and request.step == 0:
                self.pinned.pop(request.session_id, None)
            return result

    def release(self, session_id: str) -> StructuredStatus:
        with self.inner._calls:
            self.pinned.pop(session_id, None)
            return super().release(session_id)

    def metrics(self) -> MetricsResult:
        with self.inner._calls:
            counted = super().metrics()
            return replace(counted, kv_tokens=counted.kv_tokens + sum(self.pinned.values()))


class _Meeting:
    """Where the two sides of a race wait for each other in a parallel phase, so that when a
    phase holds both racing calls on two lanes, one lands in the other's window on every
    run, however the threads are scheduled. A waiter gives up as soon as another waits for
    something else: no two wait on each other."""

    #: The most turns a side waits for the other: a turn is a ``yield_point``, which ends when
    #: another lane's call answers or waits in a yield point too, and at once when the other
    #: lanes have finished.
    TURNS = 200

    def __init__(self) -> None:
        self.waiting: list[tuple[str, str]] = []  # (what it waits in, session), one per waiter

    def wait(self, waiter: tuple[str, str], ready: Callable[[], bool], partner: tuple[str, str] | None = None) -> None:
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
    LastTokensCheckThenAct,
    ReleaseFreesByIdLater,
    CancelOnFinalDecodePinsKv,
)
