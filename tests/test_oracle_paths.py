"""The twin oracle computes each history by independent paths and never takes one twin's word.

A twin fed the way the engine under test was fed shares that path's bugs: an engine whose
decode goes wrong after a few decodes of a session goes wrong in a twin that also decodes.
The oracle therefore answers each history three ways (one prefill on a fresh engine, one
token per decode, random chunks); when those disagree, the report says so and does not print
one of them as the expected answer. Beyond EAGER_TOKENS the last two answer only where the
engine under test and the recompute disagree.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shardkit import DelegatingEngine, FakeShardEngine, machine_for
from shardkit._core.checks import HistoryMemo, MemoStore
from shardkit._core.driver import Driver, StepFailed
from shardkit._core.model import input_length
from shardkit._core.output_checks import LEAKY_RECOMPUTE, OutputChecks
from shardkit._core.steps import Action, step_action
from shardkit._core.twins import EAGER_TOKENS, chunk_pieces
from shardkit._run.runner import fuzz
from shardkit._transport.resolve import resolve_target
from shardkit.contract import DecodeRequest, LoadRequest, LoadResult, PrefillRequest, StepResult, TokenOutput

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)
HEAD = LoadRequest("shardkit-fuzz", 0, 1, 4)
CORRUPT_FROM_DECODE = 5
WINDOW = 4


def _wrong(engine: DelegatingEngine[FakeShardEngine], result: StepResult) -> StepResult:
    """Another valid token: the next one in the engine's own vocabulary."""
    if not isinstance(result.output, TokenOutput):
        return result
    vocab = engine.capabilities().vocab_size
    return StepResult(result.status, result.cache, TokenOutput((result.output.token_id + 1) % vocab))


class CorruptsLateDecodes(DelegatingEngine[FakeShardEngine]):
    """From its FROM-th decode of a session on, the decode path answers wrong."""

    FROM = CORRUPT_FROM_DECODE

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.decodes: dict[tuple[str, int], int] = {}

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if not result.status.ok:
            return result
        key = (request.session_id, request.epoch)
        self.decodes[key] = self.decodes.get(key, 0) + 1
        return _wrong(self, result) if self.decodes[key] >= self.FROM else result


class CorruptsDecodesBeyondTheEagerTwins(CorruptsLateDecodes):
    FROM = EAGER_TOKENS + 5


