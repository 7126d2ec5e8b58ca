"""Engines over gRPC: the codec, ``shardkit serve``, ``grpc://``/``unix:`` targets, and a worker
written without shardkit. Servers run in-process on port 0 (the worker as a subprocess)
and are always stopped; no test waits on a hang longer than its deadline."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    EngineTensor,
    FakeShardEngine,
    FakeShardEngineConfig,
    Fault,
    HealthResult,
    InvalidTarget,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
    assert_shard_engine_contract,
)
from shardkit._cli.main import main
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit._transport import client as transport_client
from shardkit._transport import codec
from shardkit._transport.resolve import resolve_target
from shardkit._transport.server import ShardEngineServicer
from shardkit.contract import FAULT_KINDS
from shardkit.errors import EngineLost
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.proto import shard_engine_pb2_grpc as pb_grpc
from shardkit.remote import (
    EngineServer,
    RemoteDeadlineExceeded,
    RemoteEngineCrashed,
    RemoteEngineError,
    RemoteEngineEvicted,
    RemoteProtocolError,
    RemoteShardEngine,
    RemoteUnavailable,
    close_connections,
    serve,
)
from tests import streams
from tests.planted import DelegatingEngine

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "standalone_worker.py"
FULL = LoadRequest("m", 0, 3, 4)


@pytest.fixture
def served() -> Iterator[Callable[..., EngineServer]]:
    """Start servers on a free port; every one is stopped, and cached channels closed, afterwards."""
    servers: list[EngineServer] = []

    def start(target: Any = "shardkit:FakeShardEngine", listen: str = "127.0.0.1:0", **options: Any) -> EngineServer:
        server = serve(target, listen, **options)
        servers.append(server)
        return server

    yield start
    close_connections()
    for server in servers:
        server.stop(0)


# --- the codec ------------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2**62, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**200, -(2**200)]
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=8) | st.sampled_from(
    ["", "é", "сессия", "🦀", "a\x00b"]
)
int64s = st.integers(codec.INT64_MIN, codec.INT64_MAX) | st.sampled_from([-1, 0, 2**63 - 1, -(2**63)])
counters = st.integers() | st.sampled_from(EDGE_INTS)  # epochs and steps: any int reaches the engine
small = st.integers(0, 1000)
statuses = st.builds(StructuredStatus, st.sampled_from(list(StatusCode)), texts, st.booleans())
tensors = st.builds(
    EngineTensor, texts, st.sampled_from(["float32", "float64", "bf16?", ""]), st.tuples(small, small), st.binary()
) | st.builds(
    EngineTensor.from_array,
    texts,
    st.sampled_from([np.zeros((0, 8), "float32"), np.arange(6.0).reshape(2, 3), np.array([[1, -2]], ">i4")]),
)
sidebands = st.none() | st.just(()) | st.lists(int64s, max_size=4).map(tuple)
bundles = st.builds(
    BoundaryBundle, texts, counters, counters, texts, texts, st.lists(tensors, max_size=2).map(tuple), sidebands
)
token_outputs = st.builds(TokenOutput, int64s, st.none() | st.floats(allow_nan=False))
token_inputs = st.lists(int64s, max_size=4).map(tuple)


def _step_requests(kind: type[PrefillRequest] | type[DecodeRequest]) -> st.SearchStrategy[Any]:
    with_tokens = st.builds(lambda s, e, n, t: kind(s, e, n, token_ids=t), texts, counters, counters, token_inputs)
    with_bundle = st.builds(lambda s, e, n, b: kind(s, e, n, bundle=b), texts, counters, counters, bundles)
    return with_tokens | with_bundle


recipes = st.dictionaries(
    texts, st.none() | st.booleans() | int64s | texts | st.floats(allow_nan=False, allow_infinity=False), max_size=3
)
load_requests = st.builds(
    lambda model, start, extra, more, recipe: LoadRequest(model, start, start + extra, start + extra + more, recipe),
    texts,
    small,
    small,
    st.integers(1, 100),
    recipes,
)
capabilities = st.builds(
    EngineCapabilities,
    architecture=texts,
    evidence_class=st.sampled_from(["fixture", "real"]),
    total_layers=int64s,
    shard_start=int64s,
    shard_end=int64s,
    hidden_size=int64s,
    vocab_size=int64s,
    dtype=texts,
    max_sessions=int64s,
    max_kv_tokens=int64s,
    supported_faults=st.frozensets(st.sampled_from(FAULT_KINDS)),
    tolerance=st.floats(0, 1e9),
)
step_results = st.builds(StepResult, statuses, st.sampled_from(list(CacheResult)), st.none() | bundles | token_outputs)

#: (a §1 value strategy, encode, decode): every value must survive encode → bytes → decode.
ROUND_TRIPS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], Any], Callable[[Any], Any]]] = {
    "StructuredStatus": (statuses, codec.status_to_pb, codec.status_from_pb),
    "LoadRequest": (load_requests, codec.load_request_to_pb, codec.load_request_from_pb),
    "LoadResult": (st.builds(LoadResult, statuses, texts), codec.load_result_to_pb, codec.load_result_from_pb),
    "EngineCapabilities": (capabilities, codec.capabilities_to_pb, codec.capabilities_from_pb),
    "EngineTensor": (tensors, codec.tensor_to_pb, codec.tensor_from_pb),
    "BoundaryBundle": (bundles, codec.bundle_to_pb, codec.bundle_from_pb),
    "TokenOutput": (token_outputs, codec.token_output_to_pb, codec.token_output_from_pb),
    "PrefillRequest": (
        _step_requests(PrefillRequest),
        codec.step_request_to_pb,
        lambda message: codec.step_request_from_pb(message, PrefillRequest),
    ),
    "DecodeRequest": (
        _step_requests(DecodeRequest),
        codec.step_request_to_pb,
        lambda message: codec.step_request_from_pb(message, DecodeRequest),
    ),
    "StepResult": (step_results, codec.step_result_to_pb, codec.step_result_from_pb),
    "HealthResult": (st.builds(HealthResult, statuses, st.booleans()), codec.health_to_pb, codec.health_from_pb),
    "MetricsResult": (
        st.builds(MetricsResult, int64s, int64s, int64s, int64s),
        codec.metrics_to_pb,
        codec.metrics_from_pb,
    ),
    "Fault": (
        st.builds(Fault, st.sampled_from(FAULT_KINDS), st.floats(allow_nan=False, allow_infinity=False)),
        codec.fault_to_pb,
        codec.fault_from_pb,
    ),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_every_spec_type_survives_the_wire(name: str) -> None:
    strategy, encode, decode = ROUND_TRIPS[name]

    @settings(deadline=None)  # the clock decides no result: a busy machine must not fail a round trip
    @given(strategy)
    def round_trip(value: Any) -> None:
        message = encode(value)
        assert decode(type(message).FromString(message.SerializeToString())) == value

    round_trip()


@pytest.mark.parametrize("value", EDGE_INTS)
def test_an_epoch_or_step_of_any_size_reaches_the_engine_and_int64_ones_travel_as_sint64(value: int) -> None:
    request = DecodeRequest("é", value, value, token_ids=(1,))
    message = codec.step_request_to_pb(request)
    fits = codec.INT64_MIN <= value <= codec.INT64_MAX
    assert message.WhichOneof("epoch_value") == ("epoch" if fits else "epoch_decimal")
    assert codec.step_request_from_pb(pb.StepRequest.FromString(message.SerializeToString()), DecodeRequest) == request
    call = pb.CancelCall(session_id="a")
    codec.put_counter(call, "epoch", value)
    assert codec.get_counter(pb.CancelCall.FromString(call.SerializeToString()), "epoch") == value


def test_none_and_empty_stay_apart_on_the_wire() -> None:
    bundle = BoundaryBundle("a", 0, 0, "post_head_residual", "x", (), None)
    for sideband in (None, ()):
        assert (
            codec.bundle_from_pb(codec.bundle_to_pb(replace(bundle, token_id_sideband=sideband))).token_id_sideband
            == sideband
        )
    for margin in (None, 0.0):
        assert codec.token_output_from_pb(codec.token_output_to_pb(TokenOutput(1, margin))).margin == margin
    empty = PrefillRequest("a", 0, 0, token_ids=())
    assert codec.step_request_from_pb(codec.step_request_to_pb(empty), PrefillRequest) == empty
    refused = StepResult(StructuredStatus(StatusCode.NOT_FOUND), CacheResult.MISS)
    assert codec.step_result_from_pb(codec.step_result_to_pb(refused)).output is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (PrefillRequest("a", 0, 0, token_ids=(0, 2**63)), "PrefillRequest.token_ids[1]=9223372036854775808"),
        (TokenOutput(-(2**63) - 1), "TokenOutput.token_id"),
        (MetricsResult(0, 0, 0, 2**64), "MetricsResult.kv_tokens"),
        (LoadRequest("m", 0, 0, 1, {"weights": object()}), "LoadRequest.recipe"),
    ],
)
def test_a_value_the_wire_cannot_carry_is_refused_naming_the_field(value: Any, field: str) -> None:
    encode = {
        PrefillRequest: codec.step_request_to_pb,
        TokenOutput: codec.token_output_to_pb,
        MetricsResult: codec.metrics_to_pb,
        LoadRequest: codec.load_request_to_pb,
    }[type(value)]
    with pytest.raises(codec.WireFormatError, match=re.escape(f"cannot encode {field}")):
        encode(value)


@pytest.mark.parametrize(
    ("message", "decode", "problem"),
    [
        (pb.StructuredStatus(), codec.status_from_pb, "is not a status code"),
        (
            pb.StepResult(status=pb.StructuredStatus(code=pb.STATUS_CODE_OK)),
            codec.step_result_from_pb,
            "is not HIT or MISS",
        ),
        (pb.HealthResult(), codec.health_from_pb, "lacks its 'status' field"),
        (pb.StepRequest(session_id="a"), lambda m: codec.step_request_from_pb(m, PrefillRequest), "neither token_ids"),
        (
            pb.StepRequest(epoch_decimal="1e9", token_ids=pb.TokenIds()),
            lambda m: codec.step_request_from_pb(m, DecodeRequest),
            "not a decimal",
        ),
        (pb.EngineCapabilities(evidence_class="guess"), codec.capabilities_from_pb, "evidence_class"),
        (pb.Fault(kind="meteor"), codec.fault_from_pb, "Fault.kind"),
        (pb.LoadRequest(total_layers=1, recipe_json="[1]"), codec.load_request_from_pb, "JSON object"),
    ],
)
def test_garbage_on_the_wire_is_a_wire_format_error_naming_what(
    message: Any, decode: Callable[[Any], Any], problem: str
) -> None:
    with pytest.raises(codec.WireFormatError, match=problem):
        decode(message)


# --- served engines ----------------------------------------------------------------------------------


def test_a_served_fake_passes_the_contract_over_tcp_and_over_a_unix_socket(
    served: Callable[..., EngineServer], tmp_path: Path
) -> None:
    for listen in ("127.0.0.1:0", f"unix:{tmp_path / 'fake.sock'}"):
        server = served(listen=listen)
        assert server.url.startswith("grpc://127.0.0.1:" if listen.startswith("127") else "unix:")
        assert assert_shard_engine_contract(resolve_target(server.url)) == []


def test_each_remote_engine_is_a_fresh_engine_of_its_own(served: Callable[..., EngineServer]) -> None:
    server = served()
    first, second = RemoteShardEngine(server.url), RemoteShardEngine(server.url)
    assert first.engine_id != second.engine_id
    assert first.load(FULL).status.ok
    assert first.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2))).status.ok
    assert (first.health().serving, second.health().serving) == (True, False)
    assert second.metrics() == MetricsResult(0, 0, 0, 0)
    with pytest.raises(EngineError) as refusal:  # load misuse travels as EngineError, status intact
        first.load(FULL)
    assert refusal.value.status.code is StatusCode.FAILED_PRECONDITION
    assert "already serves layers 0..3" in refusal.value.status.message
    first.close()
    first.close()  # twice is fine
    with pytest.raises(RemoteEngineError, match=r"metrics\(\).*no engine \d+ on this server"):
        first.metrics()
    assert server.servicer.engine_count == 1


def test_faults_reach_a_native_engine_and_an_engine_without_inject_fault_supports_none(
    served: Callable[..., EngineServer],
) -> None:
    native = RemoteShardEngine(served().url)
    assert native.capabilities().supported_faults == frozenset(FAULT_KINDS)
    native.load(FULL)
    assert native.inject_fault(Fault("memory_pressure", 1.0)).ok
    assert native.capabilities().max_kv_tokens == 1
    refused = native.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    assert (refused.status.code, refused.status.retryable) == (StatusCode.RESOURCE_EXHAUSTED, True)

    plain = RemoteShardEngine(served("tests.planted:ReleaseLeaksKvTokens").url)
    assert plain.capabilities().supported_faults == frozenset(FAULT_KINDS)  # it forwards inject_fault
    bare = RemoteShardEngine(served(WithoutFaults).url)
    assert bare.capabilities().supported_faults == frozenset()
    assert bare.inject_fault(Fault("delay", 0.0)).code is StatusCode.UNIMPLEMENTED


class WithoutFaults(DelegatingEngine):
    """The fake without ``inject_fault``: its capabilities list every fault, but it takes none."""


def _same_failure(local: FuzzResult, remote: FuzzResult) -> None:
    assert local.failure is not None
    assert remote.failure is not None
    assert remote.failure.violation == local.failure.violation
    assert [record.action for record in remote.failure.records] == [record.action for record in local.failure.records]


def test_fuzzing_a_served_planted_bug_finds_the_same_minimal_failure_as_in_process(
    served: Callable[..., EngineServer], tmp_path: Path
) -> None:
    target = "tests.planted:ReleaseLeaksKvTokens"
    local = fuzz(target, seed=1, examples=50, steps=30)
    remote = fuzz(served(target).url, seed=1, examples=50, steps=30, out=tmp_path)
    _same_failure(local, remote)
    assert local.failure is not None
    assert (local.failure.violation.property, len(local.failure.records)) == ("§2 metrics", 2)
    assert remote.trace_path is not None
    assert main(["replay", str(remote.trace_path)]) == 1  # the trace names the grpc:// target


def test_the_same_seed_writes_the_same_trace_in_process_over_grpc_and_isolated(
    served: Callable[..., EngineServer], tmp_path: Path
) -> None:
    """Byte for byte, but for the fields that say how the engine was reached: the target
    (and the folder a module target was imported from), and the isolation's settings."""
    target = "tests.planted:ReleaseLeaksKvTokens"
    runs = {
        "in-process": fuzz(target, seed=1, examples=50, steps=30, out=tmp_path / "local"),
        "grpc": fuzz(served(target).url, seed=1, examples=50, steps=30, out=tmp_path / "grpc"),
        # A server without the Calls stream (an older one) is called RPC by RPC.
        "grpc, unary": fuzz(served(target, optional_calls=()).url, seed=1, examples=50, steps=30, out=tmp_path / "unary"),
        "isolated": fuzz(target, seed=1, examples=50, steps=30, isolate=True, out=tmp_path / "isolated"),
    }
    reached = {"target": None, "target_path": None, "isolate": None}
    traces = {}
    for mode, result in runs.items():
        assert result.trace_path is not None, mode
        written = result.trace_path.read_text()
        fields = json.loads(written)
        # The file is exactly its fields, as the kit writes them: comparing the fields is comparing the bytes.
        assert json.dumps(fields, indent=2, ensure_ascii=False) + "\n" == written
        traces[mode] = {**fields, **reached}
        assert set(fields) >= set(reached) - {"target_path"}, mode
    assert traces["grpc"] == traces["grpc, unary"] == traces["in-process"] == traces["isolated"]


