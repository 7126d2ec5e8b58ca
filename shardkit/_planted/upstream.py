"""Planted bugs that real inference engines shipped (issue 34), each faithful to its upstream
report, cited in its docstring: a cancel applied to the id instead of the request, aborted
state that outlives a release, KV blocks kept or freed twice around a cancel, shared prefix
pages freed with their first owner, slots and prompt caches restoring another conversation,
a unified cache keyed on position alone, cache resets and crops that leave stale state.

A report is cited as ``owner/repository#number`` of its project's tracker.

Each wraps the fake like the engines of ``shardkit._planted``, which lists them in
``PLANTED`` (``UPSTREAM_PLANTED`` here), is correct whenever its trigger does not happen,
and states its BUG, PROPERTY and an executable MINIMAL. The trigger is the report's, said
in the contract's calls: an abort is a cancel, a request finishing or a client going away
is a release, a reset of a session's cache is a restart at the next epoch. Every size the
bug depends on is read from the wrapped engine's capabilities, except the bug's own
constants (a block of 16 tokens).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from shardkit import (
    CacheResult,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
)
from shardkit._planted.base import PlantedEngine, StepRequest
from shardkit._planted.minimal import KvTokens, cancel, decode, prefill, release
from shardkit._planted.reach import _Scratch, _tokens_of
from shardkit.contract import DecodeRequest

__all__ = [
    "UPSTREAM_PLANTED",
    "AbortOfAFinishedRequestKeepsItsBlocks",
    "AbortedIdStaysInTheTable",
    "CancelAfterTheFinalChunkLeaksAToken",
    "CropToZeroKeepsTheCache",
    "DoubleFreeInflatesTheFreeCount",
    "FullPromptMatchAnswersStaleLogits",
    "PrefixCacheRestoresTheLastEntry",
    "ReleaseAfterCancelFreesTwice",
    "ResetKeepsTheOldLength",
    "RestartReuseDropsAReusedToken",
    "ReusedSlotKeepsTheOldConversation",
    "SharedPrefixFreedWithItsFirstOwner",
    "StaleAbortHitsTheReusedId",
    "UnifiedCacheKeyedOnPosition",
]


def _refused(engine: PlantedEngine, request: PrefillRequest, code: StatusCode, message: str) -> StepResult:
    """A refusal of ``request`` that the engine counts as a call, as it counts every prefill."""
    engine.inner.prefill(replace(request, session_id=""))  # refused by the fake, and counted
    return StepResult(StructuredStatus(code, message), CacheResult.MISS)


class StaleAbortHitsTheReusedId(PlantedEngine):
    """vLLM #23697, "Recycling request IDs can lead to requests leaking in the engine due to
    race condition in the cancellation logic" (vllm-project/vllm#23697;
    fixed by PR #24382): an abort reaches the engine core after the request is gone, keyed by
    its id, and a new request added under the same id takes it."""

    BUG = "a cancel is kept against the session's id: once the id is released and opened again, the new session is refused as cancelled"
    PROPERTY = "§2 rule 8"
    MINIMAL = (prefill("a"), cancel("a"), release("a"), prefill("a", note="the id opened again"))

    def __init__(self) -> None:
        super().__init__()
        self.pending_aborts: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        if request.step == 0 and session in self.pending_aborts and session not in self.inner._sessions:
            self.pending_aborts.discard(session)
            return _refused(self, request, StatusCode.CANCELLED, f"prefill of session {session!r}: aborted")
        return self.inner.prefill(request)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.pending_aborts.add(session_id)
        return status


class AbortedIdStaysInTheTable(PlantedEngine):
    """SGLang PR #24070, "[BugFix] Fix rid_to_state leak for aborted queued requests"
    (sgl-project/sglang#24070): the abort path of a request that has
    not run leaves its entry in ``rid_to_state``; the id counts as live and cannot be reused."""

    BUG = "a cancelled session's release leaves its id in the session table: it still counts as active"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), cancel("a"), release("a"))

    def __init__(self) -> None:
        super().__init__()
        self.lingering: set[str] = set()

    def release(self, session_id: str) -> StructuredStatus:
        held = self.inner._sessions.get(session_id)
        status = self.inner.release(session_id)
        if status.ok and held is not None and held.cancelled:
            self.lingering.add(session_id)
        return status

    def prefill(self, request: PrefillRequest) -> StepResult:
        if request.step == 0 and request.session_id in self.lingering:
            message = f"prefill of session {request.session_id!r}: duplicate request id"
            return _refused(self, request, StatusCode.FAILED_PRECONDITION, message)
        return self.inner.prefill(request)

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, active_sessions=counted.active_sessions + len(self.lingering))


class _Leaking(PlantedEngine):
    """Counts KV tokens that it never gives back, on top of the fake's."""

    def __init__(self) -> None:
        super().__init__()
        self.leaked = 0

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, kv_tokens=counted.kv_tokens + self.leaked)


