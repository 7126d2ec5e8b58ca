"""No false alarm on a correct engine, and no missed bug behind an injected fault.

Each test drives the ``Driver`` directly with a handcrafted sequence of steps that once
ended in a wrong verdict: an injected ``malformed_output`` reported as a failure of a
correct engine, or an engine bug hidden by the kit's own corruption. An injected output
the kit genuinely misses is a ``KitBug``, never a failure of the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import pytest

from shardkit import FakeShardEngine
from shardkit._core.driver import KIT_BUG_ENDING, CustomOp, Driver, StepFailed
from shardkit._core.faults import corrupt_output
from shardkit._core.model import Prediction, ReferenceModel
from shardkit._core.steps import Action, step_action
from shardkit._transport.resolve import resolve_target
from shardkit.contract import (
    RESIDUAL_TENSOR,
    BoundaryBundle,
    EngineCapabilities,
    EngineTensor,
    LoadRequest,
    PrefillRequest,
    Role,
    ShardEngine,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit.engines.base import EngineSpec, Produced, SessionEngine, StepInput
from shardkit.errors import KitBug, UsageError

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)
HEAD = LoadRequest("shardkit-fuzz", 0, 1, 4)


def driver_for(
    factory: Any, load: LoadRequest = FULL, faults: Iterable[str] = ("malformed_output",), **options: Any
) -> Driver:
    return Driver(resolve_target(factory), load, faults=frozenset(faults), **options)


def fault(kind: str, value: float = 0.0) -> Action:
    return Action("fault", {"kind": kind, "value": value})


def prefill(session: str, step: int, tokens: Iterable[int], *, epoch: int = 0, note: str = "") -> Action:
    return step_action("prefill", session, epoch, step, tuple(tokens), note=note)


def release(session: str) -> Action:
    return Action("release", {"session": session})


class NoNativeFaults(FakeShardEngine):
    """The fake advertising no native fault: the kit injects delay, malformed_output and crash at its boundary."""

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), supported_faults=frozenset())


# --- the reported false alarm: a retry corrupted twice ---------------------------------------


def test_a_retry_corrupted_again_at_the_boundary_is_still_detected() -> None:
    """As reported: step 2's output was corrupted at the boundary, and the resent step 4 too,
    identically; the old check accepted step 4 as "equal to the earlier result" and called
    the injection undetected, a failure of a correct engine."""
    driver = driver_for(NoNativeFaults)
    driver.execute(fault("malformed_output"))
    first = driver.execute(prefill("a", 0, [0]))
    driver.execute(fault("malformed_output"))
    again = driver.execute(prefill("a", 0, [0], note="resent"))
    assert "malformed output was detected" in first.observed
    assert "malformed output was detected" in again.observed


def test_a_retry_of_a_step_corrupted_at_the_boundary_must_repeat_the_engines_own_answer() -> None:
    """The kit keeps what the engine really returned, so a retry is held to it exactly (§2
    rule 6) instead of only to the reference: a drifting retry is found."""
    driver = driver_for(RetryMarginDrifts.without_native_faults)
    driver.execute(fault("malformed_output"))
    driver.execute(prefill("a", 0, [0]))
    with pytest.raises(StepFailed) as failed:
        driver.execute(prefill("a", 0, [0], note="resent"))
    assert failed.value.violation.property == "§2 rule 6"


def test_a_step_corrupted_by_the_engine_taints_its_key_only_until_the_key_is_used_again() -> None:
    """After a release the same (epoch, step) is a new step: a retry of it must repeat it exactly."""
    driver = driver_for(RetryMarginDrifts)
    driver.execute(fault("malformed_output"))
    assert "detected" in driver.execute(prefill("a", 0, [0])).observed
    driver.execute(release("a"))
    driver.execute(prefill("a", 0, [0]))
    with pytest.raises(StepFailed) as failed:
        driver.execute(prefill("a", 0, [0], note="resent"))
    assert failed.value.violation.property == "§2 rule 6"


class RetryMarginDrifts(FakeShardEngine):
    """A bug: a retry returns the same token with another margin, so not "the same result"."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, PrefillRequest] = {}

    @classmethod
    def without_native_faults(cls) -> ShardEngine:
        engine = cls()
        engine.capabilities = lambda: replace(FakeShardEngine.capabilities(engine), supported_faults=frozenset())  # type: ignore[method-assign]
        return engine

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        output = result.output
        if isinstance(output, TokenOutput) and self._last.get(request.session_id) == request:
            result = replace(result, output=replace(output, margin=(output.margin or 0.0) + 1.0))
        if result.status.ok:
            self._last[request.session_id] = request
        return result

    def release(self, session_id: str) -> StructuredStatus:
        self._last.pop(session_id, None)
        return super().release(session_id)


