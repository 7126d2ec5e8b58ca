"""The trust rule: which code a trace names replay may import and build.

Reading a trace builds nothing (``shardkit._run.trace_reader``); replaying it
(``shardkit._run.replay``) builds what this module admits, and only that. The rule is
kept in a module of its own because it is the one place where a file from anywhere
decides what code runs on this machine: it should be read, reviewed and tested as one
piece, apart from the parser below it and the driver above it.

* **Build recorded code only where it is the user's own.** The code a trace names —
  its engine ``target``, its ``reference``, the ``machine`` and ``model`` of an
  extended run — is built only if

  1. it is bundled with shardkit (``shardkit:FakeShardEngine``, ``shardkit.engines…``;
     a target must then be a shardkit engine, a machine a ``ShardMachine``, a model a
     ``ReferenceModel``); or
  2. its code lies inside the current folder's tree — the project replay is run
     from — and not in an installed-packages folder (``site-packages``, a virtual
     environment: any folder below the project's holding a ``pyvenv.cfg``, the one
     shardkit runs from or any other) there: for ``path/to/file.py:attr`` the file; for ``module:attr``
     the file of the module and of each package above it, found on ``sys.path``,
     then in the current folder, then in the folder the trace recorded, by the
     path finder alone, without importing or running anything (a module that cannot
     be found that way, such as a built-in module, counts as outside); and what the
     name reaches is not a built-in or standard-library function or class (as
     ``project_module:os.abort`` would be); or
  3. the user chose it: ``--engine TARGET`` (``target=``) replays against an engine the
     user names, and ``--trust`` (``trust=True``) builds what the trace names wherever
     it is. A generated regression test passes ``trust=True``: it is a Python file the
     user chose to run; and it names the code it builds in its own source (``CODE``,
     passed as ``code=``), so that the trace beside it cannot change what runs: a trace
     that names other code (``check_named_code``) is refused. A test of the older form,
     which built whatever its trace named, is refused too, asking to be regenerated.

  Anything else stops the replay with ``UntrustedTarget`` (exit 2), which names the
  target, where its code is, and the fixes: run replay from the project folder, pass
  ``--trust``, or name the engine with ``--engine``.
* **A recorded worker command runs only a program of the project's.** A trace of a
  ``--worker-command`` run names the command; replay starts it only if its program is a
  file inside the current project (given with a ``/``, as ``build/my_worker``), and not a
  program found on ``PATH`` (``python3``, ``sh``, ``docker``) nor one of a virtual
  environment (``.venv2/bin/python``, ``.venv2/bin/pip``: a ``pyvenv.cfg`` in a folder
  above it, as the link or as the file it leads to), whose arguments could make it do
  anything; otherwise the user chooses: ``--trust``, or ``--worker-command CMD``
  (``target=WorkerCommand(CMD)``).
* **Remote targets connect rather than run code here.** ``unix:PATH`` and ``grpc://``
  on a loopback address (``localhost``, ``127.0.0.0/8``, ``[::1]``) replay as recorded;
  ``grpc://`` to any other host needs ``--trust`` or ``--engine``, so that a trace
  cannot make replay send requests to a machine the user did not choose.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardkit._core.model import ReferenceModel
from shardkit._core.targets import PythonTarget, RemoteAddress, WorkerCommand, parse_target
from shardkit._run.trace import find_module_spec
from shardkit._run.trace_reader import Trace
from shardkit._transport.resolve import resolve_target
from shardkit.contract import ShardEngine
from shardkit.errors import InvalidTarget, TraceFormatError, UntrustedTarget

__all__ = [
    "CODE_KEYS",
    "Admitted",
    "admit",
    "build_recorded_machine",
    "check_named_code",
    "file_target_outside_project",
    "named_code",
    "resolve_admitted",
]

#: The keys of a trace that name code to build, and where to find it: what a generated
#: regression test names in its own source (its ``CODE``).
CODE_KEYS = (
    "target",
    "reference",
    "machine",
    "model",
    *(f"{role}_{kind}" for role in ("target", "reference", "machine", "model") for kind in ("file", "path")),
)

_ROLE_WORDS = MappingProxyType(
    {"target": "engine target", "reference": "reference", "machine": "machine", "model": "model"}
)


@dataclass(frozen=True)
class Admitted:
    """A recorded name replay may build: the name to build it by, and where its code is."""

    role: str
    recorded: str
    name: str
    #: The file of its code, when it is a Python file; None for bundled code or a remote address.
    origin: Path | None = None
    #: The import path entry its module was found under, and the specs to import it by.
    entry: str | None = None
    specs: tuple[tuple[str, importlib.machinery.ModuleSpec], ...] = ()
    #: The user passed trust=True: build it wherever it is and whatever it names.
    trusted: bool = False

    def describe(self) -> str:
        where = f"; code in {self.origin}" if self.origin is not None and str(self.origin) not in self.recorded else ""
        return f"{parse_target(self.recorded).shown} (recorded in the trace{where})"


def _project() -> Path:
    return Path.cwd().resolve()


def _installed(path: Path) -> bool:
    """Under site-packages, or inside a Python installation or virtual environment."""
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    prefixes = {Path(prefix).resolve() for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(path.is_relative_to(prefix) for prefix in prefixes if not _project().is_relative_to(prefix)):
        return True
    return _virtual_environment(path) is not None


def _virtual_environment(path: Path) -> Path | None:
    """The virtual environment ``path`` lies in: the nearest folder above it that holds a
    ``pyvenv.cfg`` (``python -m venv`` writes one at its root), whichever environment it
    is. A folder that holds the project itself does not count: the project is the user's."""
    path = Path(os.path.abspath(path))  # the path as named: a link is not followed
    projects = {_project(), Path(os.path.abspath(os.getcwd()))}
    for folder in path.parents:
        if any(project.is_relative_to(folder) for project in projects):
            return None
        if (folder / "pyvenv.cfg").is_file():
            return folder
    return None


