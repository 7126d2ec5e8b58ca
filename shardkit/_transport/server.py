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
notes) and the trailing metadata ``shardkit-exception-type``. So is any ``BaseException``
(``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, an engine's own): engine code runs on
the server's threads, which no signal reaches, so whatever it raises is its own doing, and a
call is never left unanswered. ``EngineError`` from
``load`` and ``capabilities`` is part of the contract, so it travels in the response.
A worker of ``--isolate`` (``fatal_exceptions``) instead ends its process after logging
the exception, as a native engine's process would die (see ``worker.py``).

What a client cannot do to the server (``docs/remote.md``, serving limits): bytes that do not
parse as the RPC's request message are answered ``INVALID_ARGUMENT`` naming it (the service is
registered with raw requests, ``_Rpc``, so that gRPC's own "Exception deserializing request!"
never answers); a delay fault may ask an engine to wait at most ``MAX_FAULT_DELAY_SECONDS``
before its next step; and engine calls run on threads of their own, so that however long they
take, ``Handshake``, ``CloseEngine`` and ``Health`` still have threads to answer on. A ``unix:``
socket that a server answers on is never taken over, and gRPC removes its file when it stops.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import ipaddress
import itertools
import os
import queue
import socket
import stat
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TextIO, TypeVar

import grpc  # type: ignore[import-untyped, unused-ignore]

from shardkit._core.targets import EngineFactory, ResolvedTarget, is_loopback
from shardkit._transport import codec
from shardkit._transport.calls_socket import CallsListener
from shardkit._transport.resolve import resolve_target
from shardkit._version import __version__
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    FaultInjectable,
    PrefillRequest,
    ShardEngine,
    StatusCode,
    StructuredStatus,
)
from shardkit.errors import ShardkitError
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.proto import shard_engine_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_MAX_ENGINES",
    "MAX_FAULT_DELAY_SECONDS",
    "OPTIONAL_CALLS",
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
#: Threads running engine calls (NewEngine, Load, Capabilities, Prefill, Decode, Cancel,
#: Release, Metrics, InjectFault). A kit's parallel phase keeps at most 3 calls in flight on one
#: engine (3 lanes), plus the closing of dropped engines; engine calls beyond the threads wait
#: their turn in gRPC's queue, so this bounds overlap, never correctness.
_ENGINE_THREADS = 8
#: Threads for ``Health`` alone: however long engine calls take, a health check has a thread.
_HEALTH_THREADS = 2
#: Threads for ``Handshake`` and ``CloseEngine``, which run no engine code: a new client can
#: always connect, and an engine can always be dropped.
_CONNECTION_THREADS = 2
#: The RPCs on each pool but the engine calls' (the rest).
_HEALTH_RPCS = frozenset({"Health"})
_CONNECTION_RPCS = frozenset({"Handshake", "CloseEngine"})
#: The optional RPCs this server has, which its handshake lists (``HandshakeResponse.calls``).
OPTIONAL_CALLS = ("Calls",)
#: The RPC that carries the others over one stream, and the RPCs it cannot carry.
_STREAM_RPC = "Calls"
_NOT_STREAMED = frozenset({"Handshake", _STREAM_RPC})
#: The most a served engine may be asked to wait by delay faults before its next prefill or
#: decode (the delays asked since its last one add up). The kit's own delay faults are 1 ms at
#: most; a longer delay would only hold a server thread, which is what the cap prevents.
MAX_FAULT_DELAY_SECONDS = 1.0
#: How long ``serve`` waits for a server already on a ``unix:`` socket to say who it is.
_WHO_IS_THERE_SECONDS = 2.0


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
        #: Seconds of delay faults accepted since the engine's last prefill or decode began.
        self.delay_asked = 0.0

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

    def ask_delay(self, seconds: float) -> bool:
        """Count a delay fault of ``seconds`` against ``MAX_FAULT_DELAY_SECONDS``: False (and
        nothing counted) if the delays asked since the last step would exceed it."""
        with self._turns:
            if self.delay_asked + seconds > MAX_FAULT_DELAY_SECONDS:
                return False
            self.delay_asked += seconds
            return True

    def forget_delay(self, seconds: float) -> None:
        """A delay counted by ``ask_delay`` that the engine did not accept."""
        with self._turns:
            self.delay_asked = max(0.0, self.delay_asked - seconds)

    def delay_waited(self) -> None:
        """A prefill or decode began: it waits out every delay asked so far."""
        with self._turns:
            self.delay_asked = 0.0

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
        except BaseException as error:
            slot.keep_failed_ahead(turn, self.operation, _raising(error))
            return
        if self._declares:
            slot.declare(result)
        try:
            self.message = self._encode(result)
        except BaseException:
            slot.keep_failed_ahead(turn, self.operation, lambda: result)