class LongPrefillsGoWrong(DelegatingEngine[FakeShardEngine]):
    """A prefill of more than EAGER_TOKENS tokens answers wrong; decodes are exact."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        long = request.token_ids is not None and len(request.token_ids) > EAGER_TOKENS
        return _wrong(self, result) if result.status.ok and long else result


class TailStageGoesWrongLate(DelegatingEngine[FakeShardEngine]):
    """Loaded as the tail half of a split (a pipeline's second stage), it answers wrong once a
    session holds more than EAGER_TOKENS + 4 tokens; the whole range is exact."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.tail_stage = False
        self.tokens: dict[str, int] = {}

    def load(self, request: LoadRequest) -> LoadResult:
        self.tail_stage = request.shard_start > 0
        return self.inner.load(request)

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._count(
            request.session_id,
            request.step,
            input_length(request),
            self.inner.prefill(request),
        )

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._count(request.session_id, request.step, 1, self.inner.decode(request))

    def _count(self, session: str, step: int, count: int, result: StepResult) -> StepResult:
        self.tokens[session] = (0 if step == 0 else self.tokens.get(session, 0)) + count
        late = self.tail_stage and self.tokens[session] > EAGER_TOKENS + 4
        return _wrong(self, result) if result.status.ok and late else result


class DecodeSeesAWindow(DelegatingEngine[FakeShardEngine]):
    """A decode fast path that answers from the last WINDOW tokens alone (prefill is exact)."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.histories: dict[str, list[int]] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        if result.status.ok and request.token_ids is not None:
            kept = [] if request.step == 0 else self.histories.get(request.session_id, [])
            self.histories[request.session_id] = kept + list(request.token_ids)
        return result

    def decode(self, request: DecodeRequest) -> StepResult:
        result = self.inner.decode(request)
        if not (result.status.ok and request.token_ids is not None):
            return result
        history = self.histories.setdefault(request.session_id, [])
        history += request.token_ids
        if len(history) <= WINDOW or not isinstance(result.output, TokenOutput):
            return result  # a full range's fast path; a head stage of the twins' pipeline is exact
        windowed = FakeShardEngine()
        windowed.load(FULL)
        recent = windowed.prefill(PrefillRequest("window", 0, 0, tuple(history[-WINDOW:])))
        return StepResult(result.status, result.cache, recent.output)


def _driver(engine: Any, load: LoadRequest = FULL) -> Driver:
    return Driver(resolve_target(engine), load)


def _one_prefill_then_decodes(driver: Driver, decodes: int) -> StepFailed | None:
    tokens = [7, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    try:
        driver.execute(step_action("prefill", "a", 0, 0, (3,)))
        for step in range(1, decodes + 1):
            driver.execute(step_action("decode", "a", 0, step, (tokens[step % len(tokens)],)))
    except StepFailed as failure:
        return failure
    return None


def test_a_decode_path_that_goes_wrong_late_is_caught_although_a_decoding_twin_agrees_with_it() -> None:
    failure = _one_prefill_then_decodes(_driver(CorruptsLateDecodes), decodes=CORRUPT_FROM_DECODE + 2)
    assert failure is not None, "the late decode corruption went unnoticed"
    violation = failure.violation
    assert violation.property == "§3 determinism"
    assert f"step {CORRUPT_FROM_DECODE + 1}: decode" in violation.message, violation.message
    assert "expected: one answer after history" in violation.message, violation.message
    assert "the engine's own paths disagree" in violation.message
    # The decoding twin took the engine's path and agrees with it; the recompute does not.
    assert "a recompute in one prefill gives token" in violation.message, violation.message
    assert "one token per decode gives token" in violation.message


def test_a_windowed_decode_is_caught_and_its_correct_prefill_is_never_called_wrong() -> None:
    failure = _one_prefill_then_decodes(_driver(DecodeSeesAWindow), decodes=WINDOW + 3)
    assert failure is not None
    message = failure.violation.message
    assert failure.violation.property == "§3 determinism"
    assert re.search(r"step \d+: decode", message), message
    # The twins disagree among themselves (the decoding one shares the bug): no twin's token is "expected".
    assert "expected: one answer after history" in message, message
    assert "one token per decode gives token" in message


def test_a_decode_path_that_goes_wrong_beyond_the_eager_twins_is_arbitrated_by_every_path() -> None:
    driver = _driver(CorruptsDecodesBeyondTheEagerTwins)
    failure = _one_prefill_then_decodes(driver, decodes=EAGER_TOKENS + 8)
    assert failure is not None, "the late decode corruption went unnoticed"
    message = failure.violation.message
    assert f"step {EAGER_TOKENS + 6}: decode" in message, message
    assert "the engine's own paths disagree: a recompute in one prefill gives token" in message, message
    assert "one token per decode gives token" in message
    assert "a recompute in one prefill and a random chunking agree on token" in message, message


def test_a_wrong_recompute_is_never_printed_as_expected() -> None:
    driver = _driver(LongPrefillsGoWrong)
    failure = _one_prefill_then_decodes(driver, decodes=EAGER_TOKENS + 2)
    assert failure is not None, "a long prefill that answers wrong went unnoticed"
    message = failure.violation.message
    assert "expected: one answer after history" in message, message
    assert "a recompute in one prefill gives token" in message, message
    assert "the engine under test gave token" in message


def test_composition_is_checked_beyond_the_eager_twins() -> None:
    driver = _driver(TailStageGoesWrongLate)
    failure = _one_prefill_then_decodes(driver, decodes=EAGER_TOKENS + 16)
    assert failure is not None, "a pipeline stage that goes wrong late went unnoticed"
    assert failure.violation.property == "§3 composition", failure.violation
    assert "by a recompute in one prefill, one token per decode and a random chunking)" in failure.violation.message, (
        failure.violation.message
    )


@pytest.mark.parametrize("engine", [FakeShardEngine], ids=["fake"])
@pytest.mark.parametrize("load", [FULL, HEAD], ids=["full", "head"])
def test_a_correct_engine_passes_a_long_session(engine: Any, load: LoadRequest) -> None:
    driver = _driver(engine, load)
    capacity = driver.caps.max_kv_tokens
    assert capacity > EAGER_TOKENS + 8, "the session must outgrow the twins that follow it"
    assert _one_prefill_then_decodes(driver, decodes=capacity - 2) is None
    assert [record.outcome for record in driver.records] == ["OK"] * (capacity - 1)
    lengths = {
        path: sorted(len(history) for history, paths in driver.memo.references.items() if path in paths)
        for path in ("recompute", "stepwise", "chunked")
    }
    # The recompute answers every history; the twins that follow the session stop at EAGER_TOKENS.
    assert lengths["recompute"] == list(range(1, capacity))
    assert lengths["stepwise"] == list(range(1, EAGER_TOKENS + 1))
    assert len(lengths["chunked"]) > EAGER_TOKENS // 8
    assert max(lengths["chunked"]) <= EAGER_TOKENS


def test_when_the_paths_agree_the_message_names_them_all() -> None:
    class ShiftsEveryPrefill(DelegatingEngine[FakeShardEngine]):
        def __init__(self) -> None:
            super().__init__(FakeShardEngine())

        def prefill(self, request: PrefillRequest) -> StepResult:
            # Only the engine under test's second session goes wrong; its twins never do.
            result = self.inner.prefill(request)
            return _wrong(self, result) if request.session_id == "b" else result

    driver = _driver(ShiftsEveryPrefill)
    driver.execute(step_action("prefill", "a", 0, 0, (3, 4)))
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "b", 0, 0, (3, 4)))
    message = failed.value.violation.message
    assert "after history [3, 4], as fresh twins (" in message, message
    assert "gave by a recompute in one prefill, one token per decode and a random chunking" in message


def test_beyond_the_eager_twins_an_agreed_answer_is_named_by_every_path() -> None:
    class ShiftsLongPrefillsOfB(DelegatingEngine[FakeShardEngine]):
        def __init__(self) -> None:
            super().__init__(FakeShardEngine())

        def prefill(self, request: PrefillRequest) -> StepResult:
            result = self.inner.prefill(request)
            return _wrong(self, result) if request.session_id == "b" else result

    history = tuple(position % 7 for position in range(EAGER_TOKENS + 3))
    driver = _driver(ShiftsLongPrefillsOfB)
    driver.execute(step_action("prefill", "a", 0, 0, history))
    driver.execute(Action("release", {"session": "a"}))  # the KV budget holds one such history
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "b", 0, 0, history))
    message = failed.value.violation.message
    assert "gave by a recompute in one prefill, one token per decode and a random chunking" in message, message


def test_a_history_seen_again_asks_no_twin() -> None:
    driver = _driver(FakeShardEngine)
    driver.execute(step_action("prefill", "a", 0, 0, (3, 4, 5)))
    memo_size = len(driver.memo.references)
    driver.execute(Action("release", {"session": "a"}))
    driver.execute(step_action("prefill", "a", 0, 0, (3, 4, 5)))
    assert len(driver.memo.references) == memo_size


@pytest.mark.parametrize(("start", "end"), [(0, 7), (0, 64), (5, 300), (17, 30)])
def test_the_chunked_path_covers_the_history_in_order_with_short_pieces(start: int, end: int) -> None:
    pieces = list(chunk_pieces(start, end))
    assert pieces[0][0] == start
    assert end - 7 < pieces[-1][1] <= end
    assert all(left[1] == right[0] for left, right in itertools.pairwise(pieces))
    assert all(1 <= piece_end - piece_start <= 7 for piece_start, piece_end in pieces)
    assert pieces == list(chunk_pieces(start, end)), "the same history is always cut alike"
    if end - start > 20:
        assert len({piece_end - piece_start for piece_start, piece_end in pieces}) > 2


class PrefixCacheOutlivesRelease(DelegatingEngine[FakeShardEngine]):
    """A prefix cache keyed on a prompt's first 3 tokens, kept across sessions and releases."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.cache: dict[tuple[int, ...], StepResult] = {}

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        tokens = request.token_ids
        if not (result.status.ok and request.step == 0 and tokens is not None and len(tokens) >= 3):
            return result
        return StepResult(result.status, result.cache, self.cache.setdefault(tokens[:3], result).output)


def test_a_recompute_twin_led_astray_by_its_own_earlier_sessions_never_judges_the_engine() -> None:
    """The example's recompute twin serves one session per history: after recomputing [0, 0, 31]
    its prefix cache answers [0, 0, 31, 1] wrong, while the engine under test (which decoded
    those tokens) is right. Fresh engines answer the history again: nothing is blamed, the
    run says why its recompute was not used, and a fresh twin takes over."""
    driver = _driver(PrefixCacheOutlivesRelease)
    for step, token in enumerate((0, 0, 31, 1)):
        driver.execute(step_action("prefill" if step == 0 else "decode", "a", 0, step, (token,)))
    assert LEAKY_RECOMPUTE in driver.caveats, driver.caveats
    assert any("answered [0, 0, 31, 1] with token" in note for note in driver.notes), driver.notes
    # The same bug in the engine under test itself is still found, with fresh twins' answers.
    driver.execute(step_action("prefill", "b", 0, 0, (0, 0, 31)))
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "c", 0, 0, (0, 0, 31, 2)))
    message = failed.value.violation.message
    assert "as fresh twins (" in message, message
    assert "a random chunking" in message, message
    # Whose state it was: the answer the engine gave before, to the history the cache keyed on.
    assert "answered token" in message, message
    assert "to history [0, 0, 31] before (session 'a', epoch 0, step 2): state carried over from there" in message
    assert "(unless by chance: one token in 32)" in message, message


