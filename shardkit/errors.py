"""The kit's exceptions, all in this one module: one root, ``ShardkitError``, and each error
also subclasses the builtin it resembles (a ``UsageError`` is a ``ValueError``, a ``KitBug`` a
``RuntimeError``), so ``except ValueError`` around a call keeps working.

The one exception here that is not a ``ShardkitError`` is ``EngineLost``: a ``BaseException``
on purpose, so that it passes through Hypothesis and the driver's guards and ends a run at once.

What an engine raises is not here. ``EngineError`` (``shardkit.contract``) is contract
vocabulary, raised by engines to refuse ``load`` or ``capabilities``; the bundled engines'
simulated process deaths (``FakeEngineCrash`` in ``shardkit.engines.fake``,
``NumpyEngineCrash`` in ``shardkit.engines.numpy_llama``, ``LlamaCppEngineCrash`` in
``shardkit.engines.llama_cpp``, ``TransformersEngineCrash`` in
``shardkit.engines.transformers_llama``) are raised by an engine under test as any engine's own
exception would be, and keep their engine's module in the type name a server reports. So is
``SchedulerClosed`` (``shardkit.engines.transformers_batching``): the batching engine's answer
to a step queued on (or waiting in) a scheduler its ``close()`` stopped.

Nor are the kit's control-flow exceptions, which never reach a user: each is caught inside
the kit and reported as a finding or as one of the errors here.

- ``Fail`` and ``StepFailed`` (``shardkit._core.outcomes``): a check disagreed inside one
  step; the driver turns ``Fail`` into ``StepFailed`` (carrying the ``Violation`` and the
  ``StepRecord``), which the state machine, the runner, the minimiser and replay catch and
  report as the failure found.
- ``OracleFailure`` (``shardkit._core.twins``): the twin oracle disagreed; the driver turns
  it into a finding, or into an ``InvalidTarget`` naming a broken reference engine.
- ``_RoleNotServed`` and ``_CheckFailed`` (``shardkit._core.conformance``): the contract
  checks' outcomes, reported as a skipped check or a ``ContractViolation``.
- ``ShrinkBudgetSpent`` (``shardkit._machine.hypothesis_adapter``): a ``BaseException``
  raised through Hypothesis to stop its shrinker on a count; the runner catches it.
- ``OptionValueError`` (``shardkit._machine.spec``): an option's declared check refused a
  value; whoever ran the check words it as a ``UsageError`` naming the option (by field and
  flag, or by the flag the command line read).
- ``ForkUnavailable`` (``shardkit._transport.forkserver``): the process that forks
  ``--isolate``'s workers cannot give one; the worker pool catches it and starts a fresh
  interpreter instead.
- ``_NotMeasured`` (``shardkit._bench.scale_out``): a run of a bench section failed; the section
  reports its message in place of figures.
- ``_Budget`` (``shardkit._parallel.linearize``): the search for an order that explains a
  parallel phase visited its counted number of states; the search catches it and answers
  "unknown", which is never reported as a failure.
- ``_CancelledMeanwhile`` (``shardkit._planted.batching``): a planted batching engine's step
  whose session was cancelled while it ran; the engine answers it as CANCELLED.
- ``_Aborted`` (``shardkit._transport.server``): a call of a ``Calls`` stream ended with a gRPC
  status; the stream answers that call with it and goes on.
- ``_SocketFailure`` (``shardkit._transport.calls_socket``): a worker's plain calls socket
  failed or an answer on it is overdue, raised as a failed gRPC call so that the client
  reads it as one (``RemoteUnavailable``, ``RemoteDeadlineExceeded``).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardkit._public import settle

__all__ = [
    "ContractViolation",
    "EngineLost",
    "GgufFormatError",
    "GgufUnavailableError",
    "InjectedCrash",
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
    """Raised for an engine target that cannot be imported, called, or build a working ShardEngine."""


class TraceFormatError(ShardkitError, ValueError):
    """Raised for a trace file that is missing, unreadable, not JSON, or not a trace this kit reads.

    The message names the problem: another format or version, or steps that do not fit the schema.
    """


class ContractViolation(ShardkitError, AssertionError):
    """Raised when an engine breaks contract v1; the message names each check, expected and observed."""

    def __init__(self, message: str, failed_checks: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failed_checks: tuple[str, ...] = tuple(failed_checks)


class UsageError(ShardkitError, ValueError):
    """Raised for an option or argument that cannot work; the message names it and the fix."""


class UntrustedTarget(ShardkitError, ValueError):
    """Raised when a trace names code to run that the user did not name and that lies outside the project.

    The code is an engine target, a reference or a machine; replay refuses to build it
    unless asked to trust it (``trust=True``, ``--trust``).
    """


class KitBug(ShardkitError, RuntimeError):
    """Raised when a check of shardkit itself fails: a bug in shardkit, never the engine's failure.

    For example an injected malformed output that went undetected.
    """


class SuiteFailure(ShardkitError, AssertionError):
    """Raised by a stateful suite (a machine's pytest ``TestCase``) that found a failure.

    The message is the minimal failure; ``shardkit_reproduce`` is the part the pytest plugin
    shows again in its "shardkit: reproduce" report section.
    """

    def __init__(self, message: str, reproduce: str) -> None:
        super().__init__(message)
        self.shardkit_reproduce = reproduce


class InjectedCrash(ShardkitError, RuntimeError):
    """Raised by the kit's fault wrapper as an engine's simulated process death (an injected ``crash``).

    The driver, which injected it, expects it and restarts the engine; a user meets it only
    named in a finding.
    """


class GgufFormatError(ShardkitError, ValueError):
    """Raised for a GGUF file that is missing, unreadable, not GGUF, or not a llama model shardkit can hold.

    The message names the file and the offending key or tensor.
    """


class GgufUnavailableError(ShardkitError, ImportError):
    """Raised when reading or writing GGUF needs the optional ``gguf`` package and it is not installed."""


class WireFormatError(ShardkitError, ValueError):
    """Raised for a value that cannot be encoded, or a message that does not decode to a contract value."""


class RemoteEngineError(ShardkitError, RuntimeError):
    """Raised when a call to a remote engine fails; ``address`` and ``operation`` say which."""

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
    """Raised when the server cannot be reached: nothing listens there, or it went away."""


class RemoteDeadlineExceeded(RemoteEngineError):
    """Raised when no answer comes within the call's deadline: the engine hangs or is too slow."""

    def __init__(
        self, message: str, *, address: str, operation: str, timeout_seconds: float, details: str = ""
    ) -> None:
        super().__init__(message, address=address, operation=operation, code="DEADLINE_EXCEEDED", details=details)
        self.timeout_seconds = timeout_seconds


class RemoteEngineCrashed(RemoteEngineError):
    """Raised when the engine raised inside the server: for the kit, the engine process died."""

    def __init__(self, message: str, *, address: str, operation: str, exception_type: str, details: str = "") -> None:
        super().__init__(message, address=address, operation=operation, code="INTERNAL", details=details)
        #: The type name of what the engine raised, e.g. ``"FakeEngineCrash"``.
        self.exception_type = exception_type


class RemoteEngineEvicted(RemoteEngineError):
    """Raised when the server dropped this engine to stay within its engine limit (``--max-engines``)."""


class RemoteProtocolError(RemoteEngineError):
    """Raised when the server speaks another protocol version, lacks an RPC, or answers garbage."""


class EngineLost(BaseException):
    """Raised when the server behind a run's ``grpc://``/``unix:`` target goes away or evicts the engine.

    The engine under test became unreachable for a reason that is not the engine's. Not an
    ``Exception`` (so not a ``ShardkitError``), on purpose: it passes through Hypothesis (which
    would shrink it into a flaky failure) and through the driver (which would report it as the
    engine's failure), and ends the run at once; the command reports it as an input error
    naming ``address``.
    """

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address


settle(__name__, globals())