def _inside_project(path: Path) -> bool:
    """Inside the current folder's tree and not installed there: neither the path as named
    (``.venv2/bin/python3``, a link) nor the file it leads to lies in a virtual environment."""
    resolved = path.resolve()
    return resolved.is_relative_to(_project()) and not _installed(resolved) and _virtual_environment(path) is None


def _outside(path: Path) -> str:
    """Why ``path``, which the rule does not count as the project's, is not: it lies in a
    virtual environment inside the project, or outside the project."""
    if path.resolve().is_relative_to(_project()):
        venv = _virtual_environment(path) or _virtual_environment(path.resolve())
        if venv is not None:
            return f"in the virtual environment {venv}"
    return "outside the current project"


def file_target_outside_project(name: str) -> bool:
    """Whether ``name`` is a ``path/to/file.py:attr`` target whose file replay would not
    build unless the user names it (``--engine``), as it lies outside the current project."""
    module, colon, attr = name.rpartition(":")
    return (
        bool(colon and attr) and module.endswith(".py") and Path(module).is_file() and not _inside_project(Path(module))
    )


def _admit_worker_command(trace: Trace, role: str, name: str, command: WorkerCommand, trust: bool) -> Admitted:
    program = command.argv[0]
    if trust:
        return Admitted(role, name, name, trusted=True)
    path = Path(program)
    fixes = (
        "run shardkit replay from the project folder that holds the program, pass --trust (trust=True) to run "
        "the recorded command anyway, or name the worker's command yourself with --worker-command CMD"
    )
    if "/" not in program:
        where = f"the program {program!r}, found on PATH, which could run anything with its arguments"
    elif not path.is_file():
        # --trust would not help: the command's paths are relative to the folder the run was started from.
        where = f"the program {program!r}, which is not a file from here (a relative path in the command is relative to the folder the run started in)"
        fixes = "run shardkit replay from that folder, or name the worker's command with paths from here: --worker-command CMD"
    elif not _inside_project(path):
        venv = _virtual_environment(path) or _virtual_environment(path.resolve())
        if venv is not None:
            where = (
                f"the program {program!r}, of the virtual environment {venv} (a pyvenv.cfg there), "
                "which could run anything with its arguments"
            )
        else:
            where = f"the program {program!r}, outside the current project (it is {path.resolve()})"
    else:
        return Admitted(role, name, name, origin=path.resolve())
    message = f"{trace.path} names the worker command {command.command!r}, which runs {where}; {fixes}"
    raise UntrustedTarget(message)


