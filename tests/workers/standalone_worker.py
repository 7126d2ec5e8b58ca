"""A shardkit.v1 worker written without shardkit: grpc, protobuf and the generated stubs only.

It proves the service is self-contained: what this file implements is what a worker in
C++, Rust or Go implements from ``shardkit/proto/shard_engine.proto``. The engine is a
tiny but complete SPEC §2 lifecycle for one role, the full model (4 layers, vocab 32),
with hash "numerics": a session epoch's cache is a sha256 chain over its token ids, and
the next token is the chain's first byte modulo the vocabulary, so the output depends on
the history alone, however it was chunked. Loading a sub-range is refused (EngineError),
which the kit allows; no fault is supported natively, so the kit injects delay,
malformed_output and crash at its client's boundary.

    python tests/workers/standalone_worker.py [--listen 127.0.0.1:0] [--proto-dir DIR]

prints ``listening on grpc://HOST:PORT`` (or ``unix:PATH``) once it serves.

``--plant cancel-keeps-kv`` plants a bug (cancel leaves the session's KV tokens counted),
``--plant abort-on-restart`` a native-style death (``os.abort()``, SIGABRT, when a
session is restarted at a newer epoch) and ``--plant hang-on-release`` a hang (release
of a session that exists never answers) and ``--plant raise-on-cancel`` an engine
exception (cancel of a session that exists raises, answered as the proto asks: INTERNAL
with its type in the trailing metadata): the tests of ``--worker-command`` find, shrink
and replay them through workers the kit starts.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import os
import signal
import sys
import threading
import time
import types
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

PROTOCOL_VERSION = "shardkit.v1/1"
DEFAULT_PROTO_DIR = Path(__file__).resolve().parents[2] / "shardkit" / "proto"

TOTAL_LAYERS, HIDDEN_SIZE, VOCAB_SIZE = 4, 8, 32
MAX_SESSIONS, MAX_KV_TOKENS = 4, 64
ARCHITECTURE = "standalone-hash"
LIMIT = 2**63  # epochs and steps live in [0, 2**63)


def load_stubs(proto_dir: Path) -> tuple[Any, Any]:
    """Import the generated modules by file path, as a package of their own (the service
    module imports its messages package-relatively), without running shardkit's code."""
    package = types.ModuleType("_shardkit_v1_stubs")
    package.__path__ = [str(proto_dir)]
    sys.modules[package.__name__] = package
    pb = importlib.import_module("_shardkit_v1_stubs.shard_engine_pb2")
    pb_grpc = importlib.import_module("_shardkit_v1_stubs.shard_engine_pb2_grpc")
    return pb, pb_grpc


@dataclass
class Session:
    epoch: int
    next_step: int
    chain: bytes
    kv_tokens: int
    last_request: tuple[str, int, int, tuple[int, ...]]  # (operation, epoch, step, token ids)
    last_result: Any  # the pb StepResult it returned
    cancelled: bool = False


#: The bugs --plant turned on (see the module docstring).
PLANTED: set[str] = set()
PLANTS = ("cancel-keeps-kv", "abort-on-restart", "hang-on-release", "raise-on-cancel")


