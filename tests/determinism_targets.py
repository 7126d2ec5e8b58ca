"""Engines for tests/test_determinism.py: a planted bug that can be slowed down.

``SHARDKIT_TEST_CALL_DELAY`` (seconds) makes every call of ``SlowedCancelLeak`` sleep
first, as an engine on a loaded machine would be slow; its answers do not change.
"""

from __future__ import annotations

import os
import time

from shardkit import DecodeRequest, HealthResult, MetricsResult, PrefillRequest, StepResult, StructuredStatus
from tests.planted import CancelLeaksKvTokens


class SlowedCancelLeak(CancelLeaksKvTokens):
    def __init__(self) -> None:
        super().__init__()
        self.delay = float(os.environ.get("SHARDKIT_TEST_CALL_DELAY", "0"))

    def _pause(self) -> None:
        if self.delay:
            time.sleep(self.delay)

    def prefill(self, request: PrefillRequest) -> StepResult:
        self._pause()
        return super().prefill(request)

    def decode(self, request: DecodeRequest) -> StepResult:
        self._pause()
        return super().decode(request)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._pause()
        return super().cancel(session_id, epoch)

    def release(self, session_id: str) -> StructuredStatus:
        self._pause()
        return super().release(session_id)

    def health(self) -> HealthResult:
        self._pause()
        return super().health()

    def metrics(self) -> MetricsResult:
        self._pause()
        return super().metrics()