def _raising(error: BaseException) -> Callable[[], NoReturn]:
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
        optional_calls: tuple[str, ...] = OPTIONAL_CALLS,
    ) -> None:
        unknown = sorted(set(optional_calls) - set(OPTIONAL_CALLS))
        if unknown:
            message = f"optional_calls names {unknown}, which this server does not have; choose among {list(OPTIONAL_CALLS)}"
            raise ValueError(message)
        if isinstance(max_engines, bool) or not isinstance(max_engines, int) or max_engines < 1:
            message = f"max_engines must be a positive whole number, got {max_engines!r}"
            raise ValueError(message)
        self.target = target
        self.protocol_version = protocol_version
        self.log = log
        #: A worker (``--worker``): an engine's exception ends the process, as a native crash would.
        self.fatal_exceptions = fatal_exceptions
        self.max_engines = max_engines
        #: What the handshake lists, and the only optional RPCs answered (an older server's part
        #: is played with fewer).
        self.optional_calls = tuple(optional_calls)
        #: Live engines, least recently used first.
        self._engines: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        #: What a ``Calls`` stream carries: every RPC but ``Handshake`` (and ``Calls``), raw.
        service = pb.DESCRIPTOR.services_by_name["ShardEngineService"]
        self._streamed = {
            method.name: _Rpc(self, method.name, getattr(pb, method.input_type.name))
            for method in service.methods
            if method.name not in _NOT_STREAMED
        }
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
            calls=self.optional_calls,
        )

    def Calls(self, calls: Iterator[pb.Call | bytes], context: Any) -> Iterator[pb.Answer]:
        """Each ``Call`` run as the unary RPC it names, answered in order with the status that
        RPC would have ended with (``_StreamedCallContext``). Raw bytes that do not parse as a
        ``Call`` end the stream with ``INVALID_ARGUMENT``, as for any other RPC (``_Rpc``)."""
        if _STREAM_RPC not in self.optional_calls:
            _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"this server does not offer {_STREAM_RPC}")
        for call in calls:
            yield self.streamed_answer(_Rpc.parsed(_STREAM_RPC, pb.Call, call, context) if isinstance(call, bytes) else call)

    def streamed_answer(self, call: pb.Call) -> pb.Answer:
        """The ``Answer`` to one call of a ``Calls`` stream: the response, or the status the
        unary RPC would have ended with."""
        rpc = self._streamed.get(call.rpc)
        if rpc is None:
            details = f"{_STREAM_RPC} cannot carry a call of {call.rpc!r}; it carries {', '.join(sorted(self._streamed))}"
            return pb.Answer(status_code=grpc.StatusCode.UNIMPLEMENTED.value[0], details=details)
        context = _StreamedCallContext()
        try:
            response = rpc(call.request, context)
        except _Aborted as aborted:
            code = aborted.code.value[0]
            return pb.Answer(status_code=code, details=aborted.details, trailing_metadata=context.trailing_metadata)
        except Exception as error:  # what gRPC answers for a unary handler that raised
            details = f"Exception calling application: {error}"
            return pb.Answer(status_code=grpc.StatusCode.UNKNOWN.value[0], details=details)
        return pb.Answer(response=response.SerializeToString())

    def NewEngine(self, request: pb.NewEngineRequest, context: Any) -> pb.NewEngineResponse:
        if request.close_engine_ids:
            with self._lock:
                for closed in request.close_engine_ids:
                    self._engines.pop(closed, None)
        try:
            engine = self.target()
        except BaseException as error:
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
        slot = self._slot(call.engine_id, context)

        def step(engine: ShardEngine) -> Any:
            slot.delay_waited()  # the step waits out the delays asked before it
            return run(engine)

        result = self._run_on(slot, call.engine_id, context, operation, step, ahead=ahead)
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
        slot = self._slot(call.engine_id, context)

        def inject(engine: ShardEngine) -> Any:
            if not isinstance(engine, FaultInjectable):
                return None
            # A negative delay is the engine's to refuse; any other counts against the cap.
            delay = fault.value if fault.kind == "delay" and fault.value >= 0 else None
            if delay is not None and not slot.ask_delay(delay):
                return _delay_refused(delay, slot.delay_asked)
            try:
                status = engine.inject_fault(fault)
            except BaseException:
                if delay is not None:
                    slot.forget_delay(delay)
                raise
            if delay is not None and not (isinstance(status, StructuredStatus) and status.ok):
                slot.forget_delay(delay)
            return status

        ahead = _metrics_ahead(call)
        status = self._run_on(slot, call.engine_id, context, "inject_fault", inject, ahead=ahead)
        if status is None:
            message = f"the engines of {self.target.name} do not implement inject_fault; they support no fault natively"
            return _with_metrics(pb.StructuredStatus(code=pb.STATUS_CODE_UNIMPLEMENTED, message=message), ahead)
        return _with_metrics(self._encode(context, "inject_fault", lambda: codec.status_to_pb(status)), ahead)

    # --- plumbing ----------------------------------------------------------------------------------

    def _decode(self, context: Any, rpc: str, decode: Callable[[], T]) -> T:
        """A request's contract values; what cannot be decoded is the client's error,
        ``INVALID_ARGUMENT``. The codec names the field (``WireFormatError``); anything else it
        raises on a client's bytes (``RecursionError``, say) is that client's error too."""
        try:
            return decode()
        except codec.WireFormatError as error:
            failure = str(error)
        except (ValueError, TypeError, OverflowError, RecursionError) as error:
            failure = _describe(error)
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode the {rpc} request: {failure}")

    def _encode(self, context: Any, operation: str, encode: Callable[[], T]) -> T:
        try:
            return encode()
        except BaseException as error:
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
        ``passes``), or any other ``BaseException``, aborts with INTERNAL. ``declares``: the answer
        is the engine's capabilities, which say, before the turn ends, whether its next calls
        may overlap. ``ahead``: an operation to answer in the same turn once ``call`` returned
        (``_AnswerAhead``)."""
        slot = self._slot(engine_id, context)
        return self._run_on(slot, engine_id, context, operation, call, passes, declares=declares, ahead=ahead)

    def _slot(self, engine_id: int, context: Any) -> _Slot:
        """The engine ``engine_id`` (now the most recently used); aborts the call if there is none."""
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
        return slot

    def _run_on(
        self,
        slot: _Slot,
        engine_id: int,
        context: Any,
        operation: str,
        call: Callable[[ShardEngine], T],
        passes: type[BaseException] | None = None,
        *,
        declares: bool = False,
        ahead: _AnswerAhead | None = None,
    ) -> T:
        """``_run`` on a slot already looked up."""
        with slot.turn() as turn:
            failed_ahead = slot.take_failed_ahead(turn, operation)
            try:
                result = call(slot.engine) if failed_ahead is None else failed_ahead()
            # Engine code runs on a server thread, which no signal reaches: whatever it raises,
            # KeyboardInterrupt and SystemExit included, is the engine's, and is answered.
            except BaseException as error:
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


def _delay_refused(seconds: float, asked: float) -> StructuredStatus:
    already = f", {asked:g} s of it asked already" if asked else ""
    message = (
        f"delay fault of {seconds:g} s refused: a served engine may be asked to wait at most "
        f"{MAX_FAULT_DELAY_SECONDS:g} s in all before its next prefill or decode{already}, so that "
        "slow calls cannot hold the server's threads; ask for less"
    )
    return StructuredStatus(StatusCode.INVALID_ARGUMENT, message)


def _describe(error: BaseException) -> str:
    """``TypeName: message`` plus the exception's notes, one per line."""
    return "".join(traceback.format_exception_only(error)).strip()


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


