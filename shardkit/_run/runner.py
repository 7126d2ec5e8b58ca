"""One fuzzing run end to end: run Hypothesis on a machine, minimise, hand the failure
to its artefacts.

``fuzz`` serves the CLI and the benchmark; ``run_as_test`` serves the machines'
pytest ``TestCase``. Neither prints: the CLI and pytest render the result
(``shardkit._run.report``). What the run leaves on disk — the in-progress and final
trace, the regression test, the engine-keyed example database — is
``shardkit._run.artefacts``'s; the result itself is ``shardkit._run.result.FuzzResult``.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from shardkit._core.driver import StepFailed
from shardkit._core.native_threads import pinned_native_threads
from shardkit._core.properties import LABEL_ANCHORS
from shardkit._core.sensitivity import history_sensitivity
from shardkit._core.targets import EngineFactory, ResolvedTarget, Target, engine_target
from shardkit._machine.build import build_machine
from shardkit._machine.hypothesis_adapter import ShrinkBudgetSpent, deterministic_hypothesis
from shardkit._machine.minimize import MinimizedFailure, minimize_failure
from shardkit._machine.observer import FailureReport, RunObserver, observed
from shardkit._machine.state_machine import ShardMachine
from shardkit._public import settle
from shardkit._run.artefacts import Artefacts, run_settings_for
from shardkit._run.database import open_database
from shardkit._run.options import DEFAULT_BUDGETS, Budgets, FuzzOptions
from shardkit._run.result import FuzzResult
from shardkit._run.trace import DEFAULT_OUT
from shardkit.errors import InvalidTarget

__all__ = [
    "DEFAULT_OUT",
    "Budgets",
    "fuzz",
    "parse_seed",
    "run_machine",
]

Progress = Callable[[int, int, int], None]  # examples done, steps done, failures seen


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


# Native thread pools (BLAS, OpenMP) pinned for the run, minimising included: native_threads.py.
@pinned_native_threads()
def run_machine(
    machine: type[ShardMachine],
    run_settings: settings,
    *,
    seed: int,
    out: Path | None,
    minimize: bool = True,
    progress: Progress | None = None,
    budgets: Budgets = DEFAULT_BUDGETS,
    shrink_examples: int | None = None,
) -> FuzzResult:
    """Run Hypothesis on ``machine`` from ``seed``; minimise a failure and write its
    artefacts under ``out``. ``shrink_examples`` bounds the examples and replays all the
    stages of shrinking spend together (``_ShrinkPool``); None leaves each its own budget.

    Every limit is counted (``budgets``): the run is a series of bounded Hypothesis runs
    (flat memory), Hypothesis's shrinker gets ``budgets.shrink_steps`` steps after the
    first failure (it is slow on failures dozens of steps long, where replay is fast),
    and the minimiser a number of replays. Hypothesis's local-constants pool is held
    fixed (``deterministic_hypothesis``) so the same seed draws the same examples whatever
    else the process imported.
    """
    artefacts = Artefacts(machine, out, seed)
    run_settings = run_settings_for(machine, run_settings)
    # Before the first example, on engines of its own: how much of a corrupted cache the oracle can see.
    sensitivity = history_sensitivity(machine._target)
    started = time.perf_counter()
    first_failure: list[tuple[int, float, int]] = []
    before_shrinking = (0, 0)
    caveats_before_shrinking: Counter[str] = Counter()
    coverage_before_shrinking: Counter[tuple[str, str]] = Counter()
    sessions_before_shrinking: Counter[int] = Counter()
    pool = _ShrinkPool(shrink_examples)

    def on_failure(failure: FailureReport) -> None:
        nonlocal before_shrinking
        if not first_failure:
            first_failure.append((stats.examples, time.perf_counter() - started, len(failure.records)))
            before_shrinking = (stats.examples, stats.steps)
            caveats_before_shrinking.update(stats.caveats)
            coverage_before_shrinking.update(stats.coverage)
            sessions_before_shrinking.update(stats.longest_session)
            stats.shrink_stop_at_step = stats.steps + budgets.shrink_steps
            # Half the pool at most: replay minimises more per example than Hypothesis's shrinker.
            stats.shrink_stop_at_example = stats.examples + pool.take(budgets.shrink_examples, share=2)
        artefacts.offer(failure)

    stats = RunObserver(on_failure=on_failure, on_example=progress)
    run_class = observed(machine, stats)
    captured = io.StringIO()
    interrupted = shrink_cut = False
    try:
        with deterministic_hypothesis(), with_reporter(lambda text: print(text, file=captured)):
            plan = chunk_seeds(seed, run_settings.max_examples, budgets.chunk_examples, budgets.single_run_examples)
            for chunk_seed, chunk_examples in plan:
                test = hypothesis_seed(chunk_seed)(run_class)
                chunk_settings = settings(run_settings, max_examples=chunk_examples, derandomize=False)
                try:
                    run_state_machine_as_test(test, settings=chunk_settings)
                except ShrinkBudgetSpent:
                    # Hypothesis's shrinker spent its steps; minimise the shortest failure by replay.
                    stats.failure = stats.shortest
                    shrink_cut = True
                if stats.failure is not None:
                    break
    except BaseException as error:
        if _interrupt_within(error):
            if stats.failure is None:
                if isinstance(error, KeyboardInterrupt):
                    raise
                raise KeyboardInterrupt from error
            # Keep the shortest failure seen, not the attempt the interrupt happened to stop.
            stats.failure = stats.shortest
            interrupted = True
        elif stats.failure is None:
            engine_error = _engine_error_within(error)
            if engine_error is error:
                raise
            raise engine_error from error
        else:
            captured.write("".join(getattr(error, "__notes__", [])))
    if first_failure:
        pool.spend(stats.examples - before_shrinking[0])
    minimized = None
    if stats.failure is not None and minimize and not interrupted and pool.left != 0:
        try:
            minimized = minimize_failure(machine, stats.failure, max_replays=pool.take(budgets.minimize_replays))
            pool.spend(minimized.replays)
            minimized = _deepen(machine, run_settings, seed, minimized, budgets, pool)
        except BaseException as error:
            if not _interrupt_within(error):
                raise
            interrupted = minimized is None
    failure = minimized.report if minimized is not None else stats.failure
    examples, steps = before_shrinking if first_failure else (stats.examples, stats.steps)
    caveats = caveats_before_shrinking if first_failure else stats.caveats
    for kind, why in machine._skipped_faults.items():
        caveats[f"the {kind} fault (docs/contract.md#{LABEL_ANCHORS['§4 ' + kind]}): {why}"] = examples
    blind_spot = sensitivity.caveat()
    if blind_spot is not None:
        caveats[blind_spot] = examples
    elapsed = time.perf_counter() - started
    written = artefacts.final(failure) if failure is not None else None
    trace_path, regression_path = written if written is not None else (None, None)
    return FuzzResult(
        target=machine._target.name,
        seed=seed,
        examples=examples,
        steps=steps,
        elapsed_s=elapsed,
        # The counts, the coverage and the caveats all cover the same examples: those run
        # until the first failure (shrinking replays variants of it, it explores nothing).
        coverage=coverage_before_shrinking if first_failure else stats.coverage,
        failure=failure,
        caveats=caveats,
        hypothesis_output=captured.getvalue(),
        faults=machine._fault_kinds,
        hypothesis_failure=stats.failure,
        minimized=minimized,
        interrupted=interrupted,
        first_failure=first_failure[0] if first_failure else None,
        shrink_cut=shrink_cut,
        shrink_budget_spent=pool.left == 0,
        shrink_work=pool.used,
        shrink_examples=stats.examples - examples,
        shrink_steps=stats.steps - steps,
        requested_examples=run_settings.max_examples,
        longest_session=sessions_before_shrinking if first_failure else stats.longest_session,
        trace_path=trace_path,
        regression_path=regression_path,
        write_error=artefacts.write_error,
    )


def _interrupt_within(error: BaseException) -> bool:
    """Whether ``error`` is a Ctrl-C, or was raised while one was being handled: an interrupt
    that lands inside Hypothesis's own machinery (computing a database key, say) can come out
    of it as another error, with the ``KeyboardInterrupt`` as its context. It is the user's
    interrupt all the same, never a failure of the kit or of the engine."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _engine_error_within(error: BaseException) -> BaseException:
    """What to report for an error that ended the run before any failure: ``error`` itself,
    unless it is Hypothesis's ``Flaky`` around an engine that could not be built
    (``InvalidTarget``: its ``load`` or ``capabilities`` raised) on one run of an example and
    not on the replay. That is the engine's doing, never the kit's: the engine's error, saying
    it happened only sometimes (threads or memory running out, say)."""
    if not isinstance(error, Flaky):
        return error
    seen: set[int] = set()
    waiting: list[BaseException] = [error]
    while waiting:
        inner = waiting.pop()
        if id(inner) in seen:
            continue
        seen.add(id(inner))
        if isinstance(inner, InvalidTarget):
            message = (
                f"{inner}; it happened on one run of an example and not when the same example ran again: "
                "the engine fails to be built only sometimes (threads, memory or another resource running out?)"
            )
            return InvalidTarget(message)
        waiting.extend(getattr(inner, "exceptions", ()))
        waiting.extend(chained for chained in (inner.__cause__, inner.__context__) if chained is not None)
    return error


