"""``BatchingTransformersShardEngine``: the transformers engine with a scheduler thread that
runs the one-token steps of different sessions as one batched forward, as vLLM's and
SGLang's schedulers batch their decodes.

Calls from several threads each take the engine's lock for their lifecycle checks (contract
§2, the base's), and a one-token step of a session that continues its epoch is then queued
for the scheduler instead of run; the caller gives the lock up while it waits, so other
calls get in meanwhile and queue theirs. The scheduler takes what is queued once every call
in the door has queued its step or returned (or after ``GATHER_SECONDS``: a call may be
slow to get in), at most ``max_sessions`` steps, and runs them as one **ragged batch**: the
norms, the query/key/value and output projections, the feed-forward and the LM head run on
a ``(batch, 1, hidden)`` tensor, each row with its own session's rotary position; the
attention runs row by row against each session's own ``DynamicCache``, whose lengths
differ. Steps of several tokens (a prefill), a session's first step and a restart run at
once in the caller, as in ``TransformersShardEngine``.

A call for a session whose step is in the batch waits until that step is done: a cancel,
a release, a restart or a retry never lands in the middle of it. Steps in flight count
towards the KV budget from the moment they are admitted. The batch's timing decides only
which steps share a forward, never an answer: a row's values depend on its session's
history alone (within the engine's tolerance: PyTorch's kernels may sum in another order
for another batch size).

The scheduler thread starts with a queued step and ends once nothing has been queued for
``IDLE_THREAD_SECONDS`` (the next step starts it again); it also stops when the engine is
closed (``close()``, or ``with engine:``), garbage-collected, or when the interpreter's
main thread ends. An engine dropped without ``close()`` thus leaves no thread, however
long the collector takes to reach it: the kit drops engines by the hundred (a fresh one for
each run of a phase), and engines in reference cycles wait for the collector's oldest
generation, which at one seed left 253 scheduler threads alive until the process could
start no more.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardkit._core.lane_context import yield_point
from shardkit.contract import DecodeRequest, LoadRequest, PrefillRequest, Role, StepResult, StructuredStatus
from shardkit.engines._checks import is_tolerance
from shardkit.engines.base import Produced, StepInput, one_call_at_a_time
from shardkit.engines.transformers_llama import (
    TransformersShardEngine,
    _import,
    _SessionCache,
    _to_numpy,
    _to_torch,
)

__all__ = ["BatchingTransformersShardEngine", "SchedulerClosed"]

#: How long the scheduler waits, by default, for a call in the door to queue its step.
GATHER_SECONDS = 0.01
#: How long the scheduler thread lives with nothing queued (and the longest it waits between
#: two looks at whether the engine was closed or dropped).
IDLE_THREAD_SECONDS = 0.2


class SchedulerClosed(RuntimeError):
    """A step was queued on (or waited for) a batching engine whose scheduler was closed."""


@dataclass(eq=False)
class _Job:
    """One queued one-token step: its session, cache and input, and what became of it."""

    session_id: str
    cache: _SessionCache
    step: StepInput
    outcome: tuple[_SessionCache, Produced] | None = None
    error: BaseException | None = None
    done: bool = False
    #: Set by a cancel that does not wait for the step (a planted bug's; see _planted/batching.py).
    cancelled: bool = False


@dataclass(eq=False)
class _Batches:
    """The queue and the scheduler thread. It holds no reference to its engine, so that an
    engine dropped is collected and stops the thread (``weakref.finalize``)."""

    changed: threading.Condition
    run: Callable[[list[_Job]], None]
    max_batch: int
    gather_seconds: float
    pending: list[_Job] = field(default_factory=list)
    #: Calls in the engine's door: entered, and neither queued a step, returned nor waiting.
    arriving: int = 0
    arrivals: threading.Lock = field(default_factory=threading.Lock)
    stopping: bool = False
    thread: threading.Thread | None = None
    #: How many batches ran, and how many steps they held: ``batch_sizes()``.
    sizes: list[int] = field(default_factory=list)

    @contextmanager
    def arrival(self) -> Iterator[None]:
        """A call in the door: the scheduler waits for its step (or its return) before it runs
        a batch. In the kit's parallel phases the lanes' calls meet here (``yield_point``), so
        that calls that overlap share a batch on every run, not only when the machine
        schedules them close enough; elsewhere ``yield_point`` returns at once."""
        self._count(+1)
        try:
            yield_point()
            yield
        finally:
            self._count(-1)
            # Only a scheduler with steps queued waits for the door to empty: waking an idle
            # one costs each call a thread switch.
            if self.pending:
                with self.changed:
                    self.changed.notify_all()

    @contextmanager
    def away(self) -> Iterator[None]:
        """The calling thread waits on something other than the door: it stops counting."""
        self._count(-1)
        try:
            yield
        finally:
            self._count(+1)

    def _count(self, change: int) -> None:
        with self.arrivals:
            self.arriving += change

    def submit(self, job: _Job) -> None:
        """Queue ``job`` and wait until the scheduler has run it; the caller holds ``changed``'s lock."""
        if self.stopping:
            raise SchedulerClosed("the batching engine was closed; its scheduler takes no more steps")
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="shardkit-batching-scheduler")
            self.thread.start()
        self.pending.append(job)
        self.changed.notify_all()
        with self.away():
            self.changed.wait_for(lambda: job.done)

    def abandon(self) -> None:
        """Stop the thread at its next look (within ``IDLE_THREAD_SECONDS``): what the garbage
        collector calls, anywhere and while any lock is held, so it takes no lock itself and
        waits for nothing. (A join there deadlocked: the collector ran in a starting thread
        that held the lock the scheduler's own exit takes.)"""
        self.stopping = True

    def stop(self) -> None:
        """Stop the thread now and wait until it has ended."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        while True:
            with self.changed:
                batch = self._next_batch()
            if batch is None:
                return
            try:
                self.run(batch)
            except BaseException as error:  # the callers re-raise it, each in its own thread
                for job in batch:
                    job.error = job.error or error
            with self.changed:
                self.sizes.append(len(batch))
                for job in batch:
                    job.done = True
                self.changed.notify_all()

    def _next_batch(self) -> list[_Job] | None:
        """The steps to run next (None: end the thread), once every call in the door has
        queued its step or left, the batch is full, or ``gather_seconds`` passed since the
        first."""
        first_queued: float | None = None
        idle_since: float | None = None
        while True:
            if self.stopping or not threading.main_thread().is_alive():
                self.stopping = True
                for job in self.pending:
                    job.error, job.done = SchedulerClosed("the batching engine was closed with this step queued"), True
                self.pending.clear()
                self.changed.notify_all()
                return None
            if not self.pending:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= IDLE_THREAD_SECONDS:
                    self.thread = None  # submit starts another, under this lock
                    return None
                first_queued = None
                self.changed.wait(IDLE_THREAD_SECONDS - (now - idle_since))
                continue
            idle_since = None
            first_queued = time.monotonic() if first_queued is None else first_queued
            waited = time.monotonic() - first_queued
            if self.arriving <= 0 or len(self.pending) >= self.max_batch or waited >= self.gather_seconds:
                batch, self.pending = self.pending[: self.max_batch], self.pending[self.max_batch :]
                return batch
            self.changed.wait(min(self.gather_seconds - waited, IDLE_THREAD_SECONDS))


class _BatchedForward:
    """The model's side of a batch: a ragged batched forward of one-token steps through the
    loaded layers (no reference to the engine, which the scheduler thread must not hold)."""

    def __init__(self, model: Any, layers: Sequence[Any], role: str, dtype: str, torch_dtype: Any) -> None:
        self.model, self.layers, self.role, self.dtype, self.torch_dtype = model, layers, role, dtype, torch_dtype

    def positions(self, batch: Sequence[_Job]) -> list[int]:
        """Each row's rotary position: the next position of its own session."""
        return [job.cache.positions for job in batch]

    def __call__(self, batch: list[_Job]) -> None:
        torch = _import("torch")
        llama = _import("transformers.models.llama.modeling_llama")
        model = self.model.model
        try:
            with torch.no_grad():
                if batch[0].step.token_ids is not None:
                    ids = [list(job.step.token_ids or ()) for job in batch]
                    x = model.embed_tokens(torch.tensor(ids, dtype=torch.long))
                else:
                    x = torch.stack([_to_torch(torch, job.step.rows(), self.torch_dtype) for job in batch])
                positions = torch.tensor([[position] for position in self.positions(batch)])
                cos, sin = model.rotary_emb(x, positions)
                rows = len(batch)
                for layer in self.layers:
                    attention = layer.self_attn
                    shape = (rows, 1, -1, attention.head_dim)
                    normed = layer.input_layernorm(x)
                    query = attention.q_proj(normed).view(shape).transpose(1, 2)
                    key = attention.k_proj(normed).view(shape).transpose(1, 2)
                    value = attention.v_proj(normed).view(shape).transpose(1, 2)
                    query, key = llama.apply_rotary_pos_emb(query, key, cos, sin)
                    attended = []
                    for row, job in enumerate(batch):  # ragged: each session's own cache and length
                        keys, values = job.cache.kv.update(
                            key[row : row + 1], value[row : row + 1], attention.layer_idx
                        )
                        out, _ = llama.eager_attention_forward(
                            attention, query[row : row + 1], keys, values, None, scaling=attention.scaling
                        )
                        attended.append(out)
                    x = x + attention.o_proj(torch.cat(attended).reshape(rows, 1, -1))
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
                if self.role in ("tail", "full"):
                    produced = [
                        _to_numpy(logits.float(), "float32") for logits in self.model.lm_head(model.norm(x))[:, -1]
                    ]
                else:
                    produced = [_to_numpy(rows_of_one, self.dtype) for rows_of_one in x]
        except BaseException:
            for job in batch:
                job.cache.kv.crop(job.cache.positions)  # each session stays as it was
            raise
        self.deliver(batch, produced)

    def deliver(self, batch: Sequence[_Job], produced: Sequence[Produced]) -> None:
        """Hand each row back to the step it was computed for."""
        for job, output in zip(batch, produced, strict=True):
            job.outcome = (_SessionCache(job.cache.kv, job.cache.positions + 1), output)


