"""What one call of a parallel phase answered, judged against the reference model: the
``apply`` and ``key`` that ``linearize`` searches with.

A call is judged as the driver judges a sequential step (status code, retryable flag and
cache result of a prefill or decode; the status code of a cancel or release; all four
counters of a metrics call), on a copy of the model, so the search can try the next
candidate from the same state.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass

from shardkit._core.checks import metrics_text
from shardkit._core.model import Prediction, ReferenceModel, SessionState, StepRequest
from shardkit._core.outcomes import status_text
from shardkit.contract import MetricsResult, PrefillRequest, StepResult, StructuredStatus

__all__ = ["ObservedCall", "apply_call", "counts_no_order_explains", "model_key"]


@dataclass(frozen=True)
class ObservedCall:
    """One engine call and its answer. ``op`` is "prefill" or "decode" (``request`` and a
    ``StepResult``), "cancel" (``session_id``, ``epoch`` and a ``StructuredStatus``),
    "release" (``session_id`` and a ``StructuredStatus``) or "metrics" (a ``MetricsResult``)."""

    op: str
    answer: StepResult | StructuredStatus | MetricsResult
    request: StepRequest | None = None
    session_id: str = ""
    epoch: int = 0

    def describe(self) -> str:
        if self.request is not None:
            request = self.request
            return f"{self.op}(session={request.session_id!r}, epoch={request.epoch}, step={request.step})"
        if self.op == "cancel":
            return f"cancel(session={self.session_id!r}, epoch={self.epoch})"
        if self.op == "release":
            return f"release(session={self.session_id!r})"
        return f"{self.op}()"


def apply_call(model: ReferenceModel, call: ObservedCall) -> ReferenceModel | str:
    """The model after ``call`` if it predicts what the engine answered, else why not
    (``model`` itself is left as it was)."""
    after = _copy(model)
    answer = call.answer
    if isinstance(answer, MetricsResult):
        expected = after.expected_metrics()
        if answer == expected:
            return after
        return f"{call.describe()} answered {metrics_text(answer)} where the model holds {metrics_text(expected)}"
    prediction = _predict(after, call)
    if isinstance(answer, StepResult):
        observed = (answer.status.code, answer.status.retryable, answer.cache)
        if observed == (prediction.code, prediction.retryable, prediction.cache):
            return after
        shown = status_text(answer.status, answer.cache)
    else:
        if answer.code is prediction.code:
            return after
        shown = status_text(answer)
    return f"{call.describe()} answered {shown} where the model predicts {prediction}"


def _predict(model: ReferenceModel, call: ObservedCall) -> Prediction:
    if call.request is not None:
        if isinstance(call.request, PrefillRequest):
            return model.prefill(call.request)
        return model.decode(call.request)
    if call.op == "cancel":
        return model.cancel(call.session_id, call.epoch)
    if call.op == "release":
        return model.release(call.session_id)
    message = f"a parallel phase cannot judge a {call.op!r} call"
    raise ValueError(message)


def _copy(model: ReferenceModel) -> ReferenceModel:
    """A deep copy that shares what never changes: the requests a session remembers (a
    middle's or tail's carry arrays) and the capabilities. Shared requests also keep
    ``model_key`` equal for states reached by different orders."""
    shared: dict[int, object] = {id(model.capabilities): model.capabilities}
    for session in model.sessions.values():
        shared[id(session.last_request)] = session.last_request
        shared[id(session.history)] = session.history
    return copy.deepcopy(model, shared)


#: The attributes of a ``ReferenceModel``; a model that has others is not memoised.
_MODEL_ATTRIBUTES = frozenset(vars(ReferenceModel()))


def model_key(model: ReferenceModel) -> Hashable | None:
    """Equal for two models that predict the same from here on, or None for a model with
    state the kit does not know (an extended model): the search then does not memoise."""
    if set(vars(model)) != _MODEL_ATTRIBUTES:
        return None
    return (
        model.max_kv_tokens,
        model.prefill_calls,
        model.decode_calls,
        tuple((session_id, _session_key(session)) for session_id, session in model.sessions.items()),
    )


def _session_key(session: SessionState) -> Hashable:
    # The last request by identity (a middle's carries arrays, which do not hash): every
    # request a state of one search can hold is alive for the whole search, in the phase's
    # calls or in the model it started from, so no identity is reused while keys are kept.
    return (
        session.epoch,
        session.next_step,
        session.kv_tokens,
        session.cancelled,
        id(session.last_request),
        session.last_cache,
        session.history,
    )


def counts_no_order_explains(model: ReferenceModel, calls: list[ObservedCall], metrics: MetricsResult) -> str | None:
    """Why no order of ``calls`` from ``model`` can end in ``metrics``, judged on what every
    order agrees on, or None where that cannot tell. The kit's own model counts every prefill
    and every decode, whatever it answers, so any order of the calls ends with the same
    ``prefill_calls`` and ``decode_calls``: a lost update of those counters is found without
    searching orders (the search may run out of states on long lanes first). A model of
    another class may count otherwise: it is not judged here."""
    if type(model) is not ReferenceModel:
        return None
    prefills = model.prefill_calls + sum(1 for call in calls if call.op == "prefill")
    decodes = model.decode_calls + sum(1 for call in calls if call.op == "decode")
    if (metrics.prefill_calls, metrics.decode_calls) == (prefills, decodes):
        return None
    return (
        f"no order of these calls explains their answers: in every order the model counts prefill_calls={prefills} "
        f"decode_calls={decodes} after them (each prefill and decode counts, whatever it answers), and metrics() "
        f"after the lanes answered {metrics_text(metrics)}"
    )

