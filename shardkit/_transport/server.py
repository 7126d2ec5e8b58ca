"""``shardkit serve``: any engine target behind the ``shardkit.v1`` gRPC service.

One server holds many engines, all built from its target. The kit needs a fresh,
unloaded engine every time it calls a target (the engine under test, each twin of
the oracle, the restart after a crash), so a remote target's factory asks the
server for one with ``NewEngine`` and gets an engine id that every later call
names; ``CloseEngine`` drops it. That way ``shardkit fuzz grpc://…`` against
``shardkit serve shardkit:FakeShardEngine`` behaves exactly as in-process fuzzing.

A server keeps at most ``max_engines`` engines alive (``DEFAULT_MAX_ENGINES``): a client
that never closes its engines cannot grow it without bound. Beyond the limit the least
recently used engine is dropped, and a later call naming it is answered with
``FAILED_PRECONDITION``, details saying it was evicted and why, and the trailing metadata
``shardkit-engine-evicted``. Messages are limited to ``codec.MAX_MESSAGE_BYTES`` both ways.

An engine's calls run one at a time until the engine declares ``concurrent_calls`` in its
answer to ``capabilities()``, and as they arrive from then on (``_Slot``): a kit fuzzing a
served engine with ``--concurrency`` then sees its races, and an engine that never declared
it is never called from two threads at once.

An exception raised by an engine is a process death for the kit: the server answers
the call with gRPC status ``INTERNAL``, details ``"TypeName: message"`` (with any
notes) and the trailing metadata ``shardkit-exception-type``. ``EngineError`` from
``load`` and ``capabilities`` is part of the contract, so it travels in the response.
A worker of ``--isolate`` (``fatal_exceptions``) instead ends its process after logging
the exception, as a native engine's process would die (see ``worker.py``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TextIO, TypeVar

import grpc  # type: ignore[import-untyped, unused-ignore]

from shardkit._core.targets import EngineFactory, ResolvedTarget
from shardkit._transport import codec
from shardkit._transport.resolve import resolve_target
from shardkit._version import __version__
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    FaultInjectable,
    PrefillRequest,
    ShardEngine,
)
from shardkit.errors import ShardkitError
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.proto import shard_engine_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_MAX_ENGINES",
    "EngineServer",
    "ShardEngineServicer",
    "parse_listen",
    "serve",
]

T = TypeVar("T")

#: Engines one server keeps alive at once. A kit's run holds a handful (the engine under test,
#: a twin or two per session, a fresh engine per unloaded step), so this leaves room for
#: many kits on one server while bounding what clients that never close their engines cost.
DEFAULT_MAX_ENGINES = 256
#: Evicted engine ids remembered, to answer "evicted" rather than "unknown" (bounded too).
_EVICTED_REMEMBERED = 4096
#: Threads answering calls. A kit's parallel phase keeps at most 3 calls in flight on one
#: engine (3 lanes), plus the closing of dropped engines; calls beyond the threads wait
#: their turn in gRPC's queue, so this bounds overlap, never correctness.
_WORKERS = 8


class _Slot:
    """One served engine, and when its calls may run.

    An engine is called one call at a time until it declares ``concurrent_calls=True`` in an
    answer to ``capabilities()`` (the kit asks right after ``load``, before any parallel
    phase); from then on its calls run as they arrive, so that a kit fuzzing it with
    ``--concurrency`` sees its races. Every ``capabilities()`` answer counts: an engine that
    takes the declaration back is called one at a time again, and its next call waits until
    the calls already running have finished. An answer that is not an ``EngineCapabilities``
    counts as no declaration.
    """

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        #: What the engine's last ``capabilities()`` answer declared (nothing yet: one at a time).
        self.concurrent = False
        self._turns = threading.Condition()
        self._running = 0
        self._alone = False  # the call running holds the engine alone
        #: Calls begun so far: a turn's number, so that the very next call can be told.
        self._begun = 0
        #: An answer sent ahead that the engine failed to give (``_AnswerAhead``): (the turn
        #: that ran it, its operation, what the next call gets instead of calling the engine).
        self._failed_ahead: tuple[int, str, Callable[[], Any]] | None = None

    @contextlib.contextmanager
    def turn(self) -> Iterator[int]:
        """Hold the engine for one call (the number of the turn): alone, unless it declared
        ``concurrent_calls``."""
        with self._turns:
            alone = not self.concurrent
            self._turns.wait_for(lambda: self._running == 0 if alone else not self._alone)
            self._running += 1
            self._alone = alone
            self._begun += 1
            number = self._begun
        try:
            yield number
        finally:
            with self._turns:
                self._running -= 1
                self._alone = False
                self._turns.notify_all()

    def declare(self, capabilities: object) -> None:
        """Learn from a ``capabilities()`` answer whether calls may overlap."""
        concurrent = isinstance(capabilities, EngineCapabilities) and capabilities.concurrent_calls is True
        with self._turns:
            self.concurrent = concurrent

    def only_call_running(self) -> bool:
        with self._turns:
            return self._running == 1

    def keep_failed_ahead(self, turn: int, operation: str, replay: Callable[[], Any]) -> None:
        with self._turns:
            self._failed_ahead = (turn, operation, replay)

    def take_failed_ahead(self, turn: int, operation: str) -> Callable[[], Any] | None:
        """What ``operation`` failed with when sent ahead, if turn ``turn`` is the very next one
        after it; any call drops it, so it never answers a later call."""
        with self._turns:
            kept, self._failed_ahead = self._failed_ahead, None
        if kept is None or kept[0] != turn - 1 or kept[1] != operation:
            return None
        return kept[2]


class _AnswerAhead:
    """An operation run right after a call, in the same turn, whose answer travels with the
    call's (``StepCall.with_metrics``, ``LoadCall.with_capabilities``): the client's next call,
    that operation, then costs no round trip.

    It runs only when the call is the only one running on the engine, so that its answer is
    the one a call made right after would get. An answer the engine fails to give (it raised,
    or returned something that cannot be sent) is not sent: the slot keeps it, and if the
    client's next call is that operation it meets the same failure, reported (and fatal to a
    worker) as usual; an engine never loses an exception to this shortcut."""

    def __init__(
        self,
        operation: str,
        run: Callable[[ShardEngine], Any],
        encode: Callable[[Any], Any],
        refused: Callable[[EngineError], Any] | None = None,
        *,
        declares: bool = False,
    ) -> None:
        self.operation = operation
        self._run = run
        self._encode = encode
        self._refused = refused  # what an EngineError, a contract answer of capabilities(), is sent as
        self._declares = declares
        #: The answer to send along, once ``answer`` succeeded.
        self.message: Any = None

    def answer(self, slot: _Slot, turn: int) -> None:
        if not slot.only_call_running():
            return
        try:
            result = self._run(slot.engine)
        except EngineError as refusal:
            if self._refused is None:
                slot.keep_failed_ahead(turn, self.operation, _raising(refusal))
                return
            self.message = self._refused(refusal)
            return
        except Exception as error:
            slot.keep_failed_ahead(turn, self.operation, _raising(error))
            return
        if self._declares:
            slot.declare(result)
        try:
            self.message = self._encode(result)
        except Exception:
            slot.keep_failed_ahead(turn, self.operation, lambda: result)


def _raising(error: Exception) -> Callable[[], NoReturn]:
    def replay() -> NoReturn:
        raise error

    return replay


def _metrics_ahead(call: Any) -> _AnswerAhead | None:
    """The engine's metrics right after ``call``, if it asks for them (``with_metrics``)."""
    if not call.with_metrics:
        return None
    return _AnswerAhead("metrics", lambda engine: engine.metrics(), codec.metrics_to_pb)


