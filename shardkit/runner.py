"""One fuzzing run end to end: run Hypothesis on a machine, minimise, write the artefacts.

``fuzz`` serves the CLI and the benchmark; ``run_as_test`` serves the machines'
pytest ``TestCase``. Neither prints: the CLI and pytest render the result.
While Hypothesis runs, the shortest failure seen so far is kept on disk as
``…-in-progress.json``, so even a killed run leaves a trace; at the end the
reported failure's trace and regression test replace it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shlex
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import ExampleDatabase
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from ._hypothesis_compat import deterministic_hypothesis
from ._profiles import suite_settings, time_independent
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
    "Budgets",
    "FuzzResult",
    "fuzz",
    "parse_seed",
    "report_document",
    "rerun_hint",
    "run_as_test",
    "run_machine",
]

Progress = Callable[[int, int, int], None]  # examples done, steps done, failures seen


@dataclass(frozen=True)
class Budgets:
    """How much work a run may spend, in counts, never in seconds: the same seed then
    reports the same failure on an idle laptop and on a loaded CI machine.

    ``single_run_examples`` and ``chunk_examples``: a run of at most
    ``single_run_examples`` is one Hypothesis run; a longer one is a series of Hypothesis
    runs of at most ``chunk_examples`` each, seeded from the run's seed, so memory stays
    flat however many examples are asked for (Hypothesis's bookkeeping of one run grows
    with its examples). ``shrink_steps`` and ``shrink_examples``: steps and examples
    Hypothesis's shrinker may run after the first failure before the replay minimiser
    takes over, whichever runs out first. ``minimize_replays``: replays the minimiser
    may make. ``deepening_examples``: examples of each search for a shorter failure
    (iterative deepening).
    """

    single_run_examples: int = 200
    chunk_examples: int = 100
    shrink_steps: int = 30_000
    shrink_examples: int = 3_000
    minimize_replays: int = 5_000
    deepening_examples: int = 200


@dataclass
class FuzzResult:
    target: str
    seed: int | None
    #: Examples run until the first failure (that one included), or all of them.
    examples: int
    #: Engine calls and fault injections of those examples.
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
    #: Hypothesis's shrinking spent its budget of steps (the replay minimiser finished the job).
    shrink_cut: bool = False
    #: Examples and steps Hypothesis ran while shrinking the failure.
    shrink_examples: int = 0
    shrink_steps: int = 0
    #: Examples asked for (``--examples``): Hypothesis counts only the valid ones it generated
    #: against it, so a run without a failure runs a few more, which it discards.
    requested_examples: int | None = None
    #: Why a trace or regression test could not be written (the failure is still reported).
    write_error: str | None = None

    @property
    def blob(self) -> str | None:
        """Hypothesis's ``@reproduce_failure`` line, if it printed one."""
        found = re.search(r"@reproduce_failure\([^)]*\)", self.hypothesis_output)
        return found.group(0) if found else None


def machine_identity(machine: type[ShardMachine]) -> str:
    """What makes two runs' failures comparable: the engine (a file target by its absolute
    path), the machine and model classes, and the options that change what is generated.
    Trace names and the example database's keys derive from it, so two engines never
    share a file or replay each other's saved examples."""
    target = machine.target.name
    module_part, colon, attr = target.rpartition(":")
    if colon and module_part.endswith(".py"):
        target = f"{Path(module_part).resolve()}:{attr}"
    options = machine.build_options
    base = options.get("base", ShardMachine)
    model = options.get("model", ReferenceModel)
    reference = machine.reference.name if machine.reference is not None else None
    parts = [
        target,
        f"role={machine.role or 'any'}",
        f"faults={','.join(sorted(machine.fault_kinds))}",
        f"twins={machine.use_twins}",
        f"reference={reference}",
        f"machine={getattr(base, '__module__', '?')}:{getattr(base, '__qualname__', base)}",
        f"model={getattr(model, '__module__', '?')}:{getattr(model, '__qualname__', model)}",
    ]
    return "\n".join(parts)


def _digest(text: str, length: int = 8) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:length]


