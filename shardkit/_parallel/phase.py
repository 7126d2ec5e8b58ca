"""A parallel phase: lanes of steps sent to one engine at the same time, then judged.

The phase calls the engine from one thread per lane, asks its metrics once every lane has
finished, and searches an order of the calls that respects real time and that the
reference model accepts, answer by answer, ending with those metrics. No such order is the
failure ``§2 linearizability``. With one, the driver takes the calls in that order as if
they had run one after another: the model advances and each OK output faces the twin
oracle, exactly as a sequential step's.

The phase ends the example: another order might explain the answers equally well and
leave the model in another state, so nothing runs after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

from shardkit._core.checks import metrics_text
from shardkit._core.driver import Driver, StepFailed
from shardkit._core.outcomes import StepRecord, Violation, raised, status_text
from shardkit._core.steps import PARALLEL_OP, Action, build_request, phase_action
from shardkit._core.targets import ProcessDeath, passes_through
from shardkit._parallel.lanes import Raised, run_lanes
from shardkit._parallel.linearize import DEFAULT_MAX_STATES, Linearization, TimedStep, linearize
from shardkit._parallel.observed import ObservedCall, apply_call, counts_no_order_explains, model_key
from shardkit.contract import MetricsResult, PrefillRequest, StepResult, StructuredStatus

__all__ = ["LINEARIZABILITY", "PARALLEL_OPS", "run_parallel"]

LINEARIZABILITY = "§2 linearizability"
#: The operations a lane may hold.
PARALLEL_OPS = frozenset({"prefill", "decode", "cancel", "release"})


def run_parallel(driver: Driver, lanes: Sequence[Sequence[Action]]) -> list[StepRecord]:
    """Run ``lanes`` at the same time on the driver's engine and judge what they answered;
    ``StepFailed`` for the first problem. The records are the calls in the order found.

    A failing phase leaves one record in the driver's, the phase itself
    (``phase_action``): that is the step a trace replays, whatever order was being judged."""
    start = len(driver.records)
    try:
        return _run_parallel(driver, lanes)
    except StepFailed as failed:
        del driver.records[start:]
        record = StepRecord(start + 1, phase_action(lanes), failed.record.expected, failed.record.observed, "FAILED")
        driver.records.append(record)
        raise StepFailed(failed.violation, record) from None


def _run_parallel(driver: Driver, lanes: Sequence[Sequence[Action]]) -> list[StepRecord]:
    for lane in lanes:
        for action in lane:
            if action.op not in PARALLEL_OPS:
                message = f"a lane holds {action.op!r}; lanes hold {sorted(PARALLEL_OPS)}"
                raise ValueError(message)
    if driver.armed_fault is not None:
        message = f"a parallel phase starts with no fault armed, and {driver.armed_fault} is"
        raise ValueError(message)
    ran = run_lanes([[_call(driver, action) for action in lane] for lane in lanes])
    actions = {(timed.lane, timed.index): lanes[timed.lane][timed.index] for timed in ran}
    _check_for_death(driver, ran, actions)
    calls = [_checked(driver, timed, actions, ran) for timed in ran]
    last = max((timed.ended for timed in calls), default=-1)
    try:
        metrics = driver.raw_engine.metrics()
    except Exception as error:  # the engine's exception is a finding; the kit's own pass through
        death = driver.target.isolation.death(error) if driver.target.isolation is not None else None
        if death is not None:
            _died(driver, death, ["metrics() after the lanes"], _lanes_text(ran, actions))
        _fail(driver, "unexplained exception", f"metrics() after the lanes raised {raised(error)}", ran, actions)
    if not isinstance(metrics, MetricsResult):
        _fail(driver, "§1 return type", f"a MetricsResult from metrics() after the lanes, got {metrics!r}", ran, actions)
    after = TimedStep(len(lanes), 0, last + 1, last + 2, ObservedCall("metrics", metrics))
    found = linearize([*calls, after], driver.model, apply_call, model_key)
    if found.unknown:
        # No verdict from the search (long lanes with no order that explains them run it out
        # of states); what every order agrees on may still rule each of them out.
        counted = counts_no_order_explains(driver.model, [timed.step for timed in calls], metrics)
        if counted is not None:
            searched = f"{counted}; the search for an order ran out of its {DEFAULT_MAX_STATES:,} states first"
            _fail(driver, LINEARIZABILITY, searched, ran, actions)
        no_verdict = (
            f"a parallel phase: the search for an order that explains it visited its {DEFAULT_MAX_STATES:,} "
            "states without a verdict"
        )
        driver.caveats.add(no_verdict)
        driver.undecided.add(no_verdict)
        return []
    if found.order is None:
        _fail(driver, LINEARIZABILITY, _no_order(found, len(lanes)), ran, actions)
    records = []
    for timed in found.order:
        if timed.lane == len(lanes):
            continue  # the metrics after the lanes: the order already agrees with them
        action = actions[timed.lane, timed.index]
        answer = timed.step.answer
        assert isinstance(answer, StepResult | StructuredStatus)
        try:
            records.append(driver.execute_answered(action, answer))
        except StepFailed as failed:
            order = ", ".join(step.name for step in found.order if step.lane < len(lanes))
            context = f"{_lanes_text(ran, actions)}\n  taken in the order {order}, which explains every status"
            # The step is named by its lane: the phase is one step of the failing sequence.
            judged = failed.violation.message.replace(f"step {failed.record.index}: ", f"{timed.name}: ", 1)
            violation = Violation(failed.violation.property, f"{context}\n{judged}", failed.violation.rows)
            raise StepFailed(violation, failed.record) from None
    return records


def _call(driver: Driver, action: Action) -> Callable[[], ObservedCall]:
    engine = driver.raw_engine
    if action.op in ("prefill", "decode"):
        request = build_request(action, driver.caps)
        send = engine.prefill if isinstance(request, PrefillRequest) else engine.decode
        return lambda: ObservedCall(action.op, send(request), request)  # type: ignore[arg-type]
    session_id = str(action.args["session"])
    if action.op == "cancel":
        epoch = int(action.args["epoch"])
        return lambda: ObservedCall("cancel", engine.cancel(session_id, epoch), session_id=session_id, epoch=epoch)
    return lambda: ObservedCall("release", engine.release(session_id), session_id=session_id)


def _check_for_death(
    driver: Driver, ran: list[TimedStep[ObservedCall | Raised[ObservedCall]]], actions: dict[tuple[int, int], Action]
) -> None:
    """An isolated engine's process that died during the lanes (a signal, an exit, a missed
    deadline, a garbage answer) is the failure a sequential step gets for it, naming the
    calls it left without an answer: which of those that overlapped killed it, the kit
    cannot tell. Each lane's later calls, which found the process gone, are not named, and
    no call that failed with the process is reported as a failure of its own."""
    failed = [(timed, timed.step.error) for timed in ran if isinstance(timed.step, Raised)]
    for _, error in failed:
        if passes_through(error):
            raise error
    isolation = driver.target.isolation
    if isolation is None:
        return
    unanswered: dict[int, str] = {}
    death = None
    # The earliest failure first: it says how the process ended (a later one may only have found it gone).
    for timed, error in sorted(failed, key=lambda pair: pair[0].started):
        found = isolation.death(error)
        if found is not None:
            death = death or found
            unanswered.setdefault(timed.lane, f"{timed.name} {actions[timed.lane, timed.index].describe()}")
    if death is not None:
        shown = _lanes_text(ran, actions, died=True)
        _died(driver, death, [unanswered[lane] for lane in sorted(unanswered)], shown)


def _died(driver: Driver, death: ProcessDeath, unanswered: list[str], calls: str) -> NoReturn:
    """The death as a sequential step's (``Driver._death_failure``), the phase as its step."""
    index = len(driver.records) + 1
    observed = f"engine process {death.summary} during step {index}, a parallel phase: no answer to {' nor to '.join(unanswered)}"
    message = f"{calls}\n  expected: an answer\n  observed: {observed}\n  {death.output_detail()}"
    record = StepRecord(index, Action(PARALLEL_OP), "an answer", observed, "FAILED")
    raise StepFailed(Violation(death.property, message), record)


