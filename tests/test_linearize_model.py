"""Parallel histories of engine calls, judged against the reference model: the races the
parallel phase is for (two sessions admitted into the last slot, a lost update of a
counter, a cancel racing a decode), written by hand as an engine would answer them."""

from __future__ import annotations

import itertools
import random

import pytest

from shardkit._core.model import ReferenceModel
from shardkit._parallel.linearize import Linearization, TimedStep, linearize
from shardkit._parallel.observed import ObservedCall, apply_call, model_key
from shardkit.contract import (
    CacheResult,
    DecodeRequest,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from tests.test_model import caps

OK = StructuredStatus(StatusCode.OK)
FULL = StructuredStatus(StatusCode.RESOURCE_EXHAUSTED, "no slot", retryable=True)


def answered(code: StructuredStatus, cache: CacheResult = CacheResult.MISS) -> StepResult:
    return StepResult(code, cache, TokenOutput(1) if code.ok else None)


def prefill(session: str, tokens: tuple[int, ...], answer: StepResult, *, step: int = 0) -> ObservedCall:
    return ObservedCall("prefill", answer, PrefillRequest(session, 0, step, token_ids=tokens))


def decode(session: str, step: int, answer: StepResult) -> ObservedCall:
    return ObservedCall("decode", answer, DecodeRequest(session, 0, step, token_ids=(5,)))


def metrics(prefills: int, decodes: int, sessions: int, tokens: int) -> ObservedCall:
    return ObservedCall("metrics", MetricsResult(prefills, decodes, sessions, tokens))


def model(**limits: int) -> ReferenceModel:
    reference = ReferenceModel()
    reference.load(caps("full", **limits))
    return reference


def judge(initial: ReferenceModel, *calls: tuple[int, int, int, int, ObservedCall]) -> Linearization[ObservedCall]:
    steps = [TimedStep(lane, index, started, ended, call) for lane, index, started, ended, call in calls]
    found = linearize(steps, initial, apply_call, model_key)
    unmemoised = linearize(steps, initial, apply_call)
    assert found.linearizable == unmemoised.linearizable, "memoisation changed the verdict"
    return found


def test_one_of_two_racing_sessions_gets_the_last_slot() -> None:
    found = judge(
        model(max_sessions=1),
        (0, 0, 0, 3, prefill("a", (1, 2), answered(FULL))),
        (1, 0, 1, 2, prefill("b", (3,), answered(OK))),
        (0, 1, 4, 5, metrics(2, 0, 1, 1)),
    )
    assert found.linearizable
    assert [call.name for call in found.order or ()] == ["B1", "A1", "A2"]


def test_two_sessions_admitted_into_the_last_slot_are_not_linearizable() -> None:
    found = judge(
        model(max_sessions=1),
        (0, 0, 0, 3, prefill("a", (1, 2), answered(OK))),
        (1, 0, 1, 2, prefill("b", (3,), answered(OK))),
    )
    assert not found.linearizable
    assert not found.unknown
    assert len(found.closest) == 1
    (reason,) = [rejection.why for rejection in found.breaks]
    assert "RESOURCE_EXHAUSTED" in reason
    assert "rule 7" in reason


def test_a_lost_update_of_a_counter_shows_in_the_metrics_after_the_lanes() -> None:
    initial = model()
    initial.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    initial.prefill(PrefillRequest("b", 0, 0, token_ids=(2,)))
    hit = answered(OK, CacheResult.HIT)
    calls = [(0, 0, 0, 3, decode("a", 1, hit)), (1, 0, 1, 2, decode("b", 1, hit))]
    assert judge(initial, *calls, (0, 1, 4, 5, metrics(2, 2, 2, 4))).linearizable
    lost = judge(initial, *calls, (0, 1, 4, 5, metrics(2, 1, 2, 4)))
    assert not lost.linearizable
    assert "decode_calls=1" in lost.breaks[0].why
    assert "decode_calls=2" in lost.breaks[0].why


def test_a_cancel_racing_a_decode_is_explained_either_way_but_not_both() -> None:
    initial = model()
    initial.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    cancel = ObservedCall("cancel", OK, session_id="a", epoch=0)
    cancelled = StructuredStatus(StatusCode.CANCELLED, "cancelled")
    # The decode took effect before the cancel: it was accepted and its token freed.
    before = judge(
        initial,
        (0, 0, 0, 3, decode("a", 1, answered(OK, CacheResult.HIT))),
        (1, 0, 1, 2, cancel),
        (0, 1, 4, 5, metrics(1, 1, 1, 0)),
    )
    assert [call.name for call in before.order or ()] == ["A1", "B1", "A2"]
    # Or after it: refused as cancelled.
    assert judge(initial, (0, 0, 0, 3, decode("a", 1, answered(cancelled))), (1, 0, 1, 2, cancel)).linearizable
    # Accepted, yet its token still cached after the cancel freed the session: written into freed cache.
    leaked = judge(
        initial,
        (0, 0, 0, 3, decode("a", 1, answered(OK, CacheResult.HIT))),
        (1, 0, 1, 2, cancel),
        (0, 1, 4, 5, metrics(1, 1, 1, 1)),
    )
    assert not leaked.linearizable
    assert "kv_tokens=1" in leaked.breaks[0].why


def test_judging_a_call_leaves_the_model_as_it_was() -> None:
    initial = model(max_sessions=1)
    before = model_key(initial)
    after = apply_call(initial, prefill("a", (1,), answered(OK)))
    assert isinstance(after, ReferenceModel)
    assert model_key(initial) == before
    assert model_key(after) != before


def test_an_extended_model_is_searched_without_memoisation() -> None:
    class Forking(ReferenceModel):
        def __init__(self) -> None:
            super().__init__()
            self.forks = 0

    extended = Forking()
    extended.load(caps("full"))
    assert model_key(extended) is None
    found = linearize([TimedStep(0, 0, 0, 1, prefill("a", (1,), answered(OK)))], extended, apply_call, model_key)
    assert found.linearizable


# --- against every interleaving -----------------------------------------------------------


def random_history(
    rng: random.Random, lanes: int, per_lane: int
) -> tuple[ReferenceModel, list[TimedStep[ObservedCall]]]:
    """Lanes of random calls on three sessions, answered as the model answers them in one
    hidden order that interleaves the lanes, with invocations and answers placed around
    each call's point in that order (so the hidden order respects real time)."""
    drawn = [
        (
            lane,
            index,
            rng.choice("abc"),
            rng.choice(("prefill", "prefill", "decode", "cancel", "release")),
            rng.randint(0, 2),
        )
        for lane in range(lanes)
        for index in range(per_lane)
    ]
    queues = {lane: [call for call in drawn if call[0] == lane] for lane in range(lanes)}
    order = []
    while any(queues.values()):
        order.append(queues[rng.choice([lane for lane, queue in queues.items() if queue])].pop(0))
    answering = model(max_sessions=2, max_kv_tokens=8)
    initial = model(max_sessions=2, max_kv_tokens=8)
    observed: dict[tuple[int, int], ObservedCall] = {}
    for lane, index, session, op, step in order:
        if op == "cancel":
            observed[lane, index] = ObservedCall(
                op, StructuredStatus(answering.cancel(session, 0).code), session_id=session
            )
        elif op == "release":
            observed[lane, index] = ObservedCall(
                op, StructuredStatus(answering.release(session).code), session_id=session
            )
        else:
            request = (
                PrefillRequest(session, 0, step, token_ids=(1, 2))
                if op == "prefill"
                else DecodeRequest(session, 0, step, token_ids=(3,))
            )
            said = answering.prefill(request) if isinstance(request, PrefillRequest) else answering.decode(request)
            status = StructuredStatus(said.code, retryable=said.retryable)
            observed[lane, index] = ObservedCall(op, answered(status, said.cache), request)
    point = {(call[0], call[1]): 10 * place for place, call in enumerate(order)}
    steps = []
    for lane in range(lanes):
        ended = -100
        for index in range(per_lane):
            here = point[lane, index]
            started = rng.randint(ended + 1, here)
            until = point[lane, index + 1] - 1 if index + 1 < per_lane else here + 40
            ended = rng.randint(here + 1, max(here + 1, (here + until) // 2))
            steps.append(TimedStep(lane, index, started * 10 + lane, ended * 10 + lane, observed[lane, index]))
    last = max(timed.ended for timed in steps)
    steps.append(TimedStep(lanes, 0, last + 1, last + 2, ObservedCall("metrics", answering.expected_metrics())))
    return initial, steps


def with_one_answer_changed(rng: random.Random, steps: list[TimedStep[ObservedCall]]) -> list[TimedStep[ObservedCall]]:
    place = rng.randrange(len(steps) - 1)
    timed = steps[place]
    call = timed.step
    code = StatusCode.NOT_FOUND if answer_code(call) is StatusCode.OK else StatusCode.OK
    answer: StepResult | StructuredStatus = (
        answered(StructuredStatus(code), CacheResult.HIT) if call.request is not None else StructuredStatus(code)
    )
    changed = ObservedCall(call.op, answer, call.request, call.session_id, call.epoch)
    return [
        *steps[:place],
        TimedStep(timed.lane, timed.index, timed.started, timed.ended, changed),
        *steps[place + 1 :],
    ]


def answer_code(call: ObservedCall) -> StatusCode:
    answer = call.answer
    if isinstance(answer, StepResult):
        return answer.status.code
    assert isinstance(answer, StructuredStatus)
    return answer.code


def explained_by_some_order(initial: ReferenceModel, steps: list[TimedStep[ObservedCall]]) -> bool:
    """Every order of ``steps`` that respects real time, tried one by one."""
    for order in itertools.permutations(steps):
        if any(later.ended < earlier.started for earlier, later in itertools.combinations(order, 2)):
            continue
        state: ReferenceModel | str = initial
        for timed in order:
            assert isinstance(state, ReferenceModel)
            state = apply_call(state, timed.step)
            if isinstance(state, str):
                break
        else:
            return True
    return False


@pytest.mark.parametrize("seed", range(4))
def test_the_verdict_agrees_with_trying_every_order(seed: int) -> None:
    """Histories answered by one hidden order are explained; with one answer changed, the
    checker says yes exactly when some order that respects real time explains them."""
    rng = random.Random(seed)
    changed_but_explained = 0
    for _ in range(25):
        initial, steps = random_history(rng, lanes=2, per_lane=3)
        found = linearize(steps, initial, apply_call, model_key)
        assert found.linearizable, [timed.step.describe() for timed in steps]
        changed = with_one_answer_changed(rng, steps)
        verdict = linearize(changed, initial, apply_call, model_key).linearizable
        assert verdict == explained_by_some_order(initial, changed)
        changed_but_explained += verdict
    assert changed_but_explained < 25  # the changed answers are mostly caught
