"""Engine targets: what names the engines of a run, told apart once, into three types.

- ``PythonTarget``: Python code in this process, ``module.path:attr`` or ``path/to/file.py:attr``
  naming a zero-argument callable that returns a fresh, unloaded ``ShardEngine``, or that
  callable itself;
- ``RemoteAddress``: an engine server, ``grpc://HOST:PORT`` or ``unix:PATH``;
- ``WorkerCommand``: a command, in any language, that serves contract v1 on the address the kit
  puts in its ``{address}`` (``--worker-command``).

``parse_target`` is the one place a target's text is read; everything below the entry points
(the command line, ``fuzz``, ``machine_for``, a trace being replayed) holds one of the types.
Also what the driver, the runner and the trace know about a target whose engines live in
another process, without importing the transport (or gRPC): what a guard lets pass
(``passes_through``: Ctrl-C and ``shardkit.errors.EngineLost``, a lost server ending the run),
and what an isolated target's worker process is asked and answers (``Isolation``,
``IsolationOptions``, ``ProcessDeath``). Turning an address into engines, and isolating a
target, is the transport's: ``shardkit._transport.resolve.resolve_target`` and
``shardkit._transport.isolation``.
"""

from __future__ import annotations

import ipaddress
import math
import shlex
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shardkit._core.importing import import_named
from shardkit.contract import EngineError, ShardEngine
from shardkit.errors import EngineLost, InvalidTarget, UsageError

__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "DEFAULT_TARGET",
    "MAX_STEP_TIMEOUT",
    "REMOTE_PREFIXES",
    "WORKER_ADDRESS_FIELD",
    "EngineFactory",
    "Isolation",
    "IsolationOptions",
    "ProcessDeath",
    "PythonTarget",
    "RemoteAddress",
    "ResolvedTarget",
    "Target",
    "WorkerCommand",
    "check_seconds",
    "describe_exception",
    "engine_target",
    "import_target",
    "is_loopback",
    "parse_target",
    "passes_through",
    "typed_target",
    "worker_command_argv",
]

EngineFactory = Callable[[], ShardEngine]
DEFAULT_TARGET = "shardkit:FakeShardEngine"
#: How a target names an engine server rather than Python code: ``grpc://HOST:PORT``, ``unix:PATH``.
REMOTE_PREFIXES = ("grpc://", "unix:")
#: A worker command's target name: this prefix, then the command as the user gave it.
_WORKER_COMMAND_PREFIX = "worker-command:"
#: Where a worker command takes the address the kit gives each worker to listen on.
WORKER_ADDRESS_FIELD = "{address}"
#: Seconds each call to an isolated (or remote) engine may take before it counts as a hang.
DEFAULT_STEP_TIMEOUT = 5.0
#: The longest deadline a run's options accept (a trace records at most this, too).
MAX_STEP_TIMEOUT = 3600.0
T = TypeVar("T")


def check_seconds(name: str, value: object) -> None:
    """Refuse (``ValueError`` naming ``name``) a deadline that is not a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        message = f"{name} must be a finite number of seconds > 0, got {value!r}"
        raise ValueError(message)


def worker_command_argv(command: str) -> list[str]:
    """The words of a worker command (``--worker-command``), checked: it must split as a shell
    would split it and name the address the kit gives each worker (``{address}``).
    ``InvalidTarget`` (a ``ValueError``) names what is wrong and the fix."""
    example = "e.g. --worker-command 'build/my_worker --listen {address}'"
    if not isinstance(command, str) or not command.strip():
        message = f"a worker command must be the command line that starts one worker, {example}; got {command!r}"
        raise InvalidTarget(message)
    try:
        words = shlex.split(command)
    except ValueError as error:
        message = f"the worker command {command!r} does not split into words as a shell would ({error}); {example}"
        raise InvalidTarget(message) from None
    if not any(WORKER_ADDRESS_FIELD in word for word in words):
        message = (
            f"the worker command {command!r} has no {WORKER_ADDRESS_FIELD}: the kit starts each worker on an "
            f"address of its own (unix:PATH) and puts it where {WORKER_ADDRESS_FIELD} stands, {example}"
        )
        raise InvalidTarget(message)
    return words


@dataclass(frozen=True)
class PythonTarget:
    """Engines built in this process by Python code: ``code`` is ``package.module:factory``,
    ``path/to/file.py:factory``, or the factory itself."""

    code: str | EngineFactory

    @property
    def name(self) -> str:
        """The name printed and recorded: the text as given, or a factory's ``module:QualName``."""
        if isinstance(self.code, str):
            return self.code
        return f"{getattr(self.code, '__module__', '?')}:{getattr(self.code, '__qualname__', repr(self.code))}"

    @property
    def label(self) -> str:
        """For labels and file names: the attribute of ``module:attr``."""
        return self.name.rpartition(":")[2] or self.name

    @property
    def shown(self) -> str:
        """As messages print it."""
        return self.name