class CancelAfterTheFinalChunkLeaksAToken(_Leaking):
    """SGLang #34149, "[Bug] Abort can commit a delayed final chunked-prefill token on latest
    main" (sgl-project/sglang#34149; fixed by PR #34153), and PR
    #37295, "fix: drop in-flight abort token from visible output in chunked prefill": an abort
    that lands while a prefill's sampled token is still to be committed commits it, and the
    release accounting, derived from the output length, leaves one KV pool token behind."""

    BUG = "a cancel right after a prefill (its token still to be committed) leaves one KV token counted for good"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), cancel("a", note="lands on the prefill's token"))

    def __init__(self) -> None:
        super().__init__()
        self.last_was_prefill: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok:
            self.last_was_prefill.add(request.session_id)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if result.status.ok:
            self.last_was_prefill.discard(request.session_id)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = self.inner.cancel(session_id, epoch)
        if status.ok and session_id in self.last_was_prefill:
            self.leaked += 1
        self.last_was_prefill.discard(session_id)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.last_was_prefill.discard(session_id)
        return self.inner.release(session_id)


class AbortOfAFinishedRequestKeepsItsBlocks(PlantedEngine):
    """vLLM PR #25067, "[NIXL] Ignore abort on already-finished request"
    (vllm-project/vllm#25067), and PR #35506, "[Core] Proactively free
    KV cache blocks when aborting finished requests" (vllm-project/vllm#35506):
    an abort that lands on a request whose last step finished it is taken as a normal finish,
    and its KV blocks stay held until a timeout. Here a step that fills the KV budget
    finishes the request (there is no room for another token)."""

    BUG = "a cancel of a session whose last step filled the KV budget (a finished request) keeps its KV tokens held"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a", tokens=KvTokens(), note="fills the budget: finished"), cancel("a"))

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, int] = {}

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        fake = self.inner
        session = fake._sessions.get(session_id)
        finished = fake._kv_tokens_used() >= fake._max_kv_tokens
        tokens = session.kv_tokens if session is not None else 0
        status = fake.cancel(session_id, epoch)
        if status.ok and finished and tokens:
            self.held[session_id] = tokens
        return status

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.step == 0:
            self.held.pop(request.session_id, None)
        return result

    def release(self, session_id: str) -> StructuredStatus:
        self.held.pop(session_id, None)
        return self.inner.release(session_id)

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, kv_tokens=counted.kv_tokens + sum(self.held.values()))