# --- residual values float32 cannot shift ----------------------------------------------------

SCALE = np.float32(2.0**40)


class HugeResiduals(NoNativeFaults):
    """A correct engine whose residual values are all beyond 2**25, where float32 cannot add 1."""

    def forward(self, cache: list[bytes], step: StepInput) -> tuple[list[bytes], Produced]:
        if step.residual is not None:
            rows = (step.rows() / SCALE).astype("<f4")
            step = StepInput(None, EngineTensor.from_array(RESIDUAL_TENSOR, rows))
        chains, produced = super().forward(cache, step)
        if isinstance(produced, bytes):
            produced = (np.frombuffer(produced, dtype="<f4") * SCALE).astype("<f4").tobytes()
        return chains, produced


def test_boundary_corruption_moves_every_residual_value_even_huge_ones() -> None:
    caps = HugeResiduals().capabilities()
    rows = np.array([[2.0**30, -(2.0**25), 3.0e38, 0.0, 1.5, -7.0, 2.0**24, 1e-30]], dtype="<f4")
    bundle = BoundaryBundle(
        "a", 0, 0, "post_head_residual", caps.architecture, (EngineTensor.from_array(RESIDUAL_TENSOR, rows),), (1,)
    )
    corrupted = corrupt_output(bundle, replace(caps, tolerance=0.25))
    assert isinstance(corrupted, BoundaryBundle)
    moved = np.abs(corrupted.tensors[0].to_array().astype(np.float64) - rows.astype(np.float64))
    assert (moved > 2 * 0.25).all(), moved
    assert np.isfinite(corrupted.tensors[0].to_array()).all()


def test_a_corruption_of_huge_residuals_at_the_boundary_is_detected() -> None:
    driver = driver_for(HugeResiduals, HEAD)
    driver.execute(fault("malformed_output"))
    assert "detected" in driver.execute(prefill("a", 0, [1, 2])).observed


class HugeResidualsCorruptedNatively(HugeResiduals):
    """The same engine, corrupting its own output: the engine base's native malformed_output fault."""

    def capabilities(self) -> EngineCapabilities:
        return FakeShardEngine.capabilities(self)


def test_a_native_corruption_of_huge_residuals_is_detected() -> None:
    """The engine base and the boundary share one corruption guard; the base once had no finiteness check."""
    assert "malformed_output" in HugeResidualsCorruptedNatively().capabilities().supported_faults
    driver = driver_for(HugeResidualsCorruptedNatively, HEAD)
    driver.execute(fault("malformed_output"))
    assert "detected" in driver.execute(prefill("a", 0, [1, 2])).observed


# --- near ties: a correct engine's token may flip where its margin is below the tolerance ------


class _Flips(SessionEngine[tuple[tuple[int, ...], int]]):
    """A one-layer engine whose top two tokens tie within its tolerance; which one wins
    depends on how many calls built the history, so a twin fed in other chunks disagrees,
    as the contract allows for a near tie (§3)."""

    ENGINE_NAME: ClassVar[str] = "Flips"
    EVIDENCE_CLASS: ClassVar[Literal["fixture", "real"]] = "fixture"
    TOLERANCE: ClassVar[float] = 0.5
    VOCAB: ClassVar[int] = 8

    def __init__(self) -> None:
        spec = EngineSpec("flips", 1, 4, self.VOCAB, "float32", 4, 64)
        super().__init__(spec, crash_exception_factory=RuntimeError)

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        pass

    def fresh_cache(self) -> tuple[tuple[int, ...], int]:
        return (), 0

    def forward(
        self, cache: tuple[tuple[int, ...], int], step: StepInput
    ) -> tuple[tuple[tuple[int, ...], int], Produced]:
        assert step.token_ids is not None
        tokens, calls = cache[0] + step.token_ids, cache[1] + 1
        return (tokens, calls), self._answer(sum(tokens) % self.VOCAB, calls)

    def _answer(self, base: int, calls: int) -> Produced:
        raise NotImplementedError


class FlipsWithoutLogits(_Flips):
    """Reports the near tie as a margin of 0 (no logits to choose a corruption from)."""

    def _answer(self, base: int, calls: int) -> Produced:
        return TokenOutput((base + calls) % self.VOCAB, margin=0.0)

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), supported_faults=frozenset())


