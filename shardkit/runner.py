"""One fuzzing run end to end: run Hypothesis on a machine, minimise, write the artefacts.

``fuzz`` serves the CLI and the benchmark; ``run_as_test`` serves the machines'
pytest ``TestCase``. Neither prints: the CLI and pytest render the result.
While Hypothesis runs, the shortest failure seen so far is kept on disk as
``…-in-progress.json``, so even a killed run leaves a trace; at the end the
reported failure's trace and regression test replace it.
"""

from __future__ import annotations

import io
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from ._version import __version__
from .contract import Role
from .driver import StepFailed
from .isolation import IsolationOptions
from .machine import FailureReport, RunStats, ShardMachine, ShrinkBudgetSpent, machine_for
from .minimize import MinimizedFailure, minimize_failure
from .model import ReferenceModel
from .regression import regression_test_source
from .targets import EngineFactory, ResolvedTarget, short_name
from .trace import DEFAULT_OUT, trace_document, write_atomically

__all__ = [
    "DEFAULT_OUT",
    "FuzzResult",
    "fuzz",
    "parse_seed",
    "report_document",
    "rerun_hint",
    "run_as_test",
    "run_machine",
]

DEFAULT_SHRINK_SECONDS = 10.0
Progress = Callable[[int, int, int], None]  # examples done, steps done, failures seen


@dataclass
class FuzzResult:
    target: str
    seed: int | None
    examples: int
    steps: int
    elapsed_s: float
    coverage: Counter[tuple[str, str]]
    failure: FailureReport | None = None
    trace_path: Path | None = None
    regression_path: Path | None = None
    hypothesis_output: str = ""
    faults: frozenset[str] = field(default_factory=frozenset)
    #: The failure as Hypothesis's shrinker left it, before the second stage.
    hypothesis_failure: FailureReport | None = None
    minimized: MinimizedFailure | None = None
    #: The run was stopped with Ctrl-C after a failure was found; it was not minimised.
    interrupted: bool = False
    rerun_command: str = ""
    #: (examples run, seconds, its steps) when the first failing example was seen: the
    #: length a plain random walk would have reported, without any shrinking.
    first_failure: tuple[int, float, int] | None = None
    #: Hypothesis's shrinking was cut short by the time budget (the replay minimiser finished the job).
    shrink_cut: bool = False

    @property
    def blob(self) -> str | None:
        """Hypothesis's ``@reproduce_failure`` line, if it printed one."""
        found = re.search(r"@reproduce_failure\([^)]*\)", self.hypothesis_output)
        return found.group(0) if found else None


class _Artefacts:
    """Writes the trace and the regression test of the best failure seen so far."""

    def __init__(self, machine: type[ShardMachine], out: Path | None, seed: int | None) -> None:
        self.machine = machine
        self.out = out
        self.seed = seed
        self.shortest: int | None = None  # steps of the in-progress trace on disk

    @property
    def label(self) -> str:
        """Names the engine and the run, so traces of different engines never collide."""
        engine = _slug(short_name(self.machine.target.name))
        return f"{engine}-seed-{self.seed}" if self.seed is not None else _slug(self.machine.__name__)

    def paths(self, failure: FailureReport) -> tuple[Path, Path]:
        assert self.out is not None
        stem = f"{self.label}-{_slug(failure.violation.property)}"
        return self.out / f"{stem}.json", self.out / f"test_{stem.replace('-', '_')}.py"

    def in_progress(self) -> Path:
        assert self.out is not None
        return self.out / f"{self.label}-in-progress.json"

    def offer(self, failure: FailureReport) -> None:
        """Keep the shortest failure seen so far on disk while the run goes on."""
        if self.out is None or (self.shortest is not None and self.shortest <= len(failure.records)):
            return
        write_atomically(self.in_progress(), self._document(failure))
        self.shortest = len(failure.records)

    def final(self, failure: FailureReport) -> tuple[Path, Path] | None:
        """Write the reported failure's trace and regression test; drop the in-progress file."""
        if self.out is None:
            return None
        trace_path, test_path = self.paths(failure)
        write_atomically(trace_path, self._document(failure))
        write_atomically(test_path, regression_test_source(trace_path.name, failure.violation, self.seed))
        self.in_progress().unlink(missing_ok=True)
        return trace_path, test_path

    def _document(self, failure: FailureReport) -> dict[str, Any]:
        return trace_document(
            target=self.machine.target.name,
            load_request=failure.load_request,
            faults=failure.faults,
            records=failure.records,
            violation=failure.violation,
            seed=self.seed,
            twins=self.machine.use_twins,
            reference=self.machine.reference.name if self.machine.reference is not None else None,
            isolation=isolation.options if (isolation := self.machine.target.isolation) is not None else None,
        )


