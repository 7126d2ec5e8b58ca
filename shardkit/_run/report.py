"""Output of a fuzzing run: the human-readable summary, coverage table and failure, and the
``--report`` JSON document."""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import hypothesis

from shardkit._core.driver import StepRecord
from shardkit._core.properties import read_more
from shardkit._core.steps import PARALLEL_OP, Action
from shardkit._machine.state_machine import ShardMachine
from shardkit._run.result import FuzzResult
from shardkit._run.trace import importable_name
from shardkit._run.trust import file_target_outside_project
from shardkit._version import __version__
from shardkit.contract import CacheResult, StatusCode

if TYPE_CHECKING:
    from shardkit._run.options import FuzzOptions

__all__ = [
    "LONG_SESSION_DECODES",
    "counts_line",
    "coverage_table",
    "failure_lines",
    "long_session_share",
    "print_summary",
    "render_failure",
    "replay_command",
    "report_document",
    "session_histogram",
    "session_lines",
]

#: A session with this many accepted decodes in one epoch counts as long: engines ship bugs
#: that only a long history reaches (a cache block or position counter that wraps).
LONG_SESSION_DECODES = 32
#: The buckets of ``session_histogram``: (label, fewest decodes, most decodes or None).
SESSION_BUCKETS = (("0", 0, 0), ("1-7", 1, 7), ("8-31", 8, 31), ("32-127", 32, 127), ("128+", 128, None))


def coverage_by_operation(result: FuzzResult) -> dict[str, dict[str, int]]:
    """The (operation, outcome) counts grouped by operation, both sorted."""
    by_op: dict[str, dict[str, int]] = {}
    for (op, outcome), count in sorted(result.coverage.items()):
        by_op.setdefault(op, {})[outcome] = count
    return by_op


def coverage_table(result: FuzzResult) -> str:
    """(operation, outcome) counts, one operation per line."""
    by_op = coverage_by_operation(result)
    width = max((len(op) for op in by_op), default=0)
    lines = []
    for op, outcomes in by_op.items():
        cells = "  ".join(f"{outcome}={count}" for outcome, count in outcomes.items())
        lines.append(f"  {op:<{width}}  {cells}")
    return "\n".join(lines)


def session_histogram(result: FuzzResult) -> dict[str, int]:
    """Examples by the accepted decodes of their longest session epoch, in buckets."""
    histogram = {}
    for label, low, high in SESSION_BUCKETS:
        histogram[label] = sum(
            count for decodes, count in result.longest_session.items() if low <= decodes and (high is None or decodes <= high)
        )
    return histogram


def long_session_share(result: FuzzResult) -> float:
    """The share of examples (0 to 1) with a session of at least ``LONG_SESSION_DECODES`` decodes."""
    total = sum(result.longest_session.values())
    long = sum(count for decodes, count in result.longest_session.items() if decodes >= LONG_SESSION_DECODES)
    return long / total if total else 0.0


def session_lines(result: FuzzResult) -> list[str]:
    """How long the sessions got: a run whose sessions all stay short cannot find the bugs
    that need a long history, however many examples it ran."""
    total = sum(result.longest_session.values())
    if not total:
        return []
    cells = "  ".join(f"{label}={count}" for label, count in session_histogram(result).items())
    long = round(long_session_share(result) * total)
    return [
        "longest session per example (accepted decodes in one epoch → examples):",
        f"  {cells}",
        f"  {long} of {total} examples ({long_session_share(result):.0%}) reached {LONG_SESSION_DECODES}+ decodes in one session",
    ]


