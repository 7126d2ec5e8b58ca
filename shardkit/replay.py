"""Replaying a trace file without Hypothesis (SPEC §5).

A trace is plain JSON and is treated as untrusted input: it is parsed with the
standard ``json`` module (never pickle, never ``eval``), and every field is
checked against the schema — types, known operations, bounded sizes — before a
single step runs, so a damaged or hostile file is refused with one clear
reason instead of half-executed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contract import FAULT_KINDS, LoadRequest
from .driver import CustomOp, Driver, StepFailed, StepRecord, Violation
from .errors import TraceFormatError
from .isolation import IsolationOptions, target_with_options
from .model import ReferenceModel
from .steps import Action, known_malformations
from .targets import EngineFactory, resolve_target
from .trace import TRACE_FORMAT, TRACE_VERSION

__all__ = ["ReplayResult", "Trace", "load_trace", "replay"]

MAX_TRACE_BYTES = 64 * 1024 * 1024
MAX_STEPS = 100_000
MAX_TOKENS = 65_536
MAX_TEXT = 65_536
MAX_INT = 2**64
MAX_DELAY_SECONDS = 10.0
BEFORE_LOAD_CALLS = ("prefill", "decode", "cancel", "release", "health")


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
            raise self.fail(where, f"must be an object, got {type(value).__name__}")
        return value

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise self.fail(where, f"must be a string of at most {MAX_TEXT} characters")
        return value

    def integer(self, value: Any, where: str, low: int = -MAX_INT, high: int = MAX_INT) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.fail(where, f"must be an integer in [{low}, {high}], got {_short(value)}")
        return value

    def number(self, value: Any, where: str, low: float, high: float) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
            raise self.fail(where, f"must be a number in [{low}, {high}], got {_short(value)}")
        return float(value)

    def tokens(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > MAX_TOKENS:
            raise self.fail(where, f"must be a list of at most {MAX_TOKENS} token ids")
        return tuple(self.integer(token, f"{where}[{index}]") for index, token in enumerate(value))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reject_constant(name: str) -> Any:
    message = f"holds {name}, which is not JSON"
    raise ValueError(message)


def _parse(path: Path) -> Mapping[str, Any]:
    try:
        size = path.stat().st_size
    except OSError as error:
        message = f"cannot read trace {path}: {error.strerror or error}"
        raise TraceFormatError(message) from None
    if size > MAX_TRACE_BYTES:
        message = f"{path}: {size} bytes is larger than a trace may be ({MAX_TRACE_BYTES})"
        raise TraceFormatError(message)
    try:
        text = path.read_text(encoding="utf-8")
        document = json.loads(text, parse_constant=_reject_constant)
    except OSError as error:
        message = f"cannot read trace {path}: {error.strerror or error}"
        raise TraceFormatError(message) from None
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
    except ValueError as error:  # NaN/Infinity, or an integer with too many digits
        message = f"{path}: {error}"
        raise TraceFormatError(message) from None
    if not isinstance(document, dict):
        message = f"{path}: a trace is a JSON object, got {type(document).__name__}"
        raise TraceFormatError(message)
    return document


def load_trace(path: str | Path, custom_ops: Mapping[str, CustomOp] | None = None) -> Trace:
    """Read and validate a trace; ``TraceFormatError`` names the first problem."""
    path = Path(path)
    document = _parse(path)
    schema = _Schema(path)
    kind = document.get("format")
    if kind != TRACE_FORMAT:
        message = f"{path} is not a shardkit trace (format {_short(kind)}, expected {TRACE_FORMAT!r})"
        raise TraceFormatError(message)
    version = document.get("version")
    if version != TRACE_VERSION:
        message = (
            f"{path} is a version {_short(version)} trace; this shardkit reads version {TRACE_VERSION} "
            "(replay it with the shardkit version that wrote it)"
        )
        raise TraceFormatError(message)
    target = schema.text(schema.field(document, "target", "the trace"), "target")
    load = schema.object(schema.field(document, "load_request", "the trace"), "load_request")
    total = schema.integer(schema.field(load, "total_layers", "load_request"), "load_request.total_layers", 1, 2**16)
    start = schema.integer(schema.field(load, "shard_start", "load_request"), "load_request.shard_start", 0, total - 1)
    end = schema.integer(schema.field(load, "shard_end", "load_request"), "load_request.shard_end", start, total - 1)
    model_id = schema.text(schema.field(load, "model_id", "load_request"), "load_request.model_id")
    recipe = schema.object(load.get("recipe", {}), "load_request.recipe")
    faults_field = document.get("faults_enabled", [])
    if not isinstance(faults_field, list) or not all(kind in FAULT_KINDS for kind in faults_field):
        message = f"{path}: faults_enabled must be a list of {list(FAULT_KINDS)}, got {_short(faults_field)}"
        raise TraceFormatError(message)
    twins = document.get("twins", True)
    if not isinstance(twins, bool):
        raise schema.fail("twins", "must be true or false")
    reference = document.get("reference")
    if reference is not None:
        reference = schema.text(reference, "reference")
    seed = document.get("seed")
    if seed is not None:
        seed = schema.integer(seed, "seed", 0, MAX_INT)
    isolation = _isolation(schema, document.get("isolate"))
    steps = schema.field(document, "steps", "the trace")
    if not isinstance(steps, list) or not 0 < len(steps) <= MAX_STEPS:
        message = f"{path}: steps must be a non-empty list of at most {MAX_STEPS} steps"
        raise TraceFormatError(message)
    actions = tuple(_action(schema, step, index, custom_ops or {}) for index, step in enumerate(steps, start=1))
    failure = schema.object(schema.field(document, "failure", "the trace"), "failure")
    violation = Violation(
        schema.text(schema.field(failure, "property", "failure"), "failure.property"),
        schema.text(schema.field(failure, "message", "failure"), "failure.message"),
    )
    load_request = LoadRequest(model_id, start, end, total, recipe)
    return Trace(
        path, target, load_request, frozenset(faults_field), twins, reference, seed, actions, violation, isolation
    )


def _isolation(schema: _Schema, value: Any) -> IsolationOptions | None:
    if value is None:
        return None
    options = schema.object(value, "isolate")
    timeout = schema.number(schema.field(options, "step_timeout", "isolate"), "isolate.step_timeout", 1e-3, 3600.0)
    memory = options.get("worker_memory_mb")
    if memory is not None:
        memory = schema.integer(memory, "isolate.worker_memory_mb", 1, 2**40)
    return IsolationOptions(timeout, memory)


def _action(schema: _Schema, step: Any, index: int, custom_ops: Mapping[str, CustomOp]) -> Action:
    where = f"step {index}"
    step = schema.object(step, where)
    op = schema.text(schema.field(step, "op", where), f"{where}.op")
    args = schema.object(step.get("args", {}), f"{where}.args")
    note = schema.text(step.get("note", ""), f"{where}.note")
    if op in custom_ops:
        return Action(op, dict(args), note)
    checked = _ARGUMENT_CHECKS.get(op)
    if checked is None:
        known = sorted([*_ARGUMENT_CHECKS, *custom_ops])
        message = (
            f"{schema.path}: {where} has op {_short(op)}, which this shardkit does not know (known: {known}); "
            "a backend's own operation replays from Python with replay(..., custom_ops=...)"
        )
        raise TraceFormatError(message)
    return Action(op, checked(schema, args, f"{where}.args"), note)


def _step_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    malformed = args.get("malformed")
    if malformed is not None and malformed not in known_malformations():
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
    if call not in BEFORE_LOAD_CALLS:
        raise schema.fail(f"{where}.call", f"must be one of {list(BEFORE_LOAD_CALLS)}, got {_short(call)}")
    checked: dict[str, Any] = {"call": call, "session": schema.text(args.get("session", "a"), f"{where}.session")}
    if call in ("prefill", "decode"):
        checked.update(_step_args(schema, {**args, "malformed": None}, where))
        del checked["malformed"]
    return checked


def _fault_args(schema: _Schema, args: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = schema.field(args, "kind", where)
    if kind not in FAULT_KINDS:
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


def replay(
    trace_path: str | Path,
    target: str | EngineFactory | None = None,
    *,
    model: Callable[[], ReferenceModel] = ReferenceModel,
    custom_ops: Mapping[str, CustomOp] | None = None,
    isolate: bool | IsolationOptions | None = None,
) -> ReplayResult:
    """Re-run a trace's steps without Hypothesis, against its recorded target or ``target``.

    The engine runs as it ran when the failure was found: in a worker process if the
    trace records ``isolate``. ``isolate`` overrides that: False runs it in-process,
    True or ``IsolationOptions`` in a worker; the worker ends with the replay.

    Raises ``TraceFormatError`` for a file that is not a valid trace and
    ``InvalidTarget`` for a target that cannot be built.
    """
    trace = load_trace(trace_path, custom_ops)
    chosen = target if target is not None else trace.target
    isolation = trace.isolation if isolate is None else isolate
    if isolation is True:
        isolation = trace.isolation or IsolationOptions()
    if isolate is None and isinstance(isolation, IsolationOptions) and _remote(chosen):
        # Already in another process: keep the recorded deadline, there is nothing to isolate.
        engine = target_with_options(chosen, step_timeout=isolation.step_timeout)
    else:
        engine = target_with_options(chosen, isolate=isolation or False)
    try:
        driver = Driver(
            engine,
            trace.load_request,
            faults=trace.faults,
            twins=trace.twins,
            reference=resolve_target(trace.reference) if trace.reference is not None else None,
            model_factory=model,
            custom_ops=custom_ops,
        )
        for action in trace.actions:
            try:
                driver.execute(action)
            except StepFailed as failed:
                return ReplayResult(trace, tuple(driver.records), failed.violation)
        return ReplayResult(trace, tuple(driver.records), None)
    finally:
        if engine.isolation is not None and engine is not target:
            engine.isolation.close()


def _remote(target: object) -> bool:
    name = target if isinstance(target, str) else getattr(target, "name", "")
    return isinstance(name, str) and name.startswith(("grpc://", "unix:"))
