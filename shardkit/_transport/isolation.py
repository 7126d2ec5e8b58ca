"""Isolation, and the options of a target's calls: the top of the transport room.

A native engine dies in ways Python cannot catch (an abort, a segfault, a hang,
memory exhaustion). ``isolated_target`` wraps a Python engine target so every engine it
builds lives in a child ``shardkit serve --worker`` process (see ``worker.py``); when the
child dies, misses a call's deadline or answers garbage, the driver asks the isolation
what happened (``death``) and reports it as an ordinary step failure, and the next engine
comes from a fresh child. A foreign worker command (``--worker-command``, a target named
by ``worker_command_target``) is isolated the same way, always: its engines live in the
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
    ResolvedTarget,
    is_remote_address,
    worker_command_of,
)
from shardkit._transport.resolve import resolve_target
from shardkit.errors import InvalidTarget

__all__ = ["isolated_target", "target_with_options"]


def isolated_target(
    target: str | EngineFactory | ResolvedTarget, options: IsolationOptions | None = None
) -> ResolvedTarget:
    """``target`` with every engine in a child ``shardkit serve --worker`` process.

    The child imports the target by name, so it must be a ``module:attr`` or
    ``file.py:attr`` target (a factory defined at module level will do, not a lambda);
    the child sees the parent's ``sys.path``. Needs the ``grpc`` extra.
    """
    if isinstance(target, str) and worker_command_of(target) is not None:
        return _in_workers(target, options)
    resolved = resolve_target(target)
    if resolved.isolation is not None:
        if options is not None and options != resolved.isolation.options:
            message = f"{resolved.name} is already isolated with {resolved.isolation.options}, not {options}"
            raise ValueError(message)
        return resolved
    name = resolved.name
    if is_remote_address(name):
        message = f"--isolate runs a Python engine target in a child process; {name} is already out of process"
        raise InvalidTarget(message)
    if "<" in name or name.startswith("__main__:"):
        message = (
            f"--isolate needs an engine target the worker process can import by name, got {name!r}: "
            "define the factory at module level of an importable module and pass 'module:attr' or 'path/to/file.py:attr'"
        )
        raise InvalidTarget(message)
    resolve_target(name)  # the child will import it by this name: refuse a name that does not import here
    return _in_workers(name, options)


def _in_workers(name: str, options: IsolationOptions | None) -> ResolvedTarget:
    try:
        from shardkit._transport.worker import WorkerPool
    except ImportError as error:
        flag = "--worker-command" if worker_command_of(name) is not None else "--isolate"
        message = f"{flag} needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
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
    error, never silently ignored. A worker command's target is always isolated.
    """
    if not isolate and worker_command_of(getattr(target, "name", target)) is not None:
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
    if isinstance(target, str) and is_remote_address(target):
        from shardkit._transport.client import remote_target

        return remote_target(target, timeout_seconds=step_timeout)
    message = "step_timeout (--step-timeout) is the deadline of calls to another process: it needs isolate=True (--isolate) or a grpc:// or unix: target"
    raise ValueError(message)