@dataclass(frozen=True)
class RemoteAddress:
    """An engine server: ``grpc://HOST:PORT`` or ``unix:PATH``; each engine is a fresh one asked of it."""

    address: str

    @property
    def on_this_machine(self) -> bool:
        """A unix socket, or ``grpc://`` to a loopback host (``localhost``, ``127.0.0.0/8``, ``[::1]``)."""
        if self.address.startswith("unix:"):
            return True
        return is_loopback(self.address.removeprefix("grpc://").rpartition(":")[0])

    @property
    def name(self) -> str:
        return self.address

    @property
    def label(self) -> str:
        return self.address

    @property
    def shown(self) -> str:
        return self.address


@dataclass(frozen=True)
class WorkerCommand:
    """Engines served by processes the kit starts with ``command`` (checked: see
    ``worker_command_argv``); always isolated."""

    command: str

    def __post_init__(self) -> None:
        worker_command_argv(self.command)

    @property
    def argv(self) -> list[str]:
        return worker_command_argv(self.command)

    @property
    def name(self) -> str:
        """As traces record it: ``worker-command:`` and the command as the user gave it."""
        return _WORKER_COMMAND_PREFIX + self.command

    @property
    def label(self) -> str:
        """The program, or the last path it is given (the script an interpreter runs), bare."""
        words = [word for word in self.command.split() if WORKER_ADDRESS_FIELD not in word]
        paths = [word for word in words if "/" in word]
        chosen = paths[-1] if paths else words[0] if words else self.command
        return chosen.rpartition("/")[2].partition(".")[0] or chosen

    @property
    def shown(self) -> str:
        return f"the worker command {self.command!r}"


Target = PythonTarget | RemoteAddress | WorkerCommand


def parse_target(target: str | EngineFactory | Target | ResolvedTarget) -> Target:
    """What ``target`` names, told apart once: a ``grpc://`` or ``unix:`` address, a worker
    command as a trace records it (``worker-command:CMD``), or Python code (any other text, or
    a callable). A target already typed (or resolved) is returned as it is typed. Nothing is
    imported or connected to; ``InvalidTarget`` for what names no engine at all."""
    if isinstance(target, PythonTarget | RemoteAddress | WorkerCommand):
        return target
    if isinstance(target, ResolvedTarget):
        return target.target
    if isinstance(target, str):
        if target.startswith(REMOTE_PREFIXES):
            return RemoteAddress(target)
        if target.startswith(_WORKER_COMMAND_PREFIX):
            return WorkerCommand(target.removeprefix(_WORKER_COMMAND_PREFIX))
        return PythonTarget(target)
    if callable(target):
        return PythonTarget(target)
    message = f"an engine target must be a 'module:attr' string or a callable, got {target!r}"
    raise InvalidTarget(message)


def typed_target(target: str | EngineFactory | Target | ResolvedTarget) -> Target | ResolvedTarget:
    """``target`` as ``parse_target`` types it, or as it is when already resolved: a target its
    caller connected or isolated keeps its engines, its deadline and its worker processes."""
    return target if isinstance(target, ResolvedTarget) else parse_target(target)


