"""Planted bugs that engines written outside this project shipped (issue 14): a decode
path that goes wrong late, prefix caches and session tables keyed on too little, bookkeeping
that survives a crash or a release, counts off at a block boundary, narrow epochs. Each
wraps the fake like the engines of ``shardkit._planted``, which lists them in ``PLANTED``
(``REACH_PLANTED`` here), and states its BUG, PROPERTY, ROLE and an executable MINIMAL.
Every size they depend on (vocabulary, KV budget) is read from the wrapped engine's
capabilities; the constants of their own (a window of 20 tokens, 32-bit epochs) are the
bug's, not the contract's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, TypeVar

from shardkit import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    FakeShardEngine,
    Fault,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit._planted.base import PlantedEngine, StepRequest
from shardkit._planted.minimal import KvTokens, cancel, decode, fault, prefill, release
from shardkit.contract import EPOCH_STEP_LIMIT

__all__ = [
    "REACH_PLANTED",
    "CancelMatchesIdPrefix",
    "DecodeFastPathCorruptsAfter20",
    "DecodeWindowsTheLast20Tokens",
    "EpochStoredIn32Bits",
    "KvBlockBoundaryMiscounted",
    "PrefixCacheKeyedOnFirst3Tokens",
    "PressureLeaksReleasedTokens",
    "RestartKeepsCancelledFlag",
    "SessionSurvivesCrash",
    "SessionsKeyedOnIdPrefix",
]

T = TypeVar("T")


@dataclass
class _History:
    """One session epoch's inputs as the engine accepted them, chunk by step: an exact retry
    writes the same chunk again instead of appending it."""

    epoch: int
    chunks: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def tokens(self) -> tuple[int, ...]:
        return tuple(token for step in sorted(self.chunks) for token in self.chunks[step])


def _tokens_of(request: StepRequest) -> tuple[int, ...]:
    """A request's input as token ids (a bundle the kit sends names its rows by its sideband)."""
    if request.token_ids is not None:
        return request.token_ids
    assert request.bundle is not None
    return request.bundle.token_id_sideband or ()


def _echoing(request: StepRequest, result: StepResult) -> StepResult:
    """``result`` with its bundle echoing ``request``'s own ids: the bug is in how the engine
    keys its table, not in its answer's header (which the kit would catch on its own)."""
    if isinstance(result.output, BoundaryBundle):
        output = replace(result.output, session_id=request.session_id, epoch=request.epoch, step=request.step)
        return replace(result, output=output)
    return result


class _Tracking(PlantedEngine):
    """Keeps each live session's accepted history, for bugs that act on it."""

    def __init__(self) -> None:
        super().__init__()
        self.histories: dict[str, _History] = {}

    def _accepted(self, request: StepRequest, result: StepResult) -> None:
        if not result.status.ok:
            return
        if request.step == 0 and isinstance(request, PrefillRequest):
            self.histories[request.session_id] = _History(request.epoch)
        history = self.histories.get(request.session_id)
        if history is not None and history.epoch == request.epoch:
            history.chunks[request.step] = _tokens_of(request)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.histories.pop(session_id, None)  # its cache is freed: nothing left to serve from
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.histories.pop(session_id, None)
        return self.inner.release(session_id)


class DecodeFastPathCorruptsAfter20(PlantedEngine):
    BUG = "from a session's 20th successful decode on, the decode fast path answers a wrong token (prefill is right)"
    PROPERTY = "§3 determinism"
    DECODES: ClassVar[int] = 20
    # One prefill of 21 tokens: the oracle's twin fed one token per decode makes 20 decodes
    # and disagrees with the recompute in one prefill. (A twin that decoded like the engine
    # under test would agree with it, and this bug went unfound at 5 000 examples.)
    MINIMAL = (prefill("a", tokens=(0,) * (DECODES + 1)),)

    def __init__(self) -> None:
        super().__init__()
        #: Per session epoch: the decodes served, and the last one's step and answer (a retry
        #: of it gets that answer again, as contract rule 6 asks; it is not a new decode).
        self.decodes: dict[tuple[str, int], tuple[int, int, StepResult]] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.step == 0:
            self.decodes.pop((request.session_id, request.epoch), None)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if not result.status.ok:
            return result
        key = (request.session_id, request.epoch)
        served, last_step, last_answer = self.decodes.get(key, (0, -1, result))
        if request.step == last_step:
            return last_answer
        answer = self._shift(result) if served + 1 >= self.DECODES else result
        self.decodes[key] = (served + 1, request.step, answer)
        return answer

    def release(self, session_id: str) -> StructuredStatus:
        self.decodes = {key: value for key, value in self.decodes.items() if key[0] != session_id}
        return self.inner.release(session_id)


