"""Isolation, and the options of a target's calls: the top of the transport room.

A native engine dies in ways Python cannot catch (an abort, a segfault, a hang,
memory exhaustion). ``isolated_target`` wraps a Python engine target so every engine it
builds lives in a child ``shardkit serve --worker`` process (see ``worker.py``); when the
child dies, misses a call's deadline or answers garbage, the driver asks the isolation
what happened (``death``) and reports it as an ordinary step failure, and the next engine
comes from a fresh child. A foreign worker command (``--worker-command``, a target named
a ``WorkerCommand``) is isolated the same way, always: its engines live in the
processes the command starts. ``target_with_options`` is what the commands call: a target
resolved, isolated if asked, with the deadline of its calls set.

What the driver, the runner and the trace need to know about isolation (``Isolation``,
``IsolationOptions``, ``ProcessDeath``) is in ``shardkit._core.targets``: they import
neither this module nor gRPC. This module imports gRPC only when it starts workers or
sets a remote target's deadline (the ``grpc`` extra).
"""

from __future__ import annotations

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
from shardkit.errors import InvalidTarget

__all__ = ["isolated_target", "target_with_options"]


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
        message = f"--isolate runs a Python engine target in a child process; {typed.address} is already out of process"
        raise InvalidTarget(message)
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


def _in_workers(target: PythonTarget | WorkerCommand, options: IsolationOptions | None) -> ResolvedTarget:
    try:
        from shardkit._transport.worker import WorkerPool
    except ImportError as error:
        flag = "--worker-command" if isinstance(target, WorkerCommand) else "--isolate"
        message = f"{flag} needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise InvalidTarget(message) from error
    pool = WorkerPool(target, options or IsolationOptions())
    return ResolvedTarget(target, pool.new_engine, isolation=pool)


def target_with_options(
    target: str | EngineFactory | Target | ResolvedTarget,
    *,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> ResolvedTarget:
    """``target`` resolved, isolated if asked, with the call deadline set where one applies.

    ``step_timeout`` applies to an isolated engine or a remote (``grpc://``, ``unix:``)
    one; ``worker_memory_mb`` only to an isolated one. An option that cannot apply is an
    error, never silently ignored. A worker command's target is always isolated.
    """
    if not isolate and isinstance(parse_target(target), WorkerCommand):
        isolate = True
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
    typed = typed_target(target)
    if isinstance(typed, RemoteAddress):
        from shardkit._transport.client import remote_target

        return remote_target(typed, timeout_seconds=step_timeout)
    message = "step_timeout (--step-timeout) is the deadline of calls to another process: it needs isolate=True (--isolate) or a grpc:// or unix: target"
    raise ValueError(message)
