"""BatchingTransformersShardEngine: a scheduler thread runs the one-token steps of different
sessions as one batched forward; the kit fuzzes it clean with --concurrency 3 and finds the
two batching bugs planted in it (shardkit/_planted/batching.py).

Needs the ``transformers`` extra; without it these tests skip with a message naming the
extra, except under SHARDKIT_REQUIRE_TRANSFORMERS=1 (CI), where a missing install fails.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from shardkit import BoundaryBundle, DecodeRequest, LoadRequest, PrefillRequest, StatusCode, StepResult, TokenOutput
from shardkit._core.steps import PARALLEL_OP
from shardkit._run.runner import fuzz

if os.environ.get("SHARDKIT_REQUIRE_TRANSFORMERS") != "1":
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'shardkit[transformers]'")

from shardkit._planted.batching import BATCHING_PLANTED, BatchTakesTheFirstRowsPosition, CancelShiftsTheBatchsRows
from shardkit.engines import transformers_batching
from shardkit.engines.transformers_batching import BatchingTransformersShardEngine, SchedulerClosed
from shardkit.engines.transformers_llama import TransformersShardEngine

TARGET = "shardkit.engines.transformers_batching:BatchingTransformersShardEngine"
LAYERS = 4
SCHEDULER = "shardkit-batching-scheduler"
#: Long enough that a batch runs only once every call in the door has queued its step.
NEVER = 600.0


def _loaded(engine: TransformersShardEngine, start: int = 0, end: int = LAYERS - 1) -> Any:
    assert engine.load(LoadRequest("tiny-llama", start, end, LAYERS)).status.ok
    return engine


def _opened(engine: TransformersShardEngine, lengths: dict[str, int]) -> None:
    for session, length in lengths.items():
        tokens = tuple(range(1, length + 1))
        assert engine.prefill(PrefillRequest(session, 0, 0, token_ids=tokens)).status.ok


def _schedulers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == SCHEDULER]


@contextmanager
def _held(engine: BatchingTransformersShardEngine) -> Iterator[None]:
    """The scheduler holds its batch while this runs: one more call is in the door."""
    with engine._batches.arrival():
        yield


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive()
    return results


def _in_one_batch(engine: BatchingTransformersShardEngine, calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call from a thread of its own, queued while one more call holds the door: one batch."""
    results: list[Any] = []
    with _held(engine):
        runner = threading.Thread(target=lambda: results.extend(_in_threads(calls)))
        runner.start()
        _until(lambda: len(engine._batches.pending) == len(calls))
    runner.join(120)
    return results


def _decodes_in_one_batch(engine: BatchingTransformersShardEngine, sessions: list[str]) -> list[StepResult]:
    return _in_one_batch(engine, [lambda s=s: engine.decode(DecodeRequest(s, 0, 1, token_ids=(9,))) for s in sessions])


