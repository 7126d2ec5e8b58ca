"""Any engine target by name: ``resolve_target``.

A ``grpc://HOST:PORT`` or ``unix:PATH`` target names an engine server, reached through the
client (the ``grpc`` extra, imported only then); any other target is Python code imported
in this process (``shardkit._core.targets.import_target``). Isolating a target, and setting
the deadline of its calls, is one level up: ``shardkit._transport.isolation``.

Importable without gRPC, and imports neither the server nor the worker, so the server can
resolve what it serves.
"""

from __future__ import annotations

from shardkit._core.targets import (
    EngineFactory,
    PythonTarget,
    RemoteAddress,
    ResolvedTarget,
    Target,
    WorkerCommand,
    import_target,
    parse_target,
)
from shardkit.errors import InvalidTarget

__all__ = ["resolve_target"]


def resolve_target(target: str | EngineFactory | Target | ResolvedTarget) -> ResolvedTarget:
    """Turn a target into a checked ``ResolvedTarget`` (text is read by ``parse_target``).

    A ``RemoteAddress`` names an engine server (the ``grpc`` extra): each call of the target
    asks the server there for a fresh engine. A ``WorkerCommand`` is refused: its engines live
    in processes the kit starts, which is isolation's
    (``shardkit._transport.isolation.target_with_options``)."""
    if isinstance(target, ResolvedTarget):
        return target
    typed = parse_target(target)
    if isinstance(typed, WorkerCommand):
        message = (
            f"the worker command {typed.command!r} names only the engine under test (--worker-command, worker_command=), "
            "not a reference or a served engine: for those, serve the worker yourself and name its unix: address"
        )
        raise InvalidTarget(message)
    if isinstance(typed, RemoteAddress):
        try:
            from shardkit._transport.client import remote_target
        except ImportError as error:
            message = f"engine target {typed.address!r} needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
            raise InvalidTarget(message) from error
        return remote_target(typed)
    assert isinstance(typed, PythonTarget)
    return import_target(typed)