def failure_lines(
    property_label: str, records: Sequence[StepRecord], message: str, rows: str = "", *, full_rows: bool = False
) -> list[str]:
    """The failing sequence as fuzz and replay print it: every step but the last with what
    the engine answered, the last one's expected and observed (and the rows it compared,
    whole, with ``full_rows``), and where the property is explained."""
    lines = [f"FAILURE ({property_label}) in {_steps(len(records))}:"]
    lines += [f"  step {r.index}: {r.action.describe()}  → {r.observed}" for r in records[:-1]]
    lines += [f"  {line}" for line in message.splitlines()]
    if rows and full_rows:
        lines += ["  the rows compared, whole:", *(f"    {line}" for line in rows.splitlines())]
    elif rows:
        lines.append("  (the rows compared, whole: --full-rows on shardkit fuzz or replay)")
    where = read_more(property_label)
    if where is not None:
        lines.append(f"  (what {property_label} requires: {where} in shardkit's documentation)")
    return lines


def _has_pytest() -> bool:
    """Whether the printed ``pytest`` command can run in this environment."""
    return importlib.util.find_spec("pytest") is not None


def render_failure(result: FuzzResult, *, full_rows: bool = False) -> str:
    """The minimal steps, expected vs observed, and every way to rerun the failure."""
    failure = result.failure
    assert failure is not None
    violation = failure.violation
    lines = failure_lines(violation.property, failure.records, violation.message, violation.rows, full_rows=full_rows)
    lines += [f"  note: {note}" for note in failure.notes]
    if result.interrupted:
        lines.append("(interrupted: the sequence above is the best found so far, not minimised)")
    elif result.minimized is not None and result.hypothesis_failure is not None:
        before = len(result.hypothesis_failure.records)
        state = "1-minimal" if result.minimized.one_minimal else f"not proven 1-minimal ({result.minimized.unproven})"
        lines.append(f"(Hypothesis shrank it to {_steps(before)}, replay to {len(failure.records)}; {state})")
    if result.shrink_budget_spent and not result.interrupted:
        # The rerun line names the same budget, so it reports this very sequence again.
        lines.append("(shrinking stopped when --shrink-examples ran out)")
    lines.append("reproduce:")
    # Quoted for the shell, so that they run as printed from a folder whose name has a space.
    blocker = _needs_python(result.trace_path) if result.trace_path is not None else None
    if blocker is not None:
        lines.append(f"  this failure:    cannot be replayed from the command line or as a generated test: {blocker}")
        lines.append(f"                   (trace: {shlex.quote(str(result.trace_path))})")
    else:
        if result.trace_path is not None:
            lines.append(f"  this failure:    {replay_command(result)}")
        if result.regression_path is not None:
            missing = "" if _has_pytest() else "  (pytest is not installed here: pip install pytest)"
            lines.append(f"  as a test:       pytest {shlex.quote(str(result.regression_path))}{missing}")
    if result.rerun_command:
        lines.append(f"  the whole run:   {result.rerun_command}")
    if result.blob is not None:
        lines.append(f"  hypothesis blob: {result.blob}")
    return "\n".join(lines)


def replay_command(result: FuzzResult) -> str | None:
    """``shardkit replay TRACE`` for the failure's trace, quoted for the shell; None without a
    trace, or for one that replays only from Python."""
    if result.trace_path is None or _needs_python(result.trace_path) is not None:
        return None
    # Replay builds the recorded engine only from inside the current project; one
    # outside it is named on the command line, as the user named it to fuzz it.
    engine = f" --engine {shlex.quote(result.target)}" if file_target_outside_project(result.target) else ""
    return f"shardkit replay {shlex.quote(str(result.trace_path))}{engine}"


def _steps(count: int) -> str:
    return "1 step" if count == 1 else f"{count} steps"


