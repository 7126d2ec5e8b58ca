"""Trace files: a failure as plain JSON that replays without Hypothesis.

Besides the steps, a trace records where the code it names lives, so that it
replays from any folder: for a ``path/to/file.py:attr`` target the absolute
file (``target_file``), for a ``module:attr`` target the ``sys.path`` entry it
was imported from (``target_path``); the same for the ``reference``. A failure
found by an extended machine (a ``ShardMachine`` subclass with ``custom_ops``,
or another ``ReferenceModel``) records the machine class and the model factory
by importable name (``machine``, ``model``, with ``machine_path`` and
``model_path``), so ``shardkit replay`` rebuilds them; when they cannot be
imported by name, ``needs_python`` says why and the trace replays only from
Python (``replay(TRACE, custom_ops=..., model=...)``). Nothing here imports
anything: locations are found from modules already imported, or by searching
the import path without executing code.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit._core.driver import StepRecord, Violation
from shardkit._core.importing import FILE_MODULE_PREFIX
from shardkit._core.targets import IsolationOptions, PythonTarget, Target
from shardkit._version import __version__
from shardkit.contract import LoadRequest

if TYPE_CHECKING:
    from shardkit._machine.state_machine import ShardMachine

__all__ = [
    "DEFAULT_OUT",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "code_location",
    "find_module_spec",
    "importable_name",
    "machine_fields",
    "trace_document",
    "write_atomically",
    "write_new",
]

#: The module name ``shardkit._core.targets`` gives a ``file.py:attr`` target's file when it imports it.

#: Where failure traces and regression tests go unless told otherwise.
DEFAULT_OUT = Path(".shardkit/failures")

TRACE_FORMAT = "shardkit-trace"
TRACE_VERSION = 1


def trace_document(
    *,
    target: Target,
    load_request: LoadRequest,
    faults: frozenset[str],
    records: list[StepRecord],
    violation: Violation,
    seed: int | None,
    twins: bool = True,
    reference: Target | None = None,
    isolation: IsolationOptions | None = None,
    machine: type[ShardMachine] | None = None,
) -> dict[str, Any]:
    """The trace of one failure, as a JSON-able dict.

    ``machine`` is the machine class the run used: an extended one (custom
    operations, another reference model) is recorded so that replay rebuilds it.
    Where the target's and the reference's code lives is recorded from this process,
    so call it in the process that ran the fuzzing (see ``code_location``).
    """
    steps = [
        {**record.action.to_json(), "expected": record.expected, "observed": record.observed} for record in records
    ]
    fault_steps = [
        {"kind": record.action.args["kind"], "value": record.action.args["value"], "step": record.index}
        for record in records
        if record.action.op == "fault"
    ]
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "shardkit_version": __version__,
        "target": target.name,
        **_located_target("target", target),
        "role": load_request.role,
        "load_request": {
            "model_id": load_request.model_id,
            "shard_start": load_request.shard_start,
            "shard_end": load_request.shard_end,
            "total_layers": load_request.total_layers,
            "recipe": dict(load_request.recipe),
        },
        "faults_enabled": sorted(faults),
        "twins": twins,
        "reference": reference.name if reference is not None else None,
        **(_located_target("reference", reference) if reference is not None else {}),
        **machine_fields(machine),
        # The engine ran in a worker process (--isolate): its failure may be a process death.
        "isolate": isolation.to_json() if isolation is not None else None,
        "fault_steps": fault_steps,
        "seed": seed,
        "steps": steps,
        "failure": {
            "property": violation.property,
            "message": violation.message,
            "step": len(records),
            # Optional (a reader that predates it ignores it): the compared rows whole.
            **({"rows": violation.rows} if violation.rows else {}),
        },
    }


def _located(role: str, name: str) -> dict[str, str]:
    return {f"{role}_{kind}": where for kind, where in code_location(name).items()}


def _located_target(role: str, target: Target) -> dict[str, str]:
    """Where a target's Python code lives; nothing for an address or a worker command."""
    return _located(role, target.name) if isinstance(target, PythonTarget) else {}


def code_location(name: str) -> dict[str, str]:
    """Where the code a Python name (``module:attr``, ``file.py:attr``) points at lives, to find
    it again from another folder.

    ``{"file": ABSOLUTE}`` for ``path/to/file.py:attr``, ``{"path": SYS_PATH_ENTRY}`` for a
    ``module:attr`` whose module is a file on the import path, ``{}`` otherwise (a bundled
    shardkit engine, a built-in module). Imports nothing.
    """
    module, colon, attr = name.rpartition(":")
    if not colon or not module or not attr:
        return {}
    if module.endswith(".py"):
        return {"file": str(Path(module).resolve())}
    if module == "shardkit" or module.startswith("shardkit."):
        return {}
    origin = _module_origin(module)
    if origin is None:
        return {}
    entry = origin.parent  # the folder of the module, or of the package's __init__.py
    for _ in range(module.count(".") + (1 if origin.name == "__init__.py" else 0)):
        entry = entry.parent
    return {"path": str(entry)}


