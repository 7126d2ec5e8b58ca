"""Planted engines that kill their own process, as native engines die: only an isolated
run (``shardkit fuzz --isolate``) survives them. Never call them in-process.

Each states, like the other planted engines, the property the kit must name and its
minimal failing sequence. ``PROPERTY`` is the property of an isolated run.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import ClassVar

import numpy as np

from shardkit import (
    CacheResult,
    DecodeRequest,
    LoadRequest,
    LoadResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
)
from shardkit._planted.base import PlantedEngine
from shardkit._planted.minimal import cancel, decode, prefill, release

#: How far the unbounded allocator goes before giving up: far beyond any test's
#: --worker-memory, yet survivable by the machine if a limit were not enforced.
ALLOCATION_CAP_BYTES = 6 * 2**30


class DyingEngine(PlantedEngine):
    """A planted engine whose bug ends the process; ``STEP_TIMEOUT`` and ``WORKER_MEMORY``
    are the isolation settings its test runs with."""

    STEP_TIMEOUT: ClassVar[float | None] = None
    WORKER_MEMORY: ClassVar[int | None] = None


class AbortsOnRetriedPrefill(DyingEngine):
    BUG = "a retried prefill trips a native assertion (abort) instead of answering from the cache"
    PROPERTY = "process killed by SIGABRT"
    MINIMAL = (prefill("a"), prefill("a", note="the retry"))

    def __init__(self) -> None:
        super().__init__()
        self.served: set[tuple[str, int, int]] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        key = (request.session_id, request.epoch, request.step)
        if key in self.served:
            os.abort()
        result = self.inner.prefill(request)
        if result.status.ok:
            self.served.add(key)
        return result


class SegfaultsOnDecodeAfterCancel(DyingEngine):
    BUG = "a decode of a cancelled session reads its freed KV cache (use after free: a segfault)"
    PROPERTY = "process killed by SIGSEGV"
    MINIMAL = (prefill("a"), cancel("a"), decode("a", step=1))

    def __init__(self) -> None:
        super().__init__()
        self.freed: set[str] = set()

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.freed.add(session_id)
        return status

    def decode(self, request: DecodeRequest) -> StepResult:
        if request.session_id in self.freed:
            ctypes.string_at(0)  # a read of address 0: SIGSEGV
        return self.inner.decode(request)

    def release(self, session_id: str) -> StructuredStatus:
        self.freed.discard(session_id)
        return self.inner.release(session_id)


class HangsOnSecondDecode(DyingEngine):
    BUG = "the second decode of a session waits forever on a lock the first one never released"
    PROPERTY = "step deadline"
    # The oracle's twin fed one token per decode decodes the second and third tokens of a
    # prefill: one prefill of three tokens makes it decode twice.
    MINIMAL = (prefill("a", tokens=(0, 0, 0)),)
    # 3 s, not 1: on a busy two-core machine a correct step of a Python worker once took over
    # 1 s, and the kit named that step's deadline instead of the hang (each hang costs this much).
    STEP_TIMEOUT = 3.0

    def __init__(self) -> None:
        super().__init__()
        self.decodes: dict[str, int] = {}

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if result.status.ok:
            self.decodes[request.session_id] = self.decodes.get(request.session_id, 0) + 1
            if self.decodes[request.session_id] == 2:
                while True:  # the deadlock
                    time.sleep(0.05)
        return result


class ExitsWhenThirdSessionOpens(DyingEngine):
    BUG = "opening a third live session takes a rarely used path that calls exit(3)"
    PROPERTY = "process exited with code 3"
    MINIMAL = (prefill("a"), prefill("b"), prefill("c"))

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and self.inner.metrics().active_sessions == 3:
            os._exit(3)
        return result


class AllocatesWithoutBoundAfterRelease(DyingEngine):
    BUG = "reopening a released session id allocates a new cache arena on every block, without bound"
    PROPERTY = "worker memory"
    MINIMAL = (prefill("a"), release("a"), prefill("a"))
    WORKER_MEMORY = 512

    def __init__(self) -> None:
        super().__init__()
        self.opened: set[str] = set()
        self.released: set[str] = set()
        self.arenas: list[np.ndarray] = []

    def prefill(self, request: PrefillRequest) -> StepResult:
        if request.session_id in self.released:
            while sum(arena.nbytes for arena in self.arenas) < ALLOCATION_CAP_BYTES:
                self.arenas.append(np.ones(64 * 2**20, dtype=np.uint8))
            return StepResult(StructuredStatus(StatusCode.INTERNAL, "arena cap reached"), CacheResult.MISS)
        result = self.inner.prefill(request)
        if result.status.ok:
            self.opened.add(request.session_id)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        if session_id in self.opened:
            self.released.add(session_id)
        return self.inner.release(session_id)


class ExitsOnLoad(PlantedEngine):
    """Not a planted bug for the machine (every example starts with a load): for the
    driver's message when a worker dies before the first step."""

    def load(self, request: LoadRequest) -> LoadResult:
        os._exit(4)


DYING: tuple[type[DyingEngine], ...] = (
    AbortsOnRetriedPrefill,
    SegfaultsOnDecodeAfterCancel,
    HangsOnSecondDecode,
    ExitsWhenThirdSessionOpens,
    AllocatesWithoutBoundAfterRelease,
)