class _Artefacts:
    """Writes the trace and the regression test of the best failure seen so far.

    File names carry the engine, the role asked for, the seed and a digest of the
    machine's identity, so two engines or two configurations never share a name; a
    file that already holds a *different* failure is never overwritten (a suffix is
    added). A write that fails is remembered, not raised: the failure is still reported.
    """

    def __init__(self, machine: type[ShardMachine], out: Path | None, seed: int | None) -> None:
        self.machine = machine
        self.out = out
        self.seed = seed
        self.shortest: int | None = None  # steps of the in-progress trace on disk
        self.write_error: str | None = None
        self._label = self._make_label()

    def _make_label(self) -> str:
        engine = _slug(short_name(self.machine.target.name)) or "engine"
        run = f"seed-{self.seed}" if self.seed is not None else _slug(self.machine.__name__)
        return f"{engine}-{self.machine.role or 'any'}-{run}-{_digest(machine_identity(self.machine))}"

    @property
    def label(self) -> str:
        return self._label

    def in_progress(self) -> Path:
        assert self.out is not None
        return self.out / f"{self.label}-in-progress.json"

    def offer(self, failure: FailureReport) -> None:
        """Keep the shortest failure seen so far on disk while the run goes on."""
        if self.out is None or (self.shortest is not None and self.shortest <= len(failure.records)):
            return
        try:
            write_atomically(self.in_progress(), self._document(failure))
        except OSError as error:
            self.write_error = f"could not write {self.in_progress()}: {error.strerror or error}"
            return
        self.shortest = len(failure.records)

    def final(self, failure: FailureReport) -> tuple[Path, Path] | None:
        """Write the reported failure's trace and regression test; drop the in-progress file
        once they are safely on disk. None when there is no folder or the write failed."""
        if self.out is None:
            return None
        document = self._document(failure)
        stem = f"{self.label}-{failure.load_request.role}-{_slug(failure.violation.property)}"
        try:
            trace_path = self._free_path(stem, document)
            test_path = trace_path.with_name(f"test_{trace_path.stem.replace('-', '_')}.py")
            write_atomically(trace_path, document)
            write_atomically(test_path, regression_test_source(trace_path.name, failure.violation, self.seed))
        except OSError as error:
            where = error.filename or self.out
            self.write_error = f"could not write the trace under {where}: {error.strerror or error}"
            return None
        self.in_progress().unlink(missing_ok=True)
        return trace_path, test_path

    def _free_path(self, stem: str, document: dict[str, Any]) -> Path:
        """``stem.json``, unless that file holds another failure: then ``stem-2.json``, …"""
        assert self.out is not None
        for attempt in range(1, 10_000):
            path = self.out / (f"{stem}.json" if attempt == 1 else f"{stem}-{attempt}.json")
            if not path.exists() or _same_failure(path, document):
                return path
        message = f"{self.out} already holds 10 000 traces named {stem}-N.json; clear it out"
        raise OSError(message)

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
            machine=self.machine,
        )


def _same_failure(path: Path, document: dict[str, Any]) -> bool:
    """Whether the trace at ``path`` records the same steps and failure as ``document``."""
    try:
        existing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    ours = json.loads(json.dumps(document, ensure_ascii=False))
    keys = ("target", "load_request", "steps", "failure")
    return isinstance(existing, dict) and all(existing.get(key) == ours.get(key) for key in keys)


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


def chunk_seeds(seed: int, examples: int, chunk: int, single_run: int = 0) -> Iterator[tuple[int, int]]:
    """(seed, examples) of each bounded Hypothesis run of a run. A run of at most
    ``single_run`` examples is one plain Hypothesis run from ``seed``; a longer one is
    cut into runs of ``chunk``, the first from ``seed`` itself and the later ones from
    seeds derived from it, so the one printed seed still repeats everything."""
    if examples <= single_run:
        yield seed, examples
        return
    for index, first in enumerate(range(0, examples, chunk)):
        count = min(chunk, examples - first)
        if index == 0:
            yield seed, count
        else:
            derived = hashlib.sha256(f"shardkit-chunk:{seed}:{index}".encode()).digest()
            yield int.from_bytes(derived[:8], "little"), count


class _EngineKeyedDatabase(ExampleDatabase):
    """The user's example database, with every key prefixed by the machine's identity,
    so an example saved while fuzzing one engine is never replayed against another."""

    def __init__(self, inner: ExampleDatabase, identity: str) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).digest()[:16]

    def __repr__(self) -> str:
        return f"EngineKeyed({self.inner!r})"

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def _run_settings(machine: type[ShardMachine], base: settings) -> settings:
    """``base`` made independent of the clock, its database keyed to this machine."""
    run_settings = time_independent(base)
    if run_settings.database is not None and not isinstance(run_settings.database, _EngineKeyedDatabase):
        run_settings = settings(run_settings, database=_EngineKeyedDatabase(run_settings.database, machine_identity(machine)))
    return run_settings


