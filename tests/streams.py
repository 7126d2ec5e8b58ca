"""Calling a server's ``Calls`` stream by hand, and what every worker's stream must answer."""

from __future__ import annotations

import grpc  # type: ignore[import-untyped, unused-ignore]

from shardkit._transport import codec
from shardkit.proto import shard_engine_pb2 as pb

#: Long enough for any answer a test waits for.
PROMPT = 10.0


def handshake_calls(url: str) -> list[str]:
    """The optional RPCs the server at ``url`` (``grpc://HOST:PORT`` or ``unix:PATH``) lists."""
    channel = grpc.insecure_channel(url.removeprefix("grpc://"))
    try:
        handshake = channel.unary_unary(
            "/shardkit.v1.ShardEngineService/Handshake",
            request_serializer=pb.HandshakeRequest.SerializeToString,
            response_deserializer=pb.HandshakeResponse.FromString,
        )
        answer = handshake(pb.HandshakeRequest(protocol_version=codec.PROTOCOL_VERSION), timeout=PROMPT)
    finally:
        channel.close()
    return list(answer.calls)


def answers(url: str, calls: list[pb.Call]) -> list[pb.Answer]:
    """The answers to ``calls`` sent on one ``Calls`` stream to the server at ``url``."""
    channel = grpc.insecure_channel(url.removeprefix("grpc://"))
    try:
        stream = channel.stream_stream(
            "/shardkit.v1.ShardEngineService/Calls",
            request_serializer=pb.Call.SerializeToString,
            response_deserializer=pb.Answer.FromString,
        )
        return list(stream(iter(calls), timeout=PROMPT))
    finally:
        channel.close()


def check_a_stream_answers_each_call_with_its_status_and_goes_on(url: str) -> None:
    """A garbage request, a call the stream cannot carry and an unknown engine are each answered
    with the status the unary RPC would end with, and the calls after them are answered too."""
    assert "Calls" in handshake_calls(url)
    garbage, handshake, new_engine, unknown_engine = answers(
        url,
        [
            pb.Call(rpc="Prefill", request=b"\xff\xff\xff\xff\xff"),
            pb.Call(rpc="Handshake", request=pb.HandshakeRequest().SerializeToString()),
            pb.Call(rpc="NewEngine", request=pb.NewEngineRequest().SerializeToString()),
            pb.Call(rpc="Health", request=pb.EngineRef(engine_id=10**6).SerializeToString()),
        ],
    )
    assert garbage.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], garbage
    assert "Prefill request" in garbage.details
    assert handshake.status_code == grpc.StatusCode.UNIMPLEMENTED.value[0], handshake
    assert "Calls cannot carry a call of 'Handshake'" in handshake.details
    assert new_engine.status_code == grpc.StatusCode.OK.value[0], new_engine
    engine_id = pb.NewEngineResponse.FromString(new_engine.response).engine_id
    assert engine_id >= 1
    assert unknown_engine.status_code == grpc.StatusCode.NOT_FOUND.value[0], unknown_engine
    (health,) = answers(url, [pb.Call(rpc="Health", request=pb.EngineRef(engine_id=engine_id).SerializeToString())])
    assert health.status_code == grpc.StatusCode.OK.value[0], health
    assert not pb.HealthResult.FromString(health.response).serving  # never loaded
