"""Isolation: the engine under test runs in a child process the kit can lose.

A native engine dies in ways Python cannot catch (an abort, a segfault, a hang,
memory exhaustion). ``isolated_target`` wraps a Python engine target so every engine it
builds lives in a child ``shardkit serve --worker`` process (see
``remote/worker.py``); when the child dies, misses a call's deadline or answers
garbage, the driver asks the isolation what happened (``death``) and reports it
as an ordinary step failure, and the next engine comes from a fresh child.

This module holds what the driver, the runner and the trace need to know about
isolation without importing gRPC; the workers themselves need the ``grpc`` extra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import InvalidTarget
from .targets import EngineFactory, ResolvedTarget, resolve_target

__all__ = [
    "DEFAULT_STEP_TIMEOUT",
    "Isolation",
    "IsolationOptions",
    "ProcessDeath",
    "isolated_target",
    "target_with_options",
]

#: Seconds each call to an isolated (or remote) engine may take before it counts as a hang.
DEFAULT_STEP_TIMEOUT = 5.0


@dataclass(frozen=True)
class IsolationOptions:
    """How an isolated engine runs: each call's deadline, and the worker's memory limit
    (``None``: no limit beyond the machine's)."""

    step_timeout: float = DEFAULT_STEP_TIMEOUT
    worker_memory_mb: int | None = None

    def __post_init__(self) -> None:
        timeout = self.step_timeout
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if not (number and math.isfinite(timeout) and timeout > 0):
            message = f"step_timeout must be a finite number of seconds > 0, got {timeout!r}"
            raise ValueError(message)
        memory = self.worker_memory_mb
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
            message = f"worker_memory_mb must be a positive whole number of MiB or None, got {memory!r}"
            raise ValueError(message)

    def to_json(self) -> dict[str, Any]:
        return {"step_timeout": self.step_timeout, "worker_memory_mb": self.worker_memory_mb}

    def command_options(self) -> list[str]:
        """The ``shardkit fuzz``/``replay`` options that ask for these settings."""
        options = ["--isolate"]
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


class Isolation(Protocol):
    """What the driver and the runner ask of an isolated target (see ``remote/worker.py``)."""

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


def isolated_target(
    target: str | EngineFactory | ResolvedTarget, options: IsolationOptions | None = None
) -> ResolvedTarget:
    """``target`` with every engine in a child ``shardkit serve --worker`` process.

    The child imports the target by name, so it must be a ``module:attr`` or
    ``file.py:attr`` target (a factory defined at module level will do, not a lambda);
    the child sees the parent's ``sys.path``. Needs the ``grpc`` extra.
    """
    resolved = resolve_target(target)
    if resolved.isolation is not None:
        if options is not None and options != resolved.isolation.options:
            message = f"{resolved.name} is already isolated with {resolved.isolation.options}, not {options}"
            raise ValueError(message)
        return resolved
    name = resolved.name
    if name.startswith(("grpc://", "unix:")):
        message = f"--isolate runs a Python engine target in a child process; {name} is already out of process"
        raise InvalidTarget(message)
    if "<" in name or name.startswith("__main__:"):
        message = (
            f"--isolate needs an engine target the worker process can import by name, got {name!r}: "
            "define the factory at module level of an importable module and pass 'module:attr' or 'path/to/file.py:attr'"
        )
        raise InvalidTarget(message)
    resolve_target(name)  # the child will import it by this name: refuse a name that does not import here
    try:
        from .remote.worker import WorkerPool
    except ImportError as error:
        message = f"--isolate needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise InvalidTarget(message) from error
    pool = WorkerPool(name, options or IsolationOptions())
    return ResolvedTarget(name, pool.new_engine, isolation=pool)


def target_with_options(
    target: str | EngineFactory | ResolvedTarget,
    *,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> ResolvedTarget:
    """``target`` resolved, isolated if asked, with the call deadline set where one applies.

    ``step_timeout`` applies to an isolated engine or a remote (``grpc://``, ``unix:``)
    one; ``worker_memory_mb`` only to an isolated one. An option that cannot apply is an
    error, never silently ignored.
    """
    if isinstance(isolate, IsolationOptions):
        if step_timeout is not None or worker_memory_mb is not None:
            message = "pass step_timeout and worker_memory_mb inside the IsolationOptions, not beside them"
            raise ValueError(message)
        return isolated_target(target, isolate)
    if isolate:
        options = IsolationOptions(DEFAULT_STEP_TIMEOUT if step_timeout is None else step_timeout, worker_memory_mb)
        return isolated_target(target, options)
    if worker_memory_mb is not None:
        message = "worker_memory_mb (--worker-memory) limits a worker process: it needs isolate=True (--isolate)"
        raise ValueError(message)
    if step_timeout is None:
        return resolve_target(target)
    IsolationOptions(step_timeout)  # validates it
    if isinstance(target, str) and target.startswith(("grpc://", "unix:")):
        from .remote.client import remote_target

        return remote_target(target, timeout_seconds=step_timeout)
    message = "step_timeout (--step-timeout) is the deadline of calls to another process: it needs isolate=True (--isolate) or a grpc:// or unix: target"
    raise ValueError(message)
