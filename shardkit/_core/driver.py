"""The driver: runs concrete steps against an engine and the model side by side.

The driver knows nothing of Hypothesis. The machine draws a step and hands it
here; replay reads one from a trace and hands it here. Either way the engine
and the reference model each answer, every check compares, and the step is
recorded. A mismatch raises ``StepFailed`` carrying a stable property name
(what minimisation preserves) and a message a person can act on.

This module owns the engine's lifecycle (load, the call that counts towards an injected
crash, the restart after one) and running each op against engine and model, comparing
statuses, caches and metrics with the prediction. ``Driver`` takes the rest from its bases:
the outcome vocabulary (``shardkit._core.outcomes``), the checks of an OK output and the twin
oracle (``shardkit._core.output_checks``), and the fault steps with the malformed-output
self-check (``shardkit._core.fault_steps``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from shardkit._core.checks import HistoryMemo, MemoStore, Payload, metrics_text
from shardkit._core.fault_steps import FaultSteps, fault_injectable, usable_faults
from shardkit._core.faults import FaultInjectingEngine
from shardkit._core.model import Prediction, ReferenceModel
from shardkit._core.outcomes import (
    CRASHED,
    KIT_BUG_ENDING,
    Fail,
    StepFailed,
    StepRecord,
    Violation,
    raised,
    status_text,
)
from shardkit._core.output_checks import SessionLog
from shardkit._core.steps import Action, build_request, step_note
from shardkit._core.targets import ResolvedTarget, describe_exception, passes_through
from shardkit._core.twins import OneShotTwin, TwinSession
from shardkit._public import settle
from shardkit.contract import (
    EngineCapabilities,
    EngineError,
    FaultInjectable,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)
from shardkit.errors import InvalidTarget, ShardkitError

__all__ = ["KIT_BUG_ENDING", "CustomOp", "Driver", "StepFailed", "StepRecord", "Violation", "usable_faults"]

T = TypeVar("T")

# The engine and model types a CustomOp works with. Covariant, so that a
# ``CustomOp[RollbackEngine, RollbackModel]`` fits where a plain ``CustomOp`` is expected
# (``ShardMachine.custom_ops``, ``replay(custom_ops=...)``); defaulted, so that a plain
# ``CustomOp`` still means ``CustomOp[ShardEngine, ReferenceModel]``. Python 3.11's TypeVar
# takes no default: type checkers read typing_extensions' (PEP 696), the runtime the plain one.
if TYPE_CHECKING:
    from typing_extensions import TypeVar as DefaultedTypeVar

    EngineT = DefaultedTypeVar("EngineT", bound=ShardEngine, default=ShardEngine, covariant=True)
    ModelT = DefaultedTypeVar("ModelT", bound=ReferenceModel, default=ReferenceModel, covariant=True)
else:
    EngineT = TypeVar("EngineT", bound=ShardEngine, covariant=True)
    ModelT = TypeVar("ModelT", bound=ReferenceModel, covariant=True)


@dataclass(frozen=True)
class CustomOp(Generic[EngineT, ModelT]):
    """An operation a backend adds beyond contract v1 (see stateful/test_extending_rules.py).

    ``call_engine`` performs it on the engine and ``predict`` asks the (extended)
    reference model, both from the step's JSON-able arguments, so a trace that
    holds the step replays it. The driver compares the status codes and the
    metrics afterwards, like for any other step.

    The type parameters are the engine and the model the two functions take, so that they
    call their own methods without an ``isinstance`` check::

        def _call_rollback(engine: RollbackEngine, args: Mapping[str, Any]) -> StructuredStatus: ...
        def _predict_rollback(model: RollbackModel, args: Mapping[str, Any]) -> Prediction: ...

        ROLLBACK = CustomOp(_call_rollback, _predict_rollback, engine_type=RollbackEngine, model_type=RollbackModel)

    A plain ``CustomOp`` is ``CustomOp[ShardEngine, ReferenceModel]``. ``engine_type`` and
    ``model_type`` (optional) make the promise checked when the kit starts an engine: an
    engine under test that is not an ``engine_type``, or a machine whose ``model_factory``
    makes no ``model_type``, is an ``InvalidTarget`` naming both types, before any step runs.
    Without them nothing is checked, and a function meeting the wrong type fails inside.
    """

    call_engine: Callable[[EngineT, Mapping[str, Any]], StructuredStatus]
    predict: Callable[[ModelT, Mapping[str, Any]], Prediction]
    engine_type: type[EngineT] | None = field(default=None, kw_only=True)
    model_type: type[ModelT] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name, given, base in (
            ("engine_type", self.engine_type, ShardEngine),
            ("model_type", self.model_type, ReferenceModel),
        ):
            if given is not None and not (isinstance(given, type) and issubclass(given, base)):
                message = (
                    f"CustomOp({name}={given!r}): {name} must be a subclass of {base.__name__} (the class, "
                    f"not an instance), or None to check nothing"
                )
                raise TypeError(message)

    def check_types(self, name: str, engine: ShardEngine, model: ReferenceModel) -> None:
        """Raise ``InvalidTarget`` if ``engine`` is no ``engine_type`` or ``model`` no
        ``model_type``: the kit calls it for each custom operation ``name`` when it starts an
        engine. Nothing is checked for a type left None."""
        if self.engine_type is not None and not isinstance(engine, self.engine_type):
            message = (
                f"custom operation {name!r} runs on a {_qualname(self.engine_type)} (its engine_type), "
                f"but the engine under test is a {_qualname(type(engine))}: fuzz a {_qualname(self.engine_type)} "
                f"(or a subclass) with this machine, or give the operation an engine_type the engine is"
            )
            raise InvalidTarget(message)
        if self.model_type is not None and not isinstance(model, self.model_type):
            message = (
                f"custom operation {name!r} predicts with a {_qualname(self.model_type)} (its model_type), "
                f"but the model is a {_qualname(type(model))}: set model_factory = "
                f"{_qualname(self.model_type)} on the machine (or pass model={_qualname(self.model_type)})"
            )
            raise InvalidTarget(message)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class Driver(FaultSteps):
    """One engine under test, its reference model, its twins and its fault state. It runs each
    step; the output checks and the twin oracle (``OutputChecks``), the fault steps
    (``FaultSteps``) and the failures naming the step (``StepContext``) come from its bases."""

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
        memo: MemoStore | None = None,
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
        #: The twins' answers, in a store the examples of a run may share (``memo``).
        # The scope is the request's text: its recipe is a read-only mapping, which does not hash.
        self.memo = HistoryMemo(memo if memo is not None else MemoStore(), scope=repr(load_request))
        self.served: dict[tuple[int, ...], tuple[str, Payload]] = {}
        self.split_twins = True
        self.records: list[StepRecord] = []
        self.notes: list[str] = []
        #: Checks this example could not make (the run's summary lists them): a user must
        #: not read a clean run as covering what was never checked.
        self.caveats: set[str] = set()
        #: Of ``caveats``, the checks that ran and reached no verdict (a search that ran out of
        #: its budget), as opposed to checks the engine's capabilities rule out: a replay with
        #: one of these and no failure is undecided, never a pass.
        self.undecided: set[str] = set()
        self._step: tuple[int, Action] = (0, Action("load", {}))
        self._start_engine()

    def fresh(self) -> Driver:
        """A driver like this one on a new engine from the same target, loaded with the same
        request and at its first step: a parallel phase reruns on one (its races may show
        on one run and not on the next)."""
        return Driver(
            self.target,
            self.load_request,
            faults=self.wanted_faults,
            twins=self.use_twins,
            reference=self.reference if self.differential else None,
            model_factory=self.model_factory,
            custom_ops=self.custom_ops,
            sleep=self.sleep,
            memo=self.memo.store,
        )

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
        self._fault_target: FaultInjectable | None = fault_injectable(raw)
        self.caps = caps
        self.model = self.model_factory()
        for name, custom in self.custom_ops.items():
            custom.check_types(name, raw, self.model)
        self.model.load(caps)
        self.logs: dict[str, SessionLog] = {}
        self.twins: dict[str, TwinSession] = {}
        self.one_shot: OneShotTwin | None = None
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
            if passes_through(error):
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

    def log(self, session_id: str) -> SessionLog:
        return self.logs.setdefault(session_id, SessionLog())

    # --- running a step ----------------------------------------------------------------

    def execute(self, action: Action) -> StepRecord:
        """Run one step; raise ``StepFailed`` on the first disagreement."""
        handler = self._HANDLERS.get(action.op)
        custom = self.custom_ops.get(action.op)
        if handler is None and custom is None:
            known = sorted([*self._HANDLERS, *self.custom_ops])
            message = f"unknown step op {action.op!r}; known: {known}"
            raise ValueError(message)
        if custom is not None:
            return self._execute(action, lambda action: self._run_custom(action, custom), custom=True)
        assert handler is not None
        return self._execute(action, lambda action: handler(self, action))

    def execute_answered(self, action: Action, answer: StepResult | StructuredStatus) -> StepRecord:
        """Judge ``answer`` as the engine's answer to ``action``, a call made earlier (one of a
        parallel phase, taken in the order that explains the phase). The model advances and
        the status and an OK output are checked as ``execute`` checks them; the metrics are
        not: the phase compares them once, after every lane."""
        if action.op in ("prefill", "decode") and isinstance(answer, StepResult):
            return self._execute(action, lambda action: self._run_step(action, answer), metrics=False)
        if action.op in ("cancel", "release") and isinstance(answer, StructuredStatus):
            return self._execute(action, lambda action: self._judge_status(action, answer), metrics=False)
        message = f"no {action.op} step answers a {type(answer).__name__}"
        raise ValueError(message)

    def _execute(
        self,
        action: Action,
        run: Callable[[Action], tuple[str, str, str]],
        *,
        custom: bool = False,
        metrics: bool = True,
    ) -> StepRecord:
        index = len(self.records) + 1
        if not custom:
            # The note says what the step meets now: a shrunk or edited sequence never keeps
            # the note of a situation the deleted steps had set up.
            session = self.model.sessions.get(str(action.args.get("session", "")))
            action = replace(action, note=step_note(action, session))
        self._step = (index, action)
        try:
            expected, observed, outcome = run(action)
            if metrics and action.op not in ("unloaded", "health") and outcome != CRASHED:
                self._check_metrics()
        except Fail as fail:
            record = StepRecord(index, action, fail.expected, fail.observed, "FAILED")
            self.records.append(record)
            lines = [
                f"step {index}: {action.describe()}",
                f"  expected: {fail.expected}",
                f"  observed: {fail.observed}",
            ]
            if fail.detail:
                lines.append(f"  {fail.detail}")
            raise StepFailed(Violation(fail.property, "\n".join(lines), fail.rows), record) from None
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
            if passes_through(error):
                raise
            death = self._death(error)
            if crash_due:
                self._recover_from_crash(call)
                return None
            if death is not None:
                raise self._death_failure(death, "an answer") from error
            raise Fail("unexplained exception", "an answer", f"the engine raised {raised(error)}") from error
        if crash_due:
            raise Fail("§4 crash", "the injected crash (the engine process dies)", f"an answer: {result!r}")
        if not isinstance(result, returns):
            raise Fail("§1 return type", f"a {returns.__name__} from {call}()", f"{type(result).__name__}: {result!r}")
        return result

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
            raise Fail("§2 metrics", f"metrics {metrics_text(expected)}", f"metrics {metrics_text(observed)}")

    # --- handlers, one per op ------------------------------------------------------------

    def _run_step(self, action: Action, answered: StepResult | None = None) -> tuple[str, str, str]:
        """A prefill or decode: sent to the engine, or ``answered`` already (a call of a
        parallel phase, which starts with no fault armed and calls the engine itself)."""
        request = build_request(action, self.caps)
        is_prefill = isinstance(request, PrefillRequest)
        predicted = self.model.prefill(request) if is_prefill else self.model.decode(request)  # type: ignore[arg-type]
        log = self.log(request.session_id)
        log.sent.append(action)
        if answered is None:
            call_engine = self.engine.prefill if is_prefill else self.engine.decode
            result = self._call(action.op, lambda: call_engine(request), StepResult)  # type: ignore[arg-type]
            if result is None:
                return str(predicted), "engine crashed (injected)", CRASHED
            # The engine's own answer: a malformed_output injected at the boundary replaced its
            # output in ``result``, and the engine is judged on what it returned, not on that.
            original = self._boundary_original()
        else:
            result, original = answered, None
        answer = original if original is not None else result
        observed = self._step_status(predicted, answer)
        if not answer.status.ok:
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

    def _judge_status(self, action: Action, status: StructuredStatus) -> tuple[str, str, str]:
        """A cancel or release that was answered already."""
        session_id = str(action.args["session"])
        if action.op == "cancel":
            return self._compare_status(self.model.cancel(session_id, int(action.args["epoch"])), status)
        if status.ok:
            self.twins.pop(session_id, None)
        return self._compare_status(self.model.release(session_id), status)

    @staticmethod
    def _step_status(predicted: Prediction, answer: StepResult) -> str:
        """The answer's status as the report shows it, once it is the one predicted (code,
        retryable flag and cache result) and a refusal carries no output."""
        observed = status_text(answer.status, answer.cache)
        actual = (answer.status.code, answer.status.retryable, answer.cache)
        if actual != (predicted.code, predicted.retryable, predicted.cache):
            raise Fail(f"§2 {predicted.rule}", str(predicted), observed)
        if not answer.status.ok and answer.output is not None:
            raise Fail("§3 shape and range", str(predicted), f"{observed} carrying an output {answer.output!r}")
        return observed

    @staticmethod
    def _raise_first(problems: list[Fail]) -> None:
        if problems:
            raise problems[0]

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
            raise Fail(f"§2 {predicted.rule}", str(predicted), status_text(status))
        return str(predicted), status_text(status), status.code.name

    def _run_health(self, action: Action) -> tuple[str, str, str]:
        health = self._call("health", self.engine.health, HealthResult, counted=False)
        assert health is not None
        if not (health.status.ok and health.serving):
            raise Fail("§2 health", "OK, serving=True", f"{status_text(health.status)}, serving={health.serving}")
        return "OK, serving=True", "OK, serving=True", "OK"

    def _run_unloaded(self, action: Action) -> tuple[str, str, str]:
        """Rule 1 on a fresh, never-loaded engine from the same target."""
        call = str(action.args["call"])
        fresh = self.target()
        if call == "health":
            health = self._call(call, fresh.health, HealthResult, counted=False)
            assert health is not None
            if health.serving:
                raise Fail("§2 health", "serving=False before load", "serving=True")
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
                raise Fail("§2 rule 1", str(predicted), status_text(result.status, result.cache))
            return str(predicted), status_text(result.status, result.cache), result.status.code.name
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
            raise Fail("§2 rule 1", str(predicted), status_text(status))
        return str(predicted), status_text(status), status.code.name

    _HANDLERS: ClassVar[dict[str, Callable[[Driver, Action], tuple[str, str, str]]]] = {
        "prefill": _run_step,
        "decode": _run_step,
        "cancel": _run_cancel,
        "release": _run_release,
        "health": _run_health,
        "unloaded": _run_unloaded,
        "fault": FaultSteps._run_fault,
    }


settle(__name__, globals())