def _deepen(
    machine: type[ShardMachine],
    run_settings: settings,
    seed: int,
    minimized: MinimizedFailure,
    budgets: Budgets,
    pool: _ShrinkPool,
) -> MinimizedFailure:
    """Iterative deepening: search again with fewer steps than the failure
    has, for the same property; a shorter one found is minimised and replaces it. This
    escapes minima that deleting steps cannot leave (a fault-based route to a bug that a
    plainer route reaches in fewer steps)."""
    while len(minimized.report.records) > 1 and pool.left != 0:
        shorter = _search_shorter(machine, run_settings, seed, minimized.report, budgets, pool)
        if shorter is None or pool.left == 0:
            break
        again = minimize_failure(machine, shorter, max_replays=pool.take(budgets.minimize_replays))
        pool.spend(again.replays)
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
    pool: _ShrinkPool,
) -> FailureReport | None:
    """A failure of the same property in fewer steps, found by a search of at most
    ``budgets.deepening_examples`` examples (and its shrinking) taken from ``pool``."""
    limit = len(failure.records) - 1
    searches = pool.take(budgets.deepening_examples)

    def start_shrink_budget(found: FailureReport) -> None:
        if stats.shrink_stop_at_step is None:
            stats.shrink_stop_at_step = stats.steps + budgets.shrink_steps
            stats.shrink_stop_at_example = stats.examples + pool.take(budgets.shrink_examples, spent=stats.examples)

    stats = RunObserver(only_property=failure.violation.property, on_failure=start_shrink_budget)
    probe = observed(machine, stats)
    probe_settings = settings(
        run_settings,
        stateful_step_count=limit,
        max_examples=searches,
        phases=[Phase.generate, Phase.shrink],
        database=None,
        derandomize=False,
    )
    try:
        with deterministic_hypothesis(), with_reporter(lambda text: None):
            run_state_machine_as_test(hypothesis_seed(seed)(probe), settings=probe_settings)
    except (ShrinkBudgetSpent, StepFailed, Flaky):
        # A failure of the property ended the search (Flaky: a race that showed on one run
        # and not on Hypothesis's replay of it); stats.shortest holds the shortest seen.
        pass
    pool.spend(stats.examples)
    found = stats.shortest
    return found if found is not None and len(found.records) <= limit else None