def _until(condition: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(12000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("the condition did not hold within 120 s")


@pytest.mark.parametrize(("start", "end"), [(0, LAYERS - 1), (0, 0), (1, 2)])
def test_a_batch_of_sessions_of_different_lengths_gives_each_its_own_answer(start: int, end: int) -> None:
    """Three sessions of 2, 7 and 4 tokens decode in one batch of three, as a full shard, a
    head and a middle, and each answer is what the unbatched engine gives that session."""
    lengths = {"a": 2, "b": 7, "c": 4}
    batching = _loaded(BatchingTransformersShardEngine(gather_seconds=NEVER), start, end)
    alone = _loaded(TransformersShardEngine(), start, end)
    head = _loaded(TransformersShardEngine(), 0, start - 1) if start > 0 else None
    decodes = []
    for session, length in lengths.items():
        tokens, step = tuple(range(1, length + 1)), (9,)
        if head is None:
            opening, decode = (
                PrefillRequest(session, 0, 0, token_ids=tokens),
                DecodeRequest(session, 0, 1, token_ids=step),
            )
        else:  # a middle's input: a head's rows
            opening = PrefillRequest(
                session, 0, 0, bundle=_rows(head.prefill(PrefillRequest(session, 0, 0, token_ids=tokens)))
            )
            decode = DecodeRequest(
                session, 0, 1, bundle=_rows(head.decode(DecodeRequest(session, 0, 1, token_ids=step)))
            )
        for engine in (batching, alone):
            assert engine.prefill(opening).status.ok
        decodes.append(decode)
    answers = _in_one_batch(batching, [lambda request=request: batching.decode(request) for request in decodes])
    assert batching.batch_sizes() == [3]
    for request, answer in zip(decodes, answers, strict=True):
        assert answer.status.ok
        _assert_close(answer.output, alone.decode(request).output)
    batching.close()


def _rows(result: StepResult) -> BoundaryBundle:
    assert isinstance(result.output, BoundaryBundle)
    return result.output


def _assert_close(ours: object, theirs: object) -> None:
    if isinstance(ours, TokenOutput):
        assert isinstance(theirs, TokenOutput)
        assert ours.token_id == theirs.token_id
        assert ours.margin == pytest.approx(theirs.margin, abs=TransformersShardEngine.TOLERANCE)
    else:
        assert isinstance(ours, BoundaryBundle)
        assert isinstance(theirs, BoundaryBundle)
        difference = np.abs(ours.tensors[0].to_array() - theirs.tensors[0].to_array()).max()
        assert difference <= TransformersShardEngine.TOLERANCE


def test_a_planted_batch_that_takes_its_first_rows_position_answers_wrongly() -> None:
    """The self-check of the planted bug: batched, a longer session's answer moves."""
    lengths = {"a": 2, "b": 30}
    planted = _loaded(BatchTakesTheFirstRowsPosition(gather_seconds=NEVER))
    alone = _loaded(TransformersShardEngine())
    _opened(planted, lengths)
    _opened(alone, lengths)
    answers = _decodes_in_one_batch(planted, list(lengths))
    expected = alone.decode(DecodeRequest("b", 0, 1, token_ids=(9,)))
    assert planted.batch_sizes() == [2]
    assert isinstance(answers[1].output, TokenOutput)
    assert isinstance(expected.output, TokenOutput)
    assert answers[1].output.margin != pytest.approx(expected.output.margin, abs=1e-3)
    planted.close()


def test_a_cancel_waits_for_its_sessions_step_in_the_batch() -> None:
    engine = _loaded(BatchingTransformersShardEngine(gather_seconds=NEVER))
    _opened(engine, {"a": 3})
    results: list[Any] = []
    with _held(engine):
        decoding = threading.Thread(
            target=lambda: results.append(engine.decode(DecodeRequest("a", 0, 1, token_ids=(9,))))
        )
        decoding.start()
        _until(lambda: len(engine._batches.pending) == 1)
        cancelling = threading.Thread(target=lambda: results.append(engine.cancel("a", 0)))
        cancelling.start()
        cancelling.join(0.5)
        assert cancelling.is_alive(), "the cancel returned while its session's step was queued"
    decoding.join(120)
    cancelling.join(120)
    step, cancelled = results
    assert step.status.ok
    assert cancelled.ok
    assert engine.metrics().kv_tokens == 0
    engine.close()


def test_the_planted_cancel_lands_in_the_batch_and_shifts_the_rows_after_it() -> None:
    """The self-check of the planted bug: a's step is cancelled in the batch, and b gets a's row."""
    planted = _loaded(CancelShiftsTheBatchsRows(gather_seconds=NEVER))
    alone = _loaded(TransformersShardEngine())
    lengths = {"a": 2, "b": 30}
    _opened(planted, lengths)
    _opened(alone, lengths)
    results: dict[str, Any] = {}
    with _held(planted):
        threads = [
            threading.Thread(
                target=lambda s=s: results.__setitem__(s, planted.decode(DecodeRequest(s, 0, 1, token_ids=(9,))))
            )
            for s in lengths
        ]
        for queued, thread in enumerate(threads, start=1):
            thread.start()  # a, then b: a's row comes first in the batch
            _until(lambda queued=queued: len(planted._batches.pending) == queued)
        assert planted.cancel("a", 0).ok  # returns at once: the bug
    for thread in threads:
        thread.join(120)
    assert results["a"].status.code is StatusCode.CANCELLED
    expected = alone.decode(DecodeRequest("b", 0, 1, token_ids=(9,)))
    assert results["b"].output != expected.output
    planted.close()


def test_the_scheduler_thread_stops_on_close_when_dropped_and_with_with(monkeypatch: pytest.MonkeyPatch) -> None:
    # Idle threads end on their own after IDLE_THREAD_SECONDS: kept waiting here, so that only
    # the close and the with can end them (a dropped engine's thread looks at its flag when
    # it wakes, so the collection is checked with the idle time as it is).
    monkeypatch.setattr(transformers_batching, "IDLE_THREAD_SECONDS", 600.0)
    before = len(_schedulers())
    engine = _loaded(BatchingTransformersShardEngine())
    _opened(engine, {"a": 1})
    assert engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,))).status.ok
    assert len(_schedulers()) == before + 1
    engine.close()
    assert len(_schedulers()) == before
    with _loaded(BatchingTransformersShardEngine()) as scoped:
        _opened(scoped, {"a": 1})
        assert scoped.decode(DecodeRequest("a", 0, 1, token_ids=(2,))).status.ok
    assert len(_schedulers()) == before
    monkeypatch.undo()
    dropped = _loaded(BatchingTransformersShardEngine())
    _opened(dropped, {"a": 1})
    assert dropped.decode(DecodeRequest("a", 0, 1, token_ids=(2,))).status.ok
    del dropped
    gc.collect()
    _until(lambda: len(_schedulers()) == before)


