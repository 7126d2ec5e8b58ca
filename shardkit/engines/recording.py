"""``RecordingEngine``: a ``DelegatingEngine`` that keeps each session's accepted steps.

A backend's own operation is often written on top of an engine that lacks it, by sending
that engine steps of its own: a ``rollback`` releases the session and sends again the steps
it keeps, a ``fork`` sends the source's steps again under the new id. That needs, for each
session, the requests the engine accepted in its current epoch, and it needs those extra
calls hidden from ``metrics()`` and from the kit's faults. ``RecordingEngine`` does both::

    from shardkit import FakeShardEngine, RecordingEngine, StatusCode, StructuredStatus

    class RollbackEngine(RecordingEngine[FakeShardEngine]):
        def __init__(self) -> None:
            super().__init__(FakeShardEngine())

        def rollback(self, session_id: str, epoch: int, to_step: int) -> StructuredStatus:
            session = self.accepted.get(session_id)
            ...  # refuse unknown, stale, cancelled, out of range
            self.inner.release(session_id)
            for request in session.requests[:to_step]:
                self.inner_step(request)
            del session.requests[to_step:]
            return StructuredStatus(StatusCode.OK)

What it keeps, in ``self.accepted`` (session id → ``AcceptedSteps``):

- a prefill or decode the engine answered OK is appended to its session's ``requests``,
  unless it is an idempotent retry of a step already there; one at another epoch than the
  session's (an opening or a restart) starts the session's record afresh;
- an accepted ``cancel`` of the session's epoch sets ``cancelled``;
- ``release`` drops the session's record (whatever the engine answers).

An operation of the wrapper's own keeps ``accepted`` in step with what it did (a rollback
truncates ``requests``, a fork adds the copy's record); a subclass that changes what the
engine answers overrides ``record_step`` and calls ``super().record_step``.

``inner_step(request)`` sends a step to the inner engine on the wrapper's behalf: it is not
recorded, and ``metrics()`` subtracts it from ``prefill_calls``/``decode_calls``, so the
counts are those of the calls the kit made. For the same reason only ``memory_pressure``
(which needs the engine's own accounting) stays native, advertised and forwarded where
the inner engine injects it; the kit injects ``delay``, ``malformed_output`` and ``crash``
at the wrapper's boundary, where a call the wrapper makes itself cannot spend them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TypeVar

from shardkit._public import settle
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    Fault,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StatusCode,
    StepResult,
    StructuredStatus,
)
from shardkit.engines.delegating import DelegatingEngine

__all__ = ["AcceptedSteps", "RecordingEngine"]

InnerT = TypeVar("InnerT", bound=ShardEngine)

#: The faults a ``RecordingEngine`` leaves native: the others go to the kit's boundary.
NATIVE_FAULTS = frozenset({"memory_pressure"})


@dataclass
class AcceptedSteps:
    """One session's current epoch as a ``RecordingEngine`` saw it: its ``epoch``, the
    prefill and decode requests the engine accepted in it, in step order (``requests[k]`` is
    step ``k``; retries are not repeated), and whether a ``cancel`` of it was accepted."""

    epoch: int
    requests: list[PrefillRequest | DecodeRequest] = field(default_factory=list)
    cancelled: bool = False


class RecordingEngine(DelegatingEngine[InnerT]):
    """A ``DelegatingEngine`` that keeps, in ``accepted``, each session's ``AcceptedSteps``
    (up to date across prefill, decode, cancel and release), sends steps of its own with
    ``inner_step`` (hidden from ``metrics()``), and leaves only ``memory_pressure`` native."""

    def __init__(self, inner: InnerT) -> None:
        super().__init__(inner)
        #: Session id → what the engine accepted in that session's current epoch.
        self.accepted: dict[str, AcceptedSteps] = {}
        #: Prefill and decode calls ``inner_step`` made, which ``metrics()`` does not count.
        self.hidden_prefills = 0
        self.hidden_decodes = 0

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self.record_step(request, self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.record_step(request, self.inner.decode(request))

    def record_step(self, request: PrefillRequest | DecodeRequest, result: StepResult) -> StepResult:
        """Record ``request`` if ``result`` (the inner engine's answer) accepted it, and
        return the answer ``prefill``/``decode`` give: ``result`` itself here."""
        if not result.status.ok:
            return result
        session = self.accepted.get(request.session_id)
        if session is not None and request.epoch == session.epoch and request.step < len(session.requests):
            return result  # an idempotent retry: nothing new was accepted
        if session is None or request.epoch != session.epoch:  # opened, or restarted at a new epoch
            session = self.accepted[request.session_id] = AcceptedSteps(request.epoch)
        session.requests.append(request)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        session = self.accepted.get(session_id)
        if status.ok and session is not None and session.epoch == epoch:
            session.cancelled = True
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.accepted.pop(session_id, None)
        return self.inner.release(session_id)

    def inner_step(self, request: PrefillRequest | DecodeRequest) -> StepResult:
        """Send ``request`` to the inner engine on the wrapper's own behalf: not recorded in
        ``accepted``, not counted by ``metrics()``."""
        if isinstance(request, PrefillRequest):
            self.hidden_prefills += 1
            return self.inner.prefill(request)
        self.hidden_decodes += 1
        return self.inner.decode(request)

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(
            metrics,
            prefill_calls=metrics.prefill_calls - self.hidden_prefills,
            decode_calls=metrics.decode_calls - self.hidden_decodes,
        )

    def capabilities(self) -> EngineCapabilities:
        caps = self.inner.capabilities()
        native = (
            caps.supported_faults & NATIVE_FAULTS
            if callable(getattr(self.inner, "inject_fault", None))
            else frozenset()
        )
        return replace(caps, supported_faults=native)

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        inject = getattr(self.inner, "inject_fault", None)
        if fault.kind not in NATIVE_FAULTS or not callable(inject):
            message = f"{fault.kind} is not native to {type(self).__name__}; the kit injects it at the boundary"
            return StructuredStatus(StatusCode.UNIMPLEMENTED, message)
        status: StructuredStatus = inject(fault)
        return status


settle(__name__, globals())