class FlipsWithLogits(_Flips):
    """Native faults; the top two logits are ``base`` and ``base + 1``, 0.01 apart."""

    def _answer(self, base: int, calls: int) -> Produced:
        logits: npt.NDArray[np.float32] = -np.arange(self.VOCAB, dtype=np.float32) / 10 - 1
        top, second = (base, base + 1) if calls % 2 else (base + 1, base)
        logits[top % self.VOCAB], logits[second % self.VOCAB] = 1.0, 0.99
        return logits


def test_a_boundary_corruption_that_lands_on_the_other_side_of_a_near_tie_is_not_counted() -> None:
    """Fed in two chunks, the engine answers 5 (margin 0); the twin fed one token per decode
    (three calls) answers 6; the kit's corruption (5 + 1) is 6 too, a valid answer: no wrong
    output to detect, so no verdict at all."""
    driver = driver_for(FlipsWithoutLogits, LoadRequest("m", 0, 0, 1))
    driver.execute(prefill("a", 0, [0]))
    driver.execute(fault("malformed_output"))
    record = driver.execute(prefill("a", 1, [1, 2]))
    assert "valid answer (a near tie); not counted" in record.observed
    assert any("not counted as an injection" in note for note in driver.notes)
    # Never silent: the run's summary lists the detection that could not be checked.
    assert any(caveat.startswith("malformed_output detection") for caveat in driver.caveats)
    driver.execute(fault("malformed_output"))
    assert "detected" in driver.execute(prefill("b", 0, [0])).observed  # no tie there: caught


def test_a_native_corruption_never_lands_on_a_near_tie() -> None:
    """The engines' own malformed_output picks the least likely token, never the runner-up
    that a twin may legitimately return (here the twin says 4, the engine 3)."""
    driver = driver_for(FlipsWithLogits, LoadRequest("m", 0, 0, 1))
    driver.execute(fault("malformed_output"))
    assert "detected" in driver.execute(prefill("a", 0, [0, 1, 2])).observed


# --- custom operations never go through the boundary -------------------------------------------


def _scratch_request() -> PrefillRequest:
    return PrefillRequest("scratch", 0, 0, token_ids=(1,))


def _scratch_call(engine: ShardEngine, args: Mapping[str, Any]) -> StructuredStatus:
    engine.prefill(_scratch_request())
    return engine.release("scratch")


def _scratch_predict(model: ReferenceModel, args: Mapping[str, Any]) -> Prediction:
    model.prefill(_scratch_request())
    return model.release("scratch")


SCRATCH = {"scratch": CustomOp(_scratch_call, _scratch_predict)}


def test_a_custom_operation_does_not_spend_a_malformed_output_injected_at_the_boundary() -> None:
    driver = driver_for(NoNativeFaults, custom_ops=SCRATCH)
    driver.execute(fault("malformed_output"))
    driver.execute(Action("scratch"))
    assert "detected" in driver.execute(prefill("a", 0, [0])).observed


def test_a_custom_operation_is_not_counted_by_a_crash_injected_at_the_boundary() -> None:
    driver = driver_for(NoNativeFaults, faults=("crash",), custom_ops=SCRATCH)
    driver.execute(fault("crash", 1.0))
    assert driver.execute(Action("scratch")).outcome == "OK"
    assert driver.execute(prefill("a", 0, [0])).outcome == "CRASH"


# --- what the engine did not do is the engine's; what the kit missed is the kit's ------------------


class CorruptsNothing(FakeShardEngine):
    def inject_fault(self, fault: Any) -> StructuredStatus:
        if fault.kind == "malformed_output":
            return StructuredStatus(StatusCode.OK)
        return super().inject_fault(fault)


def test_a_native_fault_the_engine_accepts_but_does_not_apply_is_the_engines_failure() -> None:
    driver = driver_for(CorruptsNothing)
    driver.execute(fault("malformed_output"))
    with pytest.raises(StepFailed) as failed:
        driver.execute(prefill("a", 0, [0]))
    assert failed.value.violation.property == "§4 malformed_output"
    assert "did not corrupt" in failed.value.violation.message


