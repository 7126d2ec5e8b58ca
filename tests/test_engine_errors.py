"""What an engine raises or returns is attributed to the right party.

- Anything the engine under test raises, ``SystemExit`` included, is a finding about that
  step, never the end of the run (which would read as a pass); only Ctrl-C goes through.
- ``load``/``capabilities`` raising something other than ``EngineError`` is an input error
  naming the target, the call and the exception: no step can run.
- A broken ``reference`` engine is an input error naming the reference, never a failure
  of the engine under test.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from shardkit import FakeShardEngine, FakeShardEngineConfig
from shardkit._core.driver import Driver, StepFailed
from shardkit._core.steps import Action, step_action
from shardkit._core.twins import TWIN_SESSION
from shardkit._run.runner import fuzz
from shardkit._transport.resolve import resolve_target
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    LoadRequest,
    LoadResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit.errors import InvalidTarget

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)


def driver_for(factory: Any, **options: Any) -> Driver:
    return Driver(resolve_target(factory), FULL, **options)


class Stop(BaseException):
    """A BaseException of the engine's own."""


# --- the engine under test raises a BaseException ------------------------------------------


def _raising_on_decode(error: BaseException) -> type[FakeShardEngine]:
    class RaisesOnDecode(FakeShardEngine):
        def decode(self, request: DecodeRequest) -> StepResult:
            raise error

    return RaisesOnDecode


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (SystemExit(0), "SystemExit(0)"),
        (SystemExit("bye"), "SystemExit('bye')"),
        (GeneratorExit(), "GeneratorExit()"),
        (Stop("halt"), "Stop('halt')"),
    ],
)
def test_a_base_exception_from_a_step_is_the_steps_failure(error: BaseException, shown: str) -> None:
    driver = driver_for(_raising_on_decode(error))
    driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("decode", "a", 0, 1, (2,)))
    assert failed.value.violation.property == "unexplained exception"
    assert f"observed: the engine raised {shown}" in failed.value.violation.message


def test_ctrl_c_from_the_engine_still_interrupts_the_run() -> None:
    driver = driver_for(_raising_on_decode(KeyboardInterrupt()))
    driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    with pytest.raises(KeyboardInterrupt):
        driver.execute(step_action("decode", "a", 0, 1, (2,)))


def test_a_fuzz_run_of_an_engine_that_raises_system_exit_reports_a_failure() -> None:
    """Before: SystemExit(0) left the run, and ``shardkit fuzz`` exited 0 with no output."""
    result = fuzz(_raising_on_decode(SystemExit(0)), seed=1, examples=50, steps=20, role="full", minimize=False)
    assert result.failure is not None
    assert result.failure.violation.property == "unexplained exception"
    assert "SystemExit(0)" in result.failure.violation.message


def test_an_injected_crash_may_raise_a_base_exception() -> None:
    """A native crash whose exception is a BaseException is the predicted death, not a failure."""
    driver = driver_for(
        lambda: FakeShardEngine(FakeShardEngineConfig(crash_exception_factory=Stop)), faults=frozenset({"crash"})
    )
    driver.execute(Action("fault", {"kind": "crash", "value": 1.0}))
    assert driver.execute(step_action("prefill", "a", 0, 0, (1,))).outcome == "CRASH"
    assert driver.execute(step_action("prefill", "a", 0, 0, (1,))).outcome == "OK"


class ExitsInItsTwins(FakeShardEngine):
    """Serves the kit's sessions, and raises SystemExit on the twin oracle's."""

    def prefill(self, request: PrefillRequest) -> StepResult:
        if request.session_id == TWIN_SESSION:
            raise SystemExit(3)
        return super().prefill(request)


def test_a_base_exception_in_a_twin_of_the_engine_is_the_engines_failure() -> None:
    driver = driver_for(ExitsInItsTwins)
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    assert failed.value.violation.property == "unexplained exception"
    assert "a fresh twin raised SystemExit(3)" in failed.value.violation.message


class ReturnsGarbage(FakeShardEngine):
    def release(self, session_id: str) -> StructuredStatus:
        return "OK"  # type: ignore[return-value]


def test_an_answer_of_the_wrong_type_is_the_engines_failure_not_a_crash_of_the_kit() -> None:
    driver = driver_for(ReturnsGarbage)
    with pytest.raises(StepFailed) as failed:
        driver.execute(Action("release", {"session": "a"}))
    assert failed.value.violation.property == "§1 return type"
    assert "observed: str: 'OK'" in failed.value.violation.message


# --- load and capabilities ----------------------------------------------------------------------


class _Starting(FakeShardEngine):
    LOAD_ERROR: BaseException | None = None
    CAPS_ERROR: BaseException | None = None
    LOAD_RETURNS: object = None

    def load(self, request: LoadRequest) -> LoadResult:
        if self.LOAD_ERROR is not None:
            raise self.LOAD_ERROR
        loaded = super().load(request)
        return loaded if self.LOAD_RETURNS is None else self.LOAD_RETURNS  # type: ignore[return-value]

    def capabilities(self) -> EngineCapabilities:
        if self.CAPS_ERROR is not None and self._served is not None:
            raise self.CAPS_ERROR
        return super().capabilities()