def test_an_idle_scheduler_thread_ends_while_its_engine_lives_and_a_step_starts_another() -> None:
    """An engine the collector has not reached yet (the kit drops them by the hundred, some
    in reference cycles) holds no thread once it has been idle."""
    before = len(_schedulers())
    engine = _loaded(BatchingTransformersShardEngine())
    _opened(engine, {"a": 1})
    assert engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,))).status.ok
    _until(lambda: len(_schedulers()) == before)
    assert engine.decode(DecodeRequest("a", 0, 2, token_ids=(3,))).status.ok
    assert engine.batch_sizes() == [1, 1]
    engine.close()


def test_a_step_queued_when_the_engine_closes_fails_with_scheduler_closed() -> None:
    engine = _loaded(BatchingTransformersShardEngine(gather_seconds=NEVER))
    _opened(engine, {"a": 1})
    raised: list[BaseException] = []

    def decode() -> None:
        try:
            engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,)))
        except SchedulerClosed as error:
            raised.append(error)

    with _held(engine):
        thread = threading.Thread(target=decode)
        thread.start()
        _until(lambda: len(engine._batches.pending) == 1)
        closing = threading.Thread(target=engine.close)
        closing.start()
        closing.join(120)
    thread.join(120)
    assert len(raised) == 1
    with pytest.raises(SchedulerClosed):
        engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,)))


def test_gather_seconds_must_be_a_duration() -> None:
    with pytest.raises(ValueError, match="gather_seconds must be a finite float >= 0, got -1"):
        BatchingTransformersShardEngine(gather_seconds=-1)


@pytest.mark.parametrize("seed", [1, 2])
def test_it_fuzzes_clean_with_three_lanes(seed: int) -> None:
    before = len(_schedulers())
    result = fuzz(TARGET, seed=seed, concurrency=3)
    assert result.failure is None, result.failure.violation.message
    assert result.coverage[("parallel", "OK")] > 0
    gc.collect()
    _until(lambda: len(_schedulers()) == before)


@pytest.mark.parametrize("planted", BATCHING_PLANTED, ids=lambda engine: engine.__name__)
def test_the_kit_finds_each_planted_batching_bug_with_three_lanes_and_not_without(
    planted: type[BatchingTransformersShardEngine],
) -> None:
    """Found where two sessions' steps share a batch: a parallel phase (docs/pytorch.md#batching
    has the rate at seeds 1-5 and the shrunk lengths); a sequential run never batches two.

    Whether a phase's steps share a batch also depends on how the lanes' threads are
    scheduled: on a loaded CI host one seed's run sometimes made no batch of two. So the first
    of seeds 1, 3 and 4 that finds it counts, as in test_parallel_racy: both engines were
    found at each of those on an idle machine (at seed 2 the kit's draws never reach the
    cancel's race, whatever the scheduling)."""
    target = f"shardkit._planted.batching:{planted.__name__}"
    found = None
    for seed in (1, 3, 4):
        found = fuzz(target, seed=seed, concurrency=3, minimize=False).failure
        if found is not None:
            break
    assert found is not None, f"{planted.__name__} was not found with three lanes at seeds 1, 3 and 4"
    assert found.violation.property in planted.PROPERTIES, found.violation.message
    assert found.records[-1].action.op == PARALLEL_OP
    assert fuzz(target, seed=1, minimize=False).failure is None, "found without lanes, where nothing is batched"


def test_the_bench_measures_batching_with_one_two_and_three_lanes() -> None:
    from shardkit._bench.settings import BenchSettings
    from shardkit._bench.throughput import _batching_by_lanes

    figures = _batching_by_lanes(BenchSettings(examples=5, steps=10))
    assert list(figures) == ["1", "2", "3"]
    for row in figures.values():
        assert row["kit_steps_per_s"] > 0
        assert row["failure"] is None
        assert row["batches"] >= 0