def _with_metrics(response: T, ahead: _AnswerAhead | None) -> T:
    """``response`` (a StepResult or StructuredStatus) carrying the metrics answered ahead, if any."""
    if ahead is not None and ahead.message is not None:
        response.metrics.CopyFrom(ahead.message)  # type: ignore[attr-defined]
    return response


def _served_capabilities(engine: ShardEngine) -> Any:
    caps = engine.capabilities()
    # The client is always FaultInjectable; an engine that is not supports no fault
    # natively, so the kit injects what it can at the client's boundary, as in-process.
    return caps if isinstance(engine, FaultInjectable) else replace(caps, supported_faults=frozenset())


def _abort(context: Any, code: Any, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("grpc's context.abort returned")  # pragma: no cover - abort always raises


class ShardEngineServicer(pb_grpc.ShardEngineServiceServicer):
    """The service: engines built from ``target``, keyed by id. An engine's calls run one at
    a time unless it declared ``concurrent_calls`` (see ``_Slot``); calls to different
    engines may overlap."""

    def __init__(
        self,
        target: ResolvedTarget,
        *,
        protocol_version: str = codec.PROTOCOL_VERSION,
        log: TextIO | None = None,
        fatal_exceptions: bool = False,
        max_engines: int = DEFAULT_MAX_ENGINES,
    ) -> None:
        if isinstance(max_engines, bool) or not isinstance(max_engines, int) or max_engines < 1:
            message = f"max_engines must be a positive whole number, got {max_engines!r}"
            raise ValueError(message)
        self.target = target
        self.protocol_version = protocol_version
        self.log = log
        #: A worker (``--worker``): an engine's exception ends the process, as a native crash would.
        self.fatal_exceptions = fatal_exceptions
        self.max_engines = max_engines
        #: Live engines, least recently used first.
        self._engines: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: Unique to this servicer: a client reconnected to another server sees it change.
        self.server_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

    @property
    def engine_count(self) -> int:
        with self._lock:
            return len(self._engines)

    def close_all(self) -> None:
        with self._lock:
            self._engines.clear()
            self._evicted.clear()

    # --- connection and engines ------------------------------------------------------------

    def Handshake(self, request: pb.HandshakeRequest, context: Any) -> pb.HandshakeResponse:
        if request.protocol_version != self.protocol_version:
            details = (
                f"protocol version mismatch: the client speaks {request.protocol_version!r}, "
                f"this server speaks {self.protocol_version!r}"
            )
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, details)
        return pb.HandshakeResponse(
            protocol_version=self.protocol_version,
            server=f"shardkit {__version__}",
            target=self.target.name,
            server_id=self.server_id,
        )

    def NewEngine(self, request: pb.NewEngineRequest, context: Any) -> pb.NewEngineResponse:
        if request.close_engine_ids:
            with self._lock:
                for closed in request.close_engine_ids:
                    self._engines.pop(closed, None)
        try:
            engine = self.target()
        except Exception as error:
            failure = error
        else:
            with self._lock:
                engine_id = next(self._ids)
                self._engines[engine_id] = _Slot(engine)
                while len(self._engines) > self.max_engines:
                    evicted, _ = self._engines.popitem(last=False)
                    self._evicted[evicted] = None
                    self.evictions += 1
                    if len(self._evicted) > _EVICTED_REMEMBERED:
                        self._evicted.popitem(last=False)
            return pb.NewEngineResponse(engine_id=engine_id, server_id=self.server_id, closed_engine_ids=True)
        self._report("NewEngine", failure)
        _abort(context, grpc.StatusCode.INTERNAL, f"building an engine failed: {_describe(failure)}")

    def CloseEngine(self, request: pb.EngineRef, context: Any) -> pb.CloseEngineResponse:
        with self._lock:
            slot = self._engines.pop(request.engine_id, None)
        return pb.CloseEngineResponse(closed=slot is not None)

    # --- the contract's operations -------------------------------------------------------------

    def Load(self, call: pb.LoadCall, context: Any) -> pb.LoadResponse:
        request = self._decode(context, "Load", lambda: codec.load_request_from_pb(call.request))
        ahead = None
        if call.with_capabilities:
            ahead = _AnswerAhead(
                "capabilities",
                _served_capabilities,
                lambda caps: pb.CapabilitiesResponse(capabilities=codec.capabilities_to_pb(caps)),
                lambda refusal: pb.CapabilitiesResponse(error=codec.status_to_pb(refusal.status)),
                declares=True,
            )
        try:
            result = self._run(
                call.engine_id, context, "load", lambda engine: engine.load(request), EngineError, ahead=ahead
            )
        except EngineError as refusal:
            return pb.LoadResponse(error=codec.status_to_pb(refusal.status))
        response = pb.LoadResponse(result=self._encode(context, "load", lambda: codec.load_result_to_pb(result)))
        if ahead is not None and ahead.message is not None:
            response.capabilities.CopyFrom(ahead.message)
        return response

    def Capabilities(self, call: pb.EngineRef, context: Any) -> pb.CapabilitiesResponse:
        try:
            caps = self._run(call.engine_id, context, "capabilities", _served_capabilities, EngineError, declares=True)
        except EngineError as refusal:
            return pb.CapabilitiesResponse(error=codec.status_to_pb(refusal.status))
        encoded = self._encode(context, "capabilities", lambda: codec.capabilities_to_pb(caps))
        return pb.CapabilitiesResponse(capabilities=encoded)

    def Prefill(self, call: pb.StepCall, context: Any) -> pb.StepResult:
        request = self._decode(context, "Prefill", lambda: codec.step_request_from_pb(call.request, PrefillRequest))
        return self._step(call, context, "prefill", lambda engine: engine.prefill(request))

    def Decode(self, call: pb.StepCall, context: Any) -> pb.StepResult:
        request = self._decode(context, "Decode", lambda: codec.step_request_from_pb(call.request, DecodeRequest))
        return self._step(call, context, "decode", lambda engine: engine.decode(request))

    def _step(
        self, call: pb.StepCall, context: Any, operation: str, run: Callable[[ShardEngine], Any]
    ) -> pb.StepResult:
        """A prefill or decode, and its engine's metrics right after when the call asks for them."""
        ahead = _metrics_ahead(call)
        result = self._run(call.engine_id, context, operation, run, ahead=ahead)
        return _with_metrics(self._encode(context, operation, lambda: codec.step_result_to_pb(result)), ahead)

    def Cancel(self, call: pb.CancelCall, context: Any) -> pb.StructuredStatus:
        epoch = self._decode(context, "Cancel", lambda: codec.get_counter(call, "epoch"))
        ahead = _metrics_ahead(call)
        status = self._run(
            call.engine_id, context, "cancel", lambda engine: engine.cancel(call.session_id, epoch), ahead=ahead
        )
        return _with_metrics(self._encode(context, "cancel", lambda: codec.status_to_pb(status)), ahead)

    def Release(self, call: pb.ReleaseCall, context: Any) -> pb.StructuredStatus:
        ahead = _metrics_ahead(call)
        status = self._run(
            call.engine_id, context, "release", lambda engine: engine.release(call.session_id), ahead=ahead
        )
        return _with_metrics(self._encode(context, "release", lambda: codec.status_to_pb(status)), ahead)

    def Health(self, call: pb.EngineRef, context: Any) -> pb.HealthResult:
        result = self._run(call.engine_id, context, "health", lambda engine: engine.health())
        return self._encode(context, "health", lambda: codec.health_to_pb(result))

    def Metrics(self, call: pb.EngineRef, context: Any) -> pb.MetricsResult:
        result = self._run(call.engine_id, context, "metrics", lambda engine: engine.metrics())
        return self._encode(context, "metrics", lambda: codec.metrics_to_pb(result))

    def InjectFault(self, call: pb.InjectFaultCall, context: Any) -> pb.StructuredStatus:
        fault = self._decode(context, "InjectFault", lambda: codec.fault_from_pb(call.fault))

        def inject(engine: ShardEngine) -> Any:
            if not isinstance(engine, FaultInjectable):
                return None
            return engine.inject_fault(fault)

        ahead = _metrics_ahead(call)
        status = self._run(call.engine_id, context, "inject_fault", inject, ahead=ahead)
        if status is None:
            message = f"the engines of {self.target.name} do not implement inject_fault; they support no fault natively"
            return _with_metrics(pb.StructuredStatus(code=pb.STATUS_CODE_UNIMPLEMENTED, message=message), ahead)
        return _with_metrics(self._encode(context, "inject_fault", lambda: codec.status_to_pb(status)), ahead)

    # --- plumbing ----------------------------------------------------------------------------------

    def _decode(self, context: Any, rpc: str, decode: Callable[[], T]) -> T:
        try:
            return decode()
        except codec.WireFormatError as error:
            failure = error
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode the {rpc} request: {failure}")

    def _encode(self, context: Any, operation: str, encode: Callable[[], T]) -> T:
        try:
            return encode()
        except Exception as error:
            failure = error
        self._report(operation, failure)
        self._die_if_fatal(failure)
        details = f"{operation}() returned an answer that cannot be sent: {_describe(failure)}"
        _abort(context, grpc.StatusCode.INTERNAL, details)

    def _run(
        self,
        engine_id: int,
        context: Any,
        operation: str,
        call: Callable[[ShardEngine], T],
        passes: type[BaseException] | None = None,
        *,
        declares: bool = False,
        ahead: _AnswerAhead | None = None,
    ) -> T:
        """Run ``call`` on the engine in its turn (``_Slot.turn``); an exception (other than
        ``passes``) aborts with INTERNAL. ``declares``: the answer is the engine's capabilities,
        which say, before the turn ends, whether its next calls may overlap. ``ahead``: an
        operation to answer in the same turn once ``call`` returned (``_AnswerAhead``)."""
        with self._lock:
            slot = self._engines.get(engine_id)
            if slot is not None:
                self._engines.move_to_end(engine_id)
            evicted = slot is None and engine_id in self._evicted
        if evicted:
            details = (
                f"engine {engine_id} was evicted: this server keeps at most {self.max_engines} engines alive and "
                "dropped the least recently used when a client asked for more; close engines you no longer use "
                "(CloseEngine), or start the server with a higher --max-engines"
            )
            context.set_trailing_metadata([(codec.EVICTED_KEY, str(self.max_engines))])
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, details)
        if slot is None:
            details = f"no engine {engine_id} on this server (closed, or the server restarted); call NewEngine"
            _abort(context, grpc.StatusCode.NOT_FOUND, details)
        with slot.turn() as turn:
            failed_ahead = slot.take_failed_ahead(turn, operation)
            try:
                result = call(slot.engine) if failed_ahead is None else failed_ahead()
            except Exception as error:
                if passes is not None and isinstance(error, passes):
                    raise
                failure = error
            else:
                if declares:
                    slot.declare(result)
                if ahead is not None:
                    ahead.answer(slot, turn)
                return result
        self._report(f"engine {engine_id}: {operation}", failure)
        self._die_if_fatal(failure)
        context.set_trailing_metadata([(codec.EXCEPTION_TYPE_KEY, _ascii(type(failure).__qualname__))])
        _abort(context, grpc.StatusCode.INTERNAL, _describe(failure))

    def _die_if_fatal(self, error: BaseException) -> None:
        if self.fatal_exceptions:
            os._exit(codec.EXIT_OUT_OF_MEMORY if isinstance(error, MemoryError) else codec.EXIT_ENGINE_RAISED)

    def _report(self, where: str, error: BaseException) -> None:
        """One line per exception, its notes joined to it by " / ", with the line that raised
        it: a crash fault may fire every few calls, so full tracebacks would drown the log,
        and a log read line by line must not split one exception in two."""
        if self.log is None:
            return
        frames = traceback.extract_tb(error.__traceback__)
        origin = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
        described = " / ".join(line.strip() for line in _describe(error).splitlines() if line.strip())
        print(f"shardkit serve: {where} raised {described}{origin}", file=self.log, flush=True)


