"""``RemoteShardEngine``: a ``ShardEngine`` served over the ``shardkit.v1`` gRPC service.

``grpc://HOST:PORT`` and ``unix:PATH`` are engine targets (see ``remote_target``):
each call of the target asks the server for a fresh engine of its own (``NewEngine``),
so twins and restarts after a crash get fresh engines, as in-process.

Every call has a deadline. Whatever goes wrong on the way is a ``RemoteEngineError``
naming the address and the operation, never a hang:

- ``RemoteUnavailable`` — the connection is refused, or the server went away;
- ``RemoteDeadlineExceeded`` — no answer within ``timeout_seconds``;
- ``RemoteEngineCrashed`` — the engine raised (a process death for the kit);
  ``exception_type`` names what it raised;
- ``RemoteProtocolError`` — another protocol version, a missing RPC, or an answer
  that does not decode to a contract §1 value.

For the kit (engines built by ``remote_target``), losing the server is not a finding about
the engine: a call that finds the server gone, or the engine evicted by it, raises
``EngineLost`` instead, which ends the run at once with an error naming the address.

Connections are shared per address (one channel, one handshake), and may be called
through from several threads at once, as a parallel phase does. An engine that is
closed, or garbage-collected, is dropped on the server: ``close()`` does it at once,
garbage collection queues it for the connection's next ``NewEngine`` (a finalizer must
not make a blocking call).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

import grpc  # type: ignore[import-untyped, unused-ignore]

from shardkit._core.targets import DEFAULT_STEP_TIMEOUT, RemoteAddress, ResolvedTarget, check_seconds
from shardkit._transport import codec
from shardkit._transport.calls_socket import SocketStream
from shardkit._version import __version__
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    Fault,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)
from shardkit.errors import (
    EngineLost,
    InvalidTarget,
    RemoteDeadlineExceeded,
    RemoteEngineCrashed,
    RemoteEngineError,
    RemoteEngineEvicted,
    RemoteProtocolError,
    RemoteUnavailable,
)
from shardkit.proto import shard_engine_pb2 as pb
from shardkit.proto import shard_engine_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "RemoteDeadlineExceeded",
    "RemoteEngineCrashed",
    "RemoteEngineError",
    "RemoteEngineEvicted",
    "RemoteProtocolError",
    "RemoteShardEngine",
    "RemoteUnavailable",
    "calls_sent",
    "close_connection",
    "close_connections",
    "parse_address",
    "remote_target",
    "round_trips",
]

T = TypeVar("T")
#: A call's deadline unless told otherwise: the kit's, for every engine in another process.
DEFAULT_TIMEOUT_SECONDS = DEFAULT_STEP_TIMEOUT
#: How long ``close()`` waits for the server to drop an engine: best effort.
_CLOSE_TIMEOUT_SECONDS = 1.0
#: The optional RPC that carries the others over one stream per thread (``HandshakeResponse.calls``).
_STREAM_RPC = "Calls"
#: The response message of each RPC, which a ``Calls`` answer carries serialized.
_RESPONSE_TYPES: Mapping[str, Any] = MappingProxyType(
    {method.name: getattr(pb, method.output_type.name) for method in pb.DESCRIPTOR.services_by_name["ShardEngineService"].methods}
)
_STATUS_CODES: Mapping[int, Any] = MappingProxyType({code.value[0]: code for code in grpc.StatusCode})


class _Count:
    """A count of what this process sent, over every connection (``round_trips``, ``calls_sent``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self, calls: int = 1) -> None:
        with self._lock:
            self.count += calls


_ROUND_TRIPS = _Count()
_CALLS_SENT = _Count()


def round_trips() -> int:
    """How many times this process has sent shard servers calls and waited for their
    answers, over every connection: a unary RPC is one round trip, and so are calls sent
    together on a stream (``_Connection.call_all``). A run's round trips are the difference
    before and after it (``shardkit bench`` divides them by the run's steps)."""
    return _ROUND_TRIPS.count


def calls_sent() -> int:
    """How many calls this process has sent to shard servers, each RPC and each call of a
    ``Calls`` stream, over every connection: ``round_trips`` or more."""
    return _CALLS_SENT.count


def parse_address(address: str) -> tuple[str, str]:
    """``grpc://HOST:PORT``, ``HOST:PORT`` or ``unix:PATH`` → (the URL to show, what gRPC dials)."""
    if address.startswith("unix:"):
        if not address[len("unix:") :].strip("/"):
            message = f"remote engine address {address!r}: a unix socket needs a path, e.g. unix:/tmp/shard.sock"
            raise InvalidTarget(message)
        return address, address
    dial = address.removeprefix("grpc://")
    host, colon, port = dial.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        message = f"remote engine address {address!r} must be grpc://HOST:PORT (a port in 1..65535) or unix:PATH"
        raise InvalidTarget(message)
    return f"grpc://{dial}", dial