def test_an_injection_the_kit_cannot_check_is_a_kit_bug() -> None:
    """Without twins a first-seen history has no reference: the kit cannot see the corruption."""
    driver = driver_for(NoNativeFaults, twins=False)
    driver.execute(fault("malformed_output"))
    with pytest.raises(KitBug) as bug:
        driver.execute(prefill("a", 0, [0]))
    message = str(bug.value)
    assert message.endswith(KIT_BUG_ENDING)
    assert KIT_BUG_ENDING == "this is a bug in shardkit; please report it with this trace"
    assert "no reference answer exists for history [0]" in message
    assert "step 1: fault(kind='malformed_output', value=0.0)" in message
    assert "step 2: prefill(session='a', epoch=0, step=0, tokens=[0])" in message


def test_a_boundary_corruption_that_changes_nothing_is_a_kit_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shardkit._core.faults.corrupt_output", lambda output, caps: output)
    for load in (FULL, HEAD):
        driver = driver_for(NoNativeFaults, load)
        driver.execute(fault("malformed_output"))
        with pytest.raises(KitBug, match="the corruption did not change the output"):
            driver.execute(prefill("a", 0, [0]))


def test_a_retry_with_no_logged_first_answer_is_a_kit_bug() -> None:
    """The model and the driver's log disagree: the kit's bookkeeping, not the engine, is wrong."""
    driver = driver_for(FakeShardEngine, faults=())
    driver.execute(prefill("a", 0, [0]))
    driver.log("a").results.clear()
    with pytest.raises(KitBug, match=r"predicts an idempotent retry of step \(0, 0\), but no earlier result"):
        driver.execute(prefill("a", 0, [0], note="resent"))


def test_a_decode_retry_of_a_corrupted_step_is_checked_like_a_prefill() -> None:
    """The same class on decode, and on a head's bundle: a retry of a corrupted step, corrupted again."""
    for load, factory in (
        (FULL, NoNativeFaults),
        (HEAD, NoNativeFaults),
        (FULL, FakeShardEngine),
        (HEAD, FakeShardEngine),
    ):
        driver = driver_for(factory, load)
        driver.execute(prefill("a", 0, [0]))
        decode = step_action("decode", "a", 0, 1, (3,))
        for _ in range(2):
            driver.execute(fault("malformed_output"))
            assert "detected" in driver.execute(decode).observed
        assert "detected" not in driver.execute(decode).observed


def test_a_fault_value_the_boundary_refuses_is_an_input_error_not_the_engines_failure() -> None:
    """Only a hand-made trace can ask for a crash after 0 calls; the engine never saw it."""
    driver = driver_for(NoNativeFaults, faults=("crash", "delay"))
    with pytest.raises(UsageError, match=r"cannot inject Fault\(kind='crash', value=0.0\) .* got 0.0"):
        driver.execute(fault("crash", 0.0))
    with pytest.raises(UsageError, match=r"delay must be >= 0 seconds, got -1.0"):
        driver.execute(fault("delay", -1.0))


def test_a_fault_the_engine_cannot_take_is_an_input_error_naming_the_fix() -> None:
    driver = driver_for(NoNativeFaults, faults=("memory_pressure", "crash"))
    with pytest.raises(
        UsageError, match=r"'memory_pressure' cannot be injected .* run against an engine that supports it"
    ):
        driver.execute(fault("memory_pressure", 3.0))


class OkWithoutOutput(NoNativeFaults):
    def prefill(self, request: PrefillRequest) -> StepResult:
        return replace(super().prefill(request), output=None)


def test_an_ok_result_without_output_while_a_corruption_is_armed_is_the_engines_failure() -> None:
    """The boundary had nothing to corrupt: that is the engine's doing, not a miss of the kit."""
    driver = driver_for(OkWithoutOutput)
    driver.execute(fault("malformed_output"))
    with pytest.raises(StepFailed) as failed:
        driver.execute(prefill("a", 0, [0]))
    assert failed.value.violation.property == "§3 shape and range"


class NativeOkWithoutOutput(FakeShardEngine):
    """Its native malformed_output returns no output at all: not "well formed but wrong"."""

    def prefill(self, request: PrefillRequest) -> StepResult:
        corrupt = self._corrupt_next_output
        result = super().prefill(request)
        return replace(result, output=None) if corrupt and result.status.ok else result


def test_a_native_corruption_that_breaks_the_output_structure_is_the_engines_failure() -> None:
    """A broken structure is no detection to count: the fault promises a well-formed, wrong output."""
    driver = driver_for(NativeOkWithoutOutput)
    driver.execute(fault("malformed_output"))
    with pytest.raises(StepFailed) as failed:
        driver.execute(prefill("a", 0, [0]))
    assert failed.value.violation.property == "§3 shape and range"