def _checked(
    driver: Driver,
    timed: TimedStep[ObservedCall | Raised[ObservedCall]],
    actions: dict[tuple[int, int], Action],
    ran: list[TimedStep[ObservedCall | Raised[ObservedCall]]],
) -> TimedStep[ObservedCall]:
    """The call as answered, or the failure of a call that raised or answered the wrong type
    (shown with every lane: what the other calls answered meanwhile is the evidence)."""
    outcome = timed.step
    name = f"{timed.name} {actions[timed.lane, timed.index].describe()}"
    if isinstance(outcome, Raised):
        if passes_through(outcome.error):
            raise outcome.error
        _fail(driver, "unexplained exception", f"{name} raised {raised(outcome.error)}", ran, actions)
    assert isinstance(outcome, ObservedCall)
    wanted = StepResult if outcome.request is not None else StructuredStatus
    if not isinstance(outcome.answer, wanted):
        _fail(driver, "§1 return type", f"{name} returned {outcome.answer!r}, not a {wanted.__name__}", ran, actions)
    return TimedStep(timed.lane, timed.index, timed.started, timed.ended, outcome)


def _fail(
    driver: Driver,
    prop: str,
    what: str,
    ran: list[TimedStep[ObservedCall | Raised[ObservedCall]]],
    actions: dict[tuple[int, int], Action],
) -> NoReturn:
    """``what`` below every lane; ``run_parallel`` records the phase itself as the failing step."""
    message = f"{_lanes_text(ran, actions)}\n  {what}"
    raise StepFailed(Violation(prop, message), StepRecord(len(driver.records) + 1, Action(PARALLEL_OP), "", what, "FAILED"))