def engine_target(
    target: str | EngineFactory | Target | ResolvedTarget | None, worker_command: str | WorkerCommand | None
) -> Target | ResolvedTarget:
    """The engine a run fuzzes, as an entry point receives it: ``target``, or ``worker_command``
    (``--worker-command``); exactly one of them. ``UsageError`` names what is missing or wrong."""
    if worker_command is None:
        if target is None:
            message = (
                "name the engine to fuzz: a target ('package.module:factory') or a worker_command (--worker-command)"
            )
            raise UsageError(message)
        return typed_target(target)
    if target is not None:
        message = (
            f"worker_command (--worker-command) names the engine, so the target {parse_target(target).name!r} "
            "cannot be named beside it: give one of them"
        )
        raise UsageError(message)
    try:
        return worker_command if isinstance(worker_command, WorkerCommand) else WorkerCommand(worker_command)
    except InvalidTarget as error:
        raise UsageError(str(error)) from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of a ``HOST:PORT`` address) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to any interface


def passes_through(error: BaseException) -> bool:
    """What a guard around an engine's or a target's code never turns into a finding about
    it: Ctrl-C, and a run that ends anyway because the server behind a remote target went
    away. Everything else it raises, ``SystemExit`` and ``GeneratorExit`` included, is its doing."""
    return isinstance(error, (KeyboardInterrupt, EngineLost))


def describe_exception(error: BaseException) -> str:
    """``TypeName: message`` with where it was raised, e.g. ``RuntimeError: boom (at x.py:3 in load)``;
    a ``SystemExit`` or other ``BaseException`` by its repr, e.g. ``SystemExit(0)``."""
    text = str(error)
    if isinstance(error, Exception):
        what = f"{type(error).__name__}: {text}" if text else type(error).__name__
    else:
        what = repr(error)
    # The innermost frame of the code that raised; not the kit's own call of a builtin (sys:exit).
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename != __file__]
    if frames:
        what += f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})"
    return what


@dataclass(frozen=True)
class IsolationOptions:
    """How an isolated engine runs: each call's deadline, and the worker's memory limit
    (``None``: no limit beyond the machine's)."""

    step_timeout: float = DEFAULT_STEP_TIMEOUT
    worker_memory_mb: int | None = None

    def __post_init__(self) -> None:
        check_seconds("step_timeout", self.step_timeout)
        memory = self.worker_memory_mb
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
            message = f"worker_memory_mb must be a positive whole number of MiB or None, got {memory!r}"
            raise ValueError(message)

    def to_json(self) -> dict[str, Any]:
        return {"step_timeout": self.step_timeout, "worker_memory_mb": self.worker_memory_mb}

    def command_options(self, *, isolate_flag: bool = True) -> list[str]:
        """The ``shardkit fuzz``/``replay`` options that ask for these settings (without
        ``--isolate`` for a worker command, which is always isolated)."""
        options = ["--isolate"] if isolate_flag else []
        if self.step_timeout != DEFAULT_STEP_TIMEOUT:
            options += ["--step-timeout", f"{self.step_timeout:g}"]
        if self.worker_memory_mb is not None:
            options += ["--worker-memory", str(self.worker_memory_mb)]
        return options


@dataclass(frozen=True)
class ProcessDeath:
    """How an isolated engine's process ended a call.

    ``property`` is stable across runs (what minimisation preserves), e.g.
    ``"process killed by SIGSEGV"``; ``summary`` completes "engine process …", e.g.
    ``"killed by SIGSEGV"``; ``stderr_tail`` is the end of what the process printed.
    """

    property: str
    summary: str
    stderr_tail: tuple[str, ...] = ()

    def quoted_tail(self) -> str:
        """The tail, one ``  | line`` per line, each after a newline (empty if it printed nothing)."""
        return "".join(f"\n  | {line}" for line in self.stderr_tail)

    def output_detail(self) -> str:
        """What a failure says of the process's last output: the quoted tail, or that it printed nothing."""
        tail = self.quoted_tail()
        return f"its output ended with:{tail}" if tail else "it printed nothing"


