"""Isolation, and the options of a target's calls: the top of the transport room.

A native engine dies in ways Python cannot catch (an abort, a segfault, a hang,
memory exhaustion). ``isolated_target`` wraps a Python engine target so every engine it
builds lives in a child ``shardkit serve --worker`` process (see ``worker.py``); when the
child dies, misses a call's deadline or answers garbage, the driver asks the isolation
what happened (``death``) and reports it as an ordinary step failure, and the next engine
comes from a fresh child. A foreign worker command (``--worker-command``, a target named
a ``WorkerCommand``) is isolated the same way, always: its engines live in the
processes the command starts. ``engine_plan`` is where a target meets the options that say
how it runs (``--isolate``, ``--step-timeout``, ``--worker-memory``): their combinations are
checked there once, for the command line, ``build_machine`` and replay, and the plan's
``start`` resolves the target, isolated if asked, with the deadline of its calls set.

What the driver, the runner and the trace need to know about isolation (``Isolation``,
``IsolationOptions``, ``ProcessDeath``) is in ``shardkit._core.targets``: they import
neither this module nor gRPC. This module imports gRPC only when it starts workers or
sets a remote target's deadline (the ``grpc`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit._core.targets import (
    DEFAULT_STEP_TIMEOUT,
    EngineFactory,
    IsolationOptions,
    PythonTarget,
    RemoteAddress,
    ResolvedTarget,
    Target,
    WorkerCommand,
    parse_target,
    typed_target,
)
from shardkit._transport.resolve import resolve_target
from shardkit.errors import InvalidTarget, UsageError

__all__ = ["EnginePlan", "engine_plan", "isolated_target", "target_with_options"]


def isolated_target(
    target: str | EngineFactory | Target | ResolvedTarget, options: IsolationOptions | None = None
) -> ResolvedTarget:
    """``target`` with every engine in a child ``shardkit serve --worker`` process.

    The child imports the target by name, so it must be a ``module:attr`` or
    ``file.py:attr`` target (a factory defined at module level will do, not a lambda);
    the child sees the parent's ``sys.path``. Needs the ``grpc`` extra.
    """
    if isinstance(target, ResolvedTarget) and target.isolation is not None:
        if options is not None and options != target.isolation.options:
            message = f"{target.name} is already isolated with {target.isolation.options}, not {options}"
            raise ValueError(message)
        return target
    typed = parse_target(target)
    if isinstance(typed, WorkerCommand):
        return _in_workers(typed, options)
    if isinstance(typed, RemoteAddress):
        raise InvalidTarget(_out_of_process(typed))
    name = typed.name
    if "<" in name or name.startswith("__main__:"):
        message = (
            f"--isolate needs an engine target the worker process can import by name, got {name!r}: "
            "define the factory at module level of an importable module and pass 'module:attr' or 'path/to/file.py:attr'"
        )
        raise InvalidTarget(message)
    by_name = PythonTarget(name)
    resolve_target(by_name)  # the child will import it by this name: refuse a name that does not import here
    return _in_workers(by_name, options)


def _out_of_process(address: RemoteAddress) -> str:
    return f"isolate=True (--isolate) runs a Python engine target in a worker process; {address.address} is already out of process"


def _in_workers(target: PythonTarget | WorkerCommand, options: IsolationOptions | None) -> ResolvedTarget:
    try:
        from shardkit._transport.worker import WorkerPool
    except ImportError as error:
        flag = "--worker-command" if isinstance(target, WorkerCommand) else "--isolate"
        message = f"{flag} needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise InvalidTarget(message) from error
    pool = WorkerPool(target, options or IsolationOptions())
    return ResolvedTarget(target, pool.new_engine, isolation=pool)


@dataclass(frozen=True)
class EnginePlan:
    """An engine target and how its engines run, checked once, by ``engine_plan``: in worker
    processes (``isolation``), at a remote address with a call deadline (``remote_timeout``),
    or in this process. ``start`` checks nothing."""

    target: Target | ResolvedTarget
    isolation: IsolationOptions | None = None
    remote_timeout: float | None = None

    def start(self) -> ResolvedTarget:
        """The target resolved: an isolated one starts its workers, a remote one connects."""
        if self.isolation is not None:
            return isolated_target(self.target, self.isolation)
        if self.remote_timeout is not None:
            from shardkit._transport.client import remote_target

            assert isinstance(self.target, RemoteAddress), "engine_plan sets a deadline on remote addresses only"
            return remote_target(self.target, timeout_seconds=self.remote_timeout)
        return resolve_target(self.target)


def engine_plan(
    target: str | EngineFactory | Target | ResolvedTarget,
    *,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> EnginePlan:
    """How ``target``'s engines run, with the options that set it up, checked together here
    and nowhere else: an option that cannot apply is a ``UsageError`` naming it and the fix,
    never silently ignored. ``step_timeout`` applies to an isolated engine or a remote
    (``grpc://``, ``unix:``) one; ``worker_memory_mb`` only to an isolated one. A worker
    command's target is always isolated."""
    typed = typed_target(target)
    kind = typed.target if isinstance(typed, ResolvedTarget) else typed
    if isinstance(isolate, IsolationOptions):
        if step_timeout is not None or worker_memory_mb is not None:
            message = "pass step_timeout and worker_memory_mb inside the IsolationOptions, not beside them"
            raise UsageError(message)
        return EnginePlan(typed, isolation=isolate)
    if isolate and isinstance(kind, RemoteAddress):
        raise UsageError(_out_of_process(kind))
    if isolate or isinstance(kind, WorkerCommand):
        timeout = DEFAULT_STEP_TIMEOUT if step_timeout is None else step_timeout
        return EnginePlan(typed, isolation=IsolationOptions(timeout, worker_memory_mb))
    if worker_memory_mb is not None:
        message = "worker_memory_mb (--worker-memory) limits a worker process: it needs isolate=True (--isolate) or a worker command (--worker-command)"
        raise UsageError(message)
    if step_timeout is None:
        return EnginePlan(typed)
    if isinstance(typed, RemoteAddress):
        IsolationOptions(step_timeout)  # checks the number of seconds
        return EnginePlan(typed, remote_timeout=step_timeout)
    message = (
        "step_timeout (--step-timeout) is the deadline of calls to another process: it needs isolate=True (--isolate), "
        "a worker command (--worker-command) or a grpc:// or unix: target"
    )
    raise UsageError(message)


def target_with_options(
    target: str | EngineFactory | Target | ResolvedTarget,
    *,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> ResolvedTarget:
    """``target`` resolved, isolated if asked, with the call deadline set where one applies
    (``engine_plan`` checks the options, then the plan starts)."""
    return engine_plan(target, isolate=isolate, step_timeout=step_timeout, worker_memory_mb=worker_memory_mb).start()