def _answer_text(answer: object) -> str:
    if isinstance(answer, StepResult):
        return status_text(answer.status, answer.cache)
    if isinstance(answer, StructuredStatus):
        return status_text(answer)
    if isinstance(answer, MetricsResult):
        return metrics_text(answer)
    return repr(answer)


def _lanes_text(
    ran: Sequence[TimedStep[ObservedCall | Raised[ObservedCall]]],
    actions: dict[tuple[int, int], Action],
    *,
    died: bool = False,
) -> str:
    """The lanes side by side: each call with the ticks it started and ended at and what it
    answered (what it raised; nothing, if the engine's process ``died``)."""
    lanes = max((timed.lane for timed in ran), default=-1) + 1
    rows = []
    for timed in sorted(ran, key=lambda timed: (timed.lane, timed.index)):
        call = timed.step
        if isinstance(call, ObservedCall):
            answered = _answer_text(call.answer)
        else:
            answered = "no answer" if died else f"raised {raised(call.error)}"
        # The action, tokens included: two prefills that look alike may be a retry or not.
        rows.append(f"  {timed.name} [{timed.started}-{timed.ended}] {actions[timed.lane, timed.index].describe()} → {answered}")
    return f"parallel phase, {lanes} lanes at the same time (ticks of one clock: [started-ended]):\n" + "\n".join(rows)


def _no_order(found: Linearization[ObservedCall], lanes: int) -> str:
    closest = ", ".join(step.name for step in found.closest) or "nothing"
    refused = "; ".join(
        f"{'metrics after the lanes' if rejection.step.lane == lanes else rejection.step.name}: {rejection.why}"
        for rejection in found.breaks
    )
    return (
        f"no order of these calls explains their answers ({found.explored} states searched); "
        f"the longest order that does, {closest}, cannot go on: {refused}"
    )
