"""The static contract's retry check teaches the rule it checks: its expected metrics are
the reference model's (a retry is a call, and counted), and it compares every counter."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from shardkit import (
    ContractViolation,
    DecodeRequest,
    FakeShardEngine,
    MetricsResult,
    PrefillRequest,
    StepResult,
    assert_shard_engine_contract,
)
from shardkit._planted.base import DelegatingEngine, StepRequest

RETRY_CHECK = "a retry is idempotent"


class _RetrySpotting(DelegatingEngine):
    """A correct engine (the fake) that notices exact repeats of a session's last request."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, StepRequest] = {}
        self.retried_decodes = 0
        self.retried_tokens = 0

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        self._note(request, result)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        retry = self.last.get(request.session_id) == request
        result = self.inner.decode(request)
        if retry and result.status.ok:
            self.retried_decodes += 1
            self.retried_tokens += 1
        self._note(request, result)
        return result

    def _note(self, request: StepRequest, result: StepResult) -> None:
        if result.status.ok:
            self.last[request.session_id] = request


class RetryCachesItsTokenAgain(_RetrySpotting):
    """Answers a retried decode correctly and counts it as a call, but caches its token a second time."""

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.retried_tokens)


class RetriedDecodesNotCounted(_RetrySpotting):
    """Answers a retried decode correctly, but leaves it out of ``decode_calls``."""

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, decode_calls=metrics.decode_calls - self.retried_decodes)


def _retry_failure(engine: type[DelegatingEngine]) -> str:
    with pytest.raises(ContractViolation) as raised:
        assert_shard_engine_contract(engine)
    violation = raised.value
    assert list(violation.failed_checks) == [RETRY_CHECK], str(violation)
    [line] = [line for line in str(violation).splitlines() if f"[{RETRY_CHECK}]" in line]
    return line


def test_the_fake_counts_a_retried_decode_and_passes() -> None:
    assert assert_shard_engine_contract(FakeShardEngine) == []


def test_the_expected_metrics_after_a_retry_count_the_retry() -> None:
    """The expectation is the model's: a retried decode is a call, so decode_calls=2, never 1."""
    line = _retry_failure(RetryCachesItsTokenAgain)
    expected, _, observed = line.partition("; observed ")
    assert "expected prefill_calls=1 decode_calls=2 active_sessions=1 kv_tokens=4" in expected, line
    assert not re.search(r"decode_calls=1\b", expected), f"the message teaches decode_calls=1 after a retry: {line}"
    assert "decode_calls=2" in observed, line
    assert "kv_tokens=5" in observed, line


def test_an_engine_that_leaves_retried_decodes_uncounted_fails_naming_the_counter() -> None:
    line = _retry_failure(RetriedDecodesNotCounted)
    assert "metrics() after a repeated decode" in line, line
    assert "decode_calls=2" in line.partition("; observed ")[0], line
    assert "decode_calls=1" in line.partition("; observed ")[2], line
    assert line.endswith("(decode_calls differs)"), line
    assert "by §2 metrics (a retry counts as a call and adds no tokens)" in line, line
