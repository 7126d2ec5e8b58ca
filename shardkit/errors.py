"""The kit's exceptions: one root, and user mistakes that also subclass the builtin they resemble."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ContractViolation",
    "InvalidTarget",
    "KitBug",
    "RemoteDeadlineExceeded",
    "RemoteEngineCrashed",
    "RemoteEngineError",
    "RemoteEngineEvicted",
    "RemoteProtocolError",
    "RemoteUnavailable",
    "ShardkitError",
    "SuiteFailure",
    "TraceFormatError",
    "UntrustedTarget",
    "UsageError",
    "WireFormatError",
]


class ShardkitError(Exception):
    """The root of every error shardkit raises on its own account."""


class InvalidTarget(ShardkitError, ValueError):
    """An engine target that cannot be imported, called, or does not build a ShardEngine."""


class TraceFormatError(ShardkitError, ValueError):
    """A trace file that is missing, unreadable, not JSON, of another format or
    version, or whose steps do not fit the schema; the message names the problem."""


class ContractViolation(ShardkitError, AssertionError):
    """An engine broke contract v1; the message names each check, expected and observed."""

    def __init__(self, message: str, failed_checks: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failed_checks: tuple[str, ...] = tuple(failed_checks)


class UsageError(ShardkitError, ValueError):
    """An option or argument the user gave that cannot work; the message names it and the fix."""


class UntrustedTarget(ShardkitError, ValueError):
    """A trace names code to run (an engine target, a reference or a machine) that the user has not
    named and that does not resolve inside the current project; replay refuses to build it."""


class KitBug(ShardkitError):
    """A check of shardkit itself failed (for example an injected malformed output went
    undetected): a bug in shardkit, never reported as a failure of the engine under test."""


class SuiteFailure(ShardkitError, AssertionError):
    """A stateful suite (a machine's pytest ``TestCase``) found a failure: the message is the
    minimal failure; ``shardkit_reproduce`` is the part the pytest plugin shows again in its
    "shardkit: reproduce" report section."""

    def __init__(self, message: str, reproduce: str) -> None:
        super().__init__(message)
        self.shardkit_reproduce = reproduce


class WireFormatError(ShardkitError, ValueError):
    """A value that cannot be encoded, or a message that does not decode to a contract v1 value."""


class RemoteEngineError(ShardkitError, RuntimeError):
    """A call to a remote engine failed; ``address`` and ``operation`` say which."""

    def __init__(
        self, message: str, *, address: str, operation: str, code: str | None = None, details: str = ""
    ) -> None:
        super().__init__(message)
        self.address = address
        self.operation = operation
        #: The gRPC status code's name and details, when the failure came as one.
        self.code = code
        self.details = details


class RemoteUnavailable(RemoteEngineError):
    """The server cannot be reached: nothing listens there, or it went away."""


class RemoteDeadlineExceeded(RemoteEngineError):
    """No answer within the call's deadline: the engine hangs or is too slow."""

    def __init__(
        self, message: str, *, address: str, operation: str, timeout_seconds: float, details: str = ""
    ) -> None:
        super().__init__(message, address=address, operation=operation, code="DEADLINE_EXCEEDED", details=details)
        self.timeout_seconds = timeout_seconds


class RemoteEngineCrashed(RemoteEngineError):
    """The engine raised inside the server: for the kit, the engine process died."""

    def __init__(self, message: str, *, address: str, operation: str, exception_type: str, details: str = "") -> None:
        super().__init__(message, address=address, operation=operation, code="INTERNAL", details=details)
        #: The type name of what the engine raised, e.g. ``"FakeEngineCrash"``.
        self.exception_type = exception_type


class RemoteEngineEvicted(RemoteEngineError):
    """The server dropped this engine to stay within its limit of live engines (``--max-engines``)."""


class RemoteProtocolError(RemoteEngineError):
    """The server speaks another protocol version, lacks an RPC, or answered garbage."""