def _bundled(module: str) -> bool:
    return module == "shardkit" or module.startswith("shardkit.")


def _untrusted(trace: Trace, role: str, name: str, where: str) -> UntrustedTarget:
    fixes = "run shardkit replay from the project folder that holds it, or pass --trust (trust=True) to build it anyway"
    if role in ("target", "reference"):
        fixes += ", or replay against an engine you name with --engine TARGET (target=...)"
    message = (
        f"{trace.path} names the {_ROLE_WORDS[role]} {name!r}, whose code is {where}; replay builds recorded "
        f"code only from inside the current project (the current folder's tree, {_project()}) unless you choose it: {fixes}"
    )
    return UntrustedTarget(message)


def admit(trace: Trace, role: str, name: str, trust: bool) -> Admitted:
    """Decide whether replay may build the recorded ``name`` (see the module docstring); imports nothing."""
    try:
        target = parse_target(name)  # what the trace recorded, read once
    except InvalidTarget as error:  # only a worker command is checked as it is read
        raise TraceFormatError(f"{trace.path}: the recorded worker command is not valid: {error}") from None
    if isinstance(target, WorkerCommand):
        return _admit_worker_command(trace, role, name, target, trust)
    if isinstance(target, RemoteAddress):
        if not (trust or target.on_this_machine):
            raise _untrusted(trace, role, name, "a server on another machine")
        return Admitted(role, name, name, trusted=trust)
    module, colon, attr = name.rpartition(":")
    if not colon or not module or not attr:
        return Admitted(role, name, name, trusted=trust)  # not a target name at all: resolve_target refuses it
    if module.endswith(".py"):
        return _admit_file(trace, role, name, module, attr, trust)
    if _bundled(module):
        return Admitted(role, name, name, trusted=trust)
    search = [*sys.path, os.getcwd()]
    recorded_entry = trace.locations.get(f"{role}_path")
    entries: list[tuple[str | None, list[str]]] = [(None, search)]
    if recorded_entry is not None:
        entries.append((recorded_entry, [recorded_entry]))
    for entry, places in entries:
        specs = _module_specs(module, places)
        if specs is None:
            continue
        final = specs[-1][1]
        if not (final.origin and Path(final.origin).is_file()):
            if trust:
                return Admitted(role, name, name, trusted=True)
            kind = final.origin if final.origin in ("built-in", "frozen") else "namespace"
            raise _untrusted(trace, role, name, f"the {kind} module {module!r}, not a file in the current project")
        origins = [Path(spec.origin).resolve() for _, spec in specs if spec.origin and Path(spec.origin).is_file()]
        outside = [origin for origin in origins if not _inside_project(origin)]
        if outside and not trust:
            shown = origins[-1] if origins[-1] in outside else outside[0]
            phrase = _outside(shown)
            installed = _installed(shown) and phrase == "outside the current project"
            kind = "an installed or standard-library module at" if installed else "at"
            raise _untrusted(trace, role, name, f"{kind} {shown}, {phrase}")
        top = module.split(".")[0]
        if entry is None and top not in sys.modules and find_module_spec(top, list(sys.path)) is None:
            entry = os.getcwd()  # found in the current folder, which is not on sys.path (a console script)
        return Admitted(role, name, name, origins[-1], entry, tuple(specs), trusted=trust)
    if trust:
        return Admitted(role, name, name, trusted=True)  # an importer of its own may provide it
    searched = "sys.path or the current folder" + (f" or {recorded_entry}" if recorded_entry else "")
    where = f"not found as a file on {searched} (a module only an installed importer provides?)"
    raise _untrusted(trace, role, name, where)