class _Connection:
    """One channel to one server, handshaken, shared by every engine on that address."""

    def __init__(self, url: str, dial: str, calls_socket: str | None = None) -> None:
        self.url = url
        self.channel = grpc.insecure_channel(dial, options=codec.GRPC_OPTIONS)
        self.stub = pb_grpc.ShardEngineServiceStub(self.channel)  # type: ignore[no-untyped-call]
        #: Engines garbage-collected since the last NewEngine; closed on the server then.
        self.to_close: collections.deque[int] = collections.deque()
        self.closing: set[Any] = set()
        self.server = ""
        self.target = ""
        self.server_id = ""
        #: Whether the server has ``Calls`` (its handshake says so): then every call but the
        #: handshake goes over a stream of the calling thread's (``_CallStream``).
        self.streamed = False
        #: A worker's plain socket for the calls (``calls_socket.py``), used instead of gRPC
        #: streams when the handshake lists ``Calls``; None: gRPC streams.
        self.calls_socket = calls_socket
        self._streams = threading.local()
        self._open_streams: weakref.WeakSet[_CallStream | SocketStream] = weakref.WeakSet()
        self.closed = False
        #: Whether the last engine loaded through this connection was asked ``capabilities()``
        #: right after ``load``, as the kit asks every engine: then ``load`` asks for them ahead.
        self.capabilities_after_load = False
        #: Guards what engines on this connection share (the server's identity, the
        #: CloseEngine calls in flight): any number of threads may call through it at once.
        self._lock = threading.Lock()

    def call(self, operation: str, rpc: str, request: Any, timeout: float, *, wait_for_ready: bool = False) -> Any:
        if self.closed:
            message = f"{self.url}: {operation} failed: the connection was closed (close_connections())"
            raise RemoteUnavailable(message, address=self.url, operation=operation)
        _CALLS_SENT.add()
        if self.streamed and not wait_for_ready and rpc != "Handshake":
            stream = self._thread_stream()
            return self._send(stream, operation, rpc, request, timeout).result()
        _ROUND_TRIPS.add()
        try:
            return getattr(self.stub, rpc)(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as error:
            raise self.translate(error, operation, timeout) from error

    def call_all(self, calls: list[tuple[str, str, Any]], timeout: float) -> list[_Reply]:
        """The replies to ``calls`` ((operation, rpc, request)) in order, each giving the
        response ``call`` would return or raising the ``RemoteEngineError`` it would raise. On
        the thread's ``Calls`` stream they are all sent now and their answers read when first
        asked for, so whatever else this thread sends before it asks travels in the same round
        trip (the server still runs the calls one after another, in the order sent). Without
        the stream they are called one by one now, up to the first that fails; the calls after
        it are not sent, and their replies raise that failure too."""
        if not self.streamed:
            replies: list[_Reply] = []
            for operation, rpc, request in calls:
                reply = _Reply(self, None, operation, rpc, timeout)
                if replies and replies[-1].error is not None:
                    reply.settle(error=replies[-1].error)
                else:
                    try:
                        reply.settle(response=self.call(operation, rpc, request, timeout))
                    except RemoteEngineError as error:
                        reply.settle(error=error)
                replies.append(reply)
            return replies
        if self.closed:
            operation = calls[0][0] if calls else "a call"
            message = f"{self.url}: {operation} failed: the connection was closed (close_connections())"
            raise RemoteUnavailable(message, address=self.url, operation=operation)
        _CALLS_SENT.add(len(calls))
        stream = self._thread_stream()
        return [self._send(stream, operation, rpc, request, timeout) for operation, rpc, request in calls]

    def _thread_stream(self) -> _CallStream | SocketStream:
        stream: _CallStream | SocketStream | None = getattr(self._streams, "stream", None)
        if stream is None:
            stream = _CallStream(self.channel) if self.calls_socket is None else SocketStream(self.calls_socket)
            self._streams.stream = stream
            self._open_streams.add(stream)
        return stream

    def _send(self, stream: _CallStream | SocketStream, operation: str, rpc: str, request: Any, timeout: float) -> _Reply:
        """Send one call on ``stream``, not waiting: its reply reads the answer when asked."""
        stream.send(pb.Call(rpc=rpc, request=request.SerializeToString()), timeout)
        reply = _Reply(self, stream, operation, rpc, timeout)
        stream.unread.append(reply)
        stream.sent_since_wait = True
        return reply

    def read_until(self, stream: _CallStream | SocketStream, reply: _Reply) -> None:
        """Read ``stream``'s answers in the order their calls were sent, each into its reply,
        up to ``reply``'s; the thread that sent them reads them, as it owns the stream. A
        failure that ends the stream settles every reply still unread."""
        while reply.response is None and reply.error is None:
            if stream.sent_since_wait:  # calls went out since the last wait: this wait is a round trip
                _ROUND_TRIPS.add()
                stream.sent_since_wait = False
            oldest = stream.unread.popleft()
            try:
                oldest.settle(response=self._answer(stream, oldest.operation, oldest.rpc, oldest.timeout))
            except RemoteEngineError as error:
                oldest.settle(error=error)
                if stream.ended:  # the stream failed: no later answer comes
                    self._settle_unread(stream, error)
            except BaseException:
                # Interrupted while waiting: an answer may still come, and the stream would be
                # out of step with its calls. Dropped, so that this thread's next call opens another.
                self._drop_stream(stream)
                message = f"{self.url}: {oldest.operation}: interrupted while waiting for the answer"
                lost = RemoteUnavailable(message, address=self.url, operation=oldest.operation)
                oldest.settle(error=lost)
                self._settle_unread(stream, lost)
                raise
            else:
                if stream.ended:  # answered as its deadline passed: the stream was cancelled behind it
                    while stream.unread:
                        later = stream.unread.popleft()
                        code = grpc.StatusCode.DEADLINE_EXCEEDED
                        later.settle(error=self.failure(code, "", {}, later.operation, later.timeout))

    @staticmethod
    def _settle_unread(stream: _CallStream | SocketStream, error: RemoteEngineError) -> None:
        while stream.unread:
            stream.unread.popleft().settle(error=error)

    def _answer(self, stream: _CallStream | SocketStream, operation: str, rpc: str, timeout: float) -> Any:
        """The answer to the oldest call sent on ``stream`` and not yet answered."""
        try:
            answer = stream.receive(timeout)
        except grpc.RpcError as error:
            self._drop_stream(stream)
            if stream.expired:
                raise self.failure(grpc.StatusCode.DEADLINE_EXCEEDED, "", {}, operation, timeout) from error
            raise self.translate(error, operation, timeout) from error
        except StopIteration:
            self._drop_stream(stream)
            message = f"{self.url}: {operation}: the server ended the {_STREAM_RPC} stream without an answer"
            raise RemoteProtocolError(message, address=self.url, operation=operation) from None
        if stream.expired:  # the answer came as the deadline passed: answered, but the stream is cancelled
            self._drop_stream(stream)
        if answer.status_code != grpc.StatusCode.OK.value[0]:
            code = _STATUS_CODES.get(answer.status_code)
            details = answer.details if code is not None else f"status code {answer.status_code}: {answer.details}"
            raise self.failure(code, details, dict(answer.trailing_metadata), operation, timeout)
        try:
            return _RESPONSE_TYPES[rpc].FromString(answer.response)
        except Exception as error:  # protobuf's DecodeError, or whatever its parser raises on garbage
            message = f"{self.url}: {operation}: the server answered garbage: the answer is not a {rpc} response ({error})"
            raise RemoteProtocolError(message, address=self.url, operation=operation) from None

    def _drop_stream(self, stream: _CallStream | SocketStream) -> None:
        stream.end()
        if getattr(self._streams, "stream", None) is stream:
            self._streams.stream = None

    def translate(self, error: Any, operation: str, timeout: float) -> RemoteEngineError:
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = (error.details() if callable(getattr(error, "details", None)) else None) or str(error)
        return self.failure(code, details, _trailing(error), operation, timeout)

    def failure(
        self, code: Any, details: str, trailing: dict[str, Any], operation: str, timeout: float
    ) -> RemoteEngineError:
        """The error for a call that ended with gRPC status ``code`` (None: unknown), ``details``
        and the ``trailing`` metadata, whether a unary RPC or a call of a ``Calls`` stream."""
        where = {"address": self.url, "operation": operation, "details": details}
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"{self.url}: {operation} got no answer within its {timeout:g} s deadline (the engine hangs or is too slow)"
            return RemoteDeadlineExceeded(message, timeout_seconds=timeout, **where)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            _CONNECTIONS.forget(self)  # the next engine on this address connects and handshakes afresh
            message = (
                f"{self.url}: {operation} failed: the engine server is unreachable "
                f"(nothing listens there, or it went away): {details}"
            )
            return RemoteUnavailable(message, code=code.name, **where)
        if code == grpc.StatusCode.INTERNAL:
            exception_type = trailing.get(codec.EXCEPTION_TYPE_KEY)
            if exception_type is not None:
                message = f"{self.url}: {operation}: the engine raised {details}"
                return RemoteEngineCrashed(message, exception_type=str(exception_type), **where)
        if code == grpc.StatusCode.FAILED_PRECONDITION and codec.EVICTED_KEY in trailing:
            message = f"{self.url}: {operation}: the server evicted this engine: {details}"
            return RemoteEngineEvicted(message, code=code.name, **where)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            message = (
                f"{self.url}: {operation}: a message exceeded the size limit of one end "
                f"(this client's is {codec.MAX_MESSAGE_BYTES // 2**20} MiB, shardkit.remote.MAX_MESSAGE_BYTES): {details}"
            )
            return RemoteEngineError(message, code=code.name, **where)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            message = f"{self.url}: {operation}: the server does not implement this RPC; is it a shardkit.v1 service? ({details})"
            return RemoteProtocolError(message, code=code.name, **where)
        name = code.name if code is not None else "unknown"
        return RemoteEngineError(
            f"{self.url}: {operation} failed with gRPC status {name}: {details}", code=name, **where
        )

    def handshake(self, timeout: float, wait_for_ready: bool) -> None:
        request = pb.HandshakeRequest(protocol_version=codec.PROTOCOL_VERSION, client=f"shardkit {__version__}")
        try:
            response = self.call("handshake", "Handshake", request, timeout, wait_for_ready=wait_for_ready)
        except RemoteEngineError as error:
            if error.code != "FAILED_PRECONDITION":
                raise
            # The server refused this client's version; its message names both.
            message = f"{self.url}: handshake refused: {error.details}"
            raise RemoteProtocolError(
                message, address=self.url, operation="handshake", code=error.code, details=error.details
            ) from error
        if response.protocol_version != codec.PROTOCOL_VERSION:
            message = (
                f"{self.url}: protocol version mismatch: this client speaks {codec.PROTOCOL_VERSION!r}, "
                f"the server speaks {response.protocol_version!r}"
            )
            raise RemoteProtocolError(message, address=self.url, operation="handshake")
        with self._lock:
            self.server, self.target, self.server_id = response.server, response.target, response.server_id
            self.streamed = _STREAM_RPC in response.calls

    def new_engine(self, timeout: float) -> int:
        dropped = []
        while True:
            # Another thread may take the last id between a check and a pop: pop, then check.
            try:
                dropped.append(self.to_close.popleft())
            except IndexError:
                break
        # The engines dropped since the last NewEngine travel with it: one call instead of one each.
        response = self.call("NewEngine", "NewEngine", pb.NewEngineRequest(close_engine_ids=dropped), timeout)
        if dropped and not response.closed_engine_ids:
            self._close_each(dropped, timeout)  # a server that does not know close_engine_ids
        with self._lock:
            known = self.server_id
        if response.server_id != known:
            # The channel reconnected to another server on this address: check it speaks our version.
            self.handshake(timeout, wait_for_ready=False)
        return int(response.engine_id)

    def _close_each(self, engine_ids: list[int], timeout: float) -> None:
        for engine_id in engine_ids:
            # Not waited for: a lost CloseEngine only leaves an idle engine on the server. The
            # future is kept until done, since gRPC cancels a call whose future is collected.
            _ROUND_TRIPS.add()
            _CALLS_SENT.add()
            closing = self.stub.CloseEngine.future(pb.EngineRef(engine_id=engine_id), timeout=timeout)
            with self._lock:
                self.closing.add(closing)
            closing.add_done_callback(self._closed_one)

    def _closed_one(self, closing: Any) -> None:
        with self._lock:
            self.closing.discard(closing)

    def close(self) -> None:
        self.closed = True
        for stream in list(self._open_streams):
            stream.end()
        self.channel.close()


class _Reply:
    """The reply to one call: the response, or the ``RemoteEngineError`` the call ended with.
    A call sent on a ``Calls`` stream is answered in turn: its reply reads the stream's answers
    up to its own when first asked (``result``), keeping those of the calls sent before it."""

    __slots__ = ("_connection", "_stream", "error", "operation", "response", "rpc", "timeout")

    def __init__(self, connection: _Connection, stream: _CallStream | SocketStream | None, operation: str, rpc: str, timeout: float) -> None:
        self._connection = connection
        self._stream = stream
        self.operation = operation
        self.rpc = rpc
        self.timeout = timeout
        self.response: Any = None
        self.error: RemoteEngineError | None = None

    def settle(self, *, response: Any = None, error: RemoteEngineError | None = None) -> None:
        self.response, self.error = response, error

    def result(self) -> Any:
        """The response; raises the call's ``RemoteEngineError`` if it failed."""
        if self.response is None and self.error is None:
            assert self._stream is not None, "a reply without a stream is settled when made"
            self._connection.read_until(self._stream, self)
        if self.error is not None:
            raise self.error
        return self.response


class _CallStream:
    """One thread's ``Calls`` stream: each call is sent, and its answer awaited, in turn. Ended
    (its requests half-closed, so the server's thread for it ends too) when dropped after a
    failure, when its connection closes, or when its thread ends and the stream is collected."""

    def __init__(self, channel: Any) -> None:
        self.ended = False
        #: The replies to the calls sent and not yet answered, oldest first.
        self.unread: collections.deque[_Reply] = collections.deque()
        #: Whether calls were sent since this thread last waited for an answer.
        self.sent_since_wait = False
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        open_stream = channel.stream_stream(
            f"/{pb.DESCRIPTOR.services_by_name['ShardEngineService'].full_name}/{_STREAM_RPC}",
            request_serializer=pb.Call.SerializeToString,
            response_deserializer=pb.Answer.FromString,
        )
        self._answers: Any = open_stream(iter(self._calls.get, None))
        #: Set when the watchdog cancelled the stream because an answer was overdue.
        self.expired = False
        self._end = weakref.finalize(self, self._calls.put, None)

    def send(self, call: Any, timeout: float) -> None:
        """Queue ``call`` for gRPC's sending thread (the wait for its answer has the deadline)."""
        del timeout
        self._calls.put(call)

    def receive(self, timeout: float) -> Any:
        """The answer to the oldest call sent and not yet answered; a ``grpc.RpcError`` if the
        stream fails or the answer is not there within ``timeout`` seconds (``expired`` then
        says so)."""
        with _WATCHDOG.watching(self, timeout):
            return next(self._answers)

    def expire(self) -> None:
        self.expired = True
        self._answers.cancel()

    def end(self) -> None:
        self.ended = True
        self._end()


class _Watchdog:
    """Cancels a ``Calls`` stream whose answer is overdue: a stream has no deadline per call, as
    a unary RPC has. One thread for the process, which wakes at the earliest deadline it knows of,
    so most calls neither wake it nor start anything."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._watched: dict[int, tuple[float, _CallStream]] = {}
        self._keys = itertools.count()
        self._wakes_at = math.inf
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, stream: _CallStream, timeout: float) -> Iterator[None]:
        deadline = time.monotonic() + timeout
        key = next(self._keys)
        with self._lock:
            self._watched[key] = (deadline, stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="shardkit-stream-deadlines", daemon=True)
                self._thread.start()
            if deadline < self._wakes_at:
                self._wakes_at = deadline
                self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._watched.pop(key, None)

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for key, (deadline, stream) in list(self._watched.items()):
                    if deadline <= now:
                        del self._watched[key]
                        stream.expire()
                self._wakes_at = min((deadline for deadline, _ in self._watched.values()), default=math.inf)
                self._lock.wait(None if self._wakes_at == math.inf else self._wakes_at - now)


_WATCHDOG = _Watchdog()


def _trailing(error: Any) -> dict[str, Any]:
    """A failed call's trailing metadata, as a dict (empty when there is none)."""
    if not callable(getattr(error, "trailing_metadata", None)):
        return {}
    return dict(error.trailing_metadata() or ())


class _Connections:
    """The cached channel of each address, shared by every engine on it; the process has one
    (``_CONNECTIONS``), which ``close_connections()`` empties."""

    def __init__(self) -> None:
        self._by_url: dict[str, _Connection] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> _Connection | None:
        with self._lock:
            return self._by_url.get(url)

    def keep(self, connection: _Connection) -> _Connection:
        """The cached connection of its address: ``connection``, unless another thread cached one first."""
        with self._lock:
            return self._by_url.setdefault(connection.url, connection)

    def forget(self, connection: _Connection) -> None:
        with self._lock:
            if self._by_url.get(connection.url) is connection:
                del self._by_url[connection.url]

    def pop(self, url: str) -> _Connection | None:
        with self._lock:
            return self._by_url.pop(url, None)

    def pop_all(self) -> list[_Connection]:
        with self._lock:
            connections = list(self._by_url.values())
            self._by_url.clear()
        return connections


_CONNECTIONS = _Connections()


def _connect(url: str, dial: str, timeout: float, wait_for_ready: bool, calls_socket: str | None) -> _Connection:
    connection = _CONNECTIONS.get(url)
    if connection is not None:
        return connection
    connection = _Connection(url, dial, calls_socket)
    try:
        connection.handshake(timeout, wait_for_ready)
    except BaseException:
        connection.close()
        raise
    # Another thread may have connected meanwhile: keep one channel per address.
    kept = _CONNECTIONS.keep(connection)
    if kept is not connection:
        connection.close()
    return kept


def close_connection(url: str) -> None:
    """Close the cached channel to ``url`` (a server known to be gone), if there is one."""
    connection = _CONNECTIONS.pop(url)
    if connection is not None:
        connection.close()


def close_connections() -> None:
    """Close every cached channel; engines still using one fail with ``RemoteUnavailable``."""
    for connection in _CONNECTIONS.pop_all():
        connection.close()


def _step_text(operation: str, request: PrefillRequest | DecodeRequest) -> str:
    """E.g. ``decode(session='a', epoch=0, step=3, 1 token(s))``, for messages."""
    if request.token_ids is not None:
        size = f"{len(request.token_ids)} token(s)"
    else:
        assert request.bundle is not None
        shape = request.bundle.tensors[0].shape if request.bundle.tensors else ()
        size = f"a bundle of {shape[0] if shape else 0} row(s)"
    return f"{operation}(session={request.session_id!r}, epoch={request.epoch}, step={request.step}, {size})"


#: The RPCs after which the kit asks for the engine's metrics, and which can ask for them ahead.
_STEP_RPCS = frozenset({"Prefill", "Decode", "Cancel", "Release", "InjectFault"})


class _CallOrder:
    """The calls of one remote engine in the order they start, and the answer the server sent
    ahead with the last one (``StepCall.with_metrics``, ``LoadCall.with_capabilities``): what
    lets ``metrics()`` right after a step, and ``capabilities()`` right after ``load``, be
    answered without a round trip, and only while that copy is provably current.

    A copy answers its operation only if it came with the answer of the last call started on
    this engine, a call sent while no other call of this engine was in flight (from any
    thread), and nothing started since; taking it counts as a call, so it answers once. A
    call that fails ends copies for this engine for good: one that missed its deadline may
    still be running on the server, so no copy is provably current any more. Each copy is
    what the engine itself answered, on the server, right after that call and before any other
    (the server makes sure: see ``server._AnswerAhead``).

    A copy is asked for only where the calls so far say it will be used, since the server
    calls the engine for it either way: metrics while this engine's steps (prefill, decode,
    cancel, release, inject_fault) are followed by ``metrics()`` (the engine under test;
    the twins of the oracle never are), capabilities
    while the engines loaded through this connection were asked ``capabilities()`` next.
    """

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._started = 0
        self._in_flight = 0
        self._previous = ""  # the RPC of the last call started
        #: (the RPC it answers, the number of the call it came with, the response message).
        self._kept: tuple[str, int, Any] | None = None
        self._failed = False
        self._metrics_after_steps = False

    def _note(self, rpc: str) -> None:
        """Learn whether this engine's steps are followed by ``metrics()``; a call is starting."""
        if self._previous in _STEP_RPCS:
            self._metrics_after_steps = rpc == "Metrics"
        elif self._previous == "Load":
            self._connection.capabilities_after_load = rpc == "Capabilities"
        self._previous = rpc
        self._started += 1
        self._kept = None

    def begin(self, rpc: str) -> tuple[int, bool]:
        """A call of ``rpc`` starts: its number, and whether it should ask for an answer ahead."""
        with self._lock:
            self._note(rpc)
            self._in_flight += 1
            alone = self._in_flight == 1 and not self._failed
            if rpc == "Load":
                wanted = self._connection.capabilities_after_load
            else:
                wanted = rpc in _STEP_RPCS and self._metrics_after_steps
            return self._started, alone and wanted

    def end(self, number: int, *, failed: bool = False, ahead: tuple[str, Any] | None = None) -> None:
        """Call ``number`` ended; ``ahead``: (the RPC, the message) the server answered ahead."""
        with self._lock:
            self._in_flight -= 1
            self._failed = self._failed or failed
            if ahead is not None and self._started == number and not self._failed:
                self._kept = (ahead[0], number, ahead[1])

    def take(self, rpc: str) -> Any | None:
        """The copy of ``rpc``'s answer, if it is provably current (the call is then made);
        None: make the call."""
        with self._lock:
            kept = self._kept
            current = kept is not None and kept[0] == rpc and kept[1] == self._started and self._in_flight == 0
            if not current:
                return None
            assert kept is not None
            self._note(rpc)
            return kept[2]


class RemoteShardEngine(ShardEngine):
    """A fresh engine on the server at ``address``, owned by this object until ``close()``.

    ``wait_for_server`` waits (up to ``timeout_seconds``) for a server that is still
    starting instead of failing at once when nothing listens yet. ``loss_ends_run`` (what
    ``remote_target`` sets) makes a call that finds the server gone, or this engine evicted,
    raise ``EngineLost`` rather than ``RemoteUnavailable``/``RemoteEngineEvicted``.

    Any number of threads may call one engine at once, and the connection it shares is
    safe to call through from several threads. Whether the calls may overlap on the
    server is the served engine's to say: ``capabilities()`` passes its
    ``concurrent_calls`` through, and ``shardkit serve`` runs the calls of an engine that
    does not declare it one at a time.

    The one state it keeps between calls saves round trips: a step asks the server for the
    engine's metrics right after it, and ``load`` for its capabilities, and ``metrics()`` or
    ``capabilities()`` called next answers with that copy while it is provably what the
    engine would answer now (``_CallOrder``); otherwise it asks the server. A server that does
    not send such copies (an older one, a worker in another language) is simply asked.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        wait_for_server: bool = False,
        loss_ends_run: bool = False,
        calls_socket: str | None = None,
    ) -> None:
        check_seconds("timeout_seconds", timeout_seconds)
        self.url, dial = parse_address(address)
        self.timeout_seconds = float(timeout_seconds)
        self.loss_ends_run = loss_ends_run
        self._connection = _connect(self.url, dial, self.timeout_seconds, wait_for_server, calls_socket)
        self.engine_id = self._connection.new_engine(self.timeout_seconds)
        self._ref = pb.EngineRef(engine_id=self.engine_id)
        self._order = _CallOrder(self._connection)
        self._finalizer = weakref.finalize(self, self._connection.to_close.append, self.engine_id)

    def __repr__(self) -> str:
        return f"RemoteShardEngine({self.url!r}, engine_id={self.engine_id})"

    @property
    def server_target(self) -> str:
        """The engine target the server builds its engines from."""
        return self._connection.target

    def close(self) -> None:
        """Drop this engine on the server (best effort; closing twice is fine)."""
        if self._finalizer.detach() is None:
            return
        # A failure means the server is gone, and the engine with it.
        with contextlib.suppress(RemoteEngineError):
            self._connection.call("close", "CloseEngine", self._ref, min(self.timeout_seconds, _CLOSE_TIMEOUT_SECONDS))

    def __enter__(self) -> RemoteShardEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, operation: str, rpc: str, request: Any, number: int | None = None) -> Any:
        """One call; ``number``: it began already (``_CallOrder.begin``) and the caller ends it."""
        own = number is None
        if own:
            number, _ = self._order.begin(rpc)
        assert number is not None
        try:
            response = self._connection.call(operation, rpc, request, self.timeout_seconds)
        except (RemoteUnavailable, RemoteEngineEvicted) as error:
            self._order.end(number, failed=True)
            if not self.loss_ends_run:
                raise
            raise _lost(error) from error
        except BaseException:
            self._order.end(number, failed=True)
            raise
        if own:
            self._order.end(number)
        return response

    def _decode(self, operation: str, decode: Callable[[], T]) -> T:
        try:
            return decode()
        except codec.WireFormatError as error:
            raise self._garbage(operation, str(error)) from error

    def _garbage(self, operation: str, problem: str) -> RemoteProtocolError:
        message = f"{self.url}: {operation}: the server answered garbage: {problem}"
        return RemoteProtocolError(message, address=self.url, operation=operation)

    # --- ShardEngine ---------------------------------------------------------------------------

    def load(self, request: LoadRequest) -> LoadResult:
        operation = f"load(model_id={request.model_id!r}, layers {request.shard_start}..{request.shard_end} of {request.total_layers})"
        number, ask = self._order.begin("Load")
        try:
            call = pb.LoadCall(engine_id=self.engine_id, request=codec.load_request_to_pb(request), with_capabilities=ask)
        except BaseException:
            self._order.end(number)  # nothing was sent
            raise
        response = self._call(operation, "Load", call, number)
        kept = ("Capabilities", response.capabilities) if ask and response.HasField("capabilities") else None
        self._order.end(number, ahead=kept)
        outcome = response.WhichOneof("outcome")
        if outcome == "error":
            raise EngineError(self._decode(operation, lambda: codec.status_from_pb(response.error)))
        if outcome != "result":
            raise self._garbage(operation, "a LoadResponse holds neither a result nor an error")
        return self._decode(operation, lambda: codec.load_result_from_pb(response.result))

    def capabilities(self) -> EngineCapabilities:
        operation = "capabilities()"
        response = self._order.take("Capabilities")
        if response is None:
            response = self._call(operation, "Capabilities", self._ref)
        outcome = response.WhichOneof("outcome")
        if outcome == "error":
            raise EngineError(self._decode(operation, lambda: codec.status_from_pb(response.error)))
        if outcome != "capabilities":
            raise self._garbage(operation, "a CapabilitiesResponse holds neither capabilities nor an error")
        return self._decode(operation, lambda: codec.capabilities_from_pb(response.capabilities))

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._step("prefill", "Prefill", request)

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._step("decode", "Decode", request)

    def _step(self, name: str, rpc: str, request: PrefillRequest | DecodeRequest) -> StepResult:
        operation = _step_text(name, request)

        def build(with_metrics: bool) -> Any:
            request_message = codec.step_request_to_pb(request)
            return pb.StepCall(engine_id=self.engine_id, request=request_message, with_metrics=with_metrics)

        response = self._changing(operation, rpc, build)
        return self._decode(operation, lambda: codec.step_result_from_pb(response))

    def _changing(self, operation: str, rpc: str, build: Callable[[bool], Any]) -> Any:
        """A call after which the kit asks for metrics: ``build(with_metrics)`` makes its
        message, asking for them ahead when ``_CallOrder`` says the copy will be used."""
        number, ask = self._order.begin(rpc)
        try:
            call = build(ask)
        except BaseException:
            self._order.end(number)  # nothing was sent
            raise
        response = self._call(operation, rpc, call, number)
        self._order.end(number, ahead=("Metrics", response.metrics) if ask and response.HasField("metrics") else None)
        return response

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        operation = f"cancel(session={session_id!r}, epoch={epoch})"

        def build(with_metrics: bool) -> Any:
            call = pb.CancelCall(engine_id=self.engine_id, session_id=session_id, with_metrics=with_metrics)
            codec.put_counter(call, "epoch", epoch)
            return call

        response = self._changing(operation, "Cancel", build)
        return self._decode(operation, lambda: codec.status_from_pb(response))

    def release(self, session_id: str) -> StructuredStatus:
        operation = f"release(session={session_id!r})"

        def build(with_metrics: bool) -> Any:
            return pb.ReleaseCall(engine_id=self.engine_id, session_id=session_id, with_metrics=with_metrics)

        response = self._changing(operation, "Release", build)
        return self._decode(operation, lambda: codec.status_from_pb(response))

    def calls_together(self, calls: Sequence[tuple[str, Any]]) -> Iterator[StepResult | StructuredStatus]:
        """``prefill`` or ``decode`` of a request, or ``release`` of a session id, for each
        (name, argument) of ``calls``, in order: the answers, and the first error where the
        call would raise it. Sent now, together (``_Connection.call_all``), and each answer read
        when the iterator reaches it: to a server with the ``Calls`` stream, the calls sent
        before the first answer is awaited, by any engine on this connection, make one round
        trip. The kit's twins feed an engine this way."""
        prepared: list[tuple[str, str, Any]] = []
        for name, argument in calls:
            if name == "release":
                message = pb.ReleaseCall(engine_id=self.engine_id, session_id=argument)
                prepared.append((f"release(session={argument!r})", "Release", message))
            else:
                message = pb.StepCall(engine_id=self.engine_id, request=codec.step_request_to_pb(argument))
                prepared.append((_step_text(name, argument), name.capitalize(), message))
        numbers = [self._order.begin(rpc)[0] for _, rpc, _ in prepared]
        try:
            replies = self._connection.call_all(prepared, self.timeout_seconds)
        finally:
            # Their answers are read later, and may fail: as after a failure, no copy answered
            # ahead is taken for this engine from here on (the twins never ask for one).
            for number in numbers:
                self._order.end(number, failed=True)
        return self._in_order(prepared, replies)

    def _in_order(self, prepared: list[tuple[str, str, Any]], replies: list[_Reply]) -> Iterator[StepResult | StructuredStatus]:
        for (operation, rpc, _), reply in zip(prepared, replies, strict=True):
            try:
                answer = reply.result()
            except (RemoteUnavailable, RemoteEngineEvicted) as error:
                if self.loss_ends_run:
                    raise _lost(error) from error
                raise
            if rpc == "Release":
                yield self._decode(operation, functools.partial(codec.status_from_pb, answer))
            else:
                yield self._decode(operation, functools.partial(codec.step_result_from_pb, answer))

    def health(self) -> HealthResult:
        response = self._call("health()", "Health", self._ref)
        return self._decode("health()", lambda: codec.health_from_pb(response))

    def metrics(self) -> MetricsResult:
        response = self._order.take("Metrics")
        if response is None:
            response = self._call("metrics()", "Metrics", self._ref)
        return self._decode("metrics()", lambda: codec.metrics_from_pb(response))

    # --- FaultInjectable -------------------------------------------------------------------------

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        """Forwarded; the server's ``capabilities().supported_faults`` says which kinds it takes."""
        operation = f"inject_fault({fault.kind}, {fault.value:g})"

        def build(with_metrics: bool) -> Any:
            return pb.InjectFaultCall(engine_id=self.engine_id, fault=codec.fault_to_pb(fault), with_metrics=with_metrics)

        response = self._changing(operation, "InjectFault", build)
        return self._decode(operation, lambda: codec.status_from_pb(response))


def _lost(error: RemoteEngineError) -> EngineLost:
    if isinstance(error, RemoteEngineEvicted):
        what = f"the engine server at {error.address} evicted the engine under test during {error.operation}"
    else:
        what = f"the engine server at {error.address} went away during {error.operation}"
    message = f"{what} ({error.details or error}); nothing after that was checked: check the server and run again"
    return EngineLost(message, address=error.address)


def remote_target(address: str | RemoteAddress, *, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> ResolvedTarget:
    """The engine target ``address``: each call builds a ``RemoteShardEngine`` with a fresh engine.

    A server unreachable at the first call is an ``InvalidTarget``; one that goes away
    after serving an engine of this target ends the run with ``EngineLost``."""
    target = address if isinstance(address, RemoteAddress) else RemoteAddress(address)
    address = target.address
    parse_address(address)  # refuse a malformed address now, not at the first engine
    served = False

    def build() -> ShardEngine:
        nonlocal served
        try:
            engine = RemoteShardEngine(address, timeout_seconds=timeout_seconds, loss_ends_run=True)
        except RemoteUnavailable as error:
            if served:
                raise _lost(error) from error
            raise
        served = True
        return engine

    return ResolvedTarget(target, build)
