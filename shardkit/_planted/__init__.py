"""Planted-bug engines: each wraps the fake and breaks exactly one rule or property.

Every engine states what it breaks, which property the kit must name, the role
it needs, and its minimal failing sequence as steps that run (``MINIMAL``, see
``shardkit._planted.minimal``), so the self-tests can check finding, shrinking and
that the stated sequence really fails, and fails no more once any step is dropped.

Private: they ship in the package so that ``shardkit bench`` measures them from an
installed wheel too; the self-tests import them as ``tests.planted``, which
re-exports them (``tests.planted:Name`` targets keep working).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from shardkit import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    Fault,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit._planted.base import DelegatingEngine as DelegatingEngine
from shardkit._planted.base import PlantedEngine as PlantedEngine
from shardkit._planted.base import StepRequest as StepRequest
from shardkit._planted.base import names_its_property as names_its_property
from shardkit._planted.extreme import EXTREME_PLANTED
from shardkit._planted.extreme import LayerNormVarianceOverflows as LayerNormVarianceOverflows
from shardkit._planted.minimal import KvTokens, cancel, decode, fault, prefill, release
from shardkit._planted.reach import REACH_PLANTED
from shardkit._planted.reach import CancelMatchesIdPrefix as CancelMatchesIdPrefix
from shardkit._planted.reach import DecodeFastPathCorruptsAfter20 as DecodeFastPathCorruptsAfter20
from shardkit._planted.reach import DecodeWindowsTheLast20Tokens as DecodeWindowsTheLast20Tokens
from shardkit._planted.reach import EpochStoredIn32Bits as EpochStoredIn32Bits
from shardkit._planted.reach import KvBlockBoundaryMiscounted as KvBlockBoundaryMiscounted
from shardkit._planted.reach import PrefixCacheKeyedOnFirst3Tokens as PrefixCacheKeyedOnFirst3Tokens
from shardkit._planted.reach import PressureLeaksReleasedTokens as PressureLeaksReleasedTokens
from shardkit._planted.reach import RestartKeepsCancelledFlag as RestartKeepsCancelledFlag
from shardkit._planted.reach import SessionsKeyedOnIdPrefix as SessionsKeyedOnIdPrefix
from shardkit._planted.reach import SessionSurvivesCrash as SessionSurvivesCrash
from shardkit._planted.upstream import UPSTREAM_PLANTED
from shardkit._planted.upstream import AbortedIdStaysInTheTable as AbortedIdStaysInTheTable
from shardkit._planted.upstream import AbortOfAFinishedRequestKeepsItsBlocks as AbortOfAFinishedRequestKeepsItsBlocks
from shardkit._planted.upstream import CancelAfterTheFinalChunkLeaksAToken as CancelAfterTheFinalChunkLeaksAToken
from shardkit._planted.upstream import CropToZeroKeepsTheCache as CropToZeroKeepsTheCache
from shardkit._planted.upstream import DoubleFreeInflatesTheFreeCount as DoubleFreeInflatesTheFreeCount
from shardkit._planted.upstream import FullPromptMatchAnswersStaleLogits as FullPromptMatchAnswersStaleLogits
from shardkit._planted.upstream import PrefixCacheRestoresTheLastEntry as PrefixCacheRestoresTheLastEntry
from shardkit._planted.upstream import ReleaseAfterCancelFreesTwice as ReleaseAfterCancelFreesTwice
from shardkit._planted.upstream import ResetKeepsTheOldLength as ResetKeepsTheOldLength
from shardkit._planted.upstream import RestartReuseDropsAReusedToken as RestartReuseDropsAReusedToken
from shardkit._planted.upstream import ReusedSlotKeepsTheOldConversation as ReusedSlotKeepsTheOldConversation
from shardkit._planted.upstream import SharedPrefixFreedWithItsFirstOwner as SharedPrefixFreedWithItsFirstOwner
from shardkit._planted.upstream import StaleAbortHitsTheReusedId as StaleAbortHitsTheReusedId
from shardkit._planted.upstream import UnifiedCacheKeyedOnPosition as UnifiedCacheKeyedOnPosition


def _with_ids(request: StepRequest, epoch: int, step: int) -> StepRequest:
    bundle = request.bundle
    if bundle is not None:
        bundle = replace(bundle, epoch=epoch, step=step)
    return replace(request, epoch=epoch, step=step, bundle=bundle)


class StaleEpochAccepted(PlantedEngine):
    BUG = "serves a request whose epoch is lower than the session's, as if it were current"
    PROPERTY = "§2 rule 4"
    MINIMAL = (prefill("a", epoch=1, note="opens at epoch 1"), prefill("a", epoch=0, step=1, note="stale epoch"))
    CONTRACT_CHECK = "a stale epoch is ABORTED"

    def __init__(self) -> None:
        super().__init__()
        self.epochs: dict[str, int] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._serve(request, self.inner.prefill)  # type: ignore[arg-type]

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._serve(request, self.inner.decode)  # type: ignore[arg-type]

    def _serve(self, request: StepRequest, call: Callable[[StepRequest], StepResult]) -> StepResult:
        current = self.epochs.get(request.session_id)
        if current is not None and 0 <= request.epoch < current:
            request = _with_ids(request, current, request.step)
        result = call(request)
        if result.status.ok and request.step == 0:
            self.epochs[request.session_id] = request.epoch
        return result


class DecodeOfUnknownSessionServed(PlantedEngine):
    BUG = "a decode of an unknown session is served from a fresh cache instead of NOT_FOUND"
    PROPERTY = "§2 rule 3"
    MINIMAL = (decode("a", step=0),)
    CONTRACT_CHECK = "decode of an unknown session is NOT_FOUND/MISS"

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if result.status.code is StatusCode.NOT_FOUND:
            opened = _with_ids(request, request.epoch, 0)
            return self.inner.prefill(
                PrefillRequest(opened.session_id, opened.epoch, 0, opened.token_ids, opened.bundle)
            )
        return result


class ReleaseLeaksKvTokens(PlantedEngine):
    BUG = "release frees the slot but keeps counting the session's KV tokens"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), release("a"))
    CONTRACT_CHECK = "metrics return to zero after release"

    def __init__(self) -> None:
        super().__init__()
        self.leaked = 0

    def release(self, session_id: str) -> StructuredStatus:
        before = self.inner.metrics().kv_tokens
        status = self.inner.release(session_id)
        self.leaked += before - self.inner.metrics().kv_tokens
        return status

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.leaked)


class RetryAppliedTwice(PlantedEngine):
    BUG = "an exact retry of the last step is applied again, as the next step"
    PROPERTY = "§2 rule 6"
    MINIMAL = (prefill("a"), prefill("a", note="resent"))
    CONTRACT_CHECK = "a retry is idempotent"

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[str, StepRequest] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._serve(request, self.inner.prefill)  # type: ignore[arg-type]

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._serve(request, self.inner.decode)  # type: ignore[arg-type]

    def _serve(self, request: StepRequest, call: Callable[[StepRequest], StepResult]) -> StepResult:
        if self.last.get(request.session_id) == request:
            request = _with_ids(request, request.epoch, request.step + 1)
        result = call(request)
        if result.status.ok:
            self.last[request.session_id] = request
        return result


class MiddleDropsSideband(PlantedEngine):
    BUG = "a middle shard drops the token-id sideband instead of passing it through"
    PROPERTY = "§3 shape and range"
    MINIMAL = (prefill("a"),)
    ROLE = "middle"
    CONTRACT_CHECK = "a middle shard's outputs are well-formed"

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._drop(self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._drop(self.inner.decode(request))

    def _drop(self, result: StepResult) -> StepResult:
        output = result.output
        if isinstance(output, BoundaryBundle) and output.boundary_point == "post_middle_residual":
            return replace(result, output=replace(output, token_id_sideband=None))
        return result


class CancelLeaksKvTokens(PlantedEngine):
    BUG = "cancel marks the session cancelled but does not free its KV tokens"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), cancel("a"))

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, int] = {}

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        before = self.inner.metrics().kv_tokens
        status = self.inner.cancel(session_id, epoch)
        self.held[session_id] = self.held.get(session_id, 0) + before - self.inner.metrics().kv_tokens
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.held.pop(session_id, None)
        return self.inner.release(session_id)

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + sum(self.held.values()))


class OutputDependsOnChunking(PlantedEngine):
    BUG = "a prefill chunk of several tokens predicts another token than the same tokens fed one by one"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a", tokens=(0, 3)),)

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if request.token_ids is not None and len(request.token_ids) > 1:
            return self._shift(result)
        return result


class SessionStateBleeds(PlantedEngine):
    BUG = "a session's output depends on whether another session is live (a shared cache slot)"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a"), prefill("b"))

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._bleed(self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._bleed(self.inner.decode(request))

    def _bleed(self, result: StepResult) -> StepResult:
        return self._shift(result) if self.inner.metrics().active_sessions > 1 else result


class EvictsLiveSessions(PlantedEngine):
    BUG = "when every slot is taken, the oldest live session is evicted silently to make room"
    PROPERTY = "§2 rule 7"
    ALSO = ("§2 metrics",)  # an eviction that still ends refused shows only in the counts
    MINIMAL = (prefill("a"), prefill("b", tokens=KvTokens(), note="a is evicted"))

    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.code is StatusCode.RESOURCE_EXHAUSTED and self.order and request.step == 0:
            self.inner.release(self.order.pop(0))
            result = self.inner.prefill(request)
        if result.status.ok and request.session_id not in self.order:
            self.order.append(request.session_id)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        if session_id in self.order:
            self.order.remove(session_id)
        return self.inner.release(session_id)


class CrashesOnCancelOfNewerEpoch(PlantedEngine):
    BUG = "cancel at an epoch above the session's raises (an unhandled lookup) instead of NOT_FOUND"
    PROPERTY = "unexplained exception"
    MINIMAL = (prefill("a"), cancel("a", epoch=1))

    def __init__(self) -> None:
        super().__init__()
        self.epochs: dict[str, int] = {}  # its own record, not the fake's messages

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.step == 0:
            self.epochs[request.session_id] = request.epoch
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        known = self.epochs.get(session_id)
        if status.code is StatusCode.NOT_FOUND and known is not None and epoch > known:
            raise KeyError((session_id, epoch))
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.epochs.pop(session_id, None)
        return self.inner.release(session_id)


class RefusedPrefillLeavesTokens(PlantedEngine):
    BUG = "a prefill refused for capacity still leaves its tokens counted in the cache"
    PROPERTY = "§2 metrics"
    # One chunk over the budget on an empty engine is refused, and its tokens stay counted.
    MINIMAL = (prefill("a", tokens=KvTokens(extra=1), note="refused: over the budget"),)

    def __init__(self) -> None:
        super().__init__()
        self.partial = 0

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.code is StatusCode.RESOURCE_EXHAUSTED and request.token_ids is not None:
            self.partial += len(request.token_ids)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        self.partial = 0
        return self.inner.release(session_id)

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.partial)


class FailedCallsNotCounted(PlantedEngine):
    BUG = "decode_calls counts only successful decodes"
    PROPERTY = "§2 metrics"
    MINIMAL = (decode("a", step=0),)

    def __init__(self) -> None:
        super().__init__()
        self.failed = 0

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        self.failed += not result.status.ok
        return result

    def metrics(self) -> MetricsResult:
        metrics = self.inner.metrics()
        return replace(metrics, decode_calls=metrics.decode_calls - self.failed)


class MemoryPressureIgnored(PlantedEngine):
    BUG = "accepts a memory_pressure fault but keeps admitting tokens up to the old limit"
    PROPERTY = "§2 rule 7"
    MINIMAL = (fault("memory_pressure", 0), prefill("a"))

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        if fault.kind == "memory_pressure":
            self.claimed_limit = int(fault.value)
            return StructuredStatus(StatusCode.OK)
        return self.inner.inject_fault(fault)

    def capabilities(self) -> EngineCapabilities:
        caps = self.inner.capabilities()
        limit = getattr(self, "claimed_limit", None)
        return caps if limit is None else replace(caps, max_kv_tokens=limit)


class CancelledSessionStillServes(PlantedEngine):
    BUG = "a cancelled session still serves decodes (from a cache it claims to have freed)"
    PROPERTY = "§2 rule 5"
    MINIMAL = (prefill("a"), cancel("a"), decode("a", step=1))
    CONTRACT_CHECK = "cancel then decode is CANCELLED"

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if result.status.code is StatusCode.CANCELLED:
            return StepResult(StructuredStatus(StatusCode.OK), CacheResult.HIT, TokenOutput(0))
        return result


class PrefixCacheKeyedOnFirstToken(PlantedEngine):
    BUG = "a prefix cache keyed on the first token serves another prompt's cached answer"
    PROPERTY = "§3 determinism"
    # A resent prefill is served from the cache too: an armed malformed_output never shows
    # (a prefill, the fault, the prefill resent).
    ALSO = ("§4 malformed_output",)
    ALSO_MINIMUM = MappingProxyType({"§4 malformed_output": 3})
    MINIMAL = (prefill("a", tokens=(0,)), prefill("b", tokens=(0, 3)))

    def __init__(self) -> None:
        super().__init__()
        self.prefix_cache: dict[int, StepResult] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if not (result.status.ok and request.step == 0 and request.token_ids):
            return result
        cached = self.prefix_cache.setdefault(request.token_ids[0], result)
        return replace(result, output=cached.output)


class RefusedPrefillPoisonsSession(PlantedEngine):
    BUG = "a prefill refused for capacity leaves half-written cache rows that corrupt later outputs"
    PROPERTY = "§3 determinism"
    # As short: an exact resend of step 0 after the refusal answers differently (rule 6).
    ALSO = ("§2 rule 6",)
    MINIMAL = (
        prefill("a", tokens=(0,)),
        prefill("a", step=1, tokens=KvTokens(), note="refused"),
        decode("a", step=1),
    )

    def __init__(self) -> None:
        super().__init__()
        self.poisoned: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._serve(request, self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._serve(request, self.inner.decode(request))

    def _serve(self, request: StepRequest, result: StepResult) -> StepResult:
        refused_prefill = isinstance(request, PrefillRequest) and result.status.code is StatusCode.RESOURCE_EXHAUSTED
        if refused_prefill and request.step > 0:
            self.poisoned.add(request.session_id)
        elif result.status.ok and request.step == 0:
            self.poisoned.discard(request.session_id)
        return self._shift(result) if request.session_id in self.poisoned else result

    def release(self, session_id: str) -> StructuredStatus:
        self.poisoned.discard(session_id)
        return self.inner.release(session_id)


class RequestIdWrapsAt32(PlantedEngine):
    BUG = "a 5-bit request id wraps after 32 calls and from the 32nd on answers go to the wrong slot"
    PROPERTY = "§3 determinism"
    # One prefill of 32 tokens: the twin fed one token per decode makes the 32nd call and
    # disagrees with the recompute in one prefill (the engine under test made one call).
    MINIMAL = (prefill("a", tokens=(0,) * 32),)

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._count(self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._count(self.inner.decode(request))

    def _count(self, result: StepResult) -> StepResult:
        self.calls += 1
        return self._shift(result) if self.calls >= 32 else result


class DelayedStepTimesOut(PlantedEngine):
    BUG = "a step delayed by a slow host answers DEADLINE_EXCEEDED instead of its result"
    PROPERTY = "§2 rule 8"
    # As short: a delayed malformed request also times out instead of INVALID_ARGUMENT.
    ALSO = ("§2 rule 2",)
    MINIMAL = (fault("delay", 0.0), prefill("a"))

    def __init__(self) -> None:
        super().__init__()
        self.delayed = False

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        if fault.kind == "delay":
            self.delayed = True
        return self.inner.inject_fault(fault)

    def prefill(self, request: PrefillRequest) -> StepResult:
        if self.delayed:
            self.delayed = False
            self.inner.metrics()  # the request never reaches the cache
            self.inner.prefill(replace(request, session_id=""))  # ...but it is counted as a call
            return StepResult(StructuredStatus(StatusCode.DEADLINE_EXCEEDED, "timed out", True), CacheResult.MISS)
        return self.inner.prefill(request)


class RestartKeepsOldEpochCache(PlantedEngine):
    BUG = "a restart at a higher epoch keeps serving from the old epoch's cache (no epoch check on reuse)"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a", tokens=(0,)), prefill("a", epoch=1, tokens=(0,), note="epoch bump"))

    def __init__(self) -> None:
        super().__init__()
        self.epochs: dict[str, int] = {}
        self.stale: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        known = self.epochs.get(request.session_id)
        if result.status.ok and request.step == 0:
            if known is not None and request.epoch > known:
                self.stale.add(request.session_id)
            self.epochs[request.session_id] = request.epoch
        return self._shift(result) if request.session_id in self.stale else result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        return self._shift(result) if request.session_id in self.stale else result

    def release(self, session_id: str) -> StructuredStatus:
        self.epochs.pop(session_id, None)
        self.stale.discard(session_id)
        return self.inner.release(session_id)


PLANTED: tuple[type[PlantedEngine], ...] = (
    StaleEpochAccepted,
    DecodeOfUnknownSessionServed,
    ReleaseLeaksKvTokens,
    RetryAppliedTwice,
    MiddleDropsSideband,
    CancelLeaksKvTokens,
    OutputDependsOnChunking,
    SessionStateBleeds,
    EvictsLiveSessions,
    CrashesOnCancelOfNewerEpoch,
    RefusedPrefillLeavesTokens,
    FailedCallsNotCounted,
    MemoryPressureIgnored,
    CancelledSessionStillServes,
    PrefixCacheKeyedOnFirstToken,
    RefusedPrefillPoisonsSession,
    RequestIdWrapsAt32,
    DelayedStepTimesOut,
    RestartKeepsOldEpochCache,
    *REACH_PLANTED,
    *EXTREME_PLANTED,
    *UPSTREAM_PLANTED,
)