def _module_specs(module: str, search: list[str]) -> list[tuple[str, importlib.machinery.ModuleSpec]] | None:
    """The spec of ``module`` and of each package above it, found without importing; None if not found."""
    parts = module.split(".")
    specs = []
    for depth in range(len(parts)):
        prefix = ".".join(parts[: depth + 1])
        spec = find_module_spec(prefix, search)
        if spec is None:
            return None
        specs.append((prefix, spec))
    return specs


def _admit_file(trace: Trace, role: str, name: str, module: str, attr: str, trust: bool) -> Admitted:
    recorded_file = trace.locations.get(f"{role}_file")
    # The file the run used, if it is still there; else the name as recorded, from here.
    candidates = [Path(recorded_file)] if recorded_file is not None else []
    candidates.append(Path(module))
    chosen = next((candidate for candidate in candidates if candidate.is_file()), None)
    if chosen is None:
        return Admitted(role, name, name, trusted=trust)  # resolve_target says there is no file there
    origin = chosen.resolve()
    if not (_inside_project(chosen) and _inside_project(origin)) and not trust:
        raise _untrusted(trace, role, name, f"the file {origin}, {_outside(chosen)}")
    return Admitted(role, name, f"{origin}:{attr}", origin, trusted=trust)


def _import_admitted(admitted: Admitted) -> None:
    """Import the admitted module from exactly the files that were checked (nothing for other names)."""
    if not admitted.specs:
        return
    if admitted.entry is not None and admitted.entry not in sys.path:
        sys.path.append(admitted.entry)  # so that its own imports of its neighbours work
    for module_name, spec in admitted.specs:
        if module_name in sys.modules:
            continue
        if spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as error:
            del sys.modules[module_name]
            if not isinstance(error, Exception):
                raise
            message = (
                f"{_ROLE_WORDS[admitted.role]} {admitted.recorded!r}: importing {module_name!r} raised "
                f"{type(error).__name__}: {error}"
            )
            raise InvalidTarget(message) from error
        parent, _, child = module_name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def resolve_admitted(trace: Trace, admitted: Admitted) -> object:
    """Import an admitted name and return the object it names, checked to be what its role builds
    (None for a remote address or a worker command, which import nothing)."""
    target = parse_target(admitted.name)
    if not isinstance(target, PythonTarget):
        return None
    _import_admitted(admitted)
    if admitted.role in ("target", "reference"):
        built = resolve_target(target).build
    else:
        try:
            built = resolve_target(target).build
        except InvalidTarget as error:
            message = f"{trace.path}: the recorded {admitted.role} cannot be built: {error}"
            raise TraceFormatError(message) from error
    if not admitted.trusted:
        _check_defined_inside(trace, admitted, built)
    return built