def _starting(**behaviour: object) -> type[_Starting]:
    return type("Starting", (_Starting,), behaviour)


@pytest.mark.parametrize(
    ("behaviour", "says"),
    [
        ({"LOAD_ERROR": RuntimeError("boom")}, r"load\(LoadRequest\(.*\)\) raised RuntimeError: boom \(at "),
        ({"LOAD_ERROR": SystemExit(4)}, r"load\(LoadRequest\(.*\)\) raised SystemExit\(4\)"),
        ({"CAPS_ERROR": ValueError("no caps")}, r"capabilities\(\) raised ValueError: no caps"),
        ({"CAPS_ERROR": GeneratorExit()}, r"capabilities\(\) raised GeneratorExit\(\)"),
        ({"LOAD_RETURNS": "loaded!"}, r"returned 'loaded!'; it must return a shardkit.LoadResult"),
    ],
)
def test_load_or_capabilities_misbehaving_is_an_input_error_naming_what_happened(
    behaviour: dict[str, object], says: str
) -> None:
    engine = _starting(**behaviour)
    with pytest.raises(InvalidTarget, match=says) as raised:
        driver_for(engine)
    assert "Starting" in str(raised.value)  # the target


def test_load_refusing_with_engine_error_is_still_an_engine_error() -> None:
    refusal = EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, "no such range"))
    with pytest.raises(EngineError):
        driver_for(_starting(LOAD_ERROR=refusal))


def test_ctrl_c_during_load_still_interrupts() -> None:
    with pytest.raises(KeyboardInterrupt):
        driver_for(_starting(LOAD_ERROR=KeyboardInterrupt()))


# --- a broken reference engine --------------------------------------------------------------------


class RaisingReference(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        raise RuntimeError("reference exploded")


class RefusingReference(FakeShardEngine):
    def load(self, request: LoadRequest) -> LoadResult:
        raise EngineError(StructuredStatus(StatusCode.FAILED_PRECONDITION, "weights missing"))


class GarbageReference(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        return replace(result, output=TokenOutput(10_000))


class NotOkReference(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        return StepResult(StructuredStatus(StatusCode.INTERNAL, "out of order"), super().prefill(request).cache)


class NoneReference(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        return None  # type: ignore[return-value]


class StopsReference(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        raise SystemExit(9)


@pytest.mark.parametrize(
    ("reference", "says"),
    [
        (RaisingReference, r"it raised RuntimeError: reference exploded"),
        (RefusingReference, r"it refused to load LoadRequest\(.*\): FAILED_PRECONDITION weights missing"),
        (GarbageReference, r"with a bad output: token id 10000 is outside the vocabulary"),
        (NotOkReference, r"with INTERNAL: out of order"),
        (NoneReference, r"returned None for prefill\(.*\), not a StepResult"),
        (StopsReference, r"it raised SystemExit\(9\)"),
    ],
)
def test_a_broken_reference_is_an_input_error_naming_it(reference: type[FakeShardEngine], says: str) -> None:
    driver = driver_for(FakeShardEngine, reference=resolve_target(reference))
    with pytest.raises(InvalidTarget) as raised:
        driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    message = str(raised.value)
    assert message.startswith(f"reference engine {resolve_target(reference).name} failed")
    assert f"of {resolve_target(FakeShardEngine).name}" in message
    assert "step 1 (prefill(session='a', epoch=0, step=0, tokens=[1]))" in message
    assert re.search(says, message), message


class OffByOne(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        if isinstance(result.output, TokenOutput) and request.session_id != TWIN_SESSION:
            result = replace(result, output=TokenOutput((result.output.token_id + 1) % 32, result.output.margin))
        return result


def test_a_wrong_engine_against_a_correct_reference_is_still_the_engines_failure() -> None:
    driver = driver_for(OffByOne, reference=resolve_target(FakeShardEngine))
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    assert failed.value.violation.property == "§3 determinism"


class GarbageInItsTwins(FakeShardEngine):
    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        return replace(result, output=TokenOutput(10_000)) if request.session_id == TWIN_SESSION else result


@pytest.mark.parametrize("reference", [None, GarbageInItsTwins])
def test_twins_of_the_engine_itself_failing_are_the_engines_failure(reference: type | None) -> None:
    """Without a reference (or with the target itself as one) the twins are the engine
    under test: what they do wrong is a finding about it."""
    options = {} if reference is None else {"reference": resolve_target(reference)}
    driver = driver_for(GarbageInItsTwins, **options)
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    assert failed.value.violation.property == "§3 shape and range"
    assert "a fresh twin" in failed.value.violation.message