class _CallThreads(futures.ThreadPoolExecutor):
    """Daemon threads running the calls submitted to them, in order: an executor gRPC accepts
    (it asks for a ``ThreadPoolExecutor``, and only ever calls ``submit``).

    Unlike ``ThreadPoolExecutor``'s threads, which the interpreter joins when it exits, these
    never hold the process: an engine call that never returns must not keep a server that was
    stopped (Ctrl-C, SIGTERM) from ending. Only the public methods are overridden, so the base
    class never starts a thread of its own."""

    def __init__(self, size: int, name: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._calls: queue.SimpleQueue[tuple[futures.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._size = size
        for number in range(size):
            threading.Thread(target=self._serve_calls, name=f"{name}-{number}", daemon=True).start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> futures.Future[T]:
        future: futures.Future[T] = futures.Future()
        self._calls.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End each thread once it is idle (``wait`` is ignored: the threads are daemons)."""
        if cancel_futures:
            with contextlib.suppress(queue.Empty):
                while True:
                    waiting = self._calls.get_nowait()
                    if waiting is not None:
                        waiting[0].cancel()
        for _ in range(self._size):
            self._calls.put(None)

    def _serve_calls(self) -> None:
        while (item := self._calls.get()) is not None:
            _run_into(*item)


class _Rpc:
    """One RPC of the service as gRPC calls it: with the request's raw bytes, on the thread pool
    its kind of call has (``experimental_thread_pool``, which gRPC reads from the behaviour it
    is given). Bytes that do not parse as the request message are the client's error,
    ``INVALID_ARGUMENT`` naming the RPC and the message, where gRPC's own deserializer would
    answer ``INTERNAL``."""

    def __init__(
        self, servicer: ShardEngineServicer, name: str, request_type: Any, pool: futures.ThreadPoolExecutor | None = None
    ) -> None:
        self._method = getattr(servicer, name)
        self._name = name
        self._request_type = request_type
        self.experimental_thread_pool = pool

    def __call__(self, raw: bytes, context: Any) -> Any:
        return self._method(self.parsed(self._name, self._request_type, raw, context), context)

    @staticmethod
    def parsed(name: str, request_type: Any, raw: bytes, context: Any) -> Any:
        """``raw`` as a ``request_type`` message, or the call aborted naming the RPC ``name``."""
        try:
            return request_type.FromString(raw)
        except Exception as error:  # protobuf's DecodeError, or whatever its parser raises on garbage
            failure = error
        details = (
            f"cannot decode the {name} request: its {len(raw)} bytes are not a "
            f"{request_type.DESCRIPTOR.full_name} message ({_describe(failure)})"
        )
        _abort(context, grpc.StatusCode.INVALID_ARGUMENT, details)


class _Aborted(Exception):
    """A call of the ``Calls`` stream ended with a gRPC status other than OK."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _StreamedCallContext:
    """What a servicer method is given for one call of the ``Calls`` stream: the part of gRPC's
    context it uses (``abort`` and ``set_trailing_metadata``), kept for that call's answer alone,
    since aborting the stream's own context would end every later call on it."""

    def __init__(self) -> None:
        self.trailing_metadata: dict[str, str] = {}

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> None:
        self.trailing_metadata = dict(metadata)

    def abort(self, code: Any, details: str) -> NoReturn:
        raise _Aborted(code, details)


class _OnPool:
    """A stream's behaviour as gRPC calls it, on ``pool`` (``experimental_thread_pool``)."""

    def __init__(self, behaviour: Callable[[Any, Any], Any], pool: futures.ThreadPoolExecutor) -> None:
        self._behaviour = behaviour
        self.experimental_thread_pool = pool

    def __call__(self, requests: Any, context: Any) -> Any:
        return self._behaviour(requests, context)


class _ThreadPerStream(futures.ThreadPoolExecutor):
    """A daemon thread for each ``Calls`` stream, for as long as it lasts: a stream holds its
    thread between calls, so a pool of fixed size would leave the streams beyond it unanswered.
    (Daemons and ``submit`` only, for the reasons ``_CallThreads`` gives.)"""

    def __init__(self, name: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._name = name
        self._streams = itertools.count(1)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> futures.Future[T]:
        future: futures.Future[T] = futures.Future()
        name = f"{self._name}-{next(self._streams)}"
        threading.Thread(target=_run_into, args=(future, functools.partial(fn, *args, **kwargs)), name=name, daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to do: each thread ends with its stream (the server's stop cancels them)."""


def _run_into(future: futures.Future[Any], call: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except BaseException as error:  # the future carries it to whoever waits on it
        future.set_exception(error)
    else:
        future.set_result(result)


def _add_service(
    server: Any,
    servicer: ShardEngineServicer,
    engine_pool: futures.ThreadPoolExecutor,
    health_pool: futures.ThreadPoolExecutor,
    connection_pool: futures.ThreadPoolExecutor,
    stream_pool: futures.ThreadPoolExecutor,
) -> None:
    """Register every RPC of ``ShardEngineService`` (read from the proto, so none is missed) as
    an ``_Rpc``: raw requests, each kind of call on its own pool; each ``Calls`` stream on a
    thread of its own."""
    service = pb.DESCRIPTOR.services_by_name["ShardEngineService"]
    handlers = {}
    for method in service.methods:
        if method.name == _STREAM_RPC:
            continue
        if method.name in _CONNECTION_RPCS:
            pool = connection_pool
        elif method.name in _HEALTH_RPCS:
            pool = health_pool
        else:
            pool = engine_pool
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _Rpc(servicer, method.name, request_type, pool),
            request_deserializer=None,  # the raw bytes: _Rpc parses them
            response_serializer=response_type.SerializeToString,
        )
    handlers[_STREAM_RPC] = grpc.stream_stream_rpc_method_handler(
        _OnPool(servicer.Calls, stream_pool),
        request_deserializer=None,  # the raw bytes: Calls parses them
        response_serializer=pb.Answer.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _unix_path(bind: str) -> str:
    """The file of a ``unix:PATH`` (or ``unix:///PATH``) address."""
    path = bind.removeprefix("unix:")
    return path[2:] if path.startswith("//") else path


def _refuse_a_socket_in_use(listen: str, path: str) -> None:
    """Raise ``ShardkitError`` if something answers on the ``unix:`` socket ``path``, or ``path``
    is not a socket: gRPC would replace the file, silently taking the socket over from the
    server there. A socket file nothing answers on (a server that died) is left to gRPC to
    replace."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        message = f"cannot listen on {listen!r}: cannot check what is at {path} ({error}); choose another path"
        raise ShardkitError(message) from None
    if not stat.S_ISSOCK(mode):
        message = f"cannot listen on {listen!r}: {path} exists and is not a socket; remove it or choose another path"
        raise ShardkitError(message)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # nothing listens: a socket file left by a server that died
        except OSError as error:
            message = (
                f"cannot listen on {listen!r}: cannot tell whether a server listens on {path} ({error}); "
                "choose another path"
            )
            raise ShardkitError(message) from None
    message = (
        f"cannot listen on {listen!r}: a server is already listening there: {_who_is_there(f'unix:{path}')}; "
        "stop it, or choose another path"
    )
    raise ShardkitError(message)


def _who_is_there(bind: str) -> str:
    """Who serves at ``bind``, in words, as its answer to ``Handshake`` says (only wording:
    the socket is in use whatever it answers)."""
    channel = grpc.insecure_channel(bind)
    try:
        stub = pb_grpc.ShardEngineServiceStub(channel)  # type: ignore[no-untyped-call]
        request = pb.HandshakeRequest(protocol_version=codec.PROTOCOL_VERSION, client=f"shardkit {__version__}")
        answer = stub.Handshake(request, timeout=_WHO_IS_THERE_SECONDS)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return "a shardkit server of another protocol version"
        return "a process that does not answer shardkit's Handshake"
    finally:
        channel.close()
    pid = answer.server_id.partition("-")[0]
    process = f" (process {pid})" if pid.isdigit() else ""
    return f"{_ascii(answer.server) or 'a shardkit.v1 server'}{process} serving {_ascii(answer.target)!r}"


def binds_loopback_only(host: str) -> bool:
    """Whether a server listening on ``HOST:PORT`` is reachable from this machine only: ``host``
    is a loopback address, or a host name every address of which is one (gRPC binds every
    address the name resolves to)."""
    if is_loopback(host):
        return True
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
        return bool(found) and all(ipaddress.ip_address(str(a).partition("%")[0]).is_loopback for a in found)
    except (OSError, ValueError, UnicodeError):
        return False


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
    #: The thread pools of the engine calls and of ``Health`` (gRPC's own pool answers the rest).
    pools: tuple[futures.ThreadPoolExecutor, ...] = ()
    #: A worker's plain socket for the ``Calls`` stream (``calls_socket.py``), when it has one.
    calls_listener: CallsListener | None = None

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (waiting ``grace`` seconds for calls in flight) and drop every engine;
        a ``unix:`` socket's file goes with it (gRPC removes it)."""
        if self.calls_listener is not None:
            self.calls_listener.close()
        self.server.stop(grace).wait()
        self.servicer.close_all()
        for pool in self.pools:
            # Idle threads end now; one still in an engine call ends when the call does.
            pool.shutdown(wait=False, cancel_futures=True)

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
    optional_calls: tuple[str, ...] = OPTIONAL_CALLS,
    calls_socket: str | None = None,
) -> EngineServer:
    """Serve engines built from ``target`` on ``listen`` and return the running server.

    ``protocol_version`` exists so tests can play an incompatible server; ``log`` gets a
    line for every exception an engine raises (``shardkit serve`` passes stderr);
    ``fatal_exceptions`` ends the process after that line (exit ``codec.EXIT_ENGINE_RAISED``, or
    ``codec.EXIT_OUT_OF_MEMORY`` for ``MemoryError``), as ``shardkit serve --worker`` does;
    ``max_engines`` bounds the engines kept alive (the least recently used is evicted);
    ``max_message_bytes`` bounds each message received or sent; ``optional_calls``: the
    optional RPCs served and listed by the handshake (fewer plays an older server);
    ``calls_socket``: a path where the ``Calls`` stream is served over a plain Unix socket as
    well (``calls_socket.py``; ``shardkit serve --worker`` has one, for the kit alone).
    """
    resolved = resolve_target(target)
    bind, host = parse_listen(listen)
    servicer = ShardEngineServicer(
        resolved,
        protocol_version=protocol_version,
        log=log,
        fatal_exceptions=fatal_exceptions,
        max_engines=max_engines,
        optional_calls=optional_calls,
    )
    if host is None:
        # gRPC replaces a socket file that exists: a socket in use must be an error instead.
        _refuse_a_socket_in_use(listen, _unix_path(bind))
    # gRPC sets SO_REUSEPORT by default, which lets a second server "bind" a busy port and
    # then never see a call: a port in use must be an error instead.
    options = [*codec.grpc_options(max_message_bytes), ("grpc.so_reuseport", 0)]
    connection_pool = _CallThreads(_CONNECTION_THREADS, "shardkit-connection")
    engine_pool = _CallThreads(_ENGINE_THREADS, "shardkit-engine")
    health_pool = _CallThreads(_HEALTH_THREADS, "shardkit-health")
    server = grpc.server(connection_pool, options=options)
    _add_service(server, servicer, engine_pool, health_pool, connection_pool, _ThreadPerStream("shardkit-calls"))
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as error:
        port, reason = 0, str(error)
    else:
        reason = "the address is in use or not available"
    if not port:
        for pool in (connection_pool, engine_pool, health_pool):
            pool.shutdown(wait=False)
        message = f"cannot listen on {listen!r}: {reason}"
        raise ShardkitError(message)
    listener = None
    if calls_socket is not None and _STREAM_RPC in optional_calls:
        # Listening before gRPC serves: a client that got its handshake finds it there.
        listener = CallsListener(calls_socket, servicer.streamed_answer, max_message_bytes)
    server.start()
    url = bind if host is None else f"grpc://{host}:{port}"
    return EngineServer(server, servicer, url, (engine_pool, health_pool, connection_pool), listener)