def parse_seed(text: str, option: str) -> int:
    """A seed from the command line: an integer in [0, 2**64), or "random" for a fresh one."""
    if text == "random":
        return random.SystemRandom().randrange(2**32)
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        message = f"{option} must be an integer in [0, 2**64) or 'random', got {text!r}"
        raise ValueError(message)
    return value


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def run_machine(
    machine: type[ShardMachine],
    run_settings: settings,
    *,
    seed: int | None,
    out: Path | None,
    minimize: bool = True,
    progress: Progress | None = None,
    shrink_seconds: float | None = DEFAULT_SHRINK_SECONDS,
) -> FuzzResult:
    """Run Hypothesis on ``machine``; minimise a failure and write its artefacts under ``out``.

    Hypothesis's shrinker gets ``shrink_seconds`` after the first failure (None: no
    limit); it is slow on failures dozens of steps long, where replay is fast.
    """
    artefacts = _Artefacts(machine, out, seed)
    stats = machine.stats
    started = time.perf_counter()
    first_failure: list[tuple[int, float, int]] = []

    def on_failure(failure: FailureReport) -> None:
        if not first_failure:
            first_failure.append((stats.examples, time.perf_counter() - started, len(failure.records)))
            if shrink_seconds is not None:
                stats.shrink_deadline = time.monotonic() + shrink_seconds
        artefacts.offer(failure)

    stats.on_failure = on_failure
    stats.on_example = progress
    captured = io.StringIO()
    interrupted = shrink_cut = False
    test = hypothesis_seed(seed)(machine) if seed is not None else machine
    try:
        with with_reporter(lambda text: print(text, file=captured)):
            run_state_machine_as_test(test, settings=run_settings)
    except KeyboardInterrupt:
        if stats.failure is None:
            raise
        interrupted = True
    except ShrinkBudgetSpent:
        # Hypothesis's shrinker ran out of time; minimise the shortest failure by replay.
        stats.failure = stats.shortest
        shrink_cut = True
    except BaseException as error:
        if stats.failure is None:
            raise
        captured.write("".join(getattr(error, "__notes__", [])))
    finally:
        stats.on_failure = stats.on_example = None
        stats.shrink_deadline = None
    minimized = None
    if stats.failure is not None and minimize and not interrupted:
        try:
            minimized = minimize_failure(machine, stats.failure)
            minimized = _deepen(machine, run_settings, seed, minimized, shrink_seconds)
        except KeyboardInterrupt:
            interrupted = minimized is None
    failure = minimized.report if minimized is not None else stats.failure
    result = FuzzResult(
        target=machine.target.name,
        seed=seed,
        examples=stats.examples,
        steps=stats.steps,
        elapsed_s=time.perf_counter() - started,
        coverage=stats.coverage,
        failure=failure,
        hypothesis_output=captured.getvalue(),
        faults=machine.fault_kinds,
        hypothesis_failure=stats.failure,
        minimized=minimized,
        interrupted=interrupted,
        first_failure=first_failure[0] if first_failure else None,
        shrink_cut=shrink_cut,
    )
    if failure is not None:
        written = artefacts.final(failure)
        if written is not None:
            result.trace_path, result.regression_path = written
    return result


DEEPENING_EXAMPLES = 200


def _deepen(
    machine: type[ShardMachine],
    run_settings: settings,
    seed: int | None,
    minimized: MinimizedFailure,
    shrink_seconds: float | None,
) -> MinimizedFailure:
    """Iterative deepening (SHRINKING.md): search again with fewer steps than the failure
    has, for the same property; a shorter one found is minimised and replaces it. This
    escapes minima that deleting steps cannot leave (a fault-based route to a bug that a
    plainer route reaches in fewer steps)."""
    while len(minimized.report.records) > 1:
        shorter = _search_shorter(machine, run_settings, seed, minimized.report, shrink_seconds)
        if shorter is None:
            break
        again = minimize_failure(machine, shorter)
        if len(again.report.records) >= len(minimized.report.records):
            break
        minimized = again
    return minimized