def test_an_isolated_trace_replays_against_a_served_engine_with_its_own_deadline(
    served: Callable[..., EngineServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``replay --engine grpc://… --step-timeout S`` of a trace found with --isolate once ended
    in an internal ValueError, and said the engine ran "in a worker process"."""
    target = "tests.planted:ReleaseLeaksKvTokens"
    isolated = fuzz(target, seed=1, examples=50, steps=30, isolate=True, out=tmp_path)
    assert isolated.trace_path is not None
    url = served(target).url
    for deadline in ([], ["--step-timeout", "2"]):
        assert main(["replay", str(isolated.trace_path), "--engine", url, *deadline]) == 1
        first, *rest = capsys.readouterr().out.splitlines()
        assert first == f"replaying against {url} (named by you)"
        assert rest[0] == "FAILURE (§2 metrics) in 2 steps:"


def test_fuzzing_the_served_fake_behaves_exactly_like_in_process_and_costs_this_much(
    served: Callable[..., EngineServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """Same seed, same run: no failure, the same steps and outcomes; prints the overhead."""
    started = time.perf_counter()
    local = fuzz("shardkit:FakeShardEngine", seed=1, examples=100, steps=40)
    local_s = time.perf_counter() - started
    server = served()
    started = time.perf_counter()
    remote = fuzz(server.url, seed=1, examples=100, steps=40)
    remote_s = time.perf_counter() - started
    assert local.failure is None
    assert remote.failure is None
    assert (remote.examples, remote.steps, remote.coverage) == (local.examples, local.steps, local.coverage)
    with capsys.disabled():
        print(
            f"\n[overhead] fake, seed 1, 100 examples x 40 steps = {local.steps} steps: "
            f"in-process {local.steps / local_s:,.0f} steps/s ({local_s:.2f} s), "
            f"grpc {remote.steps / remote_s:,.0f} steps/s ({remote_s:.2f} s), x{remote_s / local_s:.1f}"
        )


# --- failures are clear errors, never hangs --------------------------------------------------------------


def test_a_refused_connection_is_a_clear_error_at_once(tmp_path: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(
        RemoteUnavailable, match=r"grpc://127\.0\.0\.1:1: handshake failed: the engine server is unreachable"
    ):
        RemoteShardEngine("grpc://127.0.0.1:1")
    with pytest.raises(RemoteUnavailable, match=r"unix:.*nothing\.sock: handshake failed"):
        RemoteShardEngine(f"unix:{tmp_path / 'nothing.sock'}")
    with pytest.raises(InvalidTarget, match=r"engine target 'grpc://127\.0\.0\.1:1' raised RemoteUnavailable"):
        resolve_target("grpc://127.0.0.1:1")()
    assert time.perf_counter() - started < 3


@pytest.mark.parametrize("address", ["grpc://127.0.0.1", "grpc://:7000", "grpc://host:port", "unix:", "unix:///"])
def test_a_malformed_remote_address_is_an_invalid_target(address: str) -> None:
    with pytest.raises(InvalidTarget, match="remote engine address"):
        resolve_target(address)


def test_a_protocol_version_mismatch_is_a_clear_error_naming_both_versions(
    served: Callable[..., EngineServer],
) -> None:
    newer = served(protocol_version="shardkit.v1/2")
    with pytest.raises(
        RemoteProtocolError, match=r"the client speaks 'shardkit\.v1/1', this server speaks 'shardkit\.v1/2'"
    ):
        RemoteShardEngine(newer.url)


class _CarelessServicer(ShardEngineServicer):
    """A server that checks nothing and answers the handshake with another version."""

    def Handshake(self, request: Any, context: Any) -> Any:
        return pb.HandshakeResponse(protocol_version="shardkit.v9/1")


def test_a_server_answering_another_version_is_refused_by_the_client() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ShardEngineServiceServicer_to_server(_CarelessServicer(resolve_target(FakeShardEngine)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(
            RemoteProtocolError,
            match=f"grpc://127.0.0.1:{port}: protocol version mismatch: this client speaks 'shardkit.v1/1', the server speaks 'shardkit.v9/1'",
        ):
            RemoteShardEngine(f"grpc://127.0.0.1:{port}")
    finally:
        close_connections()
        server.stop(0)


def test_a_server_that_goes_away_mid_run_is_a_clear_error(served: Callable[..., EngineServer]) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    server.stop(0)
    started = time.perf_counter()
    with pytest.raises(
        RemoteUnavailable,
        match=r"prefill\(session='a', epoch=0, step=0, 1 token\(s\)\) failed: the engine server is unreachable",
    ):
        engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    assert time.perf_counter() - started < 3


def test_a_server_that_goes_away_mid_fuzz_ends_the_run_naming_it_not_the_engine(
    served: Callable[..., EngineServer],
) -> None:
    """Whether the kit notices in a step or when it builds the next engine, a lost server
    is not a finding about the engine (it used to be reported as one, or to end in
    Hypothesis's FlakyStrategyDefinition): the run ends at once with EngineLost."""
    server = served()
    built = 0

    def stopping() -> FakeShardEngine:
        nonlocal built
        built += 1
        if built == 12:  # a dozen engines into the run, the server stops
            threading.Thread(target=server.server.stop, args=(0,)).start()
        return FakeShardEngine()

    server.servicer.target = resolve_target(stopping)
    started = time.perf_counter()
    with pytest.raises(EngineLost, match=rf"the engine server at {re.escape(server.url)} went away during ") as lost:
        fuzz(server.url, seed=1, examples=20, steps=20, minimize=False)
    assert lost.value.address == server.url
    assert isinstance(lost.value.__cause__, RemoteUnavailable)
    assert time.perf_counter() - started < 30


def test_a_remote_engine_built_by_hand_still_raises_remote_unavailable(served: Callable[..., EngineServer]) -> None:
    """EngineLost is for the kit's runs (remote_target); a RemoteShardEngine of one's own keeps its exceptions."""
    server = served()
    engine = RemoteShardEngine(server.url)
    target = resolve_target(server.url)
    kits = target()
    server.stop(0)
    with pytest.raises(RemoteUnavailable):
        engine.health()
    with pytest.raises(EngineLost, match=r"went away during health\(\)"):
        kits.health()
    with pytest.raises(EngineLost, match="went away during "):
        target()  # it served an engine before: the server was lost
    with pytest.raises(InvalidTarget, match="unreachable"):
        resolve_target(server.url)()  # never reached: the address is wrong, an input error


def test_a_call_on_a_closed_connection_is_a_clear_error(served: Callable[..., EngineServer]) -> None:
    engine = RemoteShardEngine(served().url)
    close_connections()
    with pytest.raises(RemoteUnavailable, match=r"health\(\) failed: the connection was closed"):
        engine.health()
    assert RemoteShardEngine(engine.url).health().serving is False  # a new engine connects afresh


def test_a_call_that_misses_its_deadline_is_a_clear_error(served: Callable[..., EngineServer]) -> None:
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
    finally:
        release.set()
    assert 0.3 <= time.perf_counter() - started < 3
    assert (missed.value.timeout_seconds, missed.value.address) == (0.3, server.url)


def test_an_engine_that_raises_is_a_crash_naming_the_exception(served: Callable[..., EngineServer]) -> None:
    # One prefill/decode succeeds, the next raises, and the engine stays dead (DGR-032).
    server = served(lambda: FakeShardEngine(FakeShardEngineConfig(crash_after_calls=1)))
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    assert engine.prefill(PrefillRequest("ü", 0, 0, token_ids=(1,))).status.ok
    with pytest.raises(
        RemoteEngineCrashed,
        match=r"decode\(session='ü', epoch=0, step=1, 1 token\(s\)\): the engine raised shardkit\.engines\.fake\.FakeEngineCrash: FakeShardEngine process died",
    ) as crash:
        engine.decode(DecodeRequest("ü", 0, 1, token_ids=(2,)))
    assert crash.value.exception_type == "FakeEngineCrash"
    assert "the process died in decode()" in str(crash.value)
    with pytest.raises(RemoteEngineCrashed, match=r"cancel\(session='ü', epoch=0\): the engine raised"):
        engine.cancel("ü", 0)


def test_a_native_crash_fault_over_grpc_restarts_a_fresh_remote_engine(served: Callable[..., EngineServer]) -> None:
    result = fuzz(served().url, seed=4, examples=30, steps=30, faults="crash")
    assert result.failure is None
    crashes = sum(count for (_, outcome), count in result.coverage.items() if outcome == "CRASH")
    assert crashes > 0  # each one restarted a fresh engine on the server


# --- shardkit serve and the standalone worker -------------------------------------------------------------


def _start(command: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.kill()
        _, stderr = process.communicate(timeout=10)
        pytest.fail(f"{command} did not start: {stderr}")
    return process, line.strip()


def _stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    return stderr


def test_shardkit_serve_serves_a_target_until_ctrl_c(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "shardkit",
        "serve",
        "tests.planted:ReleaseLeaksKvTokens",
        "--listen",
        "127.0.0.1:0",
    ]
    process, line = _start(command, env)
    try:
        assert line.startswith("serving tests.planted:ReleaseLeaksKvTokens on grpc://127.0.0.1:")
        url = line.rpartition(" ")[2]
        assert main(["contract", url]) == 1  # the planted bug, found across the wire
    finally:
        close_connections()
        stderr = _stop(process)
    assert process.returncode == 130
    assert stderr.strip().splitlines()[-1] == "shardkit: interrupted"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["serve", "shardkit:FakeShardEngine", "--listen", "localhost"], "must be HOST:PORT"),
        (["serve", "shardkit:FakeShardEngine", "--listen", "unix:"], "a unix socket needs a path"),
        (["serve", "no_such_module:Engine"], "cannot import 'no_such_module'"),
        (["serve"], "the following arguments are required: target"),
        (
            ["serve", "shardkit:FakeShardEngine", "--max-engines", "0"],
            "--max-engines must be a positive integer, got '0'",
        ),
    ],
)
def test_serve_usage_errors_exit_2_with_one_line(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert reason in err


def test_serve_on_a_port_in_use_exits_2_with_one_line(
    served: Callable[..., EngineServer], capsys: pytest.CaptureFixture[str]
) -> None:
    taken = served().url.removeprefix("grpc://")
    assert main(["serve", "shardkit:FakeShardEngine", "--listen", taken]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardkit: error: cannot listen on '{taken}'")
    assert len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    """The standalone worker as a subprocess: no PYTHONPATH, so shardkit is not even importable from its path."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    process, line = _start([sys.executable, str(WORKER), "--listen", "127.0.0.1:0"], env)
    try:
        assert line.startswith("listening on grpc://127.0.0.1:")
        yield line.rpartition(" ")[2]
    finally:
        close_connections()
        _stop(process)


def test_the_standalone_worker_imports_no_shardkit() -> None:
    text = WORKER.read_text()
    assert "import shardkit" not in text
    assert "from shardkit" not in text


def test_the_standalone_worker_passes_shardkit_contract(worker: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", worker]) == 0
    out = capsys.readouterr().out
    assert f"{worker}: every contract check passed, 3 skipped:" in out  # it serves the full model only


def test_the_standalone_worker_knowing_no_answers_ahead_is_asked_every_call(worker: str, rpcs: list[str]) -> None:
    dropped = RemoteShardEngine(worker)
    del dropped
    gc.collect()
    engine = RemoteShardEngine(worker)
    total = engine.capabilities().total_layers
    engine.load(LoadRequest("m", 0, total - 1, total))
    engine.capabilities()
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    engine.metrics()
    engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,)))
    assert engine.metrics().decode_calls == 1
    assert rpcs[-9:] == [
        "NewEngine", "CloseEngine", "Capabilities", "Load", "Capabilities", "Prefill", "Metrics", "Decode", "Metrics"
    ]


def test_the_standalone_worker_answers_the_calls_stream_as_its_rpcs(worker: str) -> None:
    streams.check_a_stream_answers_each_call_with_its_status_and_goes_on(worker)


def test_the_standalone_worker_survives_a_fuzz_run_with_every_fault(worker: str) -> None:
    result = fuzz(worker, seed=2, examples=40, steps=30)
    assert result.failure is None, result.failure and result.failure.violation.message
    assert result.faults == frozenset({"delay", "malformed_output", "crash"})  # at the client's boundary


# --- serve hardening: no authentication warned of, engines bounded, messages bounded ----------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("[::1]", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("[::]", False),
        ("10.0.0.5", False),
        ("myhost.example", False),
    ],
)
def test_only_loopback_hosts_count_as_loopback(host: str, loopback: bool) -> None:
    from shardkit._core.targets import is_loopback

    assert is_loopback(host) is loopback


def test_serve_on_every_interface_warns_in_one_line_that_it_has_no_authentication() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    warnings = {}
    for listen in ("0.0.0.0:0", "127.0.0.1:0"):
        process, line = _start(
            [sys.executable, "-m", "shardkit", "serve", "shardkit:FakeShardEngine", "--listen", listen], env
        )
        assert line.startswith("serving shardkit:FakeShardEngine on grpc://")
        stderr = _stop(process)
        warnings[listen] = [text for text in stderr.splitlines() if "warning" in text]
    assert warnings["127.0.0.1:0"] == []
    (warning,) = warnings["0.0.0.0:0"]
    assert warning.startswith("shardkit serve: warning: 0.0.0.0:0 is reachable from other machines")
    assert "no authentication" in warning
    assert "anyone who can reach the port can run this engine" in warning


def test_a_server_keeps_at_most_max_engines_and_names_an_evicted_one(served: Callable[..., EngineServer]) -> None:
    server = served(max_engines=3)
    engines = [RemoteShardEngine(server.url) for _ in range(3)]
    engines[0].health()  # engine 1 is now the most recently used; engine 2 the least
    newest = RemoteShardEngine(server.url)
    assert server.servicer.engine_count == 3
    with pytest.raises(
        RemoteEngineEvicted, match=r"engine \d+ was evicted: this server keeps at most 3 engines"
    ) as evicted:
        engines[1].health()
    assert evicted.value.code == "FAILED_PRECONDITION"
    assert "--max-engines" in str(evicted.value)
    for engine in (engines[0], engines[2], newest):
        assert engine.health().status.ok
    with pytest.raises(RemoteEngineError, match="NOT_FOUND"):
        RemoteShardEngine(server.url)._connection.call("health()", "Health", pb.EngineRef(engine_id=10**6), 5.0)


def test_an_evicted_engine_ends_a_kit_run_as_a_lost_engine_not_a_finding(served: Callable[..., EngineServer]) -> None:
    server = served(max_engines=1)
    target = resolve_target(server.url)
    engine = target()
    target()  # evicts the first
    with pytest.raises(EngineLost, match=f"the engine server at {re.escape(server.url)} evicted the engine under test"):
        engine.health()


def test_engines_a_client_never_closes_are_reclaimed() -> None:
    """Each NewEngine without CloseEngine used to stay on the server for good (20 000 grew it by 17 MB)."""
    servicer = ShardEngineServicer(resolve_target("shardkit:FakeShardEngine"), max_engines=16)

    class Context:
        def set_trailing_metadata(self, metadata: object) -> None:
            pass

        def abort(self, code: object, details: str) -> None:
            raise AssertionError(details)

    for _ in range(2_000):
        servicer.NewEngine(pb.NewEngineRequest(), Context())
    assert servicer.engine_count == 16
    assert servicer.evictions == 2_000 - 16
    assert len(servicer._evicted) <= 4096


def test_messages_are_limited_on_both_ends_and_an_oversized_one_is_named(served: Callable[..., EngineServer]) -> None:
    assert ("grpc.max_receive_message_length", codec.MAX_MESSAGE_BYTES) in codec.GRPC_OPTIONS
    assert ("grpc.max_send_message_length", codec.MAX_MESSAGE_BYTES) in codec.GRPC_OPTIONS
    assert 0 < codec.MAX_MESSAGE_BYTES < 2**31
    server = served(max_message_bytes=2**20)
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    oversized = PrefillRequest("a", 0, 0, token_ids=(300,) * 600_000)  # about 1.2 MB on the wire
    with pytest.raises(
        RemoteEngineError, match=r"prefill\(.*\): a message exceeded the size limit of one end"
    ) as refused:
        engine.prefill(oversized)
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    assert engine.health().status.ok  # the server is still there


# --- answers sent ahead: fewer round trips, never a stale answer -----------------------------------------


@pytest.fixture
def rpcs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The RPCs every client in this test sends, in order (CloseEngine futures as "CloseEngine")."""
    sent: list[str] = []
    call, close_each = transport_client._Connection.call, transport_client._Connection._close_each

    def recording_call(self: Any, operation: str, rpc: str, request: Any, timeout: float, **options: Any) -> Any:
        sent.append(rpc)
        return call(self, operation, rpc, request, timeout, **options)

    def recording_close_each(self: Any, engine_ids: list[int], timeout: float) -> None:
        sent.extend("CloseEngine" for _ in engine_ids)
        close_each(self, engine_ids, timeout)

    monkeypatch.setattr(transport_client._Connection, "call", recording_call)
    monkeypatch.setattr(transport_client._Connection, "_close_each", recording_close_each)
    return sent


def _served_engine(server: EngineServer, engine: RemoteShardEngine) -> Any:
    """The engine itself, inside the (in-process) server: the truth a copy must equal."""
    return server.servicer._engines[engine.engine_id].engine


def test_metrics_right_after_a_step_come_with_it_and_are_exactly_the_engines(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    engine.metrics()  # the first step followed by metrics(): from now on its steps ask for them
    del rpcs[:]
    for step in range(1, 4):
        assert engine.decode(DecodeRequest("a", 0, step, token_ids=(step,))).status.ok
        assert engine.metrics() == _served_engine(server, engine).metrics() == MetricsResult(1, step, 1, 2 + step)
    assert rpcs == ["Decode"] * 3
    engine.metrics()  # a copy answers once: nothing happened since, but the engine is asked
    assert rpcs[-1] == "Metrics"


def test_round_trips_counts_every_call_sent_and_none_answered_ahead(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    """What ``shardkit bench`` divides by a run's steps: the calls sent over every connection,
    a metrics() answered with its step's answer not among them, an old server's CloseEngine
    calls among them."""
    server = served()
    before = transport_client.round_trips()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    engine.metrics()
    for step in range(1, 4):
        engine.decode(DecodeRequest("a", 0, step, token_ids=(step,)))
        engine.metrics()  # answered ahead: no call
    engine.health()
    engine.close()
    sent = ["Handshake", "NewEngine", "Load", "Prefill", "Metrics", "Decode", "Decode", "Decode", "Health"]
    assert rpcs == [*sent, "CloseEngine"]
    assert transport_client.round_trips() - before == len(rpcs)


def test_metrics_right_after_a_cancel_release_or_fault_come_with_it_too(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    engine.metrics()
    del rpcs[:]
    for call in (
        lambda: engine.inject_fault(Fault("memory_pressure", 5.0)),
        lambda: engine.cancel("a", 0),
        lambda: engine.release("a"),
    ):
        assert call().ok
        assert engine.metrics() == _served_engine(server, engine).metrics()
    assert rpcs == ["InjectFault", "Cancel", "Release"]
    assert engine.metrics() == MetricsResult(1, 0, 0, 0)


@pytest.mark.parametrize("between", ["health", "release", "cancel", "capabilities", "inject_fault"])
def test_any_call_between_a_step_and_metrics_makes_metrics_ask_the_engine(
    served: Callable[..., EngineServer], rpcs: list[str], between: str
) -> None:
    server = served()
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2)))
    engine.metrics()
    engine.decode(DecodeRequest("a", 0, 1, token_ids=(3,)))
    {
        "health": engine.health,
        "release": lambda: engine.release("a"),
        "cancel": lambda: engine.cancel("a", 0),
        "capabilities": engine.capabilities,
        "inject_fault": lambda: engine.inject_fault(Fault("memory_pressure", 1.0)),
    }[between]()
    del rpcs[:]
    assert engine.metrics() == _served_engine(server, engine).metrics()
    assert rpcs == ["Metrics"]


class _HeldDecodes(FakeShardEngine):
    """The fake, whose decodes of session "held" wait for ``HELD`` before they start."""

    HELD = threading.Event()

    def decode(self, request: DecodeRequest) -> StepResult:
        if request.session_id == "held":
            assert self.HELD.wait(5)
        return super().decode(request)


def test_a_step_that_overlapped_another_never_answers_metrics_from_a_copy(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    """The copy came with a step sent while no other call was in flight, but another started
    before it returned: the engine is asked."""
    _HeldDecodes.HELD.clear()
    server = served(_HeldDecodes)
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    assert engine.capabilities().concurrent_calls  # the server lets its calls overlap
    for session in ("held", "free"):
        engine.prefill(PrefillRequest(session, 0, 0, token_ids=(1,)))
        engine.metrics()
    held = futures.ThreadPoolExecutor(1).submit(engine.decode, DecodeRequest("held", 0, 1, token_ids=(2,)))
    while "Decode" not in rpcs:
        time.sleep(0.001)
    assert engine.decode(DecodeRequest("free", 0, 1, token_ids=(2,))).status.ok  # while the held one waits
    _HeldDecodes.HELD.set()
    assert held.result(5).status.ok
    del rpcs[:]
    assert engine.metrics() == MetricsResult(2, 2, 2, 4)
    assert rpcs == ["Metrics"]


class _MetricsFailOnce(FakeShardEngine):
    """The fake, whose second metrics() call raises: an engine bug that shows only sometimes."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics_calls = 0

    def metrics(self) -> MetricsResult:
        self.metrics_calls += 1
        if self.metrics_calls == 2:
            raise RuntimeError("metrics broke")
        return super().metrics()


def test_metrics_that_raise_when_sent_ahead_raise_in_the_metrics_call_the_kit_makes(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    """The server ran metrics() ahead and it raised: the client's own metrics() meets that very
    exception (a second metrics() call, which would succeed, must not hide it)."""
    server = served(_MetricsFailOnce)
    engine = RemoteShardEngine(server.url)
    engine.load(FULL)
    engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    engine.metrics()
    assert engine.decode(DecodeRequest("a", 0, 1, token_ids=(2,))).status.ok  # metrics() raised, ahead
    with pytest.raises(RemoteEngineCrashed, match=r"metrics\(\): the engine raised RuntimeError: metrics broke") as crash:
        engine.metrics()
    assert crash.value.exception_type == "RuntimeError"
    assert _served_engine(server, engine).metrics_calls == 2  # the failure was not a call of its own
    assert rpcs[-2:] == ["Decode", "Metrics"]
    assert engine.metrics() == MetricsResult(1, 1, 1, 2)  # the engine's next metrics() call


def test_a_call_that_failed_ends_copies_for_that_engine(served: Callable[..., EngineServer], rpcs: list[str]) -> None:
    """A call that missed its deadline may still run on the server: no later copy is provably current."""
    release = threading.Event()
    server = served(lambda: FakeShardEngine(FakeShardEngineConfig(step_delay_seconds=30, sleep=release.wait)))
    engine = RemoteShardEngine(server.url, timeout_seconds=0.3)
    engine.load(FULL)
    try:
        with pytest.raises(RemoteDeadlineExceeded):
            engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1,)))
    finally:
        release.set()
    for step in range(1, 3):
        engine.decode(DecodeRequest("a", 0, step, token_ids=(step,)))
        engine.metrics()
    assert rpcs[-4:] == ["Decode", "Metrics", "Decode", "Metrics"]


def test_capabilities_right_after_load_come_with_it_and_a_fault_makes_them_ask(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    server = served()
    first = RemoteShardEngine(server.url)
    first.load(FULL)
    first.capabilities()  # engines of this connection are asked for capabilities right after load
    engine = RemoteShardEngine(server.url)
    del rpcs[:]
    engine.load(FULL)
    assert engine.capabilities() == _served_engine(server, engine).capabilities()
    assert rpcs == ["Load"]
    assert engine.inject_fault(Fault("memory_pressure", 1.0)).ok
    assert engine.capabilities().max_kv_tokens == 1
    assert rpcs[-1] == "Capabilities"


class _NoCapabilitiesOnceLoaded(FakeShardEngine):
    def capabilities(self) -> EngineCapabilities:
        if self.health().serving:
            raise EngineError(StructuredStatus(StatusCode.FAILED_PRECONDITION, "no capabilities once loaded"))
        return super().capabilities()


def test_capabilities_refused_right_after_load_are_refused_from_the_copy_alike(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    server = served(_NoCapabilitiesOnceLoaded)
    refusals = []
    for _ in range(2):  # the second engine gets its capabilities ahead
        engine = RemoteShardEngine(server.url)
        engine.load(FULL)
        with pytest.raises(EngineError) as refused:
            engine.capabilities()
        refusals.append(refused.value.status)
    assert refusals[0] == refusals[1] == StructuredStatus(StatusCode.FAILED_PRECONDITION, "no capabilities once loaded")
    assert rpcs[-2:] == ["NewEngine", "Load"]


def test_engines_dropped_by_the_client_are_closed_with_its_next_new_engine(
    served: Callable[..., EngineServer], rpcs: list[str]
) -> None:
    server = served()
    dropped = RemoteShardEngine(server.url)
    del dropped
    gc.collect()
    RemoteShardEngine(server.url)
    assert server.servicer.engine_count == 1
    assert "CloseEngine" not in rpcs


class _FirstReleaseServicer(ShardEngineServicer):
    """A server of contract v1's first release: it knows none of the fields that save round trips."""

    def NewEngine(self, request: Any, context: Any) -> Any:
        response = super().NewEngine(pb.NewEngineRequest(), context)
        response.ClearField("closed_engine_ids")
        return response

    def Load(self, call: Any, context: Any) -> Any:
        call.ClearField("with_capabilities")
        return super().Load(call, context)

    def Prefill(self, call: Any, context: Any) -> Any:
        call.ClearField("with_metrics")
        return super().Prefill(call, context)

    def Decode(self, call: Any, context: Any) -> Any:
        call.ClearField("with_metrics")
        return super().Decode(call, context)

    def Cancel(self, call: Any, context: Any) -> Any:
        call.ClearField("with_metrics")
        return super().Cancel(call, context)

    def Release(self, call: Any, context: Any) -> Any:
        call.ClearField("with_metrics")
        return super().Release(call, context)

    def InjectFault(self, call: Any, context: Any) -> Any:
        call.ClearField("with_metrics")
        return super().InjectFault(call, context)


def test_a_server_without_answers_ahead_is_asked_everything_and_fuzzes_alike(
    rpcs: list[str], tmp_path: Path
) -> None:
    servicer = _FirstReleaseServicer(resolve_target(FakeShardEngine))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ShardEngineServiceServicer_to_server(servicer, server)
    url = f"unix:{tmp_path / 'first-release.sock'}"
    server.add_insecure_port(url)
    server.start()
    try:
        dropped = RemoteShardEngine(url)
        del dropped
        gc.collect()
        engine = RemoteShardEngine(url)
        engine.load(FULL)
        engine.capabilities()
        for epoch in range(2):
            engine.prefill(PrefillRequest("a", epoch, 0, token_ids=(1,)))
            assert engine.metrics() == MetricsResult(epoch + 1, 0, 1, 1)
        assert engine.release("a").ok
        assert engine.metrics() == MetricsResult(2, 0, 0, 0)
        assert rpcs[-10:] == ["NewEngine", "CloseEngine", "Load", "Capabilities", *["Prefill", "Metrics"] * 2, "Release", "Metrics"]
        deadline = time.perf_counter() + 5
        while servicer.engine_count > 1 and time.perf_counter() < deadline:
            time.sleep(0.01)  # the CloseEngine is not waited for
        assert servicer.engine_count == 1
        local = fuzz("shardkit:FakeShardEngine", seed=3, examples=15, steps=20)
        remote = fuzz(url, seed=3, examples=15, steps=20)
        assert (remote.failure, remote.steps, remote.coverage) == (None, local.steps, local.coverage)
    finally:
        close_connections()
        server.stop(0)


def test_serve_logs_one_line_per_engine_exception_notes_included() -> None:
    """``shardkit serve`` promises one log line per exception: a note (the engine base adds
    one) joins the line instead of starting another."""
    import io

    log = io.StringIO()
    servicer = ShardEngineServicer(resolve_target(FakeShardEngine), log=log)
    try:
        raise RuntimeError("boom")
    except RuntimeError as error:
        error.add_note("FakeShardEngine.prefill() raised: the process died in step 3")
        servicer._report("engine 1: prefill", error)
    [line] = log.getvalue().splitlines()
    assert line.startswith("shardkit serve: engine 1: prefill raised RuntimeError: boom / FakeShardEngine.prefill() raised")
    assert "(at " in line
