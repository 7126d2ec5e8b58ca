"""The extension surface the worked examples build on: ``RecordingEngine`` keeps each
session's ``AcceptedSteps`` across prefill, decode, cancel and release and hides its own
steps, and ``CustomOp`` takes the user's engine and model types, checked when the kit starts
an engine if ``engine_type``/``model_type`` are given, and nothing checked without them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from shardkit import (
    AcceptedSteps,
    CacheResult,
    CustomOp,
    DecodeRequest,
    DelegatingEngine,
    FakeShardEngine,
    Fault,
    InvalidTarget,
    LoadRequest,
    Prediction,
    PrefillRequest,
    RecordingEngine,
    ReferenceModel,
    StatusCode,
    StepResult,
    StructuredStatus,
)
from shardkit._core.driver import Driver
from shardkit._core.steps import Action
from shardkit._transport.resolve import resolve_target

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)


def loaded_recorder() -> RecordingEngine[FakeShardEngine]:
    engine = RecordingEngine(FakeShardEngine())
    assert engine.load(FULL).status.ok
    return engine


def prefill(session: str, step: int, *, epoch: int = 0, token: int = 1) -> PrefillRequest:
    return PrefillRequest(session, epoch, step, (token,))


def decode(session: str, step: int, *, epoch: int = 0, token: int = 1) -> DecodeRequest:
    return DecodeRequest(session, epoch, step, (token,))


# --- RecordingEngine ---------------------------------------------------------------------------


def test_accepted_steps_are_recorded_in_order_and_a_retry_once() -> None:
    engine = loaded_recorder()
    first, second = prefill("a", 0), decode("a", 1)
    assert engine.prefill(first).status.ok
    assert engine.decode(second).status.ok
    assert engine.decode(second).status.ok  # an idempotent retry of step 1
    assert engine.accepted == {"a": AcceptedSteps(0, [first, second])}


def test_a_refused_step_is_not_recorded() -> None:
    engine = loaded_recorder()
    assert engine.prefill(prefill("a", 0)).status.ok
    assert engine.decode(decode("a", 5)).status.code is StatusCode.FAILED_PRECONDITION
    assert engine.decode(decode("b", 0)).status.code is StatusCode.NOT_FOUND
    assert engine.accepted == {"a": AcceptedSteps(0, [prefill("a", 0)])}


def test_a_restart_at_a_new_epoch_starts_the_record_afresh() -> None:
    engine = loaded_recorder()
    assert engine.prefill(prefill("a", 0)).status.ok
    assert engine.decode(decode("a", 1)).status.ok
    assert engine.cancel("a", 0).ok
    restart = prefill("a", 0, epoch=3, token=2)
    assert engine.prefill(restart).status.ok
    assert engine.accepted["a"] == AcceptedSteps(3, [restart], cancelled=False)


def test_cancel_marks_only_the_epoch_it_cancelled() -> None:
    engine = loaded_recorder()
    assert engine.prefill(prefill("a", 1, epoch=2)).status.code is StatusCode.FAILED_PRECONDITION
    assert engine.prefill(prefill("a", 0, epoch=2)).status.ok
    assert not engine.cancel("a", 1).ok  # a stale epoch: refused, nothing marked
    assert not engine.accepted["a"].cancelled
    assert engine.cancel("a", 2).ok
    assert engine.accepted["a"].cancelled


def test_release_drops_the_record() -> None:
    engine = loaded_recorder()
    assert engine.prefill(prefill("a", 0)).status.ok
    assert engine.prefill(prefill("b", 0)).status.ok
    assert engine.release("a").ok
    assert set(engine.accepted) == {"b"}


def test_inner_step_is_neither_recorded_nor_counted_by_metrics() -> None:
    engine = loaded_recorder()
    assert engine.prefill(prefill("a", 0)).status.ok
    assert engine.inner_step(prefill("b", 0)).status.ok
    assert engine.inner_step(decode("b", 1)).status.ok
    assert set(engine.accepted) == {"a"}
    metrics = engine.metrics()
    assert (metrics.prefill_calls, metrics.decode_calls) == (1, 0)
    assert metrics.active_sessions == 2  # the session inner_step opened is real
    inner = engine.inner.metrics()
    assert (inner.prefill_calls, inner.decode_calls) == (2, 1)


def test_only_memory_pressure_stays_native() -> None:
    engine = loaded_recorder()
    assert engine.capabilities().supported_faults == frozenset({"memory_pressure"})
    assert engine.inject_fault(Fault("memory_pressure", 0.5)).ok
    assert engine.inner.metrics().kv_tokens == 0
    for kind in ("delay", "malformed_output", "crash"):
        status = engine.inject_fault(Fault(kind, 1.0))
        assert status.code is StatusCode.UNIMPLEMENTED, kind
        assert "boundary" in status.message


def test_memory_pressure_is_refused_when_the_inner_engine_cannot_take_it() -> None:
    engine = RecordingEngine(DelegatingEngine(FakeShardEngine()))  # no inject_fault inside
    assert engine.load(FULL).status.ok
    assert engine.capabilities().supported_faults == frozenset()
    assert engine.inject_fault(Fault("memory_pressure", 0.5)).code is StatusCode.UNIMPLEMENTED


class RefusesSecondSteps(RecordingEngine[FakeShardEngine]):
    """Changes an answer by overriding record_step: what it refuses is not recorded."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())

    def record_step(self, request: PrefillRequest | DecodeRequest, result: StepResult) -> StepResult:
        if request.step == 1:
            return StepResult(StructuredStatus(StatusCode.FAILED_PRECONDITION, "no second step"), CacheResult.MISS)
        return super().record_step(request, result)