class ReleaseAfterCancelFreesTwice(PlantedEngine):
    """TensorRT-LLM PR #12816, "[TRTLLM-10938][feat] Enable block reuse with overlap scheduler"
    (NVIDIA/TensorRT-LLM#12816): two paths terminate the same request
    and each calls ``free_resources`` on it. Here the cancel frees the session's KV blocks and
    its release frees them again: the count of blocks in use drops below what other sessions
    hold (it cannot go below zero)."""

    BUG = "a cancelled session's release frees its KV tokens a second time: the count drops below what others hold"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), prefill("b"), cancel("a"), release("a"))

    def __init__(self) -> None:
        super().__init__()
        self.freed_twice = 0
        self.freed_at_cancel: dict[str, int] = {}

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        session = self.inner._sessions.get(session_id)
        tokens = session.kv_tokens if session is not None else 0
        status = self.inner.cancel(session_id, epoch)
        if status.ok:
            self.freed_at_cancel[session_id] = self.freed_at_cancel.get(session_id, 0) + tokens
        return status

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.step == 0:
            self.freed_at_cancel.pop(request.session_id, None)  # a restart starts new books
        return result

    def release(self, session_id: str) -> StructuredStatus:
        self.freed_twice += self.freed_at_cancel.pop(session_id, 0)
        return self.inner.release(session_id)

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, kv_tokens=max(counted.kv_tokens - self.freed_twice, 0))


