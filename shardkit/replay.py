"""Replaying a trace file without Hypothesis.

A trace is data; running code is the user's decision.

* **Read as data first.** ``shardkit replay TRACE`` reads the trace before anything
  else: only a regular file (a FIFO, a device such as ``/dev/zero``, a folder or a
  socket is refused before it is read), at most 64 MiB, strict JSON (no NaN, no key
  twice in one object), every field of exactly the type the schema says
  (``"version": true`` or ``1.0`` is not version 1, ``"twins": 1`` is not true),
  every step checked — so a damaged or hostile file is refused with one clear
  reason before anything runs. It is parsed with ``json``, never pickle or ``eval``.
* **Say what will be built, then build it.** Replay prints what it is about to build
  (``replaying against TARGET (recorded in the trace)``, and the reference, the
  machine and the model when there are any) before importing or calling any of it.
* **Build recorded code only where it is the user's own.** The code a trace names —
  its engine ``target``, its ``reference``, the ``machine`` and ``model`` of an
  extended run — is built only if

  1. it is bundled with shardkit (``shardkit:FakeShardEngine``, ``shardkit.engines…``;
     a target must then be a shardkit engine, a machine a ``ShardMachine``, a model a
     ``ReferenceModel``); or
  2. its code lies inside the current folder's tree — the project replay is run
     from — and not in an installed-packages folder (``site-packages``, a virtual
     environment) there: for ``path/to/file.py:attr`` the file; for ``module:attr``
     the file of the module and of each package above it, found on ``sys.path``,
     then in the current folder, then in the folder the trace recorded, by the
     path finder alone, without importing or running anything (a module that cannot
     be found that way, such as a built-in module, counts as outside); and what the
     name reaches is not a built-in or standard-library function or class (as
     ``project_module:os.abort`` would be); or
  3. the user chose it: ``--engine TARGET`` (``target=``) replays against an engine the
     user names, and ``--trust`` (``trust=True``) builds what the trace names wherever
     it is. A generated regression test passes ``trust=True``: it is a Python file the
     user chose to run.

  Anything else stops the replay with ``UntrustedTarget`` (exit 2), which names the
  target, where its code is, and the fixes: run replay from the project folder, pass
  ``--trust``, or name the engine with ``--engine``.
* **``--engine`` replaces the target and the reference.** Replaying against an engine
  the user names builds the twins from that engine: the recorded reference is not
  built unless ``reference=`` is passed too. A recorded machine is still needed for
  its custom operations and follows the rule above.
* **Remote targets connect rather than run code here.** ``unix:PATH`` and ``grpc://``
  on a loopback address (``localhost``, ``127.0.0.0/8``, ``[::1]``) replay as recorded;
  ``grpc://`` to any other host needs ``--trust`` or ``--engine``, so that a trace
  cannot make replay send requests to a machine the user did not choose.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import ipaddress
import json
import math
import os
import stat
import sys
import sysconfig
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import FAULT_KINDS, LoadRequest, ShardEngine
from .driver import CustomOp, Driver, StepFailed, StepRecord, Violation
from .errors import InvalidTarget, TraceFormatError, UntrustedTarget
from .isolation import IsolationOptions, target_with_options
from .model import ReferenceModel
from .steps import Action, known_malformations
from .targets import EngineFactory, ResolvedTarget, resolve_target
from .trace import TRACE_FORMAT, TRACE_VERSION, find_module_spec

__all__ = [
    "MAX_TRACE_BYTES",
    "RECORDED",
    "PreparedReplay",
    "ReplayResult",
    "Trace",
    "load_trace",
    "prepare_replay",
    "read_trace",
    "replay",
]

MAX_TRACE_BYTES = 64 * 1024 * 1024
MAX_STEPS = 100_000
MAX_TOKENS = 65_536
MAX_TEXT = 65_536
MAX_INT = 2**64
MAX_DELAY_SECONDS = 10.0
MAX_RECIPE_KEYS = 256
BEFORE_LOAD_CALLS = ("prefill", "decode", "cancel", "release", "health")
#: Keys that say where a recorded name's code lives (see ``shardkit.trace.code_location``).
LOCATION_KEYS = tuple(
    f"{role}_{kind}" for role in ("target", "reference", "machine", "model") for kind in ("file", "path")
)


class _Recorded(enum.Enum):
    RECORDED = "recorded"


#: ``replay(reference=RECORDED)``: the reference the trace records, unless ``target`` is given.
RECORDED = _Recorded.RECORDED


@dataclass(frozen=True)
class Trace:
    path: Path
    target: str
    load_request: LoadRequest
    faults: frozenset[str]
    twins: bool
    reference: str | None
    seed: int | None
    actions: tuple[Action, ...]
    failure: Violation
    #: How the engine ran when the failure was found: in a worker process, or in-process (None).
    isolation: IsolationOptions | None = None
    #: The extended machine (``module:QualName``) whose custom operations the steps use, if any.
    machine: str | None = None
    #: The reference model factory (``module:QualName``) of the run, if not the machine's own.
    model: str | None = None
    #: Why this trace replays only from Python (its machine or model cannot be imported by name).
    needs_python: str | None = None
    #: Where recorded code lives: ``target_file``, ``target_path``, ``reference_file``, ... (absolute).
    locations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayResult:
    trace: Trace
    records: tuple[StepRecord, ...]
    failure: Violation | None

    @property
    def reproduced(self) -> bool:
        """The replay ended in a violation of the same property the trace recorded."""
        return self.failure is not None and self.failure.property == self.trace.failure.property


class _Schema:
    """Field checks that name the path of the bad value in the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> TraceFormatError:
        return TraceFormatError(f"{self.path}: {where} {problem}")

    def field(self, document: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in document:
            raise self.fail(where, f"has no {key!r}")
        return document[key]

    def object(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be an object, got {_kind(value)}")
        return value

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise self.fail(where, f"must be a string of at most {MAX_TEXT} characters, got {_short(value)}")
        return value

    def optional_text(self, document: Mapping[str, Any], key: str) -> str | None:
        value = document.get(key)
        return None if value is None else self.text(value, key)

    def integer(self, value: Any, where: str, low: int = -MAX_INT, high: int = MAX_INT) -> int:
        # type() is int exactly: JSON's true is a bool, which Python counts as an int.
        if type(value) is not int or not low <= value <= high:
            raise self.fail(where, f"must be an integer in [{low}, {high}], got {_short(value)}")
        return value

    def number(self, value: Any, where: str, low: float, high: float) -> float:
        if type(value) not in (int, float) or not low <= value <= high:
            raise self.fail(where, f"must be a number in [{low}, {high}], got {_short(value)}")
        return float(value)

    def tokens(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > MAX_TOKENS:
            raise self.fail(where, f"must be a list of at most {MAX_TOKENS} token ids")
        return tuple(self.integer(token, f"{where}[{index}]") for index, token in enumerate(value))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return "true or false" if isinstance(value, bool) else type(value).__name__


def _reject_constant(name: str) -> Any:
    message = f"holds {name}, which is not JSON"
    raise ValueError(message)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: a repeated key would hide one of its values."""
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            message = f"the key {_short(key)} appears twice in one object; a trace never repeats a key"
            raise ValueError(message)
        document[key] = value
    return document


_NOT_REGULAR = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_unless_regular(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
    message = f"{path} is {kind}, not a trace file; pass the path of a .json trace shardkit fuzz wrote"
    raise TraceFormatError(message)


def _read_bytes(path: Path) -> bytes:
    """At most ``MAX_TRACE_BYTES`` of a regular file: what is not one is refused before it is read."""
    try:
        _refuse_unless_regular(path, os.stat(path).st_mode)
        # O_NONBLOCK: were the path swapped for a FIFO after the stat, opening it must not hang;
        # fstat then checks the file actually opened.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        handle = os.open(path, flags)
    except OSError as error:
        message = f"cannot read trace {path}: {error.strerror or error}"
        raise TraceFormatError(message) from None
    try:
        opened = os.fstat(handle)
        _refuse_unless_regular(path, opened.st_mode)
        if opened.st_size > MAX_TRACE_BYTES:
            message = f"{path}: {opened.st_size} bytes is larger than a trace may be ({MAX_TRACE_BYTES})"
            raise TraceFormatError(message)
        chunks: list[bytes] = []
        left = MAX_TRACE_BYTES + 1
        while left > 0:
            chunk = os.read(handle, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as error:
        message = f"cannot read trace {path}: {error.strerror or error}"
        raise TraceFormatError(message) from None
    finally:
        os.close(handle)
    data = b"".join(chunks)
    if len(data) > MAX_TRACE_BYTES:
        message = f"{path} grew past the {MAX_TRACE_BYTES} bytes a trace may have while it was read"
        raise TraceFormatError(message)
    return data


def _parse(path: Path) -> Mapping[str, Any]:
    data = _read_bytes(path)
    text = ""
    try:
        text = data.decode("utf-8")
        document = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError:
        message = f"{path} is not UTF-8 text; is it a shardkit trace?"
        raise TraceFormatError(message) from None
    except json.JSONDecodeError as error:
        # The decoder stops at the end of the text, or reports a string that never closes
        # (it only says so on reaching the end): either way the file was cut short.
        cut_short = error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string")
        hint = " (the file looks truncated)" if cut_short else ""
        message = f"{path} is not valid JSON{hint}: {error.msg} (line {error.lineno}, column {error.colno})"
        raise TraceFormatError(message) from None
    except RecursionError:
        message = f"{path}: JSON nested too deeply to be a shardkit trace"
        raise TraceFormatError(message) from None
    except ValueError as error:  # NaN/Infinity, a repeated key, or an integer with too many digits
        message = f"{path}: {error}"
        raise TraceFormatError(message) from None
    if not isinstance(document, dict):
        message = f"{path}: a trace is a JSON object, got {type(document).__name__}"
        raise TraceFormatError(message)
    return document


def read_trace(path: str | Path, custom_ops: Mapping[str, CustomOp] | None = None) -> Trace:
    """Read and validate a trace as data, importing nothing; ``TraceFormatError`` names the first problem.

    Steps of operations a recorded ``machine`` adds are checked when that machine is
    built (``load_trace``, ``replay``), unless ``custom_ops`` is given.
    """
    path = Path(path)
    document = _parse(path)
    schema = _Schema(path)
    kind = document.get("format")
    if kind != TRACE_FORMAT:
        message = f"{path} is not a shardkit trace (format {_short(kind)}, expected {TRACE_FORMAT!r})"
        raise TraceFormatError(message)
    version = document.get("version")
    if type(version) is not int or version != TRACE_VERSION:
        message = (
            f"{path} is a version {_short(version)} trace; this shardkit reads version {TRACE_VERSION} "
            "(replay it with the shardkit version that wrote it)"
        )
        raise TraceFormatError(message)
    schema.optional_text(document, "shardkit_version")
    target = schema.text(schema.field(document, "target", "the trace"), "target")
    load_request = _load_request(schema, schema.field(document, "load_request", "the trace"))
    role = document.get("role")
    if role is not None and role != load_request.role:
        raise schema.fail("role", f"is {_short(role)}, but load_request is a {load_request.role} shard")
    faults_field = document.get("faults_enabled", [])
    if not isinstance(faults_field, list) or not all(isinstance(k, str) and k in FAULT_KINDS for k in faults_field):
        message = f"{path}: faults_enabled must be a list of {list(FAULT_KINDS)}, got {_short(faults_field)}"
        raise TraceFormatError(message)
    twins = document.get("twins", True)
    if not isinstance(twins, bool):
        raise schema.fail("twins", f"must be true or false, got {_short(twins)}")
    reference = schema.optional_text(document, "reference")
    seed = document.get("seed")
    if seed is not None:
        seed = schema.integer(seed, "seed", 0, MAX_INT)
    isolation = _isolation(schema, document.get("isolate"))
    machine = _code_name(schema, document, "machine")
    model = _code_name(schema, document, "model")
    needs_python = schema.optional_text(document, "needs_python")
    locations = {key: _absolute(schema, document, key) for key in LOCATION_KEYS if document.get(key) is not None}
    fault_steps = document.get("fault_steps", [])
    if not isinstance(fault_steps, list) or not all(isinstance(step, dict) for step in fault_steps):
        raise schema.fail("fault_steps", f"must be a list of objects, got {_short(fault_steps)}")
    steps = schema.field(document, "steps", "the trace")
    if not isinstance(steps, list) or not 0 < len(steps) <= MAX_STEPS:
        message = f"{path}: steps must be a non-empty list of at most {MAX_STEPS} steps"
        raise TraceFormatError(message)
    # Without the caller's custom_ops, a recorded machine's operations are checked once it is built.
    deferred = custom_ops is None and machine is not None
    context = _StepContext(custom_ops or {}, deferred, needs_python)
    actions = tuple(_action(schema, step, index, context) for index, step in enumerate(steps, start=1))
    failure = schema.object(schema.field(document, "failure", "the trace"), "failure")
    violation = Violation(
        schema.text(schema.field(failure, "property", "failure"), "failure.property"),
        schema.text(schema.field(failure, "message", "failure"), "failure.message"),
    )
    if failure.get("step") is not None:
        schema.integer(failure["step"], "failure.step", 0, MAX_STEPS)
    return Trace(
        path,
        target,
        load_request,
        frozenset(faults_field),
        twins,
        reference,
        seed,
        actions,
        violation,
        isolation,
        machine,
        model,
        needs_python,
        locations,
    )


def load_trace(path: str | Path, custom_ops: Mapping[str, CustomOp] | None = None, *, trust: bool = False) -> Trace:
    """Read and validate a trace; ``TraceFormatError`` names the first problem.

    A trace that records an extended ``machine`` has its custom steps checked against that
    machine's ``custom_ops``, which imports it: it follows this module's trust rule
    (``UntrustedTarget`` unless it is inside the current project or ``trust`` is true).
    Pass ``custom_ops`` to check them against yours instead. ``read_trace`` imports nothing.
    """
    trace = read_trace(path, custom_ops)
    if custom_ops is None and trace.machine is not None:
        admitted = _admit(trace, "machine", trace.machine, trust)
        _check_custom_steps(trace, _build_machine(trace, admitted).custom_ops)
    return trace


def _load_request(schema: _Schema, value: Any) -> LoadRequest:
    load = schema.object(value, "load_request")
    total = schema.integer(schema.field(load, "total_layers", "load_request"), "load_request.total_layers", 1, 2**16)
    start = schema.integer(schema.field(load, "shard_start", "load_request"), "load_request.shard_start", 0, total - 1)
    end = schema.integer(schema.field(load, "shard_end", "load_request"), "load_request.shard_end", start, total - 1)
    model_id = schema.text(schema.field(load, "model_id", "load_request"), "load_request.model_id")
    recipe = schema.object(load.get("recipe", {}), "load_request.recipe")
    if len(recipe) > MAX_RECIPE_KEYS:
        raise schema.fail("load_request.recipe", f"has {len(recipe)} keys, more than {MAX_RECIPE_KEYS}")
    for key, item in recipe.items():
        if isinstance(item, str):
            schema.text(item, f"load_request.recipe.{key}")
        elif item is not None and type(item) not in (bool, int, float):
            raise schema.fail(
                f"load_request.recipe.{key}", f"must be a string, number, true/false or null, got {_short(item)}"
            )
    return LoadRequest(model_id, start, end, total, recipe)


def _code_name(schema: _Schema, document: Mapping[str, Any], key: str) -> str | None:
    name = schema.optional_text(document, key)
    if name is not None and not name.rpartition(":")[0]:
        raise schema.fail(key, f"must name a class as 'module:QualName', got {_short(name)}")
    return name


def _absolute(schema: _Schema, document: Mapping[str, Any], key: str) -> str:
    where = schema.text(document[key], key)
    if not Path(where).is_absolute():
        raise schema.fail(key, f"must be an absolute path, got {_short(where)}")
    return where


def _isolation(schema: _Schema, value: Any) -> IsolationOptions | None:
    if value is None:
        return None
    options = schema.object(value, "isolate")
    timeout = schema.number(schema.field(options, "step_timeout", "isolate"), "isolate.step_timeout", 1e-3, 3600.0)
    memory = options.get("worker_memory_mb")
    if memory is not None:
        memory = schema.integer(memory, "isolate.worker_memory_mb", 1, 2**40)
    return IsolationOptions(timeout, memory)


@dataclass(frozen=True)
class _StepContext:
    custom_ops: Mapping[str, CustomOp]
    #: Unknown operations are kept for the recorded machine to check.
    deferred: bool
    needs_python: str | None


def _action(schema: _Schema, step: Any, index: int, context: _StepContext) -> Action:
    where = f"step {index}"
    step = schema.object(step, where)
    op = schema.text(schema.field(step, "op", where), f"{where}.op")
    args = schema.object(step.get("args", {}), f"{where}.args")
    note = schema.text(step.get("note", ""), f"{where}.note")
    for key in ("expected", "observed"):
        if key in step:
            schema.text(step[key], f"{where}.{key}")
    if op in context.custom_ops:
        return Action(op, dict(args), note)
    checked = _ARGUMENT_CHECKS.get(op)
    if checked is None and context.deferred:
        return Action(op, dict(args), note)
    if checked is None:
        known = sorted([*_ARGUMENT_CHECKS, *context.custom_ops])
        why = (
            f"this trace replays only from Python: {context.needs_python}"
            if context.needs_python
            else "a backend's own operation replays from Python with replay(..., custom_ops=...)"
        )
        message = (
            f"{schema.path}: {where} has op {_short(op)}, which this shardkit does not know (known: {known}); {why}"
        )
        raise TraceFormatError(message)
    return Action(op, checked(schema, args, f"{where}.args"), note)


def _check_custom_steps(trace: Trace, custom_ops: Mapping[str, CustomOp]) -> None:
    for index, action in enumerate(trace.actions, start=1):
        if action.op not in _ARGUMENT_CHECKS and action.op not in custom_ops:
            known = sorted([*_ARGUMENT_CHECKS, *custom_ops])
            message = (
                f"{trace.path}: step {index} has op {_short(action.op)}, which neither this shardkit nor the "
                f"recorded machine {trace.machine} knows (known: {known})"
            )
            raise TraceFormatError(message)


def _step_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    malformed = args.get("malformed")
    if malformed is not None and (not isinstance(malformed, str) or malformed not in known_malformations()):
        raise schema.fail(f"{where}.malformed", f"is {_short(malformed)}, not a known malformation")
    return {
        "session": schema.text(schema.field(args, "session", where), f"{where}.session"),
        "epoch": schema.integer(schema.field(args, "epoch", where), f"{where}.epoch"),
        "step": schema.integer(schema.field(args, "step", where), f"{where}.step"),
        "tokens": schema.tokens(schema.field(args, "tokens", where), f"{where}.tokens"),
        "malformed": malformed,
    }


def _cancel_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {
        "session": schema.text(schema.field(args, "session", where), f"{where}.session"),
        "epoch": schema.integer(schema.field(args, "epoch", where), f"{where}.epoch"),
    }


def _release_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"session": schema.text(schema.field(args, "session", where), f"{where}.session")}


def _unloaded_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    call = schema.field(args, "call", where)
    if not isinstance(call, str) or call not in BEFORE_LOAD_CALLS:
        raise schema.fail(f"{where}.call", f"must be one of {list(BEFORE_LOAD_CALLS)}, got {_short(call)}")
    checked: dict[str, Any] = {"call": call, "session": schema.text(args.get("session", "a"), f"{where}.session")}
    if call in ("prefill", "decode"):
        checked.update(_step_args(schema, {**args, "malformed": None}, where))
        del checked["malformed"]
    return checked


def _fault_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = schema.field(args, "kind", where)
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise schema.fail(f"{where}.kind", f"must be one of {list(FAULT_KINDS)}, got {_short(kind)}")
    limits = {"delay": MAX_DELAY_SECONDS, "memory_pressure": 2.0**40, "malformed_output": 0.0, "crash": 1e6}
    value = schema.number(schema.field(args, "value", where), f"{where}.value", 0.0, limits[kind])
    if not math.isfinite(value):
        raise schema.fail(f"{where}.value", "must be finite")
    return {"kind": kind, "value": value}


_ARGUMENT_CHECKS: dict[str, Callable[[_Schema, Mapping[str, Any], str], dict[str, Any]]] = {
    "prefill": _step_args,
    "decode": _step_args,
    "cancel": _cancel_args,
    "release": _release_args,
    "health": lambda schema, args, where: {},
    "unloaded": _unloaded_args,
    "fault": _fault_args,
}


# --- the trust rule --------------------------------------------------------------------------

_ROLE_WORDS = {"target": "engine target", "reference": "reference", "machine": "machine", "model": "model"}


@dataclass(frozen=True)
class _Admitted:
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
        return f"{self.recorded} (recorded in the trace{where})"


def _project() -> Path:
    return Path.cwd().resolve()


def _installed(path: Path) -> bool:
    """Under site-packages, or inside a Python installation or virtual environment."""
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    prefixes = {Path(prefix).resolve() for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return any(path.is_relative_to(prefix) for prefix in prefixes if not _project().is_relative_to(prefix))


def _inside_project(path: Path) -> bool:
    path = path.resolve()
    return path.is_relative_to(_project()) and not _installed(path)


def _bundled(module: str) -> bool:
    return module == "shardkit" or module.startswith("shardkit.")


def _untrusted(trace: Trace, role: str, name: str, where: str) -> UntrustedTarget:
    fixes = "run shardkit replay from the project folder that holds it, or pass --trust (trust=True) to build it anyway"
    if role in ("target", "reference"):
        fixes += ", or replay against an engine you name with --engine TARGET (target=...)"
    message = (
        f"{trace.path} names the {_ROLE_WORDS[role]} {name!r}, whose code is {where}; replay builds recorded "
        f"code only from inside the current project ({_project()}) unless you choose it: {fixes}"
    )
    return UntrustedTarget(message)


def _admit(trace: Trace, role: str, name: str, trust: bool) -> _Admitted:
    """Decide whether replay may build the recorded ``name`` (see the module docstring); imports nothing."""
    if name.startswith(("grpc://", "unix:")):
        if not (trust or _local_address(name)):
            raise _untrusted(trace, role, name, "a server on another machine")
        return _Admitted(role, name, name, trusted=trust)
    module, colon, attr = name.rpartition(":")
    if not colon or not module or not attr:
        return _Admitted(role, name, name, trusted=trust)  # not a target name at all: resolve_target refuses it
    if module.endswith(".py"):
        return _admit_file(trace, role, name, module, attr, trust)
    if _bundled(module):
        return _Admitted(role, name, name, trusted=trust)
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
                return _Admitted(role, name, name, trusted=True)
            kind = final.origin if final.origin in ("built-in", "frozen") else "namespace"
            raise _untrusted(trace, role, name, f"the {kind} module {module!r}, not a file in the current project")
        origins = [Path(spec.origin).resolve() for _, spec in specs if spec.origin and Path(spec.origin).is_file()]
        outside = [origin for origin in origins if not _inside_project(origin)]
        if outside and not trust:
            shown = origins[-1] if origins[-1] in outside else outside[0]
            kind = "an installed or standard-library module at" if _installed(shown) else "at"
            raise _untrusted(trace, role, name, f"{kind} {shown}, outside the current project")
        top = module.split(".")[0]
        if entry is None and top not in sys.modules and find_module_spec(top, list(sys.path)) is None:
            entry = os.getcwd()  # found in the current folder, which is not on sys.path (a console script)
        return _Admitted(role, name, name, origins[-1], entry, tuple(specs), trusted=trust)
    if trust:
        return _Admitted(role, name, name, trusted=True)  # an importer of its own may provide it
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


def _admit_file(trace: Trace, role: str, name: str, module: str, attr: str, trust: bool) -> _Admitted:
    recorded_file = trace.locations.get(f"{role}_file")
    # The file the run used, if it is still there; else the name as recorded, from here.
    candidates = [Path(recorded_file)] if recorded_file is not None else []
    candidates.append(Path(module))
    chosen = next((candidate for candidate in candidates if candidate.is_file()), None)
    if chosen is None:
        return _Admitted(role, name, name, trusted=trust)  # resolve_target says there is no file there
    origin = chosen.resolve()
    if not _inside_project(origin) and not trust:
        raise _untrusted(trace, role, name, f"the file {origin}, outside the current project")
    return _Admitted(role, name, f"{origin}:{attr}", origin, trusted=trust)


def _local_address(name: str) -> bool:
    if name.startswith("unix:"):
        return True
    host = name.removeprefix("grpc://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_admitted(admitted: _Admitted) -> None:
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


def _resolve_admitted(trace: Trace, admitted: _Admitted) -> object:
    """Import an admitted name and return the object it names, checked to be what its role builds
    (None for a remote address, which imports nothing)."""
    if admitted.name.startswith(("grpc://", "unix:")):
        return None
    _import_admitted(admitted)
    if admitted.role in ("target", "reference"):
        built = resolve_target(admitted.name).build
    else:
        try:
            built = resolve_target(admitted.name).build
        except InvalidTarget as error:
            message = f"{trace.path}: the recorded {admitted.role} cannot be built: {error}"
            raise TraceFormatError(message) from error
    if not admitted.trusted:
        _check_defined_inside(trace, admitted, built)
    return built


def _check_defined_inside(trace: Trace, admitted: _Admitted, value: object) -> None:
    """What a trusted name reaches must not be the standard library's, as ``project_module:os.abort``
    or ``project_module:exit`` would be; and a shardkit name must be a kit engine, machine or model."""
    from .machine import ShardMachine

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


def _build_machine(trace: Trace, admitted: _Admitted) -> Any:
    from .machine import ShardMachine

    machine = _resolve_admitted(trace, admitted)
    if not (isinstance(machine, type) and issubclass(machine, ShardMachine)):
        message = f"{trace.path}: machine {trace.machine!r} is a {type(machine).__name__}, not a ShardMachine subclass"
        raise TraceFormatError(message)
    return machine


# --- replaying -------------------------------------------------------------------------------


@dataclass
class PreparedReplay:
    """A trace whose engine is built and loaded, ready to run its steps; close it when done.

    Everything that can fail before the first step — a damaged trace, a target that is not
    trusted, cannot be imported, or refuses the recorded load request — has failed by now,
    so a failure of ``run`` is the engine's."""

    trace: Trace
    driver: Driver
    engine: ResolvedTarget
    #: What was built, one line (``replaying against TARGET (recorded in the trace)``).
    description: str
    owns_engine: bool = True

    def run(self) -> ReplayResult:
        for action in self.trace.actions:
            try:
                self.driver.execute(action)
            except StepFailed as failed:
                return ReplayResult(self.trace, tuple(self.driver.records), failed.violation)
        return ReplayResult(self.trace, tuple(self.driver.records), None)

    def close(self) -> None:
        if self.engine.isolation is not None and self.owns_engine:
            self.engine.isolation.close()

    def __enter__(self) -> PreparedReplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def replay(
    trace_path: str | Path,
    target: str | EngineFactory | None = None,
    *,
    reference: str | EngineFactory | _Recorded | None = RECORDED,
    model: Callable[[], ReferenceModel] | None = None,
    custom_ops: Mapping[str, CustomOp] | None = None,
    isolate: bool | IsolationOptions | None = None,
    trust: bool = False,
    announce: Callable[[str], object] | None = None,
) -> ReplayResult:
    """Re-run a trace's steps without Hypothesis, against its recorded target or ``target``.

    Code the trace names is built only under this module's trust rule: bundled with
    shardkit, inside the current project, named by you (``target``), or ``trust=True``.
    ``target`` replaces the recorded reference too (the twins come from ``target``) unless
    ``reference`` is given. A trace of an extended machine rebuilds that machine's custom
    operations and model unless ``custom_ops`` and ``model`` are given. ``announce`` is
    called with one line saying what will be built, before anything is.

    The engine runs as it ran when the failure was found: in a worker process if the
    trace records ``isolate``. ``isolate`` overrides that: False runs it in-process,
    True or ``IsolationOptions`` in a worker; the worker ends with the replay.

    Raises ``TraceFormatError`` for a file that is not a valid trace, ``UntrustedTarget``
    for recorded code the rule does not let it build, and ``InvalidTarget`` for a target
    that cannot be built or refuses the recorded load request.
    """
    with prepare_replay(
        trace_path,
        target,
        reference=reference,
        model=model,
        custom_ops=custom_ops,
        isolate=isolate,
        trust=trust,
        announce=announce,
    ) as prepared:
        return prepared.run()


def prepare_replay(
    trace_path: str | Path,
    target: str | EngineFactory | None = None,
    *,
    reference: str | EngineFactory | _Recorded | None = RECORDED,
    model: Callable[[], ReferenceModel] | None = None,
    custom_ops: Mapping[str, CustomOp] | None = None,
    isolate: bool | IsolationOptions | None = None,
    trust: bool = False,
    announce: Callable[[str], object] | None = None,
) -> PreparedReplay:
    """``replay`` up to its first step: the trace read, the engine built and loaded.

    A generated regression test builds it in a fixture, so that an engine that cannot
    be built is a setup error, never the bug reproducing."""
    trace = read_trace(trace_path, custom_ops)
    if trace.needs_python is not None and custom_ops is None and model is None:
        message = f"{trace.path} cannot be replayed by name: {trace.needs_python}"
        raise TraceFormatError(message)
    # Decide everything that will be built, and say so, before building any of it.
    engine_admitted = _admit(trace, "target", trace.target, trust) if target is None else None
    reference_admitted = None
    if reference is RECORDED:
        reference = None
        if target is None and trace.reference is not None:
            reference_admitted = _admit(trace, "reference", trace.reference, trust)
    want_machine = custom_ops is None or (model is None and trace.model is None)
    machine_admitted = _admit(trace, "machine", trace.machine, trust) if want_machine and trace.machine else None
    model_admitted = _admit(trace, "model", trace.model, trust) if model is None and trace.model else None
    isolation = trace.isolation if isolate is None else isolate
    description = _describe(
        trace, target, engine_admitted, reference, reference_admitted, machine_admitted, model_admitted, isolation
    )
    if announce is not None:
        announce(description)

    if machine_admitted is not None:
        machine = _build_machine(trace, machine_admitted)
        if custom_ops is None:
            custom_ops = machine.custom_ops
            _check_custom_steps(trace, machine.custom_ops)
        if model is None and model_admitted is None:
            model = machine.model_factory
    if model_admitted is not None:
        built_model = _resolve_admitted(trace, model_admitted)
        if not callable(built_model):
            message = f"{trace.path}: the recorded model {trace.model!r} is not callable"
            raise TraceFormatError(message)
        model = built_model
    chosen: str | EngineFactory
    if engine_admitted is not None:
        _resolve_admitted(trace, engine_admitted)  # imports it from the checked files; refuses a name reaching out
        chosen = engine_admitted.name
    else:
        assert target is not None
        chosen = target
    reference_target: ResolvedTarget | None = None
    if reference_admitted is not None:
        _resolve_admitted(trace, reference_admitted)
        reference_target = resolve_target(reference_admitted.name)
    elif reference is not None:
        reference_target = resolve_target(reference)
    if reference_target is not None:
        _probe_reference(trace, reference_target)
    engine = _engine(trace, chosen, isolate)
    owns_engine = engine is not target
    try:
        driver = Driver(
            engine,
            trace.load_request,
            faults=trace.faults,
            twins=trace.twins,
            reference=reference_target,
            model_factory=model or ReferenceModel,
            custom_ops=custom_ops,
        )
    except BaseException as error:
        if engine.isolation is not None and owns_engine:
            engine.isolation.close()
        if isinstance(error, (InvalidTarget, UntrustedTarget)) or not isinstance(error, Exception):
            raise
        message = (
            f"the engine {engine.name} could not be built and loaded for the replay of {trace.path}: "
            f"{type(error).__name__}: {error}"
        )
        raise InvalidTarget(message) from error
    return PreparedReplay(trace, driver, engine, description, owns_engine)


def _engine(trace: Trace, chosen: str | EngineFactory, isolate: bool | IsolationOptions | None) -> ResolvedTarget:
    isolation = trace.isolation if isolate is None else isolate
    if isolation is True:
        isolation = trace.isolation or IsolationOptions()
    if isolate is None and isinstance(isolation, IsolationOptions) and _remote(chosen):
        # Already in another process: keep the recorded deadline, there is nothing to isolate.
        return target_with_options(chosen, step_timeout=isolation.step_timeout)
    return target_with_options(chosen, isolate=isolation or False)


def _probe_reference(trace: Trace, reference: ResolvedTarget) -> None:
    """Build and load the reference once, so that a broken one is named as such, not as the engine's failure."""
    try:
        probe = reference()
        loaded = probe.load(trace.load_request)
    except Exception as error:
        message = f"the reference {reference.name} could not be built and loaded for the replay: {type(error).__name__}: {error}"
        raise InvalidTarget(message) from error
    if not loaded.status.ok:
        message = (
            f"the reference {reference.name} refused {trace.load_request}: "
            f"{loaded.status.code.name} {loaded.status.message}"
        )
        raise InvalidTarget(message)


def _describe(
    trace: Trace,
    target: str | EngineFactory | None,
    engine: _Admitted | None,
    reference: str | EngineFactory | None,
    reference_admitted: _Admitted | None,
    machine: _Admitted | None,
    model: _Admitted | None,
    isolation: bool | IsolationOptions | None,
) -> str:
    if engine is not None:
        text = f"replaying against {engine.describe()}"
    else:
        name = target if isinstance(target, str) else resolve_target(target).name if target is not None else "?"
        text = f"replaying against {name} (named by you)"
    if reference_admitted is not None:
        text += f", twins from the reference {reference_admitted.describe()}"
    elif reference is not None:
        text += f", twins from the reference {resolve_target(reference).name} (named by you)"
    elif trace.reference is not None:
        text += f", twins from the engine itself (the recorded reference {trace.reference} is not built)"
    if machine is not None:
        text += f", machine {machine.describe()}"
    if model is not None:
        text += f", model {model.describe()}"
    if isolation:
        text += ", in a worker process"
    return text


def _remote(target: object) -> bool:
    name = target if isinstance(target, str) else getattr(target, "name", "")
    return isinstance(name, str) and name.startswith(("grpc://", "unix:"))
