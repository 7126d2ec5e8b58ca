"""Engine targets: ``module.path:attr`` or ``path/to/file.py:attr`` naming a
zero-argument callable that returns a fresh, unloaded ``ShardEngine``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .contract import ShardEngine
from .errors import InvalidTarget

if TYPE_CHECKING:
    from .isolation import Isolation

__all__ = ["DEFAULT_TARGET", "EngineFactory", "ResolvedTarget", "resolve_target"]

EngineFactory = Callable[[], ShardEngine]
DEFAULT_TARGET = "shardkit:FakeShardEngine"


@dataclass(frozen=True)
class ResolvedTarget:
    """A factory that checks what it builds, and the name to print and record.

    ``isolation`` is set when every engine it builds lives in a child process
    (``shardkit.isolation.isolated_target``)."""

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
        if not isinstance(engine, ShardEngine):
            message = (
                f"engine target {self.name!r} returned {type(engine).__name__}, not a ShardEngine; "
                "it must name a zero-argument callable returning a fresh shardkit.ShardEngine"
            )
            raise InvalidTarget(message)
        return engine


def short_name(target_name: str) -> str:
    """A target's name for labels and file names: the attribute of ``module:attr``, an address whole."""
    if "://" in target_name or target_name.startswith("unix:"):
        return target_name
    return target_name.rpartition(":")[2] or target_name


def resolve_target(target: str | EngineFactory | ResolvedTarget) -> ResolvedTarget:
    """Turn a target string or a factory into a checked ``ResolvedTarget``.

    ``grpc://HOST:PORT`` and ``unix:PATH`` name a remote engine server (the ``grpc`` extra)."""
    if isinstance(target, ResolvedTarget):
        return target
    if isinstance(target, str) and target.startswith(("grpc://", "unix:")):
        # A remote engine: each call asks the server there for a fresh engine.
        try:
            from .remote.client import remote_target
        except ImportError as error:
            message = f"engine target {target!r} needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
            raise InvalidTarget(message) from error
        return remote_target(target)
    if not isinstance(target, str):
        if not callable(target):
            message = f"an engine target must be a 'module:attr' string or a callable, got {target!r}"
            raise InvalidTarget(message)
        name = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
        return ResolvedTarget(name, target)
    module_part, colon, attr = target.rpartition(":")
    if not colon or not module_part or not attr:
        message = f"engine target {target!r} must look like 'package.module:factory' or 'path/to/file.py:factory'"
        raise InvalidTarget(message)
    module = _import_file(module_part, target) if module_part.endswith(".py") else _import_module(module_part, target)
    factory: object = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            message = f"engine target {target!r}: {module_part} has no attribute {attr!r}"
            raise InvalidTarget(message) from None
    if not callable(factory):
        message = f"engine target {target!r} names a {type(factory).__name__}, which is not callable"
        raise InvalidTarget(message)
    return ResolvedTarget(target, factory)


def _import_module(name: str, target: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        message = f"engine target {target!r}: cannot import {name!r} ({error}); is it installed or on PYTHONPATH?"
        raise InvalidTarget(message) from error
    except Exception as error:
        message = f"engine target {target!r}: importing {name!r} raised {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error


def _import_file(path_text: str, target: str) -> object:
    path = Path(path_text).resolve()
    if not path.is_file():
        message = f"engine target {target!r}: no file at {path_text!r}"
        raise InvalidTarget(message)
    module_name = f"_shardkit_target_{abs(hash(str(path)))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        message = f"engine target {target!r}: {path_text!r} cannot be loaded as a Python module"
        raise InvalidTarget(message)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        message = f"engine target {target!r}: importing {path_text!r} raised {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error
    return module