class HashEngine:
    """SPEC §2 for a full shard, rule by rule; answers are protobuf messages."""

    def __init__(self, pb: Any) -> None:
        self.pb = pb
        self.seed: bytes | None = None  # set by load
        self.sessions: dict[str, Session] = {}
        self.prefill_calls = 0
        self.decode_calls = 0

    # --- helpers ----------------------------------------------------------------------------

    def status(self, code: str, message: str = "", retryable: bool = False) -> Any:
        return self.pb.StructuredStatus(
            code=self.pb.StatusCode.Value(f"STATUS_CODE_{code}"), message=message, retryable=retryable
        )

    def refusal(self, code: str, message: str, retryable: bool = False) -> Any:
        return self.pb.StepResult(status=self.status(code, message, retryable), cache=self.pb.CACHE_RESULT_MISS)

    @staticmethod
    def counter(message: Any, name: str) -> int | None:
        """An epoch or step, or None when it lies outside [0, 2**63) (every *_decimal does)."""
        which = message.WhichOneof(f"{name}_value")
        value = getattr(message, name) if which == name else (0 if which is None else -1)
        return value if 0 <= value < LIMIT else None

    # --- loading ------------------------------------------------------------------------------

    def capabilities(self) -> Any:
        return self.pb.EngineCapabilities(
            architecture=ARCHITECTURE,
            evidence_class="fixture",
            total_layers=TOTAL_LAYERS,
            shard_start=0,
            shard_end=TOTAL_LAYERS - 1,
            hidden_size=HIDDEN_SIZE,
            vocab_size=VOCAB_SIZE,
            dtype="float32",
            max_sessions=MAX_SESSIONS,
            max_kv_tokens=MAX_KV_TOKENS,
            supported_faults=[],
            tolerance=0.0,
        )

    def load(self, request: Any) -> Any:
        """A LoadResponse: the result, or the status load refuses with (EngineError)."""
        if self.seed is not None:
            return self.pb.LoadResponse(
                error=self.status("FAILED_PRECONDITION", "already loaded; build a fresh engine")
            )
        if request.total_layers != TOTAL_LAYERS:
            message = f"total_layers={request.total_layers}, but the model has {TOTAL_LAYERS}"
            return self.pb.LoadResponse(error=self.status("INVALID_ARGUMENT", message))
        if (request.shard_start, request.shard_end) != (0, TOTAL_LAYERS - 1):
            message = f"this worker serves only the full model, layers 0..{TOTAL_LAYERS - 1}"
            return self.pb.LoadResponse(error=self.status("UNIMPLEMENTED", message))
        self.seed = hashlib.sha256(b"standalone" + request.model_id.encode("utf-8", "surrogatepass")).digest()
        return self.pb.LoadResponse(result=self.pb.LoadResult(status=self.status("OK"), architecture=ARCHITECTURE))

    # --- steps --------------------------------------------------------------------------------

    def step(self, operation: str, request: Any) -> Any:
        if operation == "prefill":
            self.prefill_calls += 1
        else:
            self.decode_calls += 1
        if self.seed is None:  # rule 1
            return self.refusal("UNAVAILABLE", f"{operation} before load")
        epoch, step = self.counter(request, "epoch"), self.counter(request, "step")
        problem = self.input_problem(operation, request, epoch, step)
        if problem is not None:  # rule 2
            return self.refusal("INVALID_ARGUMENT", f"{operation}: {problem}")
        assert epoch is not None
        assert step is not None
        tokens = tuple(request.token_ids.ids)
        session = self.sessions.get(request.session_id)
        opens = operation == "prefill" and step == 0
        if session is None or epoch > session.epoch:  # rules 3 and 4 (higher epoch)
            if opens:
                return self.advance(request.session_id, session, operation, epoch, step, tokens)
            code = "FAILED_PRECONDITION" if session is None and operation == "prefill" else "NOT_FOUND"
            return self.refusal(code, f"{operation}: no such session epoch; open one with prefill step 0")
        if epoch < session.epoch:  # rule 4 (stale)
            return self.refusal("ABORTED", f"{operation}: stale epoch {epoch}, the session is at {session.epoch}")
        if session.cancelled:  # rule 5
            return self.refusal("CANCELLED", f"{operation}: the session is cancelled")
        if step == session.next_step - 1 and session.last_request == (operation, epoch, step, tokens):  # rule 6
            result = self.pb.StepResult()
            result.CopyFrom(session.last_result)
            return result
        if step != session.next_step:
            return self.refusal("FAILED_PRECONDITION", f"{operation}: expected step {session.next_step}")
        return self.advance(request.session_id, session, operation, epoch, step, tokens)

    def input_problem(self, operation: str, request: Any, epoch: int | None, step: int | None) -> str | None:
        if not request.session_id:
            return "empty session id"
        if epoch is None or step is None:
            return "epoch or step outside [0, 2**63)"
        if request.WhichOneof("input") != "token_ids":
            return "a full shard takes token_ids"
        ids = request.token_ids.ids
        if not ids:
            return "empty input"
        if operation == "decode" and len(ids) != 1:
            return f"a decode takes exactly one token, got {len(ids)}"
        if any(not 0 <= token < VOCAB_SIZE for token in ids):
            return f"token ids outside [0, {VOCAB_SIZE})"
        return None

    def advance(
        self, session_id: str, session: Session | None, operation: str, epoch: int, step: int, tokens: tuple[int, ...]
    ) -> Any:
        """Rules 7 and 8 for a request that opens, restarts or continues a session epoch."""
        continues = session is not None and session.epoch == epoch
        if session is None and len(self.sessions) >= MAX_SESSIONS:
            return self.refusal("RESOURCE_EXHAUSTED", "no free session slot", retryable=True)
        used = sum(other.kv_tokens for other in self.sessions.values())
        if session is not None and not continues:
            if "abort-on-restart" in PLANTED:
                os.abort()
            used -= session.kv_tokens  # an admitted restart gives its old epoch's tokens back
        if used + len(tokens) > MAX_KV_TOKENS:
            return self.refusal("RESOURCE_EXHAUSTED", "not enough KV cache", retryable=True)
        assert self.seed is not None
        chain = session.chain if session is not None and continues else self.seed
        for token in tokens:
            chain = hashlib.sha256(chain + token.to_bytes(8, "little")).digest()
        result = self.pb.StepResult(
            status=self.status("OK"),
            cache=self.pb.CACHE_RESULT_HIT if continues else self.pb.CACHE_RESULT_MISS,
            token=self.pb.TokenOutput(token_id=chain[0] % VOCAB_SIZE),
        )
        last = (operation, epoch, step, tokens)
        if session is not None and continues:
            session.next_step += 1
            session.chain, session.kv_tokens = chain, session.kv_tokens + len(tokens)
            session.last_request, session.last_result = last, result
        else:
            self.sessions[session_id] = Session(epoch, step + 1, chain, len(tokens), last, result)
        return result

    # --- session control ------------------------------------------------------------------------

    def cancel(self, session_id: str, epoch: int | None) -> Any:
        if self.seed is None:
            return self.status("UNAVAILABLE", "cancel before load")
        if not session_id or epoch is None:
            return self.status("INVALID_ARGUMENT", "cancel: empty session id, or an epoch outside [0, 2**63)")
        session = self.sessions.get(session_id)
        if session is None or epoch > session.epoch:
            return self.status("NOT_FOUND", f"cancel: no session {session_id!r} at epoch {epoch}")
        if epoch < session.epoch:
            return self.status("ABORTED", f"cancel: stale epoch {epoch}, the session is at {session.epoch}")
        session.cancelled = True
        if "cancel-keeps-kv" not in PLANTED:
            session.kv_tokens = 0
        return self.status("OK")

    def release(self, session_id: str) -> Any:
        if self.seed is None:
            return self.status("UNAVAILABLE", "release before load")
        if "hang-on-release" in PLANTED and session_id in self.sessions:
            threading.Event().wait()
        self.sessions.pop(session_id, None)
        return self.status("OK")

    def health(self) -> Any:
        return self.pb.HealthResult(status=self.status("OK"), serving=self.seed is not None)

    def metrics(self) -> Any:
        return self.pb.MetricsResult(
            prefill_calls=self.prefill_calls,
            decode_calls=self.decode_calls,
            active_sessions=len(self.sessions),
            kv_tokens=sum(session.kv_tokens for session in self.sessions.values()),
        )


