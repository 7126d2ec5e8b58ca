"""assert_shard_engine_contract: passes on the fake, names the right check on broken engines."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import pytest

from shardkit import (
    ContractViolation,
    DecodeRequest,
    EngineCapabilities,
    FakeShardEngine,
    PrefillRequest,
    ShardkitError,
    StepResult,
    TokenOutput,
    assert_shard_engine_contract,
)
from shardkit._core.conformance import CONTRACT_CHECKS
from tests.planted import PLANTED, PlantedEngine

CAUGHT_BY_CONTRACT = [engine for engine in PLANTED if engine.CONTRACT_CHECK is not None]


def test_the_fake_passes_the_contract() -> None:
    assert_shard_engine_contract(FakeShardEngine)


def test_at_least_five_planted_engines_are_meant_for_the_contract() -> None:
    assert len(CAUGHT_BY_CONTRACT) >= 5
    names = {check.name for check in CONTRACT_CHECKS}
    assert {engine.CONTRACT_CHECK for engine in CAUGHT_BY_CONTRACT} <= names


@pytest.mark.parametrize("engine", CAUGHT_BY_CONTRACT, ids=lambda engine: engine.__name__)
def test_a_broken_engine_fails_the_contract_naming_the_right_check(engine: type[PlantedEngine]) -> None:
    with pytest.raises(ContractViolation) as raised:
        assert_shard_engine_contract(engine)
    violation = raised.value
    assert engine.CONTRACT_CHECK in violation.failed_checks
    assert f"[{engine.CONTRACT_CHECK}]" in str(violation)
    assert "expected" in str(violation)
    assert "observed" in str(violation)


def test_a_violation_is_an_assertion_error_and_a_shardkit_error() -> None:
    with pytest.raises(AssertionError):
        assert_shard_engine_contract(CAUGHT_BY_CONTRACT[0])
    assert issubclass(ContractViolation, ShardkitError)


def test_the_message_shows_the_call_the_rule_and_both_answers() -> None:
    from tests.planted import StaleEpochAccepted

    with pytest.raises(ContractViolation) as raised:
        assert_shard_engine_contract(StaleEpochAccepted)
    message = str(raised.value)
    assert "decode(session='a', epoch=0, step=1" in message
    assert "expected ABORTED/MISS by §2 rule 4" in message
    assert "observed OK/HIT" in message


def test_an_engine_that_raises_is_reported_not_crashed_on() -> None:
    class Exploding(FakeShardEngine):
        def release(self, session_id: str) -> object:  # type: ignore[override]
            raise RuntimeError("segfault-ish")

    with pytest.raises(
        ContractViolation, match=r"\[release then decode is NOT_FOUND\] the engine raised RuntimeError: segfault-ish"
    ):
        assert_shard_engine_contract(Exploding)


def test_the_fake_skips_no_check() -> None:
    assert assert_shard_engine_contract(FakeShardEngine) == []


def test_role_checks_are_skipped_with_a_reason_for_an_engine_that_serves_only_its_whole_range() -> None:
    from shardkit import EngineError, LoadRequest, LoadResult, StatusCode, StructuredStatus

    class WholeOnly(FakeShardEngine):
        def load(self, request: LoadRequest) -> LoadResult:
            if request.role != "full":
                raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, "whole model only"))
            return super().load(request)

    skipped = assert_shard_engine_contract(WholeOnly)
    assert len(skipped) == 3
    assert all(reason.endswith("INVALID_ARGUMENT: whole model only") for reason in skipped)


class _SecondSessionAnswersOneTokenOff(FakeShardEngine):
    """The session named ``second-session`` gets the next token id, with ``MARGIN`` as its
    margin, under a tolerance of 1e-4 (below the fake's own margins on the check's inputs):
    a near tie when ``MARGIN`` is below it."""

    MARGIN: ClassVar[float | None] = None

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), tolerance=1e-4)

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._off(request.session_id, super().prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._off(request.session_id, super().decode(request))

    def _off(self, session_id: str, result: StepResult) -> StepResult:
        if session_id != "second-session" or not isinstance(result.output, TokenOutput):
            return result
        token = (result.output.token_id + 1) % self.capabilities().vocab_size
        return replace(result, output=TokenOutput(token, margin=self.MARGIN))


def test_outputs_that_differ_between_sessions_fail_the_determinism_check() -> None:
    with pytest.raises(ContractViolation) as raised:
        assert_shard_engine_contract(_SecondSessionAnswersOneTokenOff)
    assert raised.value.failed_checks == ("two fresh sessions with the same inputs give the same outputs",)
    assert "the same inputs in a second session: expected the first session's outputs; observed token" in str(
        raised.value
    )


def test_a_token_that_flips_in_a_near_tie_passes_the_contract_as_it_passes_the_fuzzer() -> None:
    """The conformance check once compared tokens exactly, stricter than the machine's own check."""

    class NearTie(_SecondSessionAnswersOneTokenOff):
        MARGIN = 1e-5

    assert assert_shard_engine_contract(NearTie) == []
