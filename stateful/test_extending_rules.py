"""A worked example: extending the kit for a backend that adds an operation.

Our imaginary backend supports ``rollback(session_id, epoch, to_step)``: drop
the steps from ``to_step`` on, so the session continues at ``to_step`` (as a
speculative-decoding runtime does when a draft is rejected). Three pieces,
none of which copies the kit, all imported from ``shardkit`` itself:

1. the **model** — subclass ``ReferenceModel`` and add ``rollback``, which
   returns a ``Prediction`` and updates the session's ``SessionState`` like the
   other rules;
2. the **step** — a ``CustomOp`` that says how to call the engine and the model
   from the step's plain arguments (so traces of it replay);
3. the **rule** — subclass ``ShardMachine``, register the op in ``custom_ops``,
   name the model in ``model_factory``, and add one ``@step_rule`` that draws small integers and derives the step
   from the model's state, like the built-in rules do.

``machine_for(engine, base=...)`` (or ``shardkit fuzz ENGINE --machine
stateful.test_extending_rules:RollbackMachine``) then fuzzes the backend with every
built-in rule, fault and check, plus the new one. The planted bug at the end
shows the new rule finding and shrinking a real defect. The engine itself is the
fake wrapped in a ``RecordingEngine``, which forwards contract v1 and keeps each
session's accepted steps, so the wrapper states only what rollback changes.
``stateful/test_fork_example.py`` is a second example (``fork``), and
docs/extending.md explains each piece.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st

from shardkit import (
    Action,
    CustomOp,
    DecodeRequest,
    FakeShardEngine,
    MetricsResult,
    Prediction,
    PrefillRequest,
    RecordingEngine,
    ReferenceModel,
    SessionState,
    ShardMachine,
    StatusCode,
    StructuredStatus,
    fuzz,
    machine_for,
    step_rule,
)

StepRequest = PrefillRequest | DecodeRequest

# --- the backend: the fake, plus rollback ---------------------------------------------------


class RollbackEngine(RecordingEngine[FakeShardEngine]):
    """The fake engine plus ``rollback``, implemented by sending the kept steps again.

    ``RecordingEngine`` keeps what each session accepted in its epoch (``self.accepted``),
    hides the steps ``inner_step`` sends from ``metrics()``, and leaves only
    ``memory_pressure`` native: the kit injects the other faults at its boundary, where
    the calls rollback makes itself cannot spend them."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())

    def rollback(self, session_id: str, epoch: int, to_step: int) -> StructuredStatus:
        session = self.accepted.get(session_id)
        if session is None or epoch > session.epoch:
            return StructuredStatus(StatusCode.NOT_FOUND, "unknown session epoch")
        if epoch < session.epoch:
            return StructuredStatus(StatusCode.ABORTED, "stale epoch")
        if session.cancelled:
            return StructuredStatus(StatusCode.CANCELLED, "cancelled")
        if not 1 <= to_step <= len(session.requests):
            return StructuredStatus(StatusCode.FAILED_PRECONDITION, f"cannot roll back to step {to_step}")
        self.inner.release(session_id)
        for request in session.requests[:to_step]:
            self.inner_step(request)
        del session.requests[to_step:]
        return StructuredStatus(StatusCode.OK)


# --- 1. the model extension -------------------------------------------------------------------


