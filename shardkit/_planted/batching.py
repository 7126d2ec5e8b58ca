"""Two bugs of batching schedulers, planted in ``BatchingTransformersShardEngine``
(docs/pytorch.md#batching). Each answers correctly one call at a time, where every batch
holds one step, and wrongly when the steps of two sessions share a batch, so only
``--concurrency`` finds them:

- ``BatchTakesTheFirstRowsPosition``: the batch's rows are rotated to the position of its
  first row's session, not each to its own (a position read from the batch instead of
  from the session), so a session batched behind a longer or shorter one gets wrong
  answers, and wrong keys in its cache;
- ``CancelShiftsTheBatchsRows``: a cancel does not wait for its session's step in the
  batch, and the write-back gives the rows to the steps still live, in order, so each
  step after the cancelled one gets the row of the one before it.

They are not in ``PLANTED`` (fakes) or ``RACY``: they need the ``transformers`` extra, and
``tests/test_transformers_batching.py`` fuzzes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from shardkit._core.lane_context import in_parallel_phase, yield_point
from shardkit.contract import DecodeRequest, PrefillRequest, StatusCode, StepResult, StructuredStatus
from shardkit.engines._checks import refusal
from shardkit.engines.base import Produced, SessionEngine
from shardkit.engines.transformers_batching import BatchingTransformersShardEngine, _BatchedForward, _Job
from shardkit.engines.transformers_llama import _SessionCache

__all__ = ["BATCHING_PLANTED", "BatchTakesTheFirstRowsPosition", "CancelShiftsTheBatchsRows"]

#: Turns a cancel of ``CancelShiftsTheBatchsRows`` gives the other lanes for its session's
#: step to be queued (each a ``yield_point``: 50 ms at most), and the gather time that keeps
#: a batch waiting for the calls in the door (a call in the door holds the batch that long at
#: most): both planted engines gather for it, so that on a busy machine, where a lane may
#: take more than the default 10 ms to queue its step, the steps of a phase still share a
#: batch (with 10 ms and two turns, a phase on a busy machine could make no batch).
WINDOW_TURNS = 8
WINDOW_GATHER_SECONDS = 1.0


class _FirstRowsPosition(_BatchedForward):
    def positions(self, batch: Sequence[_Job]) -> list[int]:
        return [batch[0].cache.positions] * len(batch)


class BatchTakesTheFirstRowsPosition(BatchingTransformersShardEngine):
    """Every row of a batch is rotated to the position of the batch's first session."""

    ENGINE_NAME: ClassVar[str] = "BatchTakesTheFirstRowsPosition"
    BUG: ClassVar[str] = "a batch's rows take the rotary position of its first row's session, not their own"
    #: The properties a run that finds the bug reports it by.
    PROPERTIES: ClassVar[tuple[str, ...]] = ("§3 determinism",)
    FORWARD = _FirstRowsPosition

    def __init__(self, model: Any = None, *, gather_seconds: float = WINDOW_GATHER_SECONDS, **options: Any) -> None:
        super().__init__(model, gather_seconds=gather_seconds, **options)


class _CancelledMeanwhile(Exception):
    """The step's session was cancelled while the step was in the batch."""


class _LiveRowsInOrder(_BatchedForward):
    def deliver(self, batch: Sequence[_Job], produced: Sequence[Produced]) -> None:
        live = [job for job in batch if not job.cancelled]
        for job, output in zip(live, produced, strict=False):
            job.outcome = (_SessionCache(job.cache.kv, job.cache.positions + 1), output)
        for job in batch:
            if job.cancelled:
                job.error = _CancelledMeanwhile()


class CancelShiftsTheBatchsRows(BatchingTransformersShardEngine):
    """A cancel lands while its session's step is in the batch, and the rows after it shift."""

    ENGINE_NAME: ClassVar[str] = "CancelShiftsTheBatchsRows"
    BUG: ClassVar[str] = (
        "a cancel does not wait for its session's step in the batch, whose rows then go to the "
        "steps still live in order: each step after the cancelled one gets the row before its own"
    )
    #: The shifted rows, or, as the threads fall, a phase that no order of its calls explains:
    #: the cancelled step answers CANCELLED "while it ran".
    PROPERTIES: ClassVar[tuple[str, ...]] = ("§3 determinism", "§2 linearizability")
    FORWARD = _LiveRowsInOrder

    def __init__(self, model: Any = None, *, gather_seconds: float = WINDOW_GATHER_SECONDS, **options: Any) -> None:
        super().__init__(model, gather_seconds=gather_seconds, **options)

    def prefill(self, request: PrefillRequest) -> StepResult:
        try:
            return super().prefill(request)
        except _CancelledMeanwhile:
            return self._cancelled(request)

    def decode(self, request: DecodeRequest) -> StepResult:
        try:
            return super().decode(request)
        except _CancelledMeanwhile:
            return self._cancelled(request)

    @staticmethod
    def _cancelled(request: PrefillRequest | DecodeRequest) -> StepResult:
        where = f"step {request.step} of session {request.session_id!r} epoch {request.epoch}"
        return refusal(StatusCode.CANCELLED, f"{where}: cancelled while it ran")

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        with self._batches.arrival():
            # The bug's window, marked as racy.py's engines mark theirs: in a lane of the kit's,
            # the cancel gives the other lanes turns until its session's step is queued, and is
            # in the door meanwhile, so the batch waits for it.
            for _ in range(WINDOW_TURNS):
                if not in_parallel_phase() or self._queued(session_id):
                    break
                yield_point()
            return self._cancel_queued_or_wait(session_id, epoch)

    def _queued(self, session_id: str) -> bool:
        with self._changed:
            return self._in_flight.get(session_id) in self._batches.pending

    def _cancel_queued_or_wait(self, session_id: str, epoch: int) -> StructuredStatus:
        with self._changed:
            job = self._in_flight.get(session_id)
            if job is None or job not in self._batches.pending:  # not queued: it waits, as it should
                self._wait_for_its_step(session_id)
                return SessionEngine.cancel(self, session_id, epoch)
            status = SessionEngine.cancel(self, session_id, epoch)
            job.cancelled = status.ok
            return status


BATCHING_PLANTED: tuple[type[BatchingTransformersShardEngine], ...] = (
    BatchTakesTheFirstRowsPosition,
    CancelShiftsTheBatchsRows,
)