def test_a_subclass_changes_answers_through_record_step() -> None:
    engine = RefusesSecondSteps()
    assert engine.load(FULL).status.ok
    assert engine.prefill(prefill("a", 0)).status.ok
    assert engine.decode(decode("a", 1)).status.code is StatusCode.FAILED_PRECONDITION
    assert engine.accepted["a"].requests == [prefill("a", 0)]


# --- CustomOp ----------------------------------------------------------------------------------


class PingEngine(RecordingEngine[FakeShardEngine]):
    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.pings = 0

    def ping(self) -> StructuredStatus:
        self.pings += 1
        return StructuredStatus(StatusCode.OK)


class PingModel(ReferenceModel):
    def ping(self) -> Prediction:
        return Prediction("ping", StatusCode.OK, "ping", "a ping is always answered")


def _call_ping(engine: PingEngine, args: Mapping[str, Any]) -> StructuredStatus:
    return engine.ping()


def _predict_ping(model: PingModel, args: Mapping[str, Any]) -> Prediction:
    return model.ping()


PING: CustomOp[PingEngine, PingModel] = CustomOp(
    _call_ping, _predict_ping, engine_type=PingEngine, model_type=PingModel
)


def driver(engine: Any, op: CustomOp, model: Any = PingModel) -> Driver:
    return Driver(
        resolve_target(engine), FULL, faults=frozenset(), twins=False, model_factory=model, custom_ops={"ping": op}
    )


def test_a_typed_custom_op_runs_on_its_own_engine_and_model() -> None:
    run = driver(PingEngine, PING)
    record = run.execute(Action("ping", {}))
    assert record.observed.startswith("OK"), record
    assert isinstance(run.raw_engine, PingEngine)
    assert run.raw_engine.pings == 1


def test_a_subclass_of_engine_type_is_accepted() -> None:
    class LoudPingEngine(PingEngine):
        pass

    run = driver(LoudPingEngine, PING)
    run.execute(Action("ping", {}))


def test_an_engine_of_another_type_is_an_input_error_naming_both_types_and_the_fix() -> None:
    with pytest.raises(InvalidTarget) as error:
        driver(FakeShardEngine, PING)
    message = str(error.value)
    assert "'ping'" in message
    assert "PingEngine (its engine_type)" in message
    assert "the engine under test is a shardkit.FakeShardEngine" in message
    assert "fuzz a" in message


def test_a_model_of_another_type_is_an_input_error_naming_both_types_and_the_fix() -> None:
    with pytest.raises(InvalidTarget) as error:
        driver(PingEngine, PING, model=ReferenceModel)
    message = str(error.value)
    assert "PingModel (its model_type)" in message
    assert "the model is a shardkit.ReferenceModel" in message
    assert "model_factory = " in message


def test_a_plain_custom_op_checks_nothing_as_before() -> None:
    """Without engine_type and model_type the kit starts any engine; the functions meet
    whatever it is (here the plain model, which has no ping)."""
    plain = CustomOp(call_engine=_call_ping, predict=_predict_ping)
    assert (plain.engine_type, plain.model_type) == (None, None)
    run = driver(PingEngine, plain, model=ReferenceModel)
    with pytest.raises(AttributeError):
        run.execute(Action("ping", {}))


@pytest.mark.parametrize("field", ["engine_type", "model_type"])
def test_a_type_that_is_not_a_class_of_the_right_kind_is_refused_at_once(field: str) -> None:
    with pytest.raises(TypeError, match=f"{field} must be a subclass of"):
        CustomOp(_call_ping, _predict_ping, **{field: PingEngine() if field == "engine_type" else PingEngine})


# --- CustomOp for a type checker ---------------------------------------------------------------

