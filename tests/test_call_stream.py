"""The ``Calls`` stream: every call but the handshake over one stream per client thread, for a
server whose handshake lists it, with the answers and errors the unary RPCs give."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import pytest

from shardkit import DecodeRequest, FakeShardEngine, FakeShardEngineConfig, LoadRequest, PrefillRequest
from shardkit._run.runner import fuzz
from shardkit._transport.client import calls_sent, round_trips
from shardkit._transport.server import OPTIONAL_CALLS, ShardEngineServicer
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.remote import (
    EngineServer,
    RemoteDeadlineExceeded,
    RemoteEngineCrashed,
    RemoteShardEngine,
    RemoteUnavailable,
    close_connections,
    serve,
)
from tests import streams

FULL = LoadRequest("m", 0, 3, 4)
PROMPT = streams.PROMPT


@pytest.fixture
def served() -> Iterator[Callable[..., EngineServer]]:
    servers: list[EngineServer] = []

    def start(target: Any = "shardkit:FakeShardEngine", **options: Any) -> EngineServer:
        server = serve(target, "127.0.0.1:0", **options)
        servers.append(server)
        return server

    yield start
    close_connections()
    for server in servers:
        server.stop(0)


@pytest.fixture
def streamed_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The RPC of every call that servers in this process answered from a ``Calls`` stream."""
    answered: list[str] = []
    answer = ShardEngineServicer.streamed_answer

    def recording(self: ShardEngineServicer, call: pb.Call) -> pb.Answer:
        answered.append(call.rpc)
        return answer(self, call)

    monkeypatch.setattr(ShardEngineServicer, "streamed_answer", recording)
    return answered


def _stream_threads() -> int:
    """The server threads (of servers in this process) that serve a ``Calls`` stream."""
    return sum(thread.name.startswith("shardkit-calls-") for thread in threading.enumerate())


def _until(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + PROMPT
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_server_whose_handshake_lists_calls_answers_every_call_but_the_handshake_on_a_stream(
    served: Callable[..., EngineServer], streamed_calls: list[str]
) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    assert engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2))).status.ok
    assert engine.decode(DecodeRequest("a", 0, 1, token_ids=(3,))).status.ok
    assert engine.health().serving
    assert streamed_calls == ["NewEngine", "Load", "Prefill", "Decode", "Health"]
    assert _stream_threads() == 1


def test_a_server_without_calls_is_called_rpc_by_rpc_and_fuzzes_alike(
    served: Callable[..., EngineServer], streamed_calls: list[str]
) -> None:
    """An older server, whose handshake lists no optional call: a client never opens a stream."""
    streamed = fuzz(served().url, seed=2, examples=20, steps=20)
    assert streamed_calls
    streamed_calls.clear()
    unary = fuzz(served(optional_calls=()).url, seed=2, examples=20, steps=20)
    assert streamed_calls == []
    assert (unary.failure, unary.steps, unary.coverage) == (None, streamed.steps, streamed.coverage)


def test_each_thread_calls_on_its_own_stream_which_ends_with_the_thread(served: Callable[..., EngineServer]) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    assert _stream_threads() == 1
    # Each stream has a thread at either end: the server's, and the client's (gRPC's) that sends its calls.
    threads_before = set(threading.enumerate())
    ready, done = threading.Barrier(3), threading.Event()

    def call_and_wait() -> None:
        engine.health()
        ready.wait(PROMPT)
        done.wait(PROMPT)

    threads = [threading.Thread(target=call_and_wait) for _ in range(2)]
    for thread in threads:
        thread.start()
    ready.wait(PROMPT)
    assert _stream_threads() == 3
    started = set(threading.enumerate()) - threads_before
    assert len(started) >= 6  # the two callers, and the two ends of each of their streams
    done.set()
    for thread in threads:
        thread.join(PROMPT)
    gc.collect()
    assert _until(lambda: not any(thread.is_alive() for thread in started)), "a stream outlived the thread that called on it"
    assert _stream_threads() == 1
    close_connections()
    assert _until(lambda: _stream_threads() == 0), "a stream outlived its closed connection"


def test_a_streamed_call_that_misses_its_deadline_is_a_clear_error_and_the_next_call_opens_another_stream(
    served: Callable[..., EngineServer],
) -> None:
    release = threading.Event()
    server = served(lambda: FakeShardEngine(FakeShardEngineConfig(step_delay_seconds=30, sleep=release.wait)))
    engine = RemoteShardEngine(server.url, timeout_seconds=0.3)
    engine.load(FULL)
    started = time.perf_counter()
    try:
        with pytest.raises(
            RemoteDeadlineExceeded,
            match=r"decode\(session='a', epoch=0, step=0, 1 token\(s\)\) got no answer within its 0.3 s deadline",
        ) as missed:
            engine.decode(DecodeRequest("a", 0, 0, token_ids=(1,)))
        assert 0.3 <= time.perf_counter() - started < 3
        assert (missed.value.timeout_seconds, missed.value.address) == (0.3, server.url)
    finally:
        release.set()
    other = RemoteShardEngine(server.url, timeout_seconds=PROMPT)
    other.load(FULL)
    assert other.health().serving
    # The cancelled stream's thread ends once the engine's call returns; the new stream stays.
    assert _until(lambda: _stream_threads() == 1)


