"""The ``Calls`` stream over a worker's plain Unix socket (``shardkit._transport.calls_socket``):
what the kit's own workers (``--isolate``) take its calls on, with the answers, errors and
deadlines of the gRPC stream."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import pytest

from shardkit import DecodeRequest, FakeShardEngine, LoadRequest, PrefillRequest
from shardkit._transport.calls_socket import SocketStream, calls_socket_path
from shardkit._transport.isolation import isolated_target
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.remote import EngineServer, RemoteDeadlineExceeded, RemoteShardEngine, close_connections, serve

FULL = LoadRequest("m", 0, 3, 4)
_HEADER = struct.Struct(">I")


class SlowDecodes(FakeShardEngine):
    """The fake, whose decodes take a second."""

    def decode(self, request: DecodeRequest):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return super().decode(request)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[EngineServer, str]]:
    url = f"unix:{tmp_path / 'worker.sock'}"
    path = calls_socket_path(url)
    assert path is not None
    server = serve(SlowDecodes, url, calls_socket=path, max_message_bytes=1024)
    yield server, path
    close_connections()
    server.stop(0)
    assert not Path(path).exists()  # the listener's file goes with the server


def _ask(connection: socket.socket, frame: bytes) -> Any:
    connection.sendall(_HEADER.pack(len(frame)) + frame)
    (size,) = _HEADER.unpack(connection.recv(_HEADER.size, socket.MSG_WAITALL))
    return pb.Answer.FromString(connection.recv(size, socket.MSG_WAITALL))


def test_an_isolated_engines_calls_go_over_the_workers_socket_and_answer_as_in_process() -> None:
    target = isolated_target("shardkit:FakeShardEngine")
    try:
        engine = target()
        alone = FakeShardEngine()
        assert engine.load(FULL) == alone.load(FULL)
        steps = [
            ("prefill", PrefillRequest("a", 0, 0, token_ids=(1, 2))),
            ("decode", DecodeRequest("a", 0, 1, token_ids=(3,))),
            ("decode", DecodeRequest("a", 0, 5, token_ids=(4,))),  # skips ahead: a refusal
        ]
        for name, request in steps:
            assert getattr(engine, name)(request) == getattr(alone, name)(request)
        assert engine.metrics() == alone.metrics()
        assert isinstance(engine._connection._thread_stream(), SocketStream)  # type: ignore[attr-defined]
    finally:
        target.isolation.close()  # type: ignore[union-attr]


def test_the_socket_answers_garbage_and_calls_it_cannot_carry_with_their_status_and_goes_on(
    served: tuple[EngineServer, str],
) -> None:
    _, path = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(path)
        garbage = _ask(connection, b"\xff\xff\xff")
        assert garbage.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        handshake = _ask(connection, pb.Call(rpc="Handshake").SerializeToString())
        assert handshake.status_code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        unknown = _ask(connection, pb.Call(rpc="Health", request=pb.EngineRef(engine_id=999).SerializeToString()).SerializeToString())
        assert unknown.status_code == grpc.StatusCode.NOT_FOUND.value[0]
        built = _ask(connection, pb.Call(rpc="NewEngine", request=pb.NewEngineRequest().SerializeToString()).SerializeToString())
        assert built.status_code == grpc.StatusCode.OK.value[0]
        assert pb.NewEngineResponse.FromString(built.response).engine_id > 0


def test_an_answer_over_the_size_limit_is_refused_in_its_place_and_the_stream_goes_on(tmp_path: Path) -> None:
    path = str(tmp_path / "worker.sock.calls")
    # A limit that the answer of Capabilities exceeds, and those of NewEngine and Health do not.
    server = serve("shardkit:FakeShardEngine", f"unix:{tmp_path / 'worker.sock'}", calls_socket=path, max_message_bytes=64)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(path)
            built = _ask(connection, pb.Call(rpc="NewEngine", request=pb.NewEngineRequest().SerializeToString()).SerializeToString())
            engine = pb.EngineRef(engine_id=pb.NewEngineResponse.FromString(built.response).engine_id).SerializeToString()
            too_long = _ask(connection, pb.Call(rpc="Capabilities", request=engine).SerializeToString())
            assert too_long.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "exceeds this server's limit of 64" in too_long.details
            health = _ask(connection, pb.Call(rpc="Health", request=engine).SerializeToString())
            assert health.status_code == grpc.StatusCode.OK.value[0]
    finally:
        server.stop(0)


def test_a_deadline_passed_on_the_socket_is_a_deadline_error_and_the_next_call_opens_another(
    served: tuple[EngineServer, str],
) -> None:
    server, path = served
    engine = RemoteShardEngine(server.url, calls_socket=path, timeout_seconds=0.3)
    engine.load(FULL)
    assert engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2))).status.ok
    first = engine._connection._thread_stream()
    with pytest.raises(RemoteDeadlineExceeded, match=r"got no answer within its 0\.3 s deadline"):
        engine.decode(DecodeRequest("a", 0, 1, token_ids=(3,)))
    assert first.ended
    time.sleep(1.0)  # the late answer arrives on the dropped socket, never read as another's
    assert engine.health().serving
    assert engine._connection._thread_stream() is not first