def run_machine(
    machine: type[ShardMachine],
    run_settings: settings,
    *,
    seed: int,
    out: Path | None,
    minimize: bool = True,
    progress: Progress | None = None,
    budgets: Budgets = Budgets(),
) -> FuzzResult:
    """Run Hypothesis on ``machine`` from ``seed``; minimise a failure and write its
    artefacts under ``out``.

    Every limit is counted (``budgets``): the run is a series of bounded Hypothesis runs
    (flat memory), Hypothesis's shrinker gets ``budgets.shrink_steps`` steps after the
    first failure (it is slow on failures dozens of steps long, where replay is fast),
    and the minimiser a number of replays. Hypothesis's local-constants pool is held
    fixed (``deterministic_hypothesis``) so the same seed draws the same examples whatever
    else the process imported.
    """
    artefacts = _Artefacts(machine, out, seed)
    stats = machine.stats
    run_settings = _run_settings(machine, run_settings)
    started = time.perf_counter()
    first_failure: list[tuple[int, float, int]] = []
    before_shrinking = (0, 0)

    def on_failure(failure: FailureReport) -> None:
        nonlocal before_shrinking
        if not first_failure:
            first_failure.append((stats.examples, time.perf_counter() - started, len(failure.records)))
            before_shrinking = (stats.examples, stats.steps)
            stats.shrink_stop_at_step = stats.steps + budgets.shrink_steps
            stats.shrink_stop_at_example = stats.examples + budgets.shrink_examples
        artefacts.offer(failure)

    stats.on_failure = on_failure
    stats.on_example = progress
    captured = io.StringIO()
    interrupted = shrink_cut = False
    try:
        with deterministic_hypothesis(), with_reporter(lambda text: print(text, file=captured)):
            plan = chunk_seeds(seed, run_settings.max_examples, budgets.chunk_examples, budgets.single_run_examples)
            for chunk_seed, chunk_examples in plan:
                test = hypothesis_seed(chunk_seed)(machine)
                chunk_settings = settings(run_settings, max_examples=chunk_examples, derandomize=False)
                try:
                    run_state_machine_as_test(test, settings=chunk_settings)
                except ShrinkBudgetSpent:
                    # Hypothesis's shrinker spent its steps; minimise the shortest failure by replay.
                    stats.failure = stats.shortest
                    shrink_cut = True
                if stats.failure is not None:
                    break
    except KeyboardInterrupt:
        if stats.failure is None:
            raise
        # Keep the shortest failure seen, not the attempt the interrupt happened to stop.
        stats.failure = stats.shortest
        interrupted = True
    except BaseException as error:
        if stats.failure is None:
            raise
        captured.write("".join(getattr(error, "__notes__", [])))
    finally:
        stats.on_failure = stats.on_example = None
        stats.shrink_stop_at_step = stats.shrink_stop_at_example = None
    minimized = None
    if stats.failure is not None and minimize and not interrupted:
        try:
            minimized = minimize_failure(machine, stats.failure, max_replays=budgets.minimize_replays)
            minimized = _deepen(machine, run_settings, seed, minimized, budgets)
        except KeyboardInterrupt:
            interrupted = minimized is None
    failure = minimized.report if minimized is not None else stats.failure
    examples, steps = before_shrinking if first_failure else (stats.examples, stats.steps)
    result = FuzzResult(
        target=machine.target.name,
        seed=seed,
        examples=examples,
        steps=steps,
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
        shrink_examples=stats.examples - examples,
        shrink_steps=stats.steps - steps,
        requested_examples=run_settings.max_examples,
    )
    if failure is not None:
        written = artefacts.final(failure)
        if written is not None:
            result.trace_path, result.regression_path = written
    result.write_error = artefacts.write_error
    return result


def _deepen(
    machine: type[ShardMachine],
    run_settings: settings,
    seed: int,
    minimized: MinimizedFailure,
    budgets: Budgets,
) -> MinimizedFailure:
    """Iterative deepening (SHRINKING.md): search again with fewer steps than the failure
    has, for the same property; a shorter one found is minimised and replaces it. This
    escapes minima that deleting steps cannot leave (a fault-based route to a bug that a
    plainer route reaches in fewer steps)."""
    while len(minimized.report.records) > 1:
        shorter = _search_shorter(machine, run_settings, seed, minimized.report, budgets)
        if shorter is None:
            break
        again = minimize_failure(machine, shorter, max_replays=budgets.minimize_replays)
        if len(again.report.records) >= len(minimized.report.records):
            break
        minimized = again
    return minimized