class RollbackModel(ReferenceModel):
    """``ReferenceModel`` plus the rollback rule. It keeps a copy of each session's state
    after every step it accepted, so a rollback to ``to_step`` restores the state after
    step ``to_step - 1``: its step counter, cached tokens, history and retry record."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: dict[str, list[SessionState]] = {}

    def prefill(self, request: PrefillRequest) -> Prediction:
        return self._remember(request, super().prefill(request))

    def decode(self, request: DecodeRequest) -> Prediction:
        return self._remember(request, super().decode(request))

    def release(self, session_id: str) -> Prediction:
        self.snapshots.pop(session_id, None)
        return super().release(session_id)

    def _remember(self, request: StepRequest, prediction: Prediction) -> Prediction:
        if prediction.code is StatusCode.OK and not prediction.is_retry:
            if request.step == 0:
                self.snapshots[request.session_id] = []
            self.snapshots[request.session_id].append(replace(self.sessions[request.session_id]))
        return prediction

    def rollback(self, session_id: str, epoch: int, to_step: int) -> Prediction:
        def say(code: StatusCode, because: str) -> Prediction:
            return Prediction(op="rollback", code=code, rule="rollback", because=because)

        if self.capabilities is None:
            return say(StatusCode.UNAVAILABLE, "the engine is not loaded")
        session = self.sessions.get(session_id)
        if session is None or epoch > session.epoch:
            return say(StatusCode.NOT_FOUND, f"session {session_id!r} has no epoch {epoch}")
        if epoch < session.epoch:
            return say(StatusCode.ABORTED, f"epoch {epoch} is stale")
        if session.cancelled:
            return say(StatusCode.CANCELLED, "the session was cancelled")
        if not 1 <= to_step <= session.next_step:
            return say(StatusCode.FAILED_PRECONDITION, f"to_step {to_step} is outside [1, {session.next_step}]")
        kept = self.snapshots[session_id][:to_step]
        self.snapshots[session_id] = kept
        self.set_session(session_id, replace(kept[-1]))
        return say(StatusCode.OK, f"session {session_id!r} continues at step {to_step}")


# --- 2. the step, and 3. the rule -------------------------------------------------------------


def _call_rollback(engine: RollbackEngine, args: Mapping[str, Any]) -> StructuredStatus:
    return engine.rollback(args["session"], args["epoch"], args["to_step"])


def _predict_rollback(model: RollbackModel, args: Mapping[str, Any]) -> Prediction:
    return model.rollback(args["session"], args["epoch"], args["to_step"])


class RollbackMachine(ShardMachine):
    # engine_type and model_type: a machine fuzzing another engine, or with another model, is an
    # input error naming both types before any step runs (the functions' argument types alone
    # are the type checker's to check).
    custom_ops: ClassVar[Mapping[str, CustomOp[RollbackEngine, RollbackModel]]] = {
        "rollback": CustomOp(_call_rollback, _predict_rollback, engine_type=RollbackEngine, model_type=RollbackModel)
    }
    model_factory = RollbackModel

    @step_rule(session=st.integers(0, 7), back=st.integers(0, 3))
    def rollback(self, session: int, back: int) -> None:
        """Drop the last ``back + 1`` steps of a session (0: just the last one)."""
        sid = self.session_id(session)
        epoch, next_step = self.position(sid)
        self.run(Action("rollback", {"session": sid, "epoch": epoch, "to_step": next_step - 1 - back}))


CI_SETTINGS = settings(settings.get_profile("shardkit-ci"), database=None)
_machine = machine_for(RollbackEngine, role="full", base=RollbackMachine, name="Rollback")
_machine.TestCase.settings = CI_SETTINGS
TestRollbackBackend = _machine.TestCase


# --- the new rule finds a bug in the new operation ------------------------------------------


class RollbackKeepsTokens(RollbackEngine):
    """Planted bug: rollback reports the dropped steps' tokens as still cached."""

    def __init__(self) -> None:
        super().__init__()
        self.stale_tokens = 0

    def rollback(self, session_id: str, epoch: int, to_step: int) -> StructuredStatus:
        before = self.inner.metrics().kv_tokens
        status = super().rollback(session_id, epoch, to_step)
        self.stale_tokens += before - self.inner.metrics().kv_tokens
        return status

    def metrics(self) -> MetricsResult:
        metrics = super().metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.stale_tokens)


def test_the_new_rule_finds_a_rollback_bug_and_shrinks_it_to_three_steps() -> None:
    """Minimum: prefill step 0, one more step, rollback to step 1 (then metrics disagree)."""
    result = fuzz(
        RollbackKeepsTokens, seed=3, examples=200, steps=50, role="full", base=RollbackMachine
    )
    assert result.failure is not None
    assert result.failure.violation.property == "§2 metrics"
    ops = [record.action.op for record in result.failure.records]
    assert len(ops) == 3, ops
    assert ops[-1] == "rollback"
