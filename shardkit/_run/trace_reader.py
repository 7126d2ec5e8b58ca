"""Reading a trace file as untrusted input: the file, the JSON and the schema.

A trace can come from anywhere, so it is data until proven a trace. This module owns
that proof and nothing else: it imports and runs no code the trace names. What
replay may then build from the names it holds is ``shardkit._run.trust``'s decision;
running the steps is ``shardkit._run.replay``'s. Kept apart so that the parser, which
every damaged or hostile file reaches, can be read and tested without the code that
imports anything.

* **Read as data first.** ``shardkit replay TRACE`` reads the trace before anything
  else: only a regular file (a FIFO, a device such as ``/dev/zero``, a folder or a
  socket is refused before it is read), at most 64 MiB, strict JSON (no NaN, no key
  twice in one object), every field of exactly the type the schema says
  (``"version": true`` or ``1.0`` is not version 1, ``"twins": 1`` is not true),
  every step checked — so a damaged or hostile file is refused with one clear
  reason before anything runs. It is parsed with ``json``, never pickle or ``eval``.
* **Bounded.** What a trace may ask of the replay is bounded too: steps, tokens, the
  lanes of a parallel phase, each delay fault and the delay faults in all
  (``MAX_TOTAL_DELAY_SECONDS``), a seed in ``[0, 2**64)``, finite numbers only (``1e999``
  reads as infinity and is refused as NaN is).

``read_regular_file`` is the file half of this, shared with ``shardkit report``, which
reads a user's file the same way.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shardkit._core.driver import CustomOp, Violation
from shardkit._core.outcomes import TRACE_TEXT_LIMIT
from shardkit._core.steps import BEFORE_LOAD_CALLS, PARALLEL_OP, Action, known_malformations, phase_action
from shardkit._core.targets import IsolationOptions
from shardkit._parallel.phase import PARALLEL_OPS
from shardkit._run.trace import TRACE_FORMAT, TRACE_VERSION
from shardkit.contract import FAULT_KINDS, LoadRequest
from shardkit.errors import TraceFormatError

__all__ = [
    "LOCATION_KEYS",
    "MAX_TOTAL_DELAY_SECONDS",
    "MAX_TRACE_BYTES",
    "Trace",
    "check_custom_steps",
    "read_regular_file",
    "read_trace",
]

MAX_TRACE_BYTES = 64 * 1024 * 1024
MAX_STEPS = 100_000
MAX_TOKENS = 65_536
MAX_TEXT = TRACE_TEXT_LIMIT
MAX_INT = 2**64
MAX_DELAY_SECONDS = 10.0
#: The delay faults of one trace, added up: replay waits them out, one run after another.
MAX_TOTAL_DELAY_SECONDS = 60.0
MAX_RECIPE_KEYS = 256
#: A parallel phase's lanes, and the steps of one lane.
MAX_LANES = 8
MAX_LANE_STEPS = 1_000
#: Keys that say where a recorded name's code lives (see ``shardkit._run.trace.code_location``).
LOCATION_KEYS = tuple(
    f"{role}_{kind}" for role in ("target", "reference", "machine", "model") for kind in ("file", "path")
)


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


def _refuse_unless_regular(path: Path, mode: int, noun: str, fix: str, error: Callable[[str], Exception]) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
    raise error(f"{path} is {kind}, not a {noun} file; {fix}")


def read_regular_file(
    path: Path, *, limit: int, noun: str, fix: str, error: Callable[[str], Exception] = TraceFormatError
) -> bytes:
    """At most ``limit`` bytes of a regular file: a FIFO, a device (``/dev/zero``), a folder
    or a socket is refused before it is opened for reading, a file larger than ``limit``
    before a byte is read. Every refusal is ``error(one line)``, naming the file as a
    ``noun`` ("trace", "report") and ending with ``fix``. Shared by every command that reads
    a file a user names: ``shardkit replay`` (a trace), ``shardkit report`` (a run report)."""
    try:
        _refuse_unless_regular(path, os.stat(path).st_mode, noun, fix, error)
        # O_NONBLOCK: were the path swapped for a FIFO after the stat, opening it must not hang;
        # fstat then checks the file actually opened.
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        handle = os.open(path, flags)
    except OSError as failed:
        raise error(f"cannot read {noun} {path}: {failed.strerror or failed}; {fix}") from None
    try:
        opened = os.fstat(handle)
        _refuse_unless_regular(path, opened.st_mode, noun, fix, error)
        if opened.st_size > limit:
            raise error(f"{path}: {opened.st_size} bytes is larger than a {noun} may be ({limit}); {fix}")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(handle, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as failed:
        raise error(f"cannot read {noun} {path}: {failed.strerror or failed}; {fix}") from None
    finally:
        os.close(handle)
    data = b"".join(chunks)
    if len(data) > limit:
        raise error(f"{path} grew past the {limit} bytes a {noun} may have while it was read; {fix}")
    return data


#: What a file that is not a trace is asked to be instead.
_TRACE_FIX = "pass the path of a .json trace shardkit fuzz wrote"


def _parse(path: Path) -> Mapping[str, Any]:
    data = read_regular_file(path, limit=MAX_TRACE_BYTES, noun="trace", fix=_TRACE_FIX)
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
        if kind is None and "failures" in document and "coverage" in document:
            # A run's --report names its traces; the report itself is drawn, not replayed.
            message += "; it is a run report: replay a trace its failures name, or draw it with `shardkit report`"
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
    if seed is not None and (type(seed) is not int or not 0 <= seed < MAX_INT):
        # A seed is what `shardkit fuzz --seed` takes: 2**64 itself is one too many.
        raise schema.fail("seed", f"must be an integer in [0, 2**64), got {_short(seed)}; write the seed the run printed, or null")
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
    _check_total_delay(path, actions)
    failure = schema.object(schema.field(document, "failure", "the trace"), "failure")
    violation = Violation(
        schema.text(schema.field(failure, "property", "failure"), "failure.property"),
        schema.text(schema.field(failure, "message", "failure"), "failure.message"),
        schema.text(failure["rows"], "failure.rows") if failure.get("rows") is not None else "",
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


def _check_total_delay(path: Path, actions: Sequence[Action]) -> None:
    """Replay waits out every delay fault (at most ``MAX_DELAY_SECONDS`` each), so a trace of
    many may ask for hours; their sum is capped too, read before anything runs."""
    delays = [float(action.args["value"]) for action in actions if action.op == "fault" and action.args["kind"] == "delay"]
    total = math.fsum(delays)
    if total > MAX_TOTAL_DELAY_SECONDS:
        message = (
            f"{path} holds {len(delays)} delay faults that add up to {total:g} seconds; a trace may wait "
            f"at most {MAX_TOTAL_DELAY_SECONDS:g} seconds in all ({MAX_DELAY_SECONDS:g} a fault): delete delay "
            f"faults or lower their values until they add up to {MAX_TOTAL_DELAY_SECONDS:g} or less"
        )
        raise TraceFormatError(message)


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
        elif type(item) is float and not math.isfinite(item):
            # json reads a number too large for a float (1e999) as infinity, which JSON cannot hold.
            raise schema.fail(
                f"load_request.recipe.{key}",
                f"must be a finite number, got {_short(item)} (a number too large for a float, such as 1e999); "
                "write a finite value",
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


def check_custom_steps(trace: Trace, custom_ops: Mapping[str, CustomOp]) -> None:
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


def _parallel_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    lanes = schema.field(args, "lanes", where)
    if not isinstance(lanes, list) or not 0 < len(lanes) <= MAX_LANES:
        raise schema.fail(f"{where}.lanes", f"must be a list of 1 to {MAX_LANES} lanes, got {_short(lanes)}")
    checked = []
    for lane, steps in enumerate(lanes):
        if not isinstance(steps, list) or not 0 < len(steps) <= MAX_LANE_STEPS:
            raise schema.fail(f"{where}.lanes[{lane}]", f"must be a list of 1 to {MAX_LANE_STEPS} steps, got {_short(steps)}")
        actions = []
        for index, step in enumerate(steps):
            inner = f"{where}.lanes[{lane}][{index}]"
            step = schema.object(step, inner)
            op = step.get("op")
            if op not in PARALLEL_OPS:
                raise schema.fail(f"{inner}.op", f"must be one of {sorted(PARALLEL_OPS)} in a lane, got {_short(op)}")
            inner_args = schema.object(step.get("args", {}), f"{inner}.args")
            note = schema.text(step.get("note", ""), f"{inner}.note")
            actions.append(Action(op, _ARGUMENT_CHECKS[op](schema, inner_args, f"{inner}.args"), note))
        checked.append(tuple(actions))
    return dict(phase_action(checked).args)


_ARGUMENT_CHECKS: Mapping[str, Callable[[_Schema, Mapping[str, Any], str], Mapping[str, Any]]] = MappingProxyType({
    "prefill": _step_args,
    "decode": _step_args,
    "cancel": _cancel_args,
    "release": _release_args,
    "health": lambda schema, args, where: {},
    "unloaded": _unloaded_args,
    "fault": _fault_args,
    PARALLEL_OP: _parallel_args,
})