def _search_shorter(
    machine: type[ShardMachine],
    run_settings: settings,
    seed: int,
    failure: FailureReport,
    budgets: Budgets,
) -> FailureReport | None:
    limit = len(failure.records) - 1
    stats = RunStats(only_property=failure.violation.property)
    probe = type(f"{machine.__name__}Shorter", (machine,), {"stats": stats})

    def start_shrink_budget(found: FailureReport) -> None:
        if stats.shrink_stop_at_step is None:
            stats.shrink_stop_at_step = stats.steps + budgets.shrink_steps
            stats.shrink_stop_at_example = stats.examples + budgets.shrink_examples

    stats.on_failure = start_shrink_budget
    probe_settings = settings(
        run_settings,
        stateful_step_count=limit,
        max_examples=budgets.deepening_examples,
        phases=[Phase.generate, Phase.shrink],
        database=None,
        derandomize=False,
    )
    try:
        with deterministic_hypothesis(), with_reporter(lambda text: None):
            run_state_machine_as_test(hypothesis_seed(seed)(probe), settings=probe_settings)
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
    budgets: Budgets = Budgets(),
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
    # Hypothesis's defaults otherwise, exactly as a TestCase run with --shardkit-seed has them,
    # so that both routes report the same failure from the same seed.
    run_settings = settings(max_examples=examples, stateful_step_count=steps, database=None, derandomize=False)
    try:
        result = run_machine(
            machine, run_settings, seed=seed, out=out, minimize=minimize, progress=progress, budgets=budgets
        )
    finally:
        if started_workers:
            assert isolation is not None
            isolation.close()
    result.rerun_command = _fuzz_command(machine.target.name, seed, examples, steps, role, faults, twins)
    if machine.reference is not None:
        result.rerun_command += f" --reference {shlex.quote(machine.reference.name)}"
    if isolation is not None:
        result.rerun_command += " " + " ".join(isolation.options.command_options())
    elif step_timeout is not None:
        result.rerun_command += f" --step-timeout {step_timeout:g}"
    return result


def _fuzz_command(
    target: str, seed: int, examples: int, steps: int, role: str | None, faults: object, twins: bool
) -> str:
    parts = ["shardkit", "fuzz", shlex.quote(target), "--seed", str(seed)]
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


def suite_seed(machine: type[ShardMachine], derandomized: bool) -> int:
    """The seed of a pytest run that names none: derived from the machine's identity when
    the profile is derandomized (every run repeats the same examples), else a fresh one,
    which a failure prints."""
    if derandomized:
        return int.from_bytes(hashlib.sha256(machine_identity(machine).encode()).digest()[:4], "little")
    return random.SystemRandom().randrange(2**32)


def run_as_test(machine: type[ShardMachine], explicit_settings: settings | None) -> None:
    """What a machine's ``TestCase`` runs under pytest: the same run as ``shardkit fuzz``,
    raising ``AssertionError`` with the minimal failure and how to rerun it.

    With ``--shardkit-seed N`` the run is exactly ``shardkit fuzz … --seed N`` (same
    settings, no example database); otherwise it runs under the suite's settings or profile
    (``_profiles.suite_settings``) with a seed derived as ``suite_seed`` says."""
    from .pytest_plugin import session_overrides
    from .report import render_failure

    __tracebackhide__ = True  # pytest: show the failure, not the runner's frames
    overrides = session_overrides()
    suite = machine
    if overrides.engine is not None:
        machine = machine_for(overrides.engine, **machine.build_options)
    run_settings, _ = suite_settings(explicit_settings)
    if overrides.seed is not None:
        seed = overrides.seed
        run_settings = settings(run_settings, database=None, derandomize=False)
    else:
        seed = suite_seed(machine, run_settings.derandomize)
    result = run_machine(machine, run_settings, seed=seed, out=overrides.out or DEFAULT_OUT)
    if result.failure is not None:
        engine = f" --shardkit-engine {shlex.quote(overrides.engine)}" if overrides.engine is not None else ""
        # pytest names the running test in PYTEST_CURRENT_TEST ("path::Class::test (call)"):
        # rerun that test alone, not every suite the project's testpaths collect.
        current = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]
        selected = f" {shlex.quote(current)}" if current else ""
        result.rerun_command = f"pytest{selected} --shardkit-seed {seed}{engine}"
        if overrides.seed is None and run_settings.derandomize:
            result.rerun_command += "  (or plain pytest: the profile is derandomized)"
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