class Aborted(Exception):
    """A call of a ``Calls`` stream ended with a gRPC status other than OK."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class OneCall:
    """The context a method gets for one call of a ``Calls`` stream: aborting the stream's own
    context would end every later call on it, so this one keeps the status for the answer."""

    def __init__(self) -> None:
        self.trailing_metadata: dict[str, str] = {}

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing_metadata = dict(metadata)

    def abort(self, code: Any, details: str) -> None:
        raise Aborted(code, details)


def make_servicer(pb: Any, pb_grpc: Any) -> Any:
    service = pb.DESCRIPTOR.services_by_name["ShardEngineService"]
    #: What a Calls stream carries: every RPC but Handshake, with its request message.
    streamed = {
        method.name: getattr(pb, method.input_type.name)
        for method in service.methods
        if method.name not in ("Handshake", "Calls")
    }

    class Servicer(pb_grpc.ShardEngineServiceServicer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.engines: dict[int, HashEngine] = {}
            self.ids = itertools.count(1)
            self.lock = threading.Lock()
            self.server_id = f"standalone-{os.getpid()}-{time.time_ns()}"

        def engine(self, engine_id: int, context: Any) -> HashEngine:
            with self.lock:
                engine = self.engines.get(engine_id)
            if engine is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no engine {engine_id}")
            return engine

        def Handshake(self, request: Any, context: Any) -> Any:
            if request.protocol_version != PROTOCOL_VERSION:
                details = f"the client speaks {request.protocol_version!r}, this server speaks {PROTOCOL_VERSION!r}"
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, details)
            return pb.HandshakeResponse(
                protocol_version=PROTOCOL_VERSION,
                server="standalone_worker.py",
                target="HashEngine",
                server_id=self.server_id,
                calls=["Calls"],  # the optional RPCs this worker has
            )

        def Calls(self, calls: Any, context: Any) -> Any:
            """Every call but Handshake over one stream: each answered, in order, with what its
            unary RPC would have ended with."""
            for call in calls:
                yield self.answer(call)

        def answer(self, call: Any) -> Any:
            request_type = streamed.get(call.rpc)
            if request_type is None:
                details = f"Calls cannot carry a call of {call.rpc!r}"
                return pb.Answer(status_code=grpc.StatusCode.UNIMPLEMENTED.value[0], details=details)
            try:
                request = request_type.FromString(call.request)
            except Exception as error:  # protobuf's DecodeError
                details = f"cannot decode the {call.rpc} request: not a {request_type.DESCRIPTOR.full_name} ({error})"
                return pb.Answer(status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], details=details)
            context = OneCall()
            try:
                response = getattr(self, call.rpc)(request, context)
            except Aborted as aborted:
                code = aborted.code.value[0]
                return pb.Answer(status_code=code, details=aborted.details, trailing_metadata=context.trailing_metadata)
            return pb.Answer(response=response.SerializeToString())

        def NewEngine(self, request: Any, context: Any) -> Any:
            with self.lock:
                engine_id = next(self.ids)
                self.engines[engine_id] = HashEngine(pb)
            return pb.NewEngineResponse(engine_id=engine_id, server_id=self.server_id)

        def CloseEngine(self, request: Any, context: Any) -> Any:
            with self.lock:
                return pb.CloseEngineResponse(closed=self.engines.pop(request.engine_id, None) is not None)

        def Load(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).load(call.request)

        def Capabilities(self, call: Any, context: Any) -> Any:
            return pb.CapabilitiesResponse(capabilities=self.engine(call.engine_id, context).capabilities())

        def Prefill(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).step("prefill", call.request)

        def Decode(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).step("decode", call.request)

        def Cancel(self, call: Any, context: Any) -> Any:
            engine = self.engine(call.engine_id, context)
            if "raise-on-cancel" in PLANTED and call.session_id in engine.sessions:
                # An engine's exception, answered as the proto's header asks.
                error = RuntimeError("cancel lost its session table")
                print(f"standalone_worker: cancel raised RuntimeError: {error}", file=sys.stderr, flush=True)
                context.set_trailing_metadata([("shardkit-exception-type", "RuntimeError")])
                context.abort(grpc.StatusCode.INTERNAL, f"RuntimeError: {error}")
            return engine.cancel(call.session_id, HashEngine.counter(call, "epoch"))

        def Release(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).release(call.session_id)

        def Health(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).health()

        def Metrics(self, call: Any, context: Any) -> Any:
            return self.engine(call.engine_id, context).metrics()

        def InjectFault(self, call: Any, context: Any) -> Any:
            engine = self.engine(call.engine_id, context)
            return engine.status("UNIMPLEMENTED", f"no fault is supported natively, {call.fault.kind!r} included")

    return Servicer()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (0 picks a free port) or unix:PATH")
    parser.add_argument("--proto-dir", type=Path, default=DEFAULT_PROTO_DIR, help="where the generated stubs are")
    parser.add_argument("--plant", action="append", choices=PLANTS, default=[], help="plant a bug (for the kit's own tests)")
    args = parser.parse_args(argv)
    PLANTED.update(args.plant)
    pb, pb_grpc = load_stubs(args.proto_dir)
    leaked = sorted(name for name in sys.modules if name == "shardkit" or name.startswith("shardkit."))
    if leaked:
        sys.exit(f"standalone_worker: shardkit was imported ({leaked}); this worker must not use it")
    # A Calls stream holds a thread for as long as it is open, and the kit opens one per thread
    # that calls (a parallel phase has up to 3 lanes): threads enough for those and the unary calls.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_ShardEngineServiceServicer_to_server(make_servicer(pb, pb_grpc), server)
    port = server.add_insecure_port(args.listen)
    server.start()
    host = args.listen.rpartition(":")[0]
    url = args.listen if args.listen.startswith("unix:") else f"grpc://{host}:{port}"
    print(f"listening on {url}", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: server.stop(0))
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
