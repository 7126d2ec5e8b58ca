"""The driver: runs concrete steps against an engine and the model side by side.

The driver knows nothing of Hypothesis. The machine draws a step and hands it
here; replay reads one from a trace and hands it here. Either way the engine
and the reference model each answer, every check compares, and the step is
recorded. A mismatch raises ``StepFailed`` carrying a stable property name
(what minimisation preserves) and a message a person can act on.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from .checks import HistoryMemo, Payload, output_problems, payload_difference, payloads_of
from .contract import (
    CacheResult,
    EngineCapabilities,
    Fault,
    FaultInjectable,
    LoadRequest,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)
from .errors import ShardkitError
from .faults import BOUNDARY_FAULTS, FaultInjectingEngine
from .isolation import ProcessDeath
from .model import Prediction, ReferenceModel, SessionState, StepRequest, input_length
from .steps import Action, build_request
from .targets import ResolvedTarget
from .twins import OracleFailure, TwinSession

__all__ = ["CustomOp", "Driver", "StepFailed", "StepRecord", "Violation", "usable_faults"]

T = TypeVar("T")
CRASHED = "CRASH"


@dataclass(frozen=True)
class StepRecord:
    index: int
    action: Action
    expected: str
    observed: str
    outcome: str


@dataclass(frozen=True)
class Violation:
    """``property`` is stable across runs (e.g. "§2 rule 4", "§3 determinism");
    ``message`` says what happened at which step, expected vs observed."""

    property: str
    message: str


class StepFailed(ShardkitError):
    def __init__(self, violation: Violation, record: StepRecord) -> None:
        super().__init__(violation.message)
        self.violation = violation
        self.record = record


@dataclass(frozen=True)
class CustomOp:
    """An operation a backend adds beyond contract v1 (see stateful/test_extending_rules.py).

    ``call_engine`` performs it on the engine and ``predict`` asks the (extended)
    reference model, both from the step's JSON-able arguments, so a trace that
    holds the step replays it. The driver compares the status codes and the
    metrics afterwards, like for any other step.
    """

    call_engine: Callable[[ShardEngine, Mapping[str, Any]], StructuredStatus]
    predict: Callable[[ReferenceModel, Mapping[str, Any]], Prediction]


class _Fail(Exception):
    def __init__(self, property_name: str, expected: str, observed: str, detail: str = "") -> None:
        super().__init__(detail)
        self.property = property_name
        self.expected = expected
        self.observed = observed
        self.detail = detail


def usable_faults(
    caps: EngineCapabilities, engine: object, wanted: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """Split ``wanted`` into (native, at the boundary); kinds in neither cannot be injected."""
    native = frozenset(kind for kind in wanted if kind in caps.supported_faults and isinstance(engine, FaultInjectable))
    return native, (wanted - native) & BOUNDARY_FAULTS


def _status_text(status: StructuredStatus, cache: CacheResult | None = None) -> str:
    text = status.code.name + (f"/{cache.name}" if cache is not None else "")
    if status.retryable:
        text += " retryable"
    return text + (f" ({status.message})" if status.message else "")


def _show(payload: Payload) -> str:
    if isinstance(payload, tuple):
        return f"token {payload[0]}"
    return "row " + np.array2string(payload, precision=4, max_line_width=200)


def _metrics_text(metrics: MetricsResult) -> str:
    return (
        f"prefill_calls={metrics.prefill_calls} decode_calls={metrics.decode_calls} "
        f"active_sessions={metrics.active_sessions} kv_tokens={metrics.kv_tokens}"
    )


def flat_history(session: SessionState) -> tuple[int, ...]:
    """The session epoch's inputs as token ids: the kit builds every bundle from
    token ids and sends them as its sideband, so the sideband names each row."""
    tokens: list[int] = []
    for chunk in session.history:
        if chunk and isinstance(chunk[0], bytes):
            sideband = chunk[1]
            assert isinstance(sideband, tuple)
            tokens.extend(sideband)
        else:
            tokens.extend(chunk)
    return tuple(tokens)


@dataclass
class _SessionLog:
    """What the driver saw of one session id, beyond what the model predicts."""

    sent: list[Action] = field(default_factory=list)
    #: The result observed for each accepted (epoch, step), which a retry must repeat.
    results: dict[tuple[int, int], StepResult] = field(default_factory=dict)
    #: Steps whose observed result carried an injected malformed output.
    tainted: set[tuple[int, int]] = field(default_factory=set)


class Driver:
    """One engine under test, its reference model, its twins and its fault state."""

    def __init__(
        self,
        target: ResolvedTarget,
        load_request: LoadRequest,
        *,
        faults: frozenset[str] = frozenset(),
        twins: bool = True,
        reference: ResolvedTarget | None = None,
        model_factory: Callable[[], ReferenceModel] = ReferenceModel,
        custom_ops: Mapping[str, CustomOp] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.target = target
        self.load_request = load_request
        self.wanted_faults = faults
        self.use_twins = twins
        #: The engine the twins are built from: the target itself, or a reference
        #: implementation to fuzz the target differentially against.
        self.reference = reference or target
        self.model_factory = model_factory
        self.custom_ops: Mapping[str, CustomOp] = custom_ops or {}
        self.sleep = sleep
        self.memo = HistoryMemo()
        self.split_twins = True
        self.records: list[StepRecord] = []
        self.notes: list[str] = []
        self._step: tuple[int, Action] = (0, Action("load", {}))
        self._start_engine()

    # --- engine lifecycle ------------------------------------------------------------

    def _start_engine(self) -> None:
        raw = self.target()
        try:
            loaded = raw.load(self.load_request)
            caps = raw.capabilities()
        except Exception as error:
            death = self._death(error)
            if death is None:
                raise
            what = f"engine process of {self.target.name} {death.summary} while loading {self.load_request}"
            message = what + death.quoted_tail()
            raise ShardkitError(message) from error
        if not loaded.status.ok:
            message = (
                f"engine {self.target.name} refused {self.load_request}: "
                f"{loaded.status.code.name} {loaded.status.message}"
            )
            raise ShardkitError(message)
        self.native_faults, self.boundary_faults = usable_faults(caps, raw, self.wanted_faults)
        self.engine: ShardEngine = FaultInjectingEngine(raw, self.sleep) if self.boundary_faults else raw
        self._fault_target: FaultInjectable | None = raw if isinstance(raw, FaultInjectable) else None
        self.caps = caps
        self.model = self.model_factory()
        self.model.load(caps)
        self.logs: dict[str, _SessionLog] = {}
        self.twins: dict[str, TwinSession] = {}
        self._counted_calls = 0
        self._crash_at: int | None = None
        self._malformed_armed = False

    @property
    def injectable_faults(self) -> frozenset[str]:
        return self.native_faults | self.boundary_faults

    def log(self, session_id: str) -> _SessionLog:
        return self.logs.setdefault(session_id, _SessionLog())

    # --- running a step ----------------------------------------------------------------

    def execute(self, action: Action) -> StepRecord:
        """Run one step; raise ``StepFailed`` on the first disagreement."""
        handler = self._HANDLERS.get(action.op)
        custom = self.custom_ops.get(action.op)
        if handler is None and custom is None:
            known = sorted([*self._HANDLERS, *self.custom_ops])
            message = f"unknown step op {action.op!r}; known: {known}"
            raise ValueError(message)
        index = len(self.records) + 1
        self._step = (index, action)
        try:
            if custom is not None:
                expected, observed, outcome = self._run_custom(action, custom)
            else:
                assert handler is not None
                expected, observed, outcome = handler(self, action)
            if action.op not in ("unloaded", "health") and outcome != CRASHED:
                self._check_metrics()
        except _Fail as fail:
            record = StepRecord(index, action, fail.expected, fail.observed, "FAILED")
            self.records.append(record)
            lines = [
                f"step {index}: {action.describe()}",
                f"  expected: {fail.expected}",
                f"  observed: {fail.observed}",
            ]
            if fail.detail:
                lines.append(f"  {fail.detail}")
            raise StepFailed(Violation(fail.property, "\n".join(lines)), record) from None
        record = StepRecord(index, action, expected, observed, outcome)
        self.records.append(record)
        return record

    def _call(self, call: str, run: Callable[[], T], *, counted: bool = True) -> T | None:
        """Call the engine; None means it died of an injected crash, as predicted."""
        crash_due = False
        if counted:
            self._counted_calls += 1
            crash_due = self._crash_at is not None and self._counted_calls >= self._crash_at
        try:
            result = run()
        except Exception as error:
            death = self._death(error)
            if crash_due:
                self._recover_from_crash(call)
                return None
            if death is not None:
                raise self._death_failure(death, "an answer") from error
            where = "".join(traceback.format_exception_only(error)).strip()
            raise _Fail("unexplained exception", "an answer", f"the engine raised {where}") from error
        if crash_due:
            raise _Fail("§4 crash", "the injected crash (the engine process dies)", f"an answer: {result!r}")
        return result

    def _death(self, error: BaseException) -> ProcessDeath | None:
        """How an isolated engine's process ended the call that raised ``error``, if it did."""
        isolation = self.target.isolation
        return isolation.death(error) if isolation is not None else None

    def _death_failure(self, death: ProcessDeath, expected: str, *, in_twin: bool = False) -> _Fail:
        """E.g. "engine process killed by SIGSEGV during step 7: decode(…)", and what it printed last."""
        index, action = self._step
        serving = " while serving a twin of the oracle" if in_twin else ""
        observed = f"engine process {death.summary}{serving} during step {index}: {action.describe()}"
        tail = death.quoted_tail()
        detail = f"its output ended with:{tail}" if tail else "it printed nothing"
        return _Fail(death.property, expected, observed, detail)

    def _recover_from_crash(self, call: str) -> None:
        """The process died: start a fresh engine from the target; the model drops
        every session and every fault. The memo stays: outputs must not change.
        An isolated engine's process really dies (if the crash was injected at the
        boundary, the kit kills it), and its twins with it."""
        self.notes.append(f"engine restarted after an injected crash during {call}")
        if self.target.isolation is not None:
            self.target.isolation.kill()
        self._start_engine()

    def _check_metrics(self) -> None:
        observed = self._call("metrics", self.engine.metrics, counted=False)
        assert observed is not None  # uncounted calls never die of an injected crash
        expected = self.model.expected_metrics()
        if observed != expected:
            raise _Fail("§2 metrics", f"metrics {_metrics_text(expected)}", f"metrics {_metrics_text(observed)}")

    # --- handlers, one per op ------------------------------------------------------------

    def _run_step(self, action: Action) -> tuple[str, str, str]:
        request = build_request(action, self.caps)
        is_prefill = isinstance(request, PrefillRequest)
        predicted = self.model.prefill(request) if is_prefill else self.model.decode(request)  # type: ignore[arg-type]
        log = self.log(request.session_id)
        log.sent.append(action)
        call_engine = self.engine.prefill if is_prefill else self.engine.decode
        result = self._call(action.op, lambda: call_engine(request))  # type: ignore[arg-type]
        if result is None:
            return str(predicted), "engine crashed (injected)", CRASHED
        observed = _status_text(result.status, result.cache)
        actual = (result.status.code, result.status.retryable, result.cache)
        if actual != (predicted.code, predicted.retryable, predicted.cache):
            raise _Fail(f"§2 {predicted.rule}", str(predicted), observed)
        if result.status.ok:
            corrupted = self._check_output(request, predicted, result, log)
            if corrupted:
                observed += " — the injected malformed output was detected"
            key = (request.epoch, request.step)
            if not predicted.is_retry:
                log.results[key] = result
            if corrupted:
                log.tainted.add(key)
        elif result.output is not None:
            raise _Fail("§3 shape and range", str(predicted), f"{observed} carrying an output {result.output!r}")
        return str(predicted), observed, result.status.code.name

    def _check_output(self, request: StepRequest, predicted: Prediction, result: StepResult, log: _SessionLog) -> bool:
        """Check an OK output; True when it was an injected malformed output, caught."""
        armed, self._malformed_armed = self._malformed_armed, False
        status = _status_text(result.status, result.cache)
        problems = [
            _Fail("§3 shape and range", f"{predicted} with a well-formed output", f"{status}: {problem}")
            for problem in output_problems(self.caps, request, result)
        ]
        if predicted.is_retry and not problems:
            problems = self._retry_problems(request, result, log)
        elif not problems:
            problems = self._history_problems(request, result, strict=armed)
        if armed:
            if not problems:
                raise _Fail(
                    "§4 malformed_output",
                    "the kit to detect the injected malformed output",
                    f"{status} passed every check: {result.output!r}",
                    "a check of the kit is too weak (or the engine did not corrupt its output)",
                )
            return True
        if problems:
            raise problems[0]
        return False

    def _retry_problems(self, request: StepRequest, result: StepResult, log: _SessionLog) -> list[_Fail]:
        key = (request.epoch, request.step)
        earlier = log.results.get(key)
        if result == earlier:
            return []
        if key in log.tainted:  # the first answer was corrupted by us; the engine may now answer truly
            return self._history_problems(request, result, strict=False)
        return [_Fail("§2 rule 6", f"the earlier result exactly (an idempotent retry): {earlier!r}", repr(result))]

    def _history_problems(self, request: StepRequest, result: StepResult, *, strict: bool) -> list[_Fail]:
        """Compare the output with the reference for each history it speaks for:
        each row of a bundle, or the token after the whole history. ``strict`` (an
        injected corruption is due) lets no near-tie token flip: rounding noise within
        tolerance is not a detection, a wrong token always is."""
        session = self.model.sessions[request.session_id]
        history = flat_history(session)  # ends with this request's input, retried or not
        count = input_length(request)
        assert result.output is not None
        payloads = payloads_of(result.output, count)
        ends = range(len(history) - count + 1, len(history) + 1) if len(payloads) == count else [len(history)]
        for end, payload in zip(ends, payloads, strict=True):
            reference = self._reference(request.session_id, session, history[:end])
            if reference is None:
                continue
            expected, source = reference
            difference = payload_difference(expected, payload, self.caps.tolerance, near_ties_may_flip=not strict)
            if difference is not None:
                after = f"after history {list(history[:end])}"
                return [
                    _Fail(
                        "§3 determinism",
                        f"{_show(expected)} {after}, as {source} gave",
                        _show(payload) if isinstance(payload, tuple) else f"{_show(payload)}: {difference}",
                    )
                ]
        return []

    def _reference(self, session_id: str, session: SessionState, key: tuple[int, ...]) -> tuple[Payload, str] | None:
        known = self.memo.get(key)
        if known is not None or not self.use_twins:
            return known
        try:
            twin = self.twins.get(session_id)
            if twin is None or twin.epoch != session.epoch or key[: len(twin.fed)] != twin.fed:
                twin = TwinSession.start(self.reference, self.load_request, session.epoch, split=self.split_twins)
                self.twins[session_id] = twin
                if twin.pipeline_refused is not None:
                    self.split_twins = False
                    self.notes.append(f"composition not checked: {twin.pipeline_refused}")
            twin.advance(key, self.memo)
        except OracleFailure as failure:
            raise _Fail(failure.property, "twins that agree", str(failure)) from None
        except Exception as error:  # a twin is the same engine: its exceptions are findings too
            death = self._death(error)
            if death is not None:
                raise self._death_failure(death, "a fresh twin to answer", in_twin=True) from error
            where = "".join(traceback.format_exception_only(error)).strip()
            raise _Fail("unexplained exception", "a fresh twin to answer", f"a fresh twin raised {where}") from error
        return self.memo.get(key)

    def _run_custom(self, action: Action, custom: CustomOp) -> tuple[str, str, str]:
        predicted = custom.predict(self.model, action.args)
        status = self._call(action.op, lambda: custom.call_engine(self.engine, action.args), counted=False)
        return self._compare_status(predicted, status)

    def _run_cancel(self, action: Action) -> tuple[str, str, str]:
        session_id, epoch = str(action.args["session"]), int(action.args["epoch"])
        predicted = self.model.cancel(session_id, epoch)
        status = self._call("cancel", lambda: self.engine.cancel(session_id, epoch))
        return self._compare_status(predicted, status)

    def _run_release(self, action: Action) -> tuple[str, str, str]:
        session_id = str(action.args["session"])
        predicted = self.model.release(session_id)
        status = self._call("release", lambda: self.engine.release(session_id))
        if status is not None and status.ok:
            self.twins.pop(session_id, None)
        return self._compare_status(predicted, status)

    def _compare_status(self, predicted: Prediction, status: StructuredStatus | None) -> tuple[str, str, str]:
        if status is None:
            return str(predicted), "engine crashed (injected)", CRASHED
        if status.code is not predicted.code:
            raise _Fail(f"§2 {predicted.rule}", str(predicted), _status_text(status))
        return str(predicted), _status_text(status), status.code.name

    def _run_health(self, action: Action) -> tuple[str, str, str]:
        health = self._call("health", self.engine.health, counted=False)
        assert health is not None
        if not (health.status.ok and health.serving):
            raise _Fail("§2 health", "OK, serving=True", f"{_status_text(health.status)}, serving={health.serving}")
        return "OK, serving=True", "OK, serving=True", "OK"

    def _run_unloaded(self, action: Action) -> tuple[str, str, str]:
        """Rule 1 on a fresh, never-loaded engine from the same target."""
        call = str(action.args["call"])
        fresh = self.target()
        if call == "health":
            health = self._call(call, fresh.health, counted=False)
            assert health is not None
            if health.serving:
                raise _Fail("§2 health", "serving=False before load", "serving=True")
            return "serving=False", "serving=False", "OK"
        model = ReferenceModel()
        if call in ("prefill", "decode"):
            step_action = Action(call, {**action.args, "call": None})
            request = build_request(step_action, self.caps)
            predicted = model.prefill(request) if call == "prefill" else model.decode(request)  # type: ignore[arg-type]
            call_fresh = fresh.prefill if call == "prefill" else fresh.decode
            result = self._call(call, lambda: call_fresh(request), counted=False)  # type: ignore[arg-type]
            assert result is not None
            if (result.status.code, result.cache) != (predicted.code, predicted.cache):
                raise _Fail("§2 rule 1", str(predicted), _status_text(result.status, result.cache))
            return str(predicted), _status_text(result.status, result.cache), result.status.code.name
        session_id = str(action.args["session"])
        predicted = model.cancel(session_id, 0) if call == "cancel" else model.release(session_id)
        status = self._call(
            call, lambda: fresh.cancel(session_id, 0) if call == "cancel" else fresh.release(session_id), counted=False
        )
        assert status is not None
        if status.code is not predicted.code:
            raise _Fail("§2 rule 1", str(predicted), _status_text(status))
        return str(predicted), _status_text(status), status.code.name

    def _run_fault(self, action: Action) -> tuple[str, str, str]:
        fault = Fault(action.args["kind"], float(action.args["value"]))
        if fault.kind not in self.injectable_faults:
            message = (
                f"fault {fault.kind!r} cannot be injected into {self.target.name}: it is not in the engine's "
                f"supported_faults and cannot be injected at the boundary"
            )
            raise ShardkitError(message)
        injector: FaultInjectable = self.engine if fault.kind in self.boundary_faults else self._fault_target  # type: ignore[assignment]
        status = self._call("inject_fault", lambda: injector.inject_fault(fault), counted=False)
        assert status is not None
        if not status.ok:
            raise _Fail(f"§4 {fault.kind}", "OK (the fault is armed)", _status_text(status))
        if fault.kind == "crash":
            due = self._counted_calls + int(fault.value)
            self._crash_at = min(due, self._crash_at or due)
        elif fault.kind == "malformed_output":
            self._malformed_armed = True
        elif fault.kind == "memory_pressure":
            self.model.memory_pressure(int(fault.value))
            capabilities = self._call("capabilities", self.engine.capabilities, counted=False)
            assert capabilities is not None
            reported = capabilities.max_kv_tokens
            if reported != int(fault.value):
                raise _Fail("§4 memory_pressure", f"capabilities().max_kv_tokens == {int(fault.value)}", str(reported))
        return "OK (armed)", "OK (armed)", "OK"

    _HANDLERS: ClassVar[dict[str, Callable[[Driver, Action], tuple[str, str, str]]]] = {
        "prefill": _run_step,
        "decode": _run_step,
        "cancel": _run_cancel,
        "release": _run_release,
        "health": _run_health,
        "unloaded": _run_unloaded,
        "fault": _run_fault,
    }