def _check_defined_inside(trace: Trace, admitted: Admitted, value: object) -> None:
    """What a trusted name reaches must not be the standard library's, as ``project_module:os.abort``
    or ``project_module:exit`` would be; and a shardkit name must be a kit engine, machine or model."""
    from shardkit._machine.state_machine import ShardMachine

    module = admitted.name.rpartition(":")[0]
    defined_in = getattr(value, "__module__", None)
    if _bundled(module):
        wanted = {"target": ShardEngine, "reference": ShardEngine, "machine": ShardMachine, "model": ReferenceModel}
        allowed = isinstance(value, type) and issubclass(value, wanted[admitted.role])
        if allowed or (admitted.role in ("target", "reference") and str(defined_in).startswith("shardkit.engines")):
            return
        where = f"{defined_in}.{getattr(value, '__qualname__', '?')}, which is not one of shardkit's engines"
        raise _untrusted(trace, admitted.role, admitted.recorded, where)
    if isinstance(value, types.BuiltinFunctionType):
        where = f"the built-in function {defined_in}.{value.__name__}, reached through the project's module"
        raise _untrusted(trace, admitted.role, admitted.recorded, where)
    if not isinstance(value, (type, types.FunctionType, types.MethodType)) or not isinstance(defined_in, str):
        return  # an instance (a functools.partial, say) held by the checked module
    source = getattr(sys.modules.get(defined_in), "__file__", None)
    if not isinstance(source, str) or _standard_library(Path(source)):
        where = f"the standard library's {defined_in}.{getattr(value, '__qualname__', '?')}, reached through the project's module"
        raise _untrusted(trace, admitted.role, admitted.recorded, where)


def _standard_library(path: Path) -> bool:
    path = path.resolve()
    if _installed(path) and any(part in ("site-packages", "dist-packages") for part in path.parts):
        return False
    places = {sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib")}
    return any(path.is_relative_to(Path(place).resolve()) for place in places if place)


def build_recorded_machine(trace: Trace, admitted: Admitted) -> Any:
    from shardkit._machine.state_machine import ShardMachine

    machine = resolve_admitted(trace, admitted)
    if not (isinstance(machine, type) and issubclass(machine, ShardMachine)):
        message = f"{trace.path}: machine {trace.machine!r} is a {type(machine).__name__}, not a ShardMachine subclass"
        raise TraceFormatError(message)
    return machine


def named_code(trace: Trace) -> dict[str, str]:
    """The code ``trace`` names, by ``CODE_KEYS``: its names and where it was found."""
    values: dict[str, str | None] = {
        "target": trace.target,
        "reference": trace.reference,
        "machine": trace.machine,
        "model": trace.model,
        **trace.locations,
    }
    return {key: value for key in CODE_KEYS if (value := values.get(key)) is not None}


def _code_words(key: str, value: str | None) -> str:
    role, _, kind = key.partition("_")
    if role == "target" and value is not None and isinstance(parse_target(value), WorkerCommand):
        return "the worker command"
    what = {"": "", "file": "'s file", "path": "'s import path entry"}[kind]
    return f"the {_ROLE_WORDS[role]}{what}"


def check_named_code(trace: Trace, code: Mapping[str, str | None]) -> None:
    """Refuse ``trace`` unless it names exactly the code ``code`` does (keys of ``CODE_KEYS``,
    a missing key or None naming nothing): a generated regression test passes its ``CODE``,
    so that what it runs is what its own source says, whatever the trace beside it says."""
    unknown = sorted(set(code) - set(CODE_KEYS))
    if unknown:
        message = f"code= takes the keys {', '.join(CODE_KEYS)}; got {', '.join(map(repr, unknown))}"
        raise ValueError(message)
    recorded = named_code(trace)
    differences = []
    for key in CODE_KEYS:
        ours, theirs = code.get(key), recorded.get(key)
        if ours == theirs:
            continue
        words = _code_words(key, theirs if theirs is not None else ours)
        if theirs is None:
            differences.append(f"names no {words.removeprefix('the ')} where the regression test's CODE names {ours!r}")
        elif ours is None:
            differences.append(f"names {words} {theirs!r}, which the regression test's CODE does not name")
        else:
            differences.append(f"names {words} {theirs!r} where the regression test's CODE names {ours!r}")
    if differences:
        message = (
            f"{trace.path} {'; and '.join(differences)}: a regression test replays only the code it names itself; "
            "put back the trace it was generated with, or regenerate both with the shardkit fuzz run that found the failure"
        )
        raise UntrustedTarget(message)