def counts_line(result: FuzzResult) -> str:
    """What was run, saying what each figure counts: examples until the failure and while
    shrinking it, or, without a failure, the ones ``--examples`` counts and those Hypothesis
    discarded; a step is one engine call or fault injection."""
    total_steps = result.steps + result.shrink_steps
    rate = total_steps / result.elapsed_s if result.elapsed_s > 0 else 0.0
    if result.failure is not None:
        shrinking = (
            f", then {_examples(result.shrink_examples)} ({result.shrink_steps} steps) while shrinking it"
            if result.shrink_examples
            else ""
        )
        counted = f"{_examples(result.examples)} ({result.steps} steps) until the first failure{shrinking}"
    else:
        requested = result.requested_examples
        extra = result.examples - requested if requested is not None else 0
        discarded = f" and {extra} that Hypothesis discarded as invalid" if extra > 0 else ""
        counted = f"{_examples(result.examples)} ({requested or result.examples} as --examples counts them{discarded}), {result.steps} steps"
    return (
        f"{counted}; {result.elapsed_s:.1f}s ({rate:,.0f} steps/s); "
        f"faults: {', '.join(sorted(result.faults)) or 'none'}"
    )


def _examples(count: int) -> str:
    return f"{count} example{'' if count == 1 else 's'}"