def _module_origin(module: str) -> Path | None:
    """The file of ``module``: from the loaded module, or found on the import path without importing it."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        origin = getattr(getattr(loaded, "__spec__", None), "origin", None) or getattr(loaded, "__file__", None)
        return Path(origin).resolve() if isinstance(origin, str) and Path(origin).is_file() else None
    spec = find_module_spec(module, [*sys.path, os.getcwd()])
    origin = spec.origin if spec is not None else None
    return Path(origin).resolve() if isinstance(origin, str) and Path(origin).is_file() else None


def find_module_spec(module: str, search: list[str]) -> importlib.machinery.ModuleSpec | None:
    """``module``'s spec found component by component by the path finder, executing nothing:
    a package already imported is taken from ``sys.modules``, the others from ``search``
    and then from their parent's folders. None if it is not a file or folder found that way."""
    spec: importlib.machinery.ModuleSpec | None = None
    parts = module.split(".")
    locations: list[str] | None = search
    for depth in range(len(parts)):
        prefix = ".".join(parts[: depth + 1])
        loaded = sys.modules.get(prefix)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else None
        if spec is None:
            try:
                spec = importlib.machinery.PathFinder.find_spec(prefix, locations)
            except (ImportError, ValueError):
                return None
        if spec is None:
            return None
        package_path = getattr(loaded, "__path__", None) if loaded is not None else None
        locations = list(package_path if package_path is not None else spec.submodule_search_locations or [])
    return spec


def importable_name(value: object) -> str | None:
    """``module:QualName`` that imports back to ``value`` (a class or function), or None.

    None for what cannot be found again by name: something defined inside a function
    or in ``__main__``, a lambda, an object its module does not hold under that name.
    A class from a ``file.py:attr`` target's file is named ``/absolute/file.py:QualName``.
    """
    module_name = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None
    if "<" in qualname or module_name == "__main__":
        return None
    module = sys.modules.get(module_name)
    found: object = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if module is None or found is not value:
        return None
    if module_name.startswith(FILE_MODULE_PREFIX):
        file = getattr(module, "__file__", None)
        return f"{Path(file).resolve()}:{qualname}" if isinstance(file, str) else None
    return f"{module_name}:{qualname}"


def machine_fields(machine: type[ShardMachine] | None) -> dict[str, str | None]:
    """The trace keys that rebuild an extended machine: ``machine`` and ``model`` (with their
    ``machine_path`` and ``model_path``), or ``needs_python`` saying why they cannot be."""
    if machine is None:
        return {}
    from shardkit._core.model import ReferenceModel
    from shardkit._machine.spec import options_of
    from shardkit._machine.state_machine import ShardMachine

    # machine_for (and the runner's probes) subclass the user's class: record the one the user wrote.
    base = options_of(machine).base if machine._options is not None else machine
    model = machine.model_factory
    fields: dict[str, str | None] = {}
    problems = []
    # Only a machine that changes what a replay does is recorded: one with operations of its
    # own or another model; importing it is then needed (and subject to replay's trust rule).
    extended = (
        isinstance(base, type)
        and issubclass(base, ShardMachine)
        and (bool(base.custom_ops) or base.model_factory is not ReferenceModel)
    )
    if extended:
        name = importable_name(base)
        if name is not None:
            fields["machine"] = name
            fields.update(_located("machine", name))
        else:
            problems.append(
                f"its machine class {base.__qualname__} (custom operations {sorted(base.custom_ops)}) "
                "cannot be imported by name (defined inside a function or in __main__?)"
            )
    if model is not ReferenceModel and not (extended and model is base.model_factory):
        name = importable_name(model)
        if name is not None:
            fields["model"] = name
            fields.update(_located("model", name))
        else:
            described = getattr(model, "__qualname__", repr(model))
            problems.append(f"its reference model {described} cannot be imported by name (a lambda, or local?)")
    if problems:
        fields["needs_python"] = (
            "; ".join(problems) + "; replay it from Python with shardkit.replay(TRACE, custom_ops=..., model=...)"
        )
    return fields


def current_umask() -> int:
    """The process's umask, read without changing it where the system says (Linux), else
    set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: Path, document: Mapping[str, Any] | str) -> Path:
    """Write to a temporary file beside ``path`` and rename it into place, so a
    killed run never leaves a half-written file. The file gets the permissions any
    new file of the user gets (0666 less the umask), not the temporary file's 0600."""
    _, temporary = _written_beside(path, document)
    try:
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def write_new(path: Path, document: Mapping[str, Any] | str) -> bool:
    """Write ``document`` to ``path`` only if no file is there yet; False if one is.

    Claiming the name and writing the content are one step: the document is written to a
    temporary file that is then hard-linked to ``path``, which fails if ``path`` exists. So
    of two processes claiming one name (pytest-xdist workers, HypoFuzz processes) exactly
    one gets it, and the other never reads it half-written. Where the file system has no
    hard links, the name is claimed with ``O_CREAT | O_EXCL`` and then written (a reader may
    then see it half-written and, finding no failure it knows there, take another name)."""
    text, temporary = _written_beside(path, document)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError:
        return _create_exclusively(path, text)
    finally:
        temporary.unlink(missing_ok=True)
    return True


def _written_beside(path: Path, document: Mapping[str, Any] | str) -> tuple[str, Path]:
    """``document`` as text, and a temporary file beside ``path`` that holds it, with the
    permissions any new file of the user gets (0666 less the umask), not mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = document if isinstance(document, str) else json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(handle, 0o666 & ~current_umask())
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return text, Path(temporary)


def _create_exclusively(path: Path, text: str) -> bool:
    try:
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(text)
    return True