class BatchingTransformersShardEngine(TransformersShardEngine):
    """``TransformersShardEngine`` whose one-token steps of different sessions run as one
    batched forward on a background scheduler thread (see the module docstring). Its
    options are ``TransformersShardEngine``'s, and ``gather_seconds``: how long the
    scheduler waits for a call in the door to queue its step before it runs the batch
    without it. ``batch_sizes()`` tells how the steps were batched. Close it (``close()`` or
    ``with``) to stop the thread at once; an engine dropped stops it when it is collected."""

    ENGINE_NAME: ClassVar[str] = "BatchingTransformersShardEngine"
    #: What runs a batch: ``_BatchedForward`` or a planted bug's subclass of it.
    FORWARD: ClassVar[type[_BatchedForward]] = _BatchedForward

    def __init__(self, model: Any = None, *, gather_seconds: float = GATHER_SECONDS, **options: Any) -> None:
        if not is_tolerance(gather_seconds):
            message = f"{self.ENGINE_NAME} gather_seconds must be a finite float >= 0, got {gather_seconds!r}"
            raise ValueError(message)
        super().__init__(model, **options)
        self._changed = threading.Condition(self._calls)
        self._batches = _Batches(self._changed, self._run_unloaded, self.spec.max_sessions, float(gather_seconds))
        self._finalizer = weakref.finalize(self, self._batches.abandon)
        #: The steps queued or running, by session: a call for one of them waits.
        self._in_flight: dict[str, _Job] = {}
        #: The session whose step is being admitted, and whether it continues its epoch.
        self._admitting: tuple[str, bool] | None = None

    @staticmethod
    def _run_unloaded(batch: list[_Job]) -> None:
        raise SchedulerClosed("a step was queued before load")

    def close(self) -> None:
        """Stop the scheduler thread (a step still queued fails with ``SchedulerClosed``)."""
        self._finalizer.detach()
        self._batches.stop()

    def __enter__(self) -> BatchingTransformersShardEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batch_sizes(self) -> list[int]:
        """The size of every batch the scheduler ran, in order."""
        with self._changed:
            return list(self._batches.sizes)

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        super().load_layers(request, layers, role)
        self._batches.run = self.FORWARD(self.model, self._layers, role, self.spec.dtype, self._torch_dtype)

    # --- the calls: each waits while its session has a step in the batch ---------------------

    def prefill(self, request: PrefillRequest) -> StepResult:
        with self._batches.arrival():
            return self._admitted(request, super().prefill)

    def decode(self, request: DecodeRequest) -> StepResult:
        with self._batches.arrival():
            return self._admitted(request, super().decode)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        with self._batches.arrival(), self._changed:
            self._wait_for_its_step(session_id)
            return super().cancel(session_id, epoch)

    def release(self, session_id: str) -> StructuredStatus:
        with self._batches.arrival(), self._changed:
            self._wait_for_its_step(session_id)
            return super().release(session_id)

    @one_call_at_a_time
    def _admitted(self, request: PrefillRequest | DecodeRequest, call: Callable[[Any], StepResult]) -> StepResult:
        self._wait_for_its_step(request.session_id)
        session = self._sessions.get(request.session_id)
        self._admitting = (request.session_id, session is not None and session.epoch == request.epoch)
        try:
            return call(request)
        finally:
            self._admitting = None
            if self._in_flight.pop(request.session_id, None) is not None:
                self._changed.notify_all()

    def _wait_for_its_step(self, session_id: str) -> None:
        if session_id in self._in_flight:
            with self._batches.away():
                self._changed.wait_for(lambda: session_id not in self._in_flight)

    def _kv_tokens_used(self) -> int:
        # A queued step was admitted: its token counts from then on.
        return super()._kv_tokens_used() + len(self._in_flight)

    def forward(self, cache: _SessionCache, step: StepInput) -> tuple[_SessionCache, Produced]:
        admitting, self._admitting = self._admitting, None
        if admitting is None or not admitting[1] or len(step) != 1:
            return super().forward(cache, step)
        job = _Job(admitting[0], cache, step)
        self._in_flight[job.session_id] = job
        self._batches.submit(job)
        if job.error is not None:
            raise job.error
        assert job.outcome is not None
        return job.outcome