class Isolation(Protocol):
    """What the driver and the runner ask of an isolated target (the transport's
    ``WorkerPool``, in ``shardkit/_transport/worker.py``)."""

    options: IsolationOptions

    def death(self, error: BaseException) -> ProcessDeath | None:
        """What ``error`` (raised by a call to one of this target's engines) means: the
        process's death, a missed deadline or a garbage answer, or None for an error that
        is not about the process. A process that may still run is killed first."""

    def kill(self) -> None:
        """End the current process at once, as an injected crash does; the next engine
        comes from a fresh one."""

    def close(self) -> None:
        """End every process this isolation started; closing twice is fine."""


@dataclass(frozen=True)
class ResolvedTarget:
    """A factory that checks what it builds, and the target it was resolved from (whose
    ``name`` is printed and recorded).

    ``isolation`` is set when every engine it builds lives in a child process
    (``shardkit._transport.isolation.isolated_target``); a target naming an engine server
    comes from ``shardkit._transport.client.remote_target``."""

    target: Target
    build: EngineFactory
    isolation: Isolation | None = None

    @property
    def name(self) -> str:
        return self.target.name

    def __call__(self) -> ShardEngine:
        try:
            engine = self.build()
        except InvalidTarget:
            raise
        except Exception as error:
            message = f"engine target {self.name!r} raised {type(error).__name__} when called: {error}"
            raise InvalidTarget(message) from error
        except BaseException as error:
            if passes_through(error):
                raise
            # A SystemExit (or GeneratorExit, …) from the target is never the kit's own exit.
            message = (
                f"engine target {self.name!r} raised {describe_exception(error)} when called; "
                "it must return a fresh shardkit.ShardEngine (a SystemExit from the target does not end the kit)"
            )
            raise InvalidTarget(message) from error
        if not isinstance(engine, ShardEngine):
            message = (
                f"engine target {self.name!r} returned {type(engine).__name__}, not a ShardEngine; "
                "it must name a zero-argument callable returning a fresh shardkit.ShardEngine"
            )
            raise InvalidTarget(message)
        return engine

    def guarded(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``, one call of an engine of this target (``what``, e.g. ``"capabilities()"``)
        made before any step, while the kit finds out what the engine serves.

        ``EngineError`` passes (the contract lets ``load`` and ``capabilities`` refuse with it);
        anything else the engine raises, or its worker process dying (isolated), is an
        ``InvalidTarget`` naming the call and what happened.
        """
        try:
            return call()
        except EngineError:
            raise
        except BaseException as error:
            if passes_through(error):
                raise
            death = self.isolation.death(error) if self.isolation is not None else None
            if death is not None:
                message = f"engine target {self.name!r}: its worker process {death.summary} during {what}"
                tail = death.quoted_tail()
                message += f"; its output ended with:{tail}" if tail else " (it printed nothing)"
            else:
                message = (
                    f"engine target {self.name!r}: {what} raised {describe_exception(error)}; "
                    "contract v1 lets it raise only EngineError"
                )
            raise InvalidTarget(message) from error


def import_target(target: PythonTarget) -> ResolvedTarget:
    """Turn Python code into a checked ``ResolvedTarget`` whose engines are built in this process.
    An address or a worker command names no Python code to import: the transport's
    ``resolve_target`` connects to the one and isolation starts the other."""
    if not isinstance(target.code, str):
        return ResolvedTarget(target, target.code)
    factory = import_named(target.code, "engine target", "'package.module:factory' or 'path/to/file.py:factory'")
    if not callable(factory):
        message = f"engine target {target.code!r} names a {type(factory).__name__}, which is not callable"
        raise InvalidTarget(message)
    return ResolvedTarget(target, factory)