def _describe(error: BaseException) -> str:
    """``TypeName: message`` plus the exception's notes, one per line."""
    return "".join(traceback.format_exception_only(error)).strip()


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


def parse_listen(listen: str) -> tuple[str, str | None]:
    """``HOST:PORT`` (or ``grpc://HOST:PORT``) or ``unix:PATH`` → (what gRPC binds, the host
    for a TCP address, else None); raises ``ValueError`` with a one-line reason."""
    if listen.startswith("unix:"):
        if not listen[len("unix:") :].strip("/"):
            message = f"--listen {listen!r}: a unix socket needs a path, e.g. unix:/tmp/shard.sock"
            raise ValueError(message)
        return listen, None
    address = listen.removeprefix("grpc://")
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        message = f"--listen {listen!r} must be HOST:PORT (PORT 0 picks a free one) or unix:PATH"
        raise ValueError(message)
    return address, host


@dataclass
class EngineServer:
    """A running service: ``url`` is what a client passes as a target (``grpc://HOST:PORT``
    with the bound port, or ``unix:PATH``)."""

    server: Any  # grpc.Server
    servicer: ShardEngineServicer
    url: str

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (waiting ``grace`` seconds for calls in flight) and drop every engine."""
        self.server.stop(grace).wait()
        self.servicer.close_all()

    def wait(self) -> None:
        """Block until the server stops."""
        self.server.wait_for_termination()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(0)


def serve(
    target: str | EngineFactory | ResolvedTarget,
    listen: str = "127.0.0.1:0",
    *,
    protocol_version: str = codec.PROTOCOL_VERSION,
    log: TextIO | None = None,
    fatal_exceptions: bool = False,
    max_engines: int = DEFAULT_MAX_ENGINES,
    max_message_bytes: int = codec.MAX_MESSAGE_BYTES,
) -> EngineServer:
    """Serve engines built from ``target`` on ``listen`` and return the running server.

    ``protocol_version`` exists so tests can play an incompatible server; ``log`` gets a
    line for every exception an engine raises (``shardkit serve`` passes stderr);
    ``fatal_exceptions`` ends the process after that line (exit ``codec.EXIT_ENGINE_RAISED``, or
    ``codec.EXIT_OUT_OF_MEMORY`` for ``MemoryError``), as ``shardkit serve --worker`` does;
    ``max_engines`` bounds the engines kept alive (the least recently used is evicted);
    ``max_message_bytes`` bounds each message received or sent.
    """
    resolved = resolve_target(target)
    bind, host = parse_listen(listen)
    servicer = ShardEngineServicer(
        resolved,
        protocol_version=protocol_version,
        log=log,
        fatal_exceptions=fatal_exceptions,
        max_engines=max_engines,
    )
    # gRPC sets SO_REUSEPORT by default, which lets a second server "bind" a busy port and
    # then never see a call: a port in use must be an error instead.
    options = [*codec.grpc_options(max_message_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=_WORKERS), options=options)
    pb_grpc.add_ShardEngineServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as error:
        port, reason = 0, str(error)
    else:
        reason = "the address is in use or not available"
    if not port:
        message = f"cannot listen on {listen!r}: {reason}"
        raise ShardkitError(message)
    server.start()
    url = bind if host is None else f"grpc://{host}:{port}"
    return EngineServer(server, servicer, url)
