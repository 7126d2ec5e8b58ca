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
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import numpy as np

from .checks import HistoryMemo, Payload, output_problems, payload_difference, payloads_of
from .contract import (
    CacheResult,
    EngineCapabilities,
    EngineError,
    Fault,
    FaultInjectable,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from .errors import InvalidTarget, KitBug, ShardkitError, UsageError
from .faults import BOUNDARY_FAULTS, FaultInjectingEngine
from .isolation import ProcessDeath
from .model import Prediction, ReferenceModel, SessionState, StepRequest, input_length
from .steps import Action, build_request, step_note
from .targets import EngineLost, ResolvedTarget, describe_exception
from .twins import OracleFailure, TwinSession

__all__ = ["CustomOp", "Driver", "StepFailed", "StepRecord", "Violation", "usable_faults"]

T = TypeVar("T")
CRASHED = "CRASH"
KIT_BUG_ENDING = "this is a bug in shardkit; please report it with this trace"


def _passes_through(error: BaseException) -> bool:
    """What the driver never turns into a finding about an engine: Ctrl-C, and a run that
    ends anyway because the server behind a remote target went away. Everything else an
    engine raises, ``SystemExit`` and ``GeneratorExit`` included, is the engine's doing."""
    return isinstance(error, (KeyboardInterrupt, EngineLost))


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


def _raised(error: BaseException) -> str:
    """``RuntimeError: boom`` for an exception; ``SystemExit(0)`` for another BaseException,
    whose message alone ("0") would not say what happened."""
    if isinstance(error, Exception):
        return "".join(traceback.format_exception_only(error)).strip()
    return repr(error)


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
        #: Twins from another engine: what they do wrong is that engine's doing (an input
        #: error naming it), never a failure of the engine under test.
        self.differential = reference is not None and reference.name != target.name
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
        loaded = self._starting("load", lambda: raw.load(self.load_request))
        if not isinstance(loaded, LoadResult):
            message = (
                f"engine {self.target.name}: load({self.load_request}) returned {loaded!r}; "
                "it must return a shardkit.LoadResult (or raise EngineError to refuse)"
            )
            raise InvalidTarget(message)
        if not loaded.status.ok:
            message = (
                f"engine {self.target.name} refused {self.load_request}: "
                f"{loaded.status.code.name} {loaded.status.message}"
            )
            raise ShardkitError(message)
        caps = self._starting("capabilities", raw.capabilities)
        if not isinstance(caps, EngineCapabilities):
            message = (
                f"engine {self.target.name}: capabilities() after load returned {caps!r}; "
                "it must return a shardkit.EngineCapabilities"
            )
            raise InvalidTarget(message)
        self.native_faults, self.boundary_faults = usable_faults(caps, raw, self.wanted_faults)
        self.raw_engine: ShardEngine = raw
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

    def _starting(self, call: str, run: Callable[[], T]) -> T:
        """``load``/``capabilities`` of a starting engine. ``EngineError`` (how the contract
        lets them refuse) passes; anything else, or the death of its process, is an error
        naming the target, the call and what happened: no step can run on that engine."""
        try:
            return run()
        except EngineError:
            raise
        except BaseException as error:
            if _passes_through(error):
                raise
            death = self._death(error)
            if death is not None:
                what = f"engine process of {self.target.name} {death.summary} while loading {self.load_request}"
                raise ShardkitError(what + death.quoted_tail()) from error
            argument = f"{self.load_request}" if call == "load" else ""
            message = (
                f"engine {self.target.name}: {call}({argument}) raised {describe_exception(error)}; "
                "contract v1 lets load and capabilities raise only EngineError (to refuse a range or a second load)"
            )
            raise InvalidTarget(message) from error

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
        if custom is None:
            # The note says what the step meets now: a shrunk or edited sequence never keeps
            # the note of a situation the deleted steps had set up.
            session = self.model.sessions.get(str(action.args.get("session", "")))
            action = replace(action, note=step_note(action, session))
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

    def _call(self, call: str, run: Callable[[], object], returns: type[T], *, counted: bool = True) -> T | None:
        """Call the engine; None means it died of an injected crash, as predicted. An answer
        that is not a ``returns`` is the engine's failure (not an error of the kit's)."""
        crash_due = False
        if counted:
            self._counted_calls += 1
            crash_due = self._crash_at is not None and self._counted_calls >= self._crash_at
        try:
            result = run()
        except BaseException as error:
            if _passes_through(error):
                raise
            death = self._death(error)
            if crash_due:
                self._recover_from_crash(call)
                return None
            if death is not None:
                raise self._death_failure(death, "an answer") from error
            raise _Fail("unexplained exception", "an answer", f"the engine raised {_raised(error)}") from error
        if crash_due:
            raise _Fail("§4 crash", "the injected crash (the engine process dies)", f"an answer: {result!r}")
        if not isinstance(result, returns):
            raise _Fail("§1 return type", f"a {returns.__name__} from {call}()", f"{type(result).__name__}: {result!r}")
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
        observed = self._call("metrics", self.engine.metrics, MetricsResult, counted=False)
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
        result = self._call(action.op, lambda: call_engine(request), StepResult)  # type: ignore[arg-type]
        if result is None:
            return str(predicted), "engine crashed (injected)", CRASHED
        # The engine's own answer: a malformed_output injected at the boundary replaced its
        # output in ``result``, and the engine is judged on what it returned, not on that.
        original = self._boundary_original()
        answer = original if original is not None else result
        observed = _status_text(answer.status, answer.cache)
        actual = (answer.status.code, answer.status.retryable, answer.cache)
        if actual != (predicted.code, predicted.retryable, predicted.cache):
            raise _Fail(f"§2 {predicted.rule}", str(predicted), observed)
        if not answer.status.ok:
            if answer.output is not None:
                raise _Fail("§3 shape and range", str(predicted), f"{observed} carrying an output {answer.output!r}")
            return str(predicted), observed, answer.status.code.name
        key = (request.epoch, request.step)
        armed, self._malformed_armed = self._malformed_armed, False
        if armed and "malformed_output" in self.boundary_faults:
            if original is None:
                # The boundary replaces only an OK result's output: without one, the engine is at fault.
                self._raise_first(self._output_problems(request, predicted, answer, log, strict=False)[0])
                raise self._kit_bug("the malformed_output armed at the boundary did not replace this OK output")
            self._raise_first(self._output_problems(request, predicted, original, log, strict=False)[0])
            observed += self._injection_outcome(request, predicted, result, log, original=original)
        elif armed:
            # Corrupted or not, the engine's output must be well formed: the fault promises a wrong value only.
            self._raise_first(self._shape_problems(request, predicted, result))
            observed += self._injection_outcome(request, predicted, result, log, original=None)
            log.tainted.add(key)  # the engine itself returned a wrong output for this step
        else:
            if original is not None:
                raise self._kit_bug("the boundary replaced an output although no malformed_output was armed")
            self._raise_first(self._output_problems(request, predicted, answer, log, strict=False)[0])
        if not predicted.is_retry:
            log.results[key] = answer
            if not armed or original is not None:
                log.tainted.discard(key)  # a key used again (after a release) starts clean
        return str(predicted), observed, answer.status.code.name

    def _boundary_original(self) -> StepResult | None:
        """The engine's own result of the last step, if the boundary replaced its output."""
        engine = self.engine
        return engine.last_original if isinstance(engine, FaultInjectingEngine) else None

    @staticmethod
    def _raise_first(problems: list[_Fail]) -> None:
        if problems:
            raise problems[0]

    def _injection_outcome(
        self,
        request: StepRequest,
        predicted: Prediction,
        delivered: StepResult,
        log: _SessionLog,
        *,
        original: StepResult | None,
    ) -> str:
        """An injected malformed output must be caught by the kit's checks (§4 malformed_output).

        ``original`` is the engine's own result when the kit corrupted it at the boundary
        (None: the engine corrupted its output itself). Returns the note for the step's
        observed text; raises a ``KitBug`` when the checks miss a wrong output, and a
        failure of the engine when it armed the fault natively but did not corrupt."""
        problems, unreferenced = self._output_problems(request, predicted, delivered, log, strict=True)
        if problems:
            return " — the injected malformed output was detected"
        assert delivered.output is not None
        if unreferenced:
            histories = ", ".join(str(list(history)) for history in unreferenced)
            what = (
                f"the malformed output injected {'at the boundary' if original is not None else 'by the engine'} "
                f"went undetected: no reference answer exists for history {histories} "
                f"(twins {'on' if self.use_twins else 'off'})"
            )
            raise self._kit_bug(what, delivered=delivered.output, original=original)
        # The output agrees with the reference wherever it was compared: it is not wrong.
        one_token = isinstance(delivered.output, TokenOutput) and self.caps.vocab_size == 1
        if original is None and not one_token:
            raise _Fail(
                "§4 malformed_output",
                "a wrong output (the engine accepted the malformed_output fault)",
                f"{_status_text(delivered.status, delivered.cache)} agreeing with the reference: {delivered.output!r}",
                "the engine armed the fault but did not corrupt this output, the next OK one it returned",
            )
        if original is None:
            changed = False
        elif isinstance(delivered.output, TokenOutput) and isinstance(original.output, TokenOutput):
            changed = delivered.output.token_id != original.output.token_id
        else:
            changed = delivered.output != original.output
        if isinstance(delivered.output, TokenOutput) and (changed or one_token):
            # The kit's corruption landed on an answer a correct engine may give (a near tie
            # the engine reported), or there is no other token: nothing wrong to detect.
            index, action = self._step
            why = "a near tie" if changed else "the vocabulary has one token"
            where = "by the engine" if original is None else "at the boundary"
            self.notes.append(
                f"step {index}: the malformed output injected {where} into {action.describe()} "
                f"is a valid answer here ({why}); not counted as an injection"
            )
            return f" — the injected output happened to be a valid answer ({why}); not counted"
        what = "the malformed output injected at the boundary went undetected: " + (
            "the corruption did not change the output" if not changed else "it agrees with the reference"
        )
        raise self._kit_bug(what, delivered=delivered.output, original=original)

    def _output_problems(
        self, request: StepRequest, predicted: Prediction, result: StepResult, log: _SessionLog, *, strict: bool
    ) -> tuple[list[_Fail], list[tuple[int, ...]]]:
        """What is wrong with an OK result, and the histories it could not be compared on
        (no reference). ``strict``: an injected corruption is being looked for, so no
        near-tie token may flip and a retry is never accepted on its equality alone."""
        problems = self._shape_problems(request, predicted, result)
        if problems:
            return problems, []
        if predicted.is_retry:
            return self._retry_problems(request, result, log, strict=strict)
        return self._history_problems(request, result, strict=strict)

    def _shape_problems(self, request: StepRequest, predicted: Prediction, result: StepResult) -> list[_Fail]:
        status = _status_text(result.status, result.cache)
        return [
            _Fail("§3 shape and range", f"{predicted} with a well-formed output", f"{status}: {problem}")
            for problem in output_problems(self.caps, request, result)
        ]

    def _retry_problems(
        self, request: StepRequest, result: StepResult, log: _SessionLog, *, strict: bool
    ) -> tuple[list[_Fail], list[tuple[int, ...]]]:
        key = (request.epoch, request.step)
        earlier = log.results.get(key)
        if earlier is None:
            raise self._kit_bug(
                f"the model predicts an idempotent retry of step {key}, but no earlier result is logged"
            )
        if result == earlier and not strict:
            return [], []
        if result == earlier or key in log.tainted:
            # The earlier answer may itself be wrong (an injected corruption), and a repeat of
            # it is no evidence either way: the reference decides.
            return self._history_problems(request, result, strict=strict)
        return [_Fail("§2 rule 6", f"the earlier result exactly (an idempotent retry): {earlier!r}", repr(result))], []

    def _history_problems(
        self, request: StepRequest, result: StepResult, *, strict: bool
    ) -> tuple[list[_Fail], list[tuple[int, ...]]]:
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
        unreferenced: list[tuple[int, ...]] = []
        for end, payload in zip(ends, payloads, strict=True):
            reference = self._reference(request.session_id, session, history[:end])
            if reference is None:
                unreferenced.append(history[:end])
                continue
            expected, source = reference
            difference = payload_difference(expected, payload, self.caps.tolerance, near_ties_may_flip=not strict)
            if difference is not None:
                after = f"after history {list(history[:end])}"
                failure = _Fail(
                    "§3 determinism",
                    f"{_show(expected)} {after}, as {source} gave",
                    _show(payload) if isinstance(payload, tuple) else f"{_show(payload)}: {difference}",
                )
                return [failure], unreferenced
        return [], unreferenced

    def _kit_bug(
        self,
        what: str,
        *,
        delivered: object = None,
        original: StepResult | None = None,
    ) -> KitBug:
        """A check or the bookkeeping of the kit failed, not the engine: name the step and the
        steps before it, so the report reproduces it."""
        index, action = self._step
        lines = [f"shardkit's own check failed at step {index}: {what}"]
        if original is not None:
            lines.append(f"  the engine returned: {original.output!r}")
        if delivered is not None:
            lines.append(f"  the kit checked: {delivered!r}")
        lines.append(f"  engine {self.target.name}, {self.load_request}; the steps:")
        lines += [f"    step {record.index}: {record.action.describe()}" for record in self.records]
        lines.append(f"    step {index}: {action.describe()}")
        lines.append(KIT_BUG_ENDING)
        return KitBug("\n".join(lines))

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
            if self.differential:
                raise self._broken_reference(str(failure)) from None
            raise _Fail(failure.property, "twins that agree", str(failure)) from None
        except BaseException as error:  # a twin is the same engine: its exceptions are findings too
            if _passes_through(error):
                raise
            if self.differential:
                if isinstance(error, EngineError):
                    status = error.status
                    what = f"it refused to load {self.load_request}: {status.code.name} {status.message}"
                else:
                    isolation = self.reference.isolation
                    death = isolation.death(error) if isolation is not None else None
                    what = f"its process {death.summary}" if death is not None else f"it raised {_raised(error)}"
                raise self._broken_reference(what) from error
            death = self._death(error)
            if death is not None:
                raise self._death_failure(death, "a fresh twin to answer", in_twin=True) from error
            raise _Fail(
                "unexplained exception", "a fresh twin to answer", f"a fresh twin raised {_raised(error)}"
            ) from error
        return self.memo.get(key)

    def _broken_reference(self, what: str) -> InvalidTarget:
        """The reference engine (``reference=``, ``--reference``) failed: not a failure of the
        engine under test, whose outputs cannot be judged against it."""
        index, action = self._step
        message = (
            f"reference engine {self.reference.name} failed while answering for step {index} "
            f"({action.describe()}) of {self.target.name}: {what}; the reference must be a correct engine "
            "that serves the same model: fix it, or fuzz without a reference"
        )
        return InvalidTarget(message)

    def _run_custom(self, action: Action, custom: CustomOp) -> tuple[str, str, str]:
        predicted = custom.predict(self.model, action.args)
        # The engine itself, never the boundary wrapper: a custom op is not a call the crash
        # countdown counts, and what it does inside must not spend an armed malformed output.
        status = self._call(
            action.op, lambda: custom.call_engine(self.raw_engine, action.args), StructuredStatus, counted=False
        )
        return self._compare_status(predicted, status)

    def _run_cancel(self, action: Action) -> tuple[str, str, str]:
        session_id, epoch = str(action.args["session"]), int(action.args["epoch"])
        predicted = self.model.cancel(session_id, epoch)
        status = self._call("cancel", lambda: self.engine.cancel(session_id, epoch), StructuredStatus)
        return self._compare_status(predicted, status)

    def _run_release(self, action: Action) -> tuple[str, str, str]:
        session_id = str(action.args["session"])
        predicted = self.model.release(session_id)
        status = self._call("release", lambda: self.engine.release(session_id), StructuredStatus)
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
        health = self._call("health", self.engine.health, HealthResult, counted=False)
        assert health is not None
        if not (health.status.ok and health.serving):
            raise _Fail("§2 health", "OK, serving=True", f"{_status_text(health.status)}, serving={health.serving}")
        return "OK, serving=True", "OK, serving=True", "OK"

    def _run_unloaded(self, action: Action) -> tuple[str, str, str]:
        """Rule 1 on a fresh, never-loaded engine from the same target."""
        call = str(action.args["call"])
        fresh = self.target()
        if call == "health":
            health = self._call(call, fresh.health, HealthResult, counted=False)
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
            result = self._call(call, lambda: call_fresh(request), StepResult, counted=False)  # type: ignore[arg-type]
            assert result is not None
            if (result.status.code, result.cache) != (predicted.code, predicted.cache):
                raise _Fail("§2 rule 1", str(predicted), _status_text(result.status, result.cache))
            return str(predicted), _status_text(result.status, result.cache), result.status.code.name
        session_id = str(action.args["session"])
        predicted = model.cancel(session_id, 0) if call == "cancel" else model.release(session_id)
        status = self._call(
            call,
            lambda: fresh.cancel(session_id, 0) if call == "cancel" else fresh.release(session_id),
            StructuredStatus,
            counted=False,
        )
        assert status is not None
        if status.code is not predicted.code:
            raise _Fail("§2 rule 1", str(predicted), _status_text(status))
        return str(predicted), _status_text(status), status.code.name

    def _run_fault(self, action: Action) -> tuple[str, str, str]:
        fault = Fault(action.args["kind"], float(action.args["value"]))
        if fault.kind not in self.wanted_faults:
            enabled = ", ".join(sorted(self.wanted_faults)) or "none"
            message = (
                f"a {fault.kind!r} fault step, but this run injects only these faults: {enabled}; "
                f"enable it (--faults, or faults= in machine_for/Driver) or drop the step"
            )
            raise UsageError(message)
        if fault.kind not in self.injectable_faults:
            message = (
                f"fault {fault.kind!r} cannot be injected into {self.target.name}: it is not in the engine's "
                f"supported_faults {sorted(self.caps.supported_faults)} and cannot be injected at the boundary "
                f"(which takes {', '.join(sorted(BOUNDARY_FAULTS))}); run against an engine that supports it, "
                "or without that fault"
            )
            raise UsageError(message)
        injector: FaultInjectable = self.engine if fault.kind in self.boundary_faults else self._fault_target  # type: ignore[assignment]
        status = self._call("inject_fault", lambda: injector.inject_fault(fault), StructuredStatus, counted=False)
        assert status is not None
        if not status.ok and fault.kind in self.boundary_faults:
            # The kit's own injector refused: the value never came from the engine.
            message = f"the kit cannot inject {fault} at the engine's boundary: {status.message}"
            raise UsageError(message)
        if not status.ok:
            raise _Fail(f"§4 {fault.kind}", "OK (the fault is armed)", _status_text(status))
        if fault.kind == "crash":
            due = self._counted_calls + int(fault.value)
            self._crash_at = min(due, self._crash_at or due)
        elif fault.kind == "malformed_output":
            self._malformed_armed = True
        elif fault.kind == "memory_pressure":
            self.model.memory_pressure(int(fault.value))
            capabilities = self._call("capabilities", self.engine.capabilities, EngineCapabilities, counted=False)
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