def _search_shorter(
    machine: type[ShardMachine],
    run_settings: settings,
    seed: int | None,
    failure: FailureReport,
    shrink_seconds: float | None,
) -> FailureReport | None:
    limit = len(failure.records) - 1
    stats = RunStats(only_property=failure.violation.property)
    probe = type(f"{machine.__name__}Shorter", (machine,), {"stats": stats})

    def start_shrink_clock(found: FailureReport) -> None:
        if stats.shrink_deadline is None and shrink_seconds is not None:
            stats.shrink_deadline = time.monotonic() + shrink_seconds

    stats.on_failure = start_shrink_clock
    probe_settings = settings(
        run_settings,
        stateful_step_count=limit,
        max_examples=DEEPENING_EXAMPLES,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    test = hypothesis_seed(seed)(probe) if seed is not None else probe
    try:
        with with_reporter(lambda text: None):
            run_state_machine_as_test(test, settings=probe_settings)
    except (ShrinkBudgetSpent, StepFailed):
        pass  # a failure of the property ended the search; stats.shortest holds the shortest
    found = stats.shortest
    return found if found is not None and len(found.records) <= limit else None


def fuzz(
    target: str | EngineFactory | ResolvedTarget,
    *,
    seed: int,
    examples: int = 200,
    steps: int = 50,
    role: Role | str | None = None,
    faults: bool | str | Iterable[str] = True,
    twins: bool = True,
    reference: str | EngineFactory | ResolvedTarget | None = None,
    out: Path | None = None,
    model: Callable[[], ReferenceModel] = ReferenceModel,
    base: type[ShardMachine] = ShardMachine,
    minimize: bool = True,
    progress: Progress | None = None,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> FuzzResult:
    """Fuzz ``target`` reproducibly from ``seed``; on a failure, minimise it further
    by replay (unless ``minimize`` is False) and write its trace and regression
    test under ``out`` (if given). ``isolate``, ``step_timeout`` and ``worker_memory_mb``
    are ``machine_for``'s; the worker processes an isolated run starts end with it."""
    machine = machine_for(
        target,
        role=role,
        faults=faults,
        twins=twins,
        reference=reference,
        model=model,
        base=base,
        isolate=isolate,
        step_timeout=step_timeout,
        worker_memory_mb=worker_memory_mb,
    )
    isolation = machine.target.isolation
    started_workers = isolation is not None and not (
        isinstance(target, ResolvedTarget) and target.isolation is isolation
    )
    run_settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    try:
        result = run_machine(machine, run_settings, seed=seed, out=out, minimize=minimize, progress=progress)
    finally:
        if started_workers:
            assert isolation is not None
            isolation.close()
    result.rerun_command = _fuzz_command(machine.target.name, seed, examples, steps, role, faults, twins)
    if machine.reference is not None:
        result.rerun_command += f" --reference {machine.reference.name}"
    if isolation is not None:
        result.rerun_command += " " + " ".join(isolation.options.command_options())
    elif step_timeout is not None:
        result.rerun_command += f" --step-timeout {step_timeout:g}"
    return result


def _fuzz_command(
    target: str, seed: int, examples: int, steps: int, role: str | None, faults: object, twins: bool
) -> str:
    parts = ["shardkit", "fuzz", target, "--seed", str(seed)]
    if role not in (None, "any"):
        parts += ["--role", str(role)]
    if examples != 200:
        parts += ["--examples", str(examples)]
    if steps != 50:
        parts += ["--steps", str(steps)]
    if faults not in (True, "all"):
        listed = faults if isinstance(faults, str) else ("none" if faults is False else ",".join(sorted(faults)))  # type: ignore[call-overload]
        parts += ["--faults", listed]
    if not twins:
        parts.append("--no-twins")
    return " ".join(parts)


def run_as_test(machine: type[ShardMachine], run_settings: settings) -> None:
    """What a machine's ``TestCase`` runs under pytest: the same run as ``shardkit fuzz``,
    raising ``AssertionError`` with the minimal failure and how to rerun it."""
    from .pytest_plugin import session_overrides
    from .report import render_failure

    __tracebackhide__ = True  # pytest: show the failure, not the runner's frames
    overrides = session_overrides()
    suite = machine
    if overrides.engine is not None:
        machine = machine_for(overrides.engine, **machine.build_options)
    if overrides.seed is not None:
        run_settings = settings(run_settings, derandomize=False)
    result = run_machine(machine, run_settings, seed=overrides.seed, out=overrides.out or DEFAULT_OUT)
    if result.failure is not None:
        engine = f" --shardkit-engine {overrides.engine}" if overrides.engine is not None else ""
        if overrides.seed is not None:
            result.rerun_command = f"pytest --shardkit-seed {overrides.seed}{engine}"
        elif run_settings.derandomize:
            result.rerun_command = f"pytest{engine}  (the profile is derandomized: every run repeats this one)"
        message = render_failure(result)
        _RERUN_HINTS[suite] = message[message.index("reproduce:") :]
        raise AssertionError(message)


_RERUN_HINTS: dict[type[ShardMachine], str] = {}


def rerun_hint(run_test: object) -> str | None:
    """The reproduction commands of the last failure of the machine behind a TestCase's runTest."""
    machine = getattr(run_test, "_hypothesis_state_machine_class", None)
    return _RERUN_HINTS.get(machine) if isinstance(machine, type) else None


def report_document(result: FuzzResult) -> dict[str, Any]:
    """The ``--report`` JSON (SPEC §6); its keys are a stable schema."""
    coverage: dict[str, dict[str, int]] = {}
    for (op, outcome), count in sorted(result.coverage.items()):
        coverage.setdefault(op, {})[outcome] = count
    failures = []
    if result.failure is not None:
        records = result.failure.records
        failures.append(
            {
                "message": result.failure.violation.message,
                "property": result.failure.violation.property,
                "steps": [
                    {
                        "op": r.action.op,
                        "args": r.action.to_json()["args"],
                        "expected": r.expected,
                        "observed": r.observed,
                    }
                    for r in records
                ],
                "trace": str(result.trace_path) if result.trace_path is not None else None,
                "faults": [
                    {"kind": r.action.args["kind"], "value": r.action.args["value"], "step": r.index}
                    for r in records
                    if r.action.op == "fault"
                ],
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
        "failures": failures,
    }
