"""Engine targets: ``module.path:attr`` or ``path/to/file.py:attr`` naming a
zero-argument callable that returns a fresh, unloaded ``ShardEngine``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .contract import EngineError, ShardEngine
from .errors import InvalidTarget

if TYPE_CHECKING:
    from .isolation import Isolation

__all__ = ["DEFAULT_TARGET", "EngineFactory", "EngineLost", "ResolvedTarget", "describe_exception", "resolve_target"]

EngineFactory = Callable[[], ShardEngine]
DEFAULT_TARGET = "shardkit:FakeShardEngine"
T = TypeVar("T")


class EngineLost(BaseException):
    """The engine under test became unreachable for a reason that is not the engine's: the
    ``shardkit serve`` process behind a ``grpc://``/``unix:`` target went away, or evicted it.

    Not an ``Exception``: it passes through Hypothesis (which would shrink it into a flaky
    failure) and through the driver (which would report it as the engine's failure), and ends
    the run at once; the command reports it as an input error naming ``address``.
    """

    def __init__(self, message: str, *, address: str) -> None:
        super().__init__(message)
        self.address = address


def _passes_through(error: BaseException) -> bool:
    """What a guard around the target's code must not turn into an error of the target:
    Ctrl-C, and a run that is ending anyway because its server is lost."""
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
        except BaseException as error:
            if _passes_through(error):
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
            if _passes_through(error):
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
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not _from_current_folder(name, error):
                raise
            return importlib.import_module(name)
    except ImportError as error:
        message = f"engine target {target!r}: cannot import {name!r} ({error}); is it installed or on PYTHONPATH?"
        raise InvalidTarget(message) from error
    except Exception as error:
        message = f"engine target {target!r}: importing {name!r} raised {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error


def _from_current_folder(name: str, error: ModuleNotFoundError) -> bool:
    """Make ``name`` importable from the current folder, as ``python -m`` does, when its
    package was found nowhere else: the ``shardkit`` console script, unlike ``python -m
    shardkit``, does not put the current folder on ``sys.path``. True if it was added."""
    missing = error.name or ""
    if not missing or not (name == missing or name.startswith(f"{missing}.")):
        return False  # the target's own imports failed, not the target
    here = os.getcwd()
    if any(entry in ("", ".") or _same_folder(entry, here) for entry in sys.path):
        return False
    top = missing.partition(".")[0]
    if not (Path(here, top).is_dir() or Path(here, f"{top}.py").is_file()):
        return False
    # Last, so it shadows nothing that is installed; worker processes inherit it (PYTHONPATH).
    sys.path.append(here)
    importlib.invalidate_caches()
    return True


def _same_folder(entry: str, folder: str) -> bool:
    try:
        return os.path.samefile(entry, folder)
    except OSError:
        return False


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