class _ShrinkPool:
    """The examples and replays left to shrinking (``--shrink-examples``), which every stage
    takes its budget from in turn: Hypothesis's shrinker, the replay minimiser, then each
    search for a shorter failure and its minimisation. ``left`` None: no common bound, each
    stage has its own ``Budgets``. A count, never a time: the same seed shrinks alike anywhere."""

    def __init__(self, total: int | None) -> None:
        self.left = total
        #: What the stages spent, bounded or not.
        self.used = 0

    def take(self, budget: int, *, spent: int = 0, share: int = 1) -> int:
        """What a stage of ``budget`` may run: ``1/share`` of what the pool holds beyond the
        ``spent`` in use already."""
        return budget if self.left is None else min(budget, max(self.left - spent, 0) // share)

    def spend(self, count: int) -> None:
        self.used += count
        if self.left is not None:
            self.left = max(self.left - count, 0)


def fuzz(
    target: str | EngineFactory | Target | ResolvedTarget | None = None,
    options: FuzzOptions | None = None,
    *,
    seed: int,
    out: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    **changes: Any,
) -> FuzzResult:
    """Fuzz ``target`` reproducibly from ``seed`` with ``options`` (``FuzzOptions``; any of
    its fields may also be given by name: ``fuzz(target, seed=1, examples=500)``); on a
    failure, minimise it further by replay (unless ``minimize`` is False) and write its
    trace and regression test under ``out`` (if given). The worker processes an isolated
    run starts end with it. ``target`` is None when the options name a ``worker_command``."""
    options = FuzzOptions.from_fields(options, changes)
    machine = build_machine(engine_target(target, options.worker_command), options)
    isolation = machine._target.isolation
    started_workers = isolation is not None and not (
        isinstance(target, ResolvedTarget) and target.isolation is isolation
    )
    # Hypothesis's defaults otherwise, exactly as a TestCase run with --shardkit-seed has them,
    # so that both routes report the same failure from the same seed. No example database
    # unless one is named: then its saved failures are replayed before the seed's examples.
    database = open_database(options.database_choice)
    run_settings = settings(
        max_examples=options.examples, stateful_step_count=options.steps, database=database, derandomize=False
    )
    try:
        result = run_machine(
            machine,
            run_settings,
            seed=seed,
            out=Path(out) if out is not None else None,
            minimize=options.minimize,
            progress=progress,
            budgets=options.budgets,
            shrink_examples=options.shrink_examples,
        )
    finally:
        if started_workers:
            assert isolation is not None
            isolation.close()
    reference = machine._reference.target if machine._reference is not None else None
    rerun_command = options.command(
        machine._target.target, seed, reference, isolation.options if isolation is not None else None
    )
    return replace(result, rerun_command=rerun_command)


settle(__name__, globals())