class DoubleFreeInflatesTheFreeCount(PlantedEngine):
    """vLLM #42571, "[Bug]: KV Block double free when using eager SimpleCPUOffloading + Sliding
    window attention" (vllm-project/vllm#42571): one block is listed
    twice among a request's blocks, and freeing the request frees it twice, so the free count
    rises by two blocks for one. Here a session of more than one block of 16 tokens lists its
    first block twice."""

    BUG = "releasing a session of more than one 16-token block frees its first block twice: 16 tokens too few counted"
    PROPERTY = "§2 metrics"
    BLOCK: ClassVar[int] = 16
    MINIMAL = (
        prefill("a", tokens=(0,) * (BLOCK + 1), note="two blocks"),
        prefill("b"),
        release("a", note="its first block freed twice"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.over_freed = 0

    def release(self, session_id: str) -> StructuredStatus:
        session = self.inner._sessions.get(session_id)
        status = self.inner.release(session_id)
        if status.ok and session is not None and session.kv_tokens > self.BLOCK:
            self.over_freed += self.BLOCK
        return status

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, kv_tokens=max(counted.kv_tokens - self.over_freed, 0))


class SharedPrefixFreedWithItsFirstOwner(_Scratch):
    """vLLM PR #3347, "Fixes #1556 double free" (vllm-project/vllm#3347):
    sequences share the blocks of a common prefix, and freeing one sequence frees the shared
    blocks while the other still uses them. Here a session opened with a prompt that begins
    as a live session's history shares the blocks of what they have in common; when that
    first owner goes (release or cancel), the sharer's cache loses them and it answers from
    what is left."""

    BUG = "a session whose prompt begins as a live one's history shares those blocks, which are freed when the first owner goes"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a"), prefill("b", tokens=(0, 3), note="shares a's block of [0]"), release("a"), decode("b"))

    def __init__(self) -> None:
        super().__init__()
        self.shares: dict[str, tuple[str, int]] = {}  # sharer -> (owner, tokens shared)
        self.lost_prefix: dict[str, int] = {}  # session -> tokens of its history freed under it

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        if request.step == 0:
            self.shares.pop(session, None)
            self.lost_prefix.pop(session, None)
        prompt = _tokens_of(request)
        owners = [
            (_common_prefix(history.tokens(), prompt), other)
            for other, history in self.histories.items()
            if other != session and other not in self.shares
        ]
        shared, owner = max(owners, default=(0, ""))
        result = self.served(request, super().prefill(request))
        if result.status.ok and request.step == 0 and shared:
            self.shares[session] = (owner, shared)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.served(request, super().decode(request))

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        lost = self.lost_prefix.get(session)
        return None if lost is None else tokens[lost:]

    def _owner_gone(self, owner: str) -> None:
        for sharer, (shared_with, tokens) in list(self.shares.items()):
            if shared_with == owner:
                del self.shares[sharer]
                self.lost_prefix[sharer] = tokens

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = super().cancel(session_id, epoch)
        if status.ok:
            self._owner_gone(session_id)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self._owner_gone(session_id)
        self.shares.pop(session_id, None)
        self.lost_prefix.pop(session_id, None)
        return super().release(session_id)


def _common_prefix(first: tuple[int, ...], second: tuple[int, ...]) -> int:
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


class ReusedSlotKeepsTheOldConversation(_Scratch):
    """llama.cpp #27148, "server: RAM-backed prompt cache (--cache-ram/--cache-idle-slots)
    restores content from an unrelated conversation into a fresh slot under concurrent load"
    (ggml-org/llama.cpp#27148; fixed by PR #27624, "server: clear
    stale state when reusing LRU-selected slots"): a slot taken as an eviction victim is not
    cleared, and the new request continues the previous conversation. Here the session opened
    next after a release takes the released session's slot, stale tokens and all."""

    BUG = "the session opened after a release takes the released session's slot without clearing it: it continues the old conversation"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a"), release("a"), prefill("b", tokens=(3,), note="continues a's history"))

    def __init__(self) -> None:
        super().__init__()
        self.idle_slots: list[tuple[int, ...]] = []
        self.stale: dict[str, tuple[int, ...]] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        session = request.session_id
        opening = request.step == 0 and session not in self.histories
        result = super().prefill(request)
        if result.status.ok and request.step == 0:
            self.stale.pop(session, None)
            if opening and self.idle_slots:
                self.stale[session] = self.idle_slots.pop()
        return self.served(request, result)

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.served(request, super().decode(request))

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        stale = self.stale.get(session)
        return None if stale is None else stale + tokens

    def release(self, session_id: str) -> StructuredStatus:
        history = self.histories.get(session_id)
        if history is not None and history.tokens():
            self.idle_slots.append(self.stale.get(session_id, ()) + history.tokens())
        self.stale.pop(session_id, None)
        return super().release(session_id)


class FullPromptMatchAnswersStaleLogits(_Scratch):
    """llama.cpp #28526, "Eval bug: --cache-reuse 1 returns HTTP 200 with an empty completion"
    (ggml-org/llama.cpp#28526): a request repeated after a finished
    one is matched in full against the slot's cached tokens, nothing is left to evaluate, and
    the answer comes from the logits the slot computed last. Here a prompt that the cache of
    a released session begins with, when that session went on past it, is answered with that
    session's last answer."""

    BUG = "a prompt that a released session's cache begins with is answered with that session's last answer (nothing evaluated)"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a", tokens=(0, 3)), release("a"), prefill("b", tokens=(0,), note="a's cache begins with it"))

    def __init__(self) -> None:
        super().__init__()
        self.last_answers: dict[str, StepResult] = {}
        self.cached: list[tuple[tuple[int, ...], StepResult]] = []

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        if result.status.ok and request.step == 0:
            prompt = _tokens_of(request)
            for tokens, last in reversed(self.cached):
                if len(tokens) > len(prompt) and tokens[: len(prompt)] == prompt:
                    result = replace(result, output=last.output)
                    break
        if result.status.ok:
            self.last_answers[request.session_id] = result
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        if result.status.ok:
            self.last_answers[request.session_id] = result
        return result

    def release(self, session_id: str) -> StructuredStatus:
        history = self.histories.get(session_id)
        last = self.last_answers.pop(session_id, None)
        if history is not None and last is not None:
            self.cached.append((history.tokens(), last))
        return super().release(session_id)


class UnifiedCacheKeyedOnPosition(_Scratch):
    """llama.cpp #27994, "Eval bug: Parallel Runs with Unified KV Cache Cuases Loss of
    Coherency on qwen4exp" (ggml-org/llama.cpp#27994): with one
    cache shared by every sequence, a map of its cells keyed on position alone lets the
    sequence that wrote a position last win it. Here a session's step reads, at each position
    of its history, the token the last session to write that position wrote."""

    BUG = (
        "one cache for all sessions, its cells keyed on position only: a session reads another's token where both wrote"
    )
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a"), prefill("b", tokens=(3,), note="writes position 0 too"), decode("a"))

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[int, int] = {}  # position -> the token written there last

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self.served(request, super().prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.served(request, super().decode(request))

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        # The step's own tokens are written first, then the earlier positions are read back.
        for position in range(len(tokens) - len(_tokens_of(request)), len(tokens)):
            self.cells[position] = tokens[position]
        return tuple(self.cells.get(position, token) for position, token in enumerate(tokens))


class _Restarts(_Scratch):
    """Keeps the history of each session's epoch before the one it runs, for a restart."""

    def __init__(self) -> None:
        super().__init__()
        self.before_restart: dict[str, tuple[int, ...]] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        old = self.histories.get(request.session_id)
        restarting = request.step == 0 and old is not None and request.epoch > old.epoch
        old_tokens = old.tokens() if old is not None else ()
        result = super().prefill(request)
        if result.status.ok and restarting:
            return self.restarted(request, result, old_tokens)
        return result

    def restarted(self, request: PrefillRequest, result: StepResult, old: tuple[int, ...]) -> StepResult:
        return result


class ResetKeepsTheOldLength(_Restarts):
    """transformers PR #48809, "Fix `reset` on the dynamic cache layers"
    (huggingface/transformers#48809), and PR #48509, "Fix
    DynamicCache.reset() leaving the cache in a corrupt, non-empty state": ``reset()`` zeroes a
    dynamic layer's tensors in place but keeps their length, so ``get_seq_length()`` still
    reports the old one. Here a restart resets the session's cache, and its length counts on
    from the old epoch's."""

    BUG = "a restart resets the session's cache but keeps its length: the old epoch's tokens stay counted"
    PROPERTY = "§2 metrics"
    MINIMAL = (prefill("a"), prefill("a", epoch=1, note="reset"))

    def __init__(self) -> None:
        super().__init__()
        self.kept_length: dict[str, int] = {}

    def restarted(self, request: PrefillRequest, result: StepResult, old: tuple[int, ...]) -> StepResult:
        self.kept_length[request.session_id] = self.kept_length.get(request.session_id, 0) + len(old)
        return result

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        status = super().cancel(session_id, epoch)
        if status.ok:
            self.kept_length.pop(session_id, None)
        return status

    def release(self, session_id: str) -> StructuredStatus:
        self.kept_length.pop(session_id, None)
        return super().release(session_id)

    def metrics(self) -> MetricsResult:
        counted = self.inner.metrics()
        return replace(counted, kv_tokens=counted.kv_tokens + sum(self.kept_length.values()))


class CropToZeroKeepsTheCache(_Restarts):
    """transformers #47433, "DynamicCache.crop(0) retains the full KV cache and oversized
    negative crops retain stale tokens" (huggingface/transformers#47433;
    fixed by PR #47977): ``crop(max_length)`` reads every length of 0 or below as relative to
    the end, so ``crop(0)`` keeps everything. Here a restart keeps what the new prompt shares
    with the old epoch's history by cropping the cache to that length, then appends the rest:
    a prompt that shares nothing crops to 0 and is appended to the whole old history."""

    BUG = "a restart crops the cache to what the new prompt shares with the old history: sharing nothing, crop(0) keeps it all"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a"), prefill("a", epoch=1, tokens=(3,), note="shares no token: crop(0)"))

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, tuple[int, ...]] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        if request.step == 0:
            self.kept.pop(request.session_id, None)
        return self.served(request, super().prefill(request))

    def restarted(self, request: PrefillRequest, result: StepResult, old: tuple[int, ...]) -> StepResult:
        prompt = _tokens_of(request)
        if old and prompt and old[0] != prompt[0]:
            self.kept[request.session_id] = old
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.served(request, super().decode(request))

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        kept = self.kept.get(session)
        return None if kept is None else kept + tokens


class RestartReuseDropsAReusedToken(_Restarts):
    """llama.cpp #12160, "Misc. bug: Calculating the position of kv cache error in llama sever"
    (ggml-org/llama.cpp#12160; fixed by PR #12161, "Server: Cache
    position calculation error"): when a new prompt reuses the cached tokens it shares with
    the slot's old prompt, the position bookkeeping is not moved with them, and the next
    removal takes a valid reused token out. Here a restart whose prompt shares two or more
    tokens with the old epoch's history (the last token is always evaluated) reuses them and
    loses the last one it reused."""

    BUG = "a restart reusing two or more tokens its prompt shares with the old history loses the last reused one"
    PROPERTY = "§3 determinism"
    MINIMAL = (prefill("a", tokens=(0, 3, 6)), prefill("a", epoch=1, tokens=(0, 3, 6), note="reuses 0 and 3"))

    def __init__(self) -> None:
        super().__init__()
        self.dropped: dict[str, int] = {}  # session -> the position of its history lost

    def prefill(self, request: PrefillRequest) -> StepResult:
        if request.step == 0:
            self.dropped.pop(request.session_id, None)
        return self.served(request, super().prefill(request))

    def restarted(self, request: PrefillRequest, result: StepResult, old: tuple[int, ...]) -> StepResult:
        prompt = _tokens_of(request)
        shared = 0
        while shared < min(len(old), len(prompt) - 1) and old[shared] == prompt[shared]:
            shared += 1
        if shared >= 2:
            self.dropped[request.session_id] = shared - 1
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        return self.served(request, super().decode(request))

    def wrong_history(self, session: str, tokens: tuple[int, ...], request: StepRequest) -> tuple[int, ...] | None:
        dropped = self.dropped.get(session)
        return None if dropped is None else tokens[:dropped] + tokens[dropped + 1 :]


class PrefixCacheRestoresTheLastEntry(_Scratch):
    """mistral.rs #1026, "Text models output gibberish after multiple requests"
    (EricLBuehler/mistral.rs#1026; PR #1035, "Patch prefix caching
    to fix incorrect outputs"): with the prefix cacher on, a repeated prompt is matched but the
    cache restored for it is not the matched entry's. Here the caches of released sessions are
    kept by prompt, and a hit restores the cache stored last: right when it is the match."""

    BUG = "a prompt cache hit restores the cache stored last instead of the matching entry's"
    PROPERTY = "§3 determinism"
    MINIMAL = (
        prefill("a"),
        release("a"),
        prefill("b", tokens=(1,)),
        release("b"),
        prefill("c", note="a's prompt: restores b's cache"),
    )

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[int, ...]] = []  # released sessions' histories, oldest first

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        prompt = _tokens_of(request)
        if result.status.ok and request.step == 0 and prompt in self.entries and self.entries[-1] != prompt:
            # The matched entry's tokens are skipped; the state is the last entry's.
            return self.answer_for(result, self.entries[-1])
        return result

    def release(self, session_id: str) -> StructuredStatus:
        history = self.histories.get(session_id)
        if history is not None and history.tokens():
            self.entries.append(history.tokens())
        return super().release(session_id)


UPSTREAM_PLANTED: tuple[type[PlantedEngine], ...] = (
    StaleAbortHitsTheReusedId,
    AbortedIdStaysInTheTable,
    CancelAfterTheFinalChunkLeaksAToken,
    AbortOfAFinishedRequestKeepsItsBlocks,
    ReleaseAfterCancelFreesTwice,
    DoubleFreeInflatesTheFreeCount,
    SharedPrefixFreedWithItsFirstOwner,
    ReusedSlotKeepsTheOldConversation,
    FullPromptMatchAnswersStaleLogits,
    UnifiedCacheKeyedOnPosition,
    ResetKeepsTheOldLength,
    CropToZeroKeepsTheCache,
    RestartReuseDropsAReusedToken,
    PrefixCacheRestoresTheLastEntry,
)