class PrefixCacheKeyedOnFirst3Tokens(PlantedEngine):
    BUG = "a prefix cache keyed on a prompt's first 3 tokens serves another prompt's answer when they differ later"
    PROPERTY = "§3 determinism"
    PREFIX: ClassVar[int] = 3
    MINIMAL = (prefill("a", tokens=(0, 0, 0)), prefill("b", tokens=(0, 0, 0, 1), note="the same first 3 tokens"))

    def __init__(self) -> None:
        super().__init__()
        self.prefix_cache: dict[tuple[int, ...], StepResult] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        tokens = request.token_ids
        if not (result.status.ok and request.step == 0 and tokens is not None and len(tokens) >= self.PREFIX):
            return result
        cached = self.prefix_cache.setdefault(tokens[: self.PREFIX], result)
        return replace(result, output=cached.output)


class _Scratch(_Tracking):
    """Keeps each live session's history, and a second fake loaded as the engine is, to
    compute what the engine answers for a history it gets wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = FakeShardEngine()

    def load(self, request: LoadRequest) -> LoadResult:
        loaded = super().load(request)
        if loaded.status.ok:
            self.scratch.load(request)
        return loaded

    def answer_for(self, result: StepResult, history: tuple[int, ...]) -> StepResult:
        """``result`` with the output the model gives after ``history`` (its last token the one it answers)."""
        if not history:
            return result
        computed = self.scratch.prefill(PrefillRequest("scratch", 0, 0, token_ids=history))
        self.scratch.release("scratch")
        return replace(result, output=computed.output)

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        """The history the engine wrongly answers ``request`` of ``session`` for, whose own
        history is ``tokens``; None: its own. A planted bug says it here and calls ``served``."""
        return None

    def served(self, request: StepRequest, result: StepResult) -> StepResult:
        """``result``, answered for ``wrong_history`` where the bug gives one."""
        history = self.histories.get(request.session_id)
        if not result.status.ok or history is None:
            return result
        tokens = history.tokens()
        wrong = self.wrong_history(request.session_id, tokens, request)
        return result if wrong is None or wrong == tokens else self.answer_for(result, wrong)

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        self._accepted(request, result)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        self._accepted(request, result)
        return result



class DecodeWindowsTheLast20Tokens(_Scratch):
    BUG = "the decode fast path computes its token from the last 20 tokens only: wrong once a history is longer"
    PROPERTY = "§3 determinism"
    # One prefill of 21 tokens: the twin fed one token per decode windows its last decode and
    # disagrees with the recompute in one prefill; where the random chunking decodes past the
    # window, the pipeline of twins (a head and a tail, without the fast path) disagrees first.
    ALSO = ("§3 composition",)
    WINDOW: ClassVar[int] = 20
    MINIMAL = (prefill("a", tokens=(1, *(0,) * 20), note="21 tokens: the last decode's window drops the first"),)

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        history = self.histories.get(request.session_id)
        # The fast path is the full model's (token ids in, a token out): a shard of a split
        # model decodes the slow way, so the kit's pipeline of twins computes it right.
        if not (result.status.ok and isinstance(result.output, TokenOutput) and request.token_ids) or history is None:
            return result
        tokens = history.tokens()
        if len(tokens) <= self.WINDOW:
            return result
        # What the fast path computes: a fresh history of the window alone.
        return self.answer_for(result, tokens[-self.WINDOW :])


class _Survivors:
    """Session bookkeeping kept outside an engine (a table in shared memory, say): what one
    engine leaves when its process dies, for the next engine that loads to find."""

    def __init__(self) -> None:
        self.table: dict[str, _History] | None = None


class SessionSurvivesCrash(_Tracking):
    BUG = (
        "the session table survives a crash: after the restart a decode of a pre-crash session is served, not NOT_FOUND"
    )
    PROPERTY = "§2 rule 3"
    FAULTS = "crash"
    MINIMAL = (
        prefill("a"),
        fault("crash", 1),
        decode("a", step=1, note="the process dies"),
        decode("a", step=1, note="after the restart: a is unknown"),
    )
    #: Shared by every engine of this class in the process, as the table outlives a process.
    #: The kit loads a fresh engine as soon as one dies, and that load takes the table, so a
    #: table never reaches an engine of a later run. (A worker process of an isolated run
    #: takes it to its grave: this bug shows in-process only.)
    SURVIVORS: ClassVar[_Survivors] = _Survivors()

    def __init__(self) -> None:
        super().__init__()
        self.ghosts: dict[str, _History] = {}

    def load(self, request: LoadRequest) -> LoadResult:
        loaded = super().load(request)
        self.ghosts, self.SURVIVORS.table = self.SURVIVORS.table or {}, None
        return loaded

    def _dying(self, call: Callable[[], T]) -> T:
        """``call()``; if the process dies in it, the table is left behind as it stands."""
        try:
            return call()
        except BaseException:
            self.SURVIVORS.table = dict(self.histories)
            raise

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self._dying(lambda: self.inner.prefill(request))
        if result.status.ok and request.step == 0:
            self.ghosts.pop(request.session_id, None)
        self._accepted(request, result)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self._dying(lambda: self.inner.decode(request))
        ghost = self.ghosts.get(request.session_id)
        if result.status.code is StatusCode.NOT_FOUND and ghost is not None and ghost.epoch == request.epoch:
            # The table says the session exists: its cache is rebuilt from the recorded inputs.
            del self.ghosts[request.session_id]
            self.inner.prefill(PrefillRequest(request.session_id, request.epoch, 0, token_ids=ghost.tokens()))
            result = self.inner.decode(replace(request, step=1))
        self._accepted(request, result)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self.ghosts.pop(session_id, None)
        return self._dying(lambda: super(SessionSurvivesCrash, self).cancel(session_id, epoch))

    def release(self, session_id: str) -> StructuredStatus:
        self.ghosts.pop(session_id, None)
        return self._dying(lambda: super(SessionSurvivesCrash, self).release(session_id))


class PressureLeaksReleasedTokens(PlantedEngine):
    BUG = "once a memory_pressure fault was injected, release no longer takes the freed tokens off the count"
    PROPERTY = "§2 metrics"
    FAULTS = "memory_pressure"
    MINIMAL = (fault("memory_pressure", 1, note="a limit of 1 token"), prefill("a"), release("a"))

    def __init__(self) -> None:
        super().__init__()
        self.pressured = False
        self.leaked = 0

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        status = self.inner.inject_fault(fault)
        self.pressured |= status.ok and fault.kind == "memory_pressure"
        return status

    def release(self, session_id: str) -> StructuredStatus:
        before = self.inner.metrics().kv_tokens
        status = self.inner.release(session_id)
        if self.pressured:
            self.leaked += before - self.inner.metrics().kv_tokens
        return status

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.leaked)


class CancelMatchesIdPrefix(PlantedEngine):
    BUG = "cancel looks sessions up by id prefix: cancelling 'req-0001' cancels 'req-00010' too"
    PROPERTY = "§2 metrics"  # the other session's tokens are freed
    ALSO = ("§2 rule 5",)  # ...and it answers CANCELLED
    MINIMAL = (prefill("req-00010"), prefill("req-0001"), cancel("req-0001"))

    def __init__(self) -> None:
        super().__init__()
        self.epochs: dict[str, int] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.step == 0:
            self.epochs[request.session_id] = request.epoch
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            for other, other_epoch in self.epochs.items():
                if other != session_id and other.startswith(session_id):
                    self.inner.cancel(other, other_epoch)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.epochs.pop(session_id, None)
        return self.inner.release(session_id)


class SessionsKeyedOnIdPrefix(PlantedEngine):
    BUG = "sessions are keyed on the first 8 characters of their id: 'req-0001' and 'req-0001/retry' share one"
    PROPERTY = "§2 metrics"  # the same first chunk: answered as a retry of the other session's step
    ALSO = (
        "§2 rule 8",  # another first chunk: refused as out of order
        "§2 rule 3",
        "§2 cancel",  # cancel('req-00010') cancels the live 'req-0001', which is due NOT_FOUND
    )
    KEY_LENGTH: ClassVar[int] = 8
    MINIMAL = (prefill("req-0001"), prefill("req-0001/retry", note="the same first 8 characters"))

    def _key(self, session_id: str) -> str:
        return session_id[: self.KEY_LENGTH]

    def _keyed(self, request: StepRequest) -> StepRequest:
        key = self._key(request.session_id)
        bundle = request.bundle and replace(request.bundle, session_id=key)
        return replace(request, session_id=key, bundle=bundle)

    def prefill(self, request: PrefillRequest) -> StepResult:
        return _echoing(request, self.inner.prefill(self._keyed(request)))  # type: ignore[arg-type]

    def decode(self, request: DecodeRequest) -> StepResult:
        return _echoing(request, self.inner.decode(self._keyed(request)))  # type: ignore[arg-type]

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        return self.inner.cancel(self._key(session_id), epoch)

    def release(self, session_id: str) -> StructuredStatus:
        return self.inner.release(self._key(session_id))


class RestartKeepsCancelledFlag(PlantedEngine):
    BUG = "a restart at a higher epoch keeps the cancelled flag: the session answers CANCELLED until released"
    PROPERTY = "§2 rule 8"  # the restart is refused where an OK is due
    MINIMAL = (prefill("a"), cancel("a"), prefill("a", epoch=1, note="restart"))

    def __init__(self) -> None:
        super().__init__()
        #: The epoch each session was cancelled at, until it is released.
        self.cancelled: dict[str, int] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        # The engine behind it checks everything in the contract's order; only a restart of a
        # cancelled session, which it accepts, is then answered with the stale flag.
        result = self.inner.prefill(request)
        epoch = self.cancelled.get(request.session_id)
        if result.status.ok and request.step == 0 and epoch is not None and request.epoch > epoch:
            status = StructuredStatus(StatusCode.CANCELLED, f"session {request.session_id!r} was cancelled")
            return StepResult(status, CacheResult.MISS)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.cancelled[session_id] = epoch
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.cancelled.pop(session_id, None)
        return self.inner.release(session_id)


class KvBlockBoundaryMiscounted(PlantedEngine):
    BUG = (
        "the KV pool is two blocks of half the budget each; a chunk written across the boundary "
        "loses one token from the count"
    )
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a", tokens=KvTokens(1, 2, extra=1), note="crosses max_kv_tokens//2"),)

    def __init__(self) -> None:
        super().__init__()
        self.half = 0
        self.lost: dict[str, int] = {}
        self.last: dict[str, tuple[int, int]] = {}

    def load(self, request: LoadRequest) -> LoadResult:
        loaded = super().load(request)
        self.half = self.inner.capabilities().max_kv_tokens // 2  # the pool as loaded
        return loaded

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._count(request, self.inner.prefill)  # type: ignore[arg-type]

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._count(request, self.inner.decode)  # type: ignore[arg-type]

    def _count(self, request: StepRequest, call: Callable[[StepRequest], StepResult]) -> StepResult:
        before = self.inner.metrics().kv_tokens
        result = call(request)
        key = (request.epoch, request.step)
        if not result.status.ok or self.last.get(request.session_id) == key:
            return result  # refused, or an exact retry: nothing written
        self.last[request.session_id] = key
        end = self.inner.metrics().kv_tokens
        start = before
        if request.step == 0 and isinstance(request, PrefillRequest):
            self.lost.pop(request.session_id, None)  # an opening or a restart: counted afresh
            start = end - len(_tokens_of(request))  # a restart freed the old epoch's tokens first
        if start < self.half < end:
            self.lost[request.session_id] = self.lost.get(request.session_id, 0) + 1
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.lost.pop(session_id, None)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.lost.pop(session_id, None)
        self.last.pop(session_id, None)
        return self.inner.release(session_id)

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens - sum(self.lost.values()))


class EpochStoredIn32Bits(PlantedEngine):
    BUG = "epochs are stored in 32 bits: a restart at epoch 2**32 lands on epoch 0 and is refused as out of order"
    PROPERTY = "§2 rule 8"  # the restart is refused where an OK is due
    ALSO = ("§2 rule 4",)  # after a wrapped restart, an epoch-0 request is taken as current
    BITS: ClassVar[int] = 32
    MINIMAL = (prefill("a", tokens=(0,)), prefill("a", epoch=2**32, tokens=(1,), note="restart: wraps to epoch 0"))

    def _stored(self, epoch: int) -> int:
        """The epoch as the engine keeps it; one outside [0, 2**63) is refused before it is
        stored (the range check is right: only the storage is too narrow)."""
        return epoch % 2**self.BITS if 0 <= epoch < EPOCH_STEP_LIMIT else epoch

    def _wrapped(self, request: StepRequest) -> StepRequest:
        epoch = self._stored(request.epoch)
        bundle = request.bundle and replace(request.bundle, epoch=epoch)
        return replace(request, epoch=epoch, bundle=bundle)

    def prefill(self, request: PrefillRequest) -> StepResult:
        return _echoing(request, self.inner.prefill(self._wrapped(request)))  # type: ignore[arg-type]

    def decode(self, request: DecodeRequest) -> StepResult:
        return _echoing(request, self.inner.decode(self._wrapped(request)))  # type: ignore[arg-type]

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        return self.inner.cancel(session_id, self._stored(epoch))


REACH_PLANTED: tuple[type[PlantedEngine], ...] = (
    DecodeFastPathCorruptsAfter20,
    PrefixCacheKeyedOnFirst3Tokens,
    DecodeWindowsTheLast20Tokens,
    SessionSurvivesCrash,
    PressureLeaksReleasedTokens,
    CancelMatchesIdPrefix,
    SessionsKeyedOnIdPrefix,
    RestartKeepsCancelledFlag,
    KvBlockBoundaryMiscounted,
    EpochStoredIn32Bits,
)
