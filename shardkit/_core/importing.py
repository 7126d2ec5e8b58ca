"""Importing code by name, as engine targets and ``--machine`` name it: ``package.module:attr``
or ``path/to/file.py:attr``. A file imports like a script (its folder on the path), and a
module reached both ways is imported once, so that its classes have one identity."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from shardkit.errors import InvalidTarget

__all__ = ["FILE_MODULE_PREFIX", "import_named"]

#: The module name a ``path/to/file.py:attr`` target's file is imported under starts with this.
FILE_MODULE_PREFIX = "_shardkit_target_"


def import_named(target: str, what: str, shapes: str) -> object:
    """The object a ``module:attr`` or ``file.py:attr`` string names; ``what`` and
    ``shapes`` (the accepted forms) name it in the ``InvalidTarget`` raised otherwise."""
    module_part, colon, attr = target.rpartition(":")
    if not colon or not module_part or not attr:
        message = f"{what} {target!r} must look like {shapes}"
        raise InvalidTarget(message)
    if module_part.endswith(".py"):
        module = _import_file(module_part, target, what)
    else:
        module = _import_module(module_part, target, what)
    found: object = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            message = f"{what} {target!r}: {module_part} has no attribute {attr!r}"
            raise InvalidTarget(message) from None
    return found


def _import_module(name: str, target: str, what: str) -> object:
    try:
        try:
            return _module_by_name(name)
        except ModuleNotFoundError as error:
            if not _from_current_folder(name, error):
                raise
            return _module_by_name(name)
    except ImportError as error:
        message = f"{what} {target!r}: cannot import {name!r} ({error}); is it installed or on PYTHONPATH?"
        raise InvalidTarget(message) from error
    except Exception as error:
        message = f"{what} {target!r}: importing {name!r} raised {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error


def _module_by_name(name: str) -> object:
    """``name`` imported, unless its file was already loaded as a ``file.py:attr`` target:
    then that module, so that an engine and a machine named in different forms share one
    copy of their classes (a second copy would fail every ``isinstance`` between them)."""
    if name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.has_location and spec.origin is not None:
            loaded = _loaded_from(Path(spec.origin).resolve())
            if loaded is not None:
                return loaded
    return importlib.import_module(name)


def _loaded_from(path: Path) -> ModuleType | None:
    """A module already imported from the file at ``path`` (resolved), if any."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.basename(file) == path.name and _same_file(file, path):
            return module
    return None


def _same_file(file: str, path: Path) -> bool:
    try:
        return Path(file).resolve() == path
    except (OSError, RuntimeError):
        return False


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


def _import_file(path_text: str, target: str, what: str) -> object:
    path = Path(path_text).resolve()
    if not path.is_file():
        message = f"{what} {target!r}: no file at {path_text!r}"
        raise InvalidTarget(message)
    # A digest, not hash(): str hashes change from one process to the next.
    module_name = f"{FILE_MODULE_PREFIX}{hashlib.sha256(str(path).encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loaded = _loaded_from(path)
    if loaded is not None:
        return loaded  # already imported by its module name: one copy of its classes
    # As ``python file.py`` does, its folder is on the path, so that it imports its neighbours
    # (last, so that it shadows nothing installed; worker processes inherit it).
    folder = str(path.parent)
    if not any(entry == folder or _same_folder(entry, folder) for entry in sys.path if entry):
        sys.path.append(folder)
        importlib.invalidate_caches()
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        message = f"{what} {target!r}: {path_text!r} cannot be loaded as a Python module"
        raise InvalidTarget(message)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        message = f"{what} {target!r}: importing {path_text!r} raised {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error
    return module