TYPED = """
from collections.abc import Mapping
from typing import Any, ClassVar

from shardkit import CustomOp, FakeShardEngine, Prediction, RecordingEngine, ReferenceModel, ShardMachine
from shardkit import StatusCode, StructuredStatus


class PingEngine(RecordingEngine[FakeShardEngine]):
    def ping(self) -> StructuredStatus:
        return StructuredStatus(StatusCode.OK)


class PingModel(ReferenceModel):
    def ping(self) -> Prediction:
        return Prediction("ping", StatusCode.OK, "ping", "always")


def call(engine: PingEngine, args: Mapping[str, Any]) -> StructuredStatus:
    return engine.ping()


def predict(model: PingModel, args: Mapping[str, Any]) -> Prediction:
    return model.ping()


class PingMachine(ShardMachine):
    custom_ops: ClassVar[Mapping[str, CustomOp[PingEngine, PingModel]]] = {
        "ping": CustomOp(call, predict, engine_type=PingEngine, model_type=PingModel)
    }


PLAIN: Mapping[str, CustomOp] = PingMachine.custom_ops  # a typed op fits where a plain one goes
"""


def test_a_type_checker_follows_the_users_own_types(tmp_path: Any) -> None:
    """mypy --strict accepts the typed op (a bare ``CustomOp`` too) and rejects one whose
    engine_type or model_type is not what its functions take."""
    api = pytest.importorskip("mypy.api")
    (tmp_path / "typed_ok.py").write_text(TYPED, encoding="utf-8")
    mistakes = (
        "\nWRONG_ENGINE: CustomOp[PingEngine, PingModel] = CustomOp(call, predict, engine_type=FakeShardEngine)\n"
        "WRONG_MODEL: CustomOp[PingEngine, PingModel] = CustomOp(call, predict, model_type=ReferenceModel)\n"
    )
    (tmp_path / "typed_bad.py").write_text(TYPED + mistakes, encoding="utf-8")
    out, _, _ = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(tmp_path / "typed_ok.py")])
    assert out.startswith("Success"), out
    out, _, _ = api.run(["--strict", "--cache-dir", str(tmp_path / "cache"), str(tmp_path / "typed_bad.py")])
    assert 'Argument "engine_type" to "CustomOp" has incompatible type "type[FakeShardEngine]"' in out, out
    assert 'Argument "model_type" to "CustomOp" has incompatible type "type[ReferenceModel]"' in out, out
    assert "Found 2 errors" in out, out


# --- What a ShardMachine subclass sees ----------------------------------------------------------

#: The helpers docs/extending.md documents for a subclass's rules; every other name the kit
#: gives ``ShardMachine`` starts with ``_``, so it never shares a namespace with a user's rules.
DOCUMENTED_HELPERS = frozenset(
    {
        "session_id",
        "position",
        "sessions",
        "capabilities",
        "chunk",
        "token",
        "room",
        "history_tokens",
        "run",
        "custom_ops",
        "model_factory",
        "prepare",
        "TestCase",
        "teardown",
    }
)


def public_helpers(machine: type) -> frozenset[str]:
    """The names without an underscore a machine class adds to Hypothesis's own, less its rules."""
    from hypothesis.stateful import RuleBasedStateMachine

    from shardkit._machine.hypothesis_adapter import rules_and_initializers

    rules, initializers = rules_and_initializers(machine)
    rule_names = {name for name, _, _ in (*rules, *initializers)}
    hypothesis_names = {name for name in dir(RuleBasedStateMachine) if name not in ("TestCase", "teardown")}
    public = {name for name in dir(machine) if not name.startswith("_")}
    return frozenset(public - hypothesis_names - rule_names)


def test_a_subclass_sees_its_rules_and_only_the_documented_helpers() -> None:
    from shardkit import ShardMachine

    assert public_helpers(ShardMachine) == DOCUMENTED_HELPERS


def test_each_documented_helper_is_in_the_guide_for_extenders() -> None:
    from pathlib import Path

    from shardkit import ShardMachine
    from shardkit._machine.hypothesis_adapter import rules_and_initializers

    guide = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    assert [name for name in sorted(DOCUMENTED_HELPERS) if f"`{name}" not in guide and f".{name}" not in guide] == []
    rules, initializers = rules_and_initializers(ShardMachine)
    built_in = sorted(name for name, _, _ in (*rules, *initializers))
    assert len(built_in) >= 12
    assert [name for name in built_in if f"`{name}`" not in guide] == []  # a rule of the same name replaces it


def test_a_public_helper_the_kit_adds_is_seen() -> None:
    """Self-test: a name without an underscore on the machine, not a rule, is caught."""
    from shardkit import ShardMachine

    class Leaky(ShardMachine):
        def driver_state(self) -> None: ...

    assert public_helpers(Leaky) == DOCUMENTED_HELPERS | {"driver_state"}
