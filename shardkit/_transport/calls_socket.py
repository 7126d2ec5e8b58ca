"""The ``Calls`` stream over a plain Unix socket, between the kit and its own workers.

A worker of ``--isolate`` (``shardkit serve --worker --listen unix:PATH``) listens on
``PATH.calls`` too, beside its gRPC socket. A connection there carries what one thread's
``Calls`` stream carries, the same ``Call`` and ``Answer`` messages in the same order,
each framed as its length (4 bytes, big-endian) and its bytes. The kit is at both ends,
so the contract's service stays what any other worker implements (the handshake still
goes over gRPC); this path only skips gRPC's threads and queues, which cost more than the
call itself on a fast engine.

Each connection has a thread of its own on the worker. An answer that exceeds the size
limit is replaced by a ``RESOURCE_EXHAUSTED`` answer, as gRPC would refuse it; a call that
exceeds it ends the connection.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from shardkit.proto import shard_engine_pb2 as pb

__all__ = ["CallsListener", "SocketStream", "calls_socket_path"]

_HEADER = struct.Struct(">I")


def calls_socket_path(url: str) -> str | None:
    """Where a worker serving ``url`` listens for calls over a plain socket: beside its
    ``unix:`` socket; None for any other address."""
    if not url.startswith("unix:"):
        return None
    return url.removeprefix("unix:") + ".calls"


def _read_exactly(connection: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None when the other end closes before the first byte; an
    ``EOFError`` when it closes within them."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    read = 0
    while read < size:
        count = connection.recv_into(view[read:])
        if count == 0:
            if read == 0:
                return None
            raise EOFError(f"the connection closed after {read} of {size} bytes")
        read += count
    return bytes(buffer)


class CallsListener:
    """The worker's end: a thread accepting connections on ``path``, and one answering the
    calls of each (``answer`` turns a ``Call`` into its ``Answer``)."""

    def __init__(self, path: str, answer: Callable[[Any], Any], max_message_bytes: int) -> None:
        self.path = path
        self._answer = answer
        self._max_bytes = max_message_bytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the kit names each worker's socket afresh: a file here is stale
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(path)
        self._socket.listen(16)
        threading.Thread(target=self._accept, name="shardkit-socket-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed: the server stopped
                return
            threading.Thread(target=self._serve, args=(connection,), name="shardkit-socket-stream", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError, EOFError):
            while True:
                header = _read_exactly(connection, _HEADER.size)
                if header is None:
                    return
                (size,) = _HEADER.unpack(header)
                if size > self._max_bytes:
                    return  # its bytes cannot be skipped safely: the client sees the stream end
                body = _read_exactly(connection, size)
                if body is None:
                    return
                connection.sendall(self._framed_answer(body))

    def _framed_answer(self, body: bytes) -> bytes:
        try:
            call = pb.Call.FromString(body)
        except Exception as error:  # protobuf's DecodeError, or whatever its parser raises on garbage
            answer = pb.Answer(status_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], details=f"not a Call: {error}")
        else:
            answer = self._answer(call)
        data: bytes = answer.SerializeToString()
        if len(data) > self._max_bytes:
            details = f"the answer of {len(data)} bytes exceeds this server's limit of {self._max_bytes}"
            data = pb.Answer(status_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], details=details).SerializeToString()
        return _HEADER.pack(len(data)) + data

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _SocketFailure(grpc.RpcError):  # type: ignore[misc]
    """What a ``SocketStream`` raises, read as a failed gRPC call would be: ``UNAVAILABLE``
    when the worker is gone, ``DEADLINE_EXCEEDED`` when its answer is overdue."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> Any:
        return self._code

    def details(self) -> str:
        return self._details


class SocketStream:
    """The kit's end: one thread's calls to one worker, as a ``Calls`` stream (the
    interface of ``client._CallStream``). A call's deadline is the socket's timeout while it
    is sent and while its answer is read; once one passes, the stream is ``expired`` and out
    of step with its calls, and its owner drops it."""

    def __init__(self, path: str) -> None:
        self.ended = False
        self.expired = False
        #: The replies to the calls sent and not yet answered, oldest first (``client._Reply``).
        self.unread: collections.deque[Any] = collections.deque()
        self.sent_since_wait = False
        self._broken = ""
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._end = weakref.finalize(self, self._socket.close)
        try:
            self._socket.connect(path)
        except OSError as error:
            self._broken = f"cannot connect to the worker's calls socket: {error}"

    def send(self, call: Any, timeout: float) -> None:
        """Send ``call``; a failure shows when its answer is read."""
        if self._broken:
            return
        data = call.SerializeToString()
        try:
            self._socket.settimeout(timeout)
            self._socket.sendall(_HEADER.pack(len(data)) + data)
        except TimeoutError:
            self.expired = True
            self._broken = "the worker took no more calls within the deadline"
        except OSError as error:
            self._broken = f"the worker's calls socket failed: {error}"

    def receive(self, timeout: float) -> Any:
        """The answer to the oldest call sent and not yet answered; a ``_SocketFailure`` if the
        worker is gone or the answer is not there within ``timeout`` seconds."""
        if self.expired:
            raise _SocketFailure(grpc.StatusCode.DEADLINE_EXCEEDED, self._broken)
        if self._broken:
            raise _SocketFailure(grpc.StatusCode.UNAVAILABLE, self._broken)
        try:
            self._socket.settimeout(timeout)
            header = _read_exactly(self._socket, _HEADER.size)
            body = None if header is None else _read_exactly(self._socket, _HEADER.unpack(header)[0])
        except TimeoutError:
            self.expired = True
            raise _SocketFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "") from None
        except (OSError, EOFError) as error:
            raise _SocketFailure(grpc.StatusCode.UNAVAILABLE, f"the worker's calls socket failed: {error}") from None
        if body is None:
            raise _SocketFailure(grpc.StatusCode.UNAVAILABLE, "the worker closed its calls socket")
        try:
            return pb.Answer.FromString(body)
        except Exception as error:  # protobuf's DecodeError, or whatever its parser raises on garbage
            raise _SocketFailure(grpc.StatusCode.INTERNAL, f"the worker answered garbage: {error}") from None

    def end(self) -> None:
        self.ended = True
        self._end()