def _needs_python(trace_path: Path) -> str | None:
    """Why the trace replays only from Python (its extended machine or model cannot be imported by name)."""
    try:
        document = json.loads(trace_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    reason = document.get("needs_python") if isinstance(document, dict) else None
    return reason if isinstance(reason, str) else None


def print_summary(result: FuzzResult, out: TextIO, *, full_rows: bool = False) -> None:
    print(counts_line(result), file=out)
    print("coverage (operation → outcome counts):", file=out)
    print(coverage_table(result), file=out)
    for line in session_lines(result):
        print(line, file=out)
    for caveat, examples in sorted(result.caveats.items()):
        print(f"not checked in {examples} of {result.examples} examples: {caveat}", file=out)
    if result.failure is None:
        print("no failure found", file=out)
        return
    print(file=out)
    print(render_failure(result, full_rows=full_rows), file=out)


def report_document(result: FuzzResult, options: FuzzOptions | None = None) -> dict[str, Any]:
    """The ``--report`` JSON (contract §6); its keys are a stable schema. ``options`` are the
    run's (``run.options`` is null without them)."""
    coverage = coverage_by_operation(result)
    failures = []
    if result.failure is not None:
        records = result.failure.records
        message = result.failure.violation.message
        failures.append(
            {
                "message": message,
                "property": result.failure.violation.property,
                "rows": result.failure.violation.rows or None,
                "steps": [
                    {
                        "op": r.action.op,
                        "args": r.action.to_json()["args"],
                        "expected": r.expected,
                        "observed": r.observed,
                        **_step_fields(r, violating=r is records[-1], message=message),
                    }
                    for r in records
                ],
                "violating_step": records[-1].index if records else None,
                "read_more": read_more(result.failure.violation.property),
                "replay_command": replay_command(result),
                "regression_test": str(result.regression_path) if result.regression_path is not None else None,
                "trace": str(result.trace_path) if result.trace_path is not None else None,
                "faults": [
                    {"kind": r.action.args["kind"], "value": r.action.args["value"], "step": r.index}
                    for r in records
                    if r.action.op == "fault"
                ],
                "notes": list(result.failure.notes),
            }
        )
    return {
        "shardkit_version": __version__,
        "target": result.target,
        "seed": result.seed,
        "examples": result.examples,
        "steps": result.steps,
        "elapsed_s": round(result.elapsed_s, 3),
        "coverage": coverage,
        "not_checked": dict(sorted(result.caveats.items())),
        "longest_session": {
            "decodes_histogram": session_histogram(result),
            f"share_with_{LONG_SESSION_DECODES}_decodes": round(long_session_share(result), 4),
        },
        "failures": failures,
        "run": {
            "options": _options_fields(options) if options is not None else None,
            "versions": {
                "shardkit": __version__,
                "hypothesis": hypothesis.__version__,
                "python": platform.python_version(),
            },
            "rerun_command": result.rerun_command or None,
        },
    }


#: How ``status_text`` and a prediction begin: a status code, and a prefill's or decode's cache result.
_ANSWER = re.compile(r"(?P<status>[A-Z_]+)(?:/(?P<cache>[A-Z]+))?(?![A-Za-z_/])")
#: A call of a parallel phase as its failure message lists it: name, ticks, the call, its answer.
_LANE_CALL = re.compile(r"^\s*(?P<name>[A-Z]\d+) \[(?P<started>\d+)-(?P<ended>\d+)\] (?P<rest>.*)$")


def _answer_fields(text: str) -> tuple[str | None, str | None]:
    """The status code and cache result an expected or observed text starts with; (None, None)
    for one that states something else (an output, metrics)."""
    found = _ANSWER.match(text)
    if found is None or found["status"] not in StatusCode.__members__:
        return None, None
    cache = found["cache"]
    return found["status"], cache if cache in CacheResult.__members__ else None


def _session_of(action: Action) -> str | None:
    session = action.args.get("session")
    return session if isinstance(session, str) else None


def _step_fields(record: StepRecord, *, violating: bool, message: str) -> dict[str, Any]:
    """What the HTML report draws of a step beyond the keys the schema had first: its lane,
    the status and cache result expected and observed, and a parallel phase's lanes."""
    expected_status, expected_cache = _answer_fields(record.expected)
    observed_status, observed_cache = _answer_fields(record.observed)
    lanes = record.action.args.get("lanes") if record.action.op == PARALLEL_OP else None
    return {
        "index": record.index,
        "session": _session_of(record.action),
        "note": record.action.note,
        "outcome": record.outcome,
        "expected_status": expected_status,
        "expected_cache": expected_cache,
        "observed_status": observed_status,
        "observed_cache": observed_cache,
        "violating": violating,
        # Only a failing phase's message holds its calls' ticks and answers.
        "lanes": _lane_fields(lanes, message if violating else "") if lanes is not None else None,
    }


def _lane_fields(lanes: Sequence[Sequence[Action]], message: str) -> list[list[dict[str, Any]]]:
    """Each lane's calls: name (``A1``), op, args, session, and the ticks and answer the
    message shows (null where it shows none)."""
    shown: dict[str, tuple[int, int, str]] = {}
    for line in message.splitlines():
        found = _LANE_CALL.match(line)
        if found is not None:
            shown[found["name"]] = (int(found["started"]), int(found["ended"]), found["rest"])
    fields = []
    for lane, actions in enumerate(lanes):
        calls = []
        for index, action in enumerate(actions):
            name = f"{chr(ord('A') + lane)}{index + 1}"
            started, ended, rest = shown.get(name, (None, None, ""))
            described = f"{action.describe()} → "
            if rest.startswith(described):
                answer: str | None = rest.removeprefix(described)
            else:
                answer = rest.rpartition(" → ")[2] if " → " in rest else None
            status, cache = _answer_fields(answer) if answer is not None else (None, None)
            calls.append(
                {
                    "call": name,
                    "op": action.op,
                    "args": action.to_json()["args"],
                    "session": _session_of(action),
                    "started": started,
                    "ended": ended,
                    "answer": answer,
                    "observed_status": status,
                    "observed_cache": cache,
                }
            )
        fields.append(calls)
    return fields


def _options_fields(options: FuzzOptions) -> dict[str, Any]:
    """The run's options by their ``FuzzOptions`` names, as JSON."""
    reference = options.reference.name if options.reference is not None else None
    base = options.base
    machine = importable_name(base) if isinstance(base, type) and base is not ShardMachine else None
    return {
        "examples": options.examples,
        "steps": options.steps,
        "role": options.role or "any",
        "faults": options.faults,
        "twins": options.twins,
        "extreme_values": options.extreme_values,
        "reference": reference,
        "concurrency": options.concurrency,
        "isolate": bool(options.isolate),
        "step_timeout": options.step_timeout,
        "worker_memory_mb": options.worker_memory_mb,
        "machine": machine,
        "minimize": options.minimize,
        "shrink_examples": options.shrink_examples,
    }
