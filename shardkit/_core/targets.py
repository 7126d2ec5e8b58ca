"""Engine targets in this process: ``module.path:attr`` or ``path/to/file.py:attr`` naming a
zero-argument callable that returns a fresh, unloaded ``ShardEngine``.

Also what the driver, the runner and the trace know about a target whose engines live in
another process, without importing the transport (or gRPC): how an address is told from
a Python target (``is_remote_address``), how a foreign worker's command is named as a
target (``worker_command_target``, ``worker_command_of``), what a guard lets pass (``passes_through``: Ctrl-C
and ``shardkit.errors.EngineLost``, a lost server ending the run), and what an isolated
target's worker process is asked and answers (``Isolation``, ``IsolationOptions``,
``ProcessDeath``). Turning an address into engines, and isolating a target, is the
transport's: ``shardkit._transport.resolve.resolve_target`` and ``shardkit._transport.isolation``.
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
    "ResolvedTarget",
    "check_seconds",
    "check_step_timeout",
    "describe_exception",
    "display_name",
    "import_target",
    "is_loopback",
    "is_remote_address",
    "passes_through",
    "short_name",
    "worker_command_argv",
    "worker_command_of",
    "worker_command_target",
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


def check_step_timeout(value: float | None) -> None:
    """Refuse (``UsageError`` naming ``step_timeout`` and ``--step-timeout``) a deadline a run's
    options cannot take: one outside (0, ``MAX_STEP_TIMEOUT``] seconds. ``None`` is the default."""
    if value is not None and not 0 < value <= MAX_STEP_TIMEOUT:
        message = (
            f"step_timeout (--step-timeout) must be a number of seconds in (0, {MAX_STEP_TIMEOUT:g}], got {value!r}"
        )
        raise UsageError(message)


def is_remote_address(target: str) -> bool:
    """Whether the target string ``target`` names an engine server (``grpc://…``, ``unix:…``)."""
    return target.startswith(REMOTE_PREFIXES)


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


def worker_command_target(command: str) -> str:
    """The target name of the engines a foreign worker command serves (checked first)."""
    worker_command_argv(command)
    return _WORKER_COMMAND_PREFIX + command


def worker_command_of(target: object) -> str | None:
    """The worker command a target name stands for, or None for any other target."""
    if isinstance(target, str) and target.startswith(_WORKER_COMMAND_PREFIX):
        return target.removeprefix(_WORKER_COMMAND_PREFIX)
    return None


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
    """A factory that checks what it builds, and the name to print and record.

    ``isolation`` is set when every engine it builds lives in a child process
    (``shardkit._transport.isolation.isolated_target``); a target naming an engine server
    comes from ``shardkit._transport.client.remote_target``."""

    name: str
    build: EngineFactory
    isolation: Isolation | None = None

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


def short_name(target_name: str) -> str:
    """A target's name for labels and file names: the attribute of ``module:attr``, an address
    whole, a worker command's program without its folder."""
    if is_remote_address(target_name):
        return target_name
    command = worker_command_of(target_name)
    if command is not None:
        # The program, or the last path it is given (the script an interpreter runs), bare.
        words = [word for word in command.split() if WORKER_ADDRESS_FIELD not in word]
        paths = [word for word in words if "/" in word]
        chosen = paths[-1] if paths else words[0] if words else command
        return chosen.rpartition("/")[2].partition(".")[0] or chosen
    return target_name.rpartition(":")[2] or target_name


def display_name(target_name: str) -> str:
    """A target's name as messages print it: ``worker command '…'`` for a worker command."""
    command = worker_command_of(target_name)
    return f"the worker command {command!r}" if command is not None else target_name


def import_target(target: str | EngineFactory | ResolvedTarget) -> ResolvedTarget:
    """Turn a ``module:attr`` or ``file.py:attr`` string, or a factory, into a checked
    ``ResolvedTarget`` whose engines are built in this process.

    An address (``grpc://``, ``unix:``) is refused: it names no Python code to import; the
    transport's ``resolve_target`` connects to it."""
    if isinstance(target, ResolvedTarget):
        return target
    if isinstance(target, str) and is_remote_address(target):
        message = (
            f"engine target {target!r} names an engine server, not Python code to import; "
            "resolve it with shardkit._transport.resolve.resolve_target, which connects to it"
        )
        raise InvalidTarget(message)
    if not isinstance(target, str):
        if not callable(target):
            message = f"an engine target must be a 'module:attr' string or a callable, got {target!r}"
            raise InvalidTarget(message)
        name = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
        return ResolvedTarget(name, target)
    factory = import_named(target, "engine target", "'package.module:factory' or 'path/to/file.py:factory'")
    if not callable(factory):
        message = f"engine target {target!r} names a {type(factory).__name__}, which is not callable"
        raise InvalidTarget(message)
    return ResolvedTarget(target, factory)
