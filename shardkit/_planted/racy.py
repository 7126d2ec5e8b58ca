"""Planted racy engines: each answers correctly one call at a time and wrongly when two
calls overlap, so only ``--concurrency`` finds it (a sequential run never flags it; the
self-tests check both).

Each opens its race window with ``time.sleep(0)``, which gives up the interpreter as a
real engine's I/O, native call or lock would, so that the race shows in a good share of
the runs, not once in thousands. Each declares ``concurrent_calls``, as the fake it
wraps does: the claim is the bug.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import replace
from typing import ClassVar

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
from shardkit._planted.base import DelegatingEngine
from shardkit.engines.base import StepInput

__all__ = [
    "RACY",
    "CancelFreesUnderARunningStep",
    "DecodeCounterLostUpdate",
    "LastSlotCheckThenAct",
    "RacyEngine",
    "SharedScratchToken",
]

LINEARIZABILITY = "§2 linearizability"


class RacyEngine(DelegatingEngine):
    """What a racy planted engine states: its race and what the kit must name."""

    RACE: ClassVar[str]
    #: The properties a found failure may name (a race shows through the first check it breaks).
    PROPERTIES: ClassVar[tuple[str, ...]] = (LINEARIZABILITY,)


class DecodeCounterLostUpdate(RacyEngine):
    RACE = "counts decodes itself: reads the count, decodes, writes the count back; an overlapping decode is lost"

    def __init__(self) -> None:
        super().__init__()
        self.decodes = 0

    def decode(self, request: DecodeRequest) -> StepResult:
        seen = self.decodes
        time.sleep(0)
        self.decodes = seen + 1
        return super().decode(request)

    def metrics(self) -> MetricsResult:
        counted = super().metrics()
        return MetricsResult(counted.prefill_calls, self.decodes, counted.active_sessions, counted.kv_tokens)


class SharedScratchToken(RacyEngine):
    RACE = "writes each decoded token into one scratch slot every session shares, then answers what the slot holds"
    PROPERTIES = ("§3 determinism",)

    def __init__(self) -> None:
        super().__init__()
        self.scratch = 0

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        if not isinstance(result.output, TokenOutput):
            return result
        self.scratch = result.output.token_id
        time.sleep(0)
        return StepResult(result.status, result.cache, TokenOutput(self.scratch))


class LastSlotCheckThenAct(RacyEngine):
    """Admits sessions itself, into fewer slots than the fake has: it checks for a free slot,
    then opens the session, and two openings between the check and the act both get in.
    One call at a time it is right: an opening past its slots that the fake admits is
    released again and refused, one the fake refuses keeps the fake's answer."""

    RACE = "checks for a free session slot, then opens the session: two openings both take the last slot"
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


RACY: tuple[type[RacyEngine], ...] = (
    DecodeCounterLostUpdate,
    SharedScratchToken,
    LastSlotCheckThenAct,
    CancelFreesUnderARunningStep,
)