def test_a_recompute_twin_that_fails_after_its_own_earlier_sessions_is_replaced_not_blamed() -> None:
    """A head whose prefix cache, keyed on the first token, serves the bundle it cached for the
    recompute of [0] (another session's header) when the recompute twin prefills [0, 0]: the
    twin's bad output came from its own earlier session. A fresh engine recomputes [0, 0]."""
    from shardkit._planted import PrefixCacheKeyedOnFirstToken

    driver = _driver(PrefixCacheKeyedOnFirstToken, HEAD)
    driver.execute(step_action("prefill", "a", 0, 0, (0,)))
    driver.execute(step_action("decode", "a", 0, 1, (0,)))
    assert LEAKY_RECOMPUTE in driver.caveats, driver.caveats
    assert any("failed at [0, 0]" in note for note in driver.notes), driver.notes


# --- the memo a run's examples share ------------------------------------------------------


def test_the_shared_memo_keeps_layer_ranges_apart_and_stays_within_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MemoStore, "MAX_BYTES", 2000)
    store = MemoStore()
    full, head = HistoryMemo(store, scope=repr(FULL)), HistoryMemo(store, scope=repr(HEAD))
    full.remember((1, 2), "recompute", (5, None))
    assert full.get((1, 2)) == {"recompute": (5, None)}
    assert head.get((1, 2)) == {}  # another layer range answers for itself
    for length in range(1, 200):
        head.remember(tuple(range(length)), "stepwise", np.zeros(4, np.float32))
    assert 0 < store.size_bytes <= 2000
    assert head.get(tuple(range(199))), "the newest answer stays"
    assert full.get((1, 2)) == {}, "the oldest went first"


def test_a_runs_examples_share_the_twins_answers_until_one_fails() -> None:
    """One store for the examples of a machine class; from its first failure on, a store per
    example, so that what Hypothesis shrinks does not depend on the examples run before."""
    machine = machine_for(FakeShardEngine, role="full")
    first, second = machine._oracle_memo(), machine._oracle_memo()
    assert first is second
    other = machine_for(FakeShardEngine, role="full")
    assert other._oracle_memo() is not first  # another run starts afresh
    machine._failed = True
    after = machine._oracle_memo()
    assert after is not first
    assert machine._oracle_memo() is not after


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_run_that_finds_nothing_recomputes_each_history_once(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Without the shared memo, the same 60 examples recompute each history about twice."""
    recomputed: list[tuple[int, ...]] = []
    recompute = OutputChecks._recompute

    def counted(self: OutputChecks, history: tuple[int, ...]) -> Callable[[], None]:
        recomputed.append(history)
        return recompute(self, history)

    monkeypatch.setattr(OutputChecks, "_recompute", counted)
    assert fuzz(FakeShardEngine, seed=seed, examples=60, steps=30, role="full").failure is None
    assert recomputed
    assert len(recomputed) == len(set(recomputed))