def test_the_stream_answers_a_garbage_or_unknown_call_with_its_status_and_goes_on(
    served: Callable[..., EngineServer],
) -> None:
    url = served().url
    streams.check_a_stream_answers_each_call_with_its_status_and_goes_on(url)
    (garbage,) = streams.answers(url, [pb.Call(rpc="Decode", request=b"\xff\xff")])
    assert "its 2 bytes are not a shardkit.v1.StepCall message" in garbage.details


def test_an_older_server_lists_no_optional_call_and_refuses_the_stream(served: Callable[..., EngineServer]) -> None:
    url = served(optional_calls=()).url
    assert streams.handshake_calls(url) == []
    with pytest.raises(grpc.RpcError) as refused:
        streams.answers(url, [pb.Call(rpc="NewEngine", request=b"")])
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "this server does not offer Calls" in refused.value.details()


def test_a_server_refuses_an_optional_call_it_does_not_have_naming_those_it_has() -> None:
    with pytest.raises(ValueError, match=r"optional_calls names \['Batch'\].*choose among \['Calls'\]"):
        serve("shardkit:FakeShardEngine", "127.0.0.1:0", optional_calls=("Batch",))
    assert OPTIONAL_CALLS == ("Calls",)


def test_a_stream_that_the_server_ends_is_dropped_and_the_error_names_the_server_gone(
    served: Callable[..., EngineServer],
) -> None:
    server = served()
    engine = RemoteShardEngine(server.url, timeout_seconds=PROMPT)
    engine.load(FULL)
    server.stop(0)
    with pytest.raises(RemoteUnavailable, match="the engine server is unreachable"):
        engine.health()


@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "unary"])
def test_calls_sent_together_answer_as_one_by_one_in_one_round_trip_on_a_stream(
    served: Callable[..., EngineServer], streamed: bool
) -> None:
    server = served(optional_calls=OPTIONAL_CALLS if streamed else ())
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    alone = FakeShardEngine()
    alone.load(FULL)
    calls: list[tuple[str, Any]] = [
        ("prefill", PrefillRequest("a", 0, 0, token_ids=(1, 2))),
        ("decode", DecodeRequest("a", 0, 1, token_ids=(3,))),
        ("decode", DecodeRequest("a", 0, 5, token_ids=(4,))),  # skips ahead: a refusal, in the answer
        ("release", "a"),
    ]
    before, sent_before = round_trips(), calls_sent()
    answered = list(engine.calls_together(calls))
    assert (round_trips() - before, calls_sent() - sent_before) == ((1 if streamed else 4), 4)
    expected = [getattr(alone, name)(argument) for name, argument in calls]
    assert answered == expected
    assert answered[2].status.code.name == "FAILED_PRECONDITION"


def test_calls_of_several_engines_sent_before_any_answer_is_read_make_one_round_trip(
    served: Callable[..., EngineServer],
) -> None:
    """What the twins of a new history do: each engine's calls are sent, then each is judged;
    a call made meanwhile reads past the answers before its own, which stay with their calls."""
    server = served()
    first, second = RemoteShardEngine(server.url), RemoteShardEngine(server.url)
    first.load(FULL)
    second.load(FULL)
    alone = FakeShardEngine()
    alone.load(FULL)
    prompt, longer = PrefillRequest("a", 0, 0, token_ids=(1, 2)), PrefillRequest("a", 0, 0, token_ids=(1, 2, 3))
    before = round_trips()
    answered_first = first.calls_together([("prefill", prompt), ("release", "a")])
    answered_second = second.calls_together([("prefill", longer)])
    assert second.health().serving  # reads the three answers sent before its own
    assert round_trips() - before == 1
    assert list(answered_first) == [alone.prefill(prompt), alone.release("a")]
    assert list(answered_second) == [alone.prefill(longer)]
    assert round_trips() - before == 1


def test_an_error_among_calls_sent_together_is_raised_in_its_place_and_the_stream_stays_in_step(
    served: Callable[..., EngineServer],
) -> None:
    server = served(lambda: FakeShardEngine(FakeShardEngineConfig(crash_after_calls=1)))
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    answers = engine.calls_together(
        [
            ("prefill", PrefillRequest("a", 0, 0, token_ids=(1,))),
            ("decode", DecodeRequest("a", 0, 1, token_ids=(2,))),
            ("release", "a"),
        ]
    )
    assert next(answers).status.ok
    with pytest.raises(RemoteEngineCrashed, match=r"decode\(session='a', epoch=0, step=1, 1 token\(s\)\): the engine raised"):
        next(answers)
    # Every answer was read: the next call on this thread's stream gets its own.
    other = RemoteShardEngine(server.url)
    assert other.load(FULL).status.ok
    assert other.health().serving
