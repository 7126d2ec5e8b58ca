"""A machine as a pytest suite: ``machine_for`` builds it, its ``TestCase`` runs the same
run as ``shardkit fuzz`` and fails with the minimal failure and how to rerun it."""

from __future__ import annotations

import hashlib
import os
import random
import shlex
import unittest
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from hypothesis import settings

from shardkit._core.model import ReferenceModel
from shardkit._core.targets import EngineFactory, IsolationOptions, ResolvedTarget, Target, engine_target
from shardkit._machine.build import build_machine
from shardkit._machine.observer import FailureReport
from shardkit._machine.profiles import suite_settings
from shardkit._machine.spec import MachineOptions, options_of
from shardkit._machine.state_machine import ShardMachine
from shardkit._public import settle
from shardkit._run.artefacts import Artefacts, machine_identity
from shardkit._run.database import (
    DATABASE_VARIABLE,
    READ_ONLY_VARIABLE,
    DatabaseChoice,
    database_from_environment,
    open_database,
)
from shardkit._run.report import render_failure
from shardkit._run.runner import run_machine
from shardkit._run.trace import DEFAULT_OUT
from shardkit.contract import Role
from shardkit.errors import KitBug, ShardkitError, SuiteFailure

__all__ = [
    "OUT_ENVIRONMENT",
    "SuiteOverrides",
    "item_seed",
    "keep_fuzzer_failures",
    "machine_for",
    "run_as_test",
    "suite_out",
    "suite_seed",
]

#: Where a suite's traces go when pytest's ``--shardkit-out`` does not say, and where a
#: machine HypoFuzz fuzzes leaves its traces (it runs no pytest options); else ``DEFAULT_OUT``.
OUT_ENVIRONMENT = "SHARDKIT_OUT"


@dataclass(frozen=True)
class SuiteOverrides:
    """What pytest's command line asks of every shardkit suite (the plugin hands it to each
    ``TestCase`` it runs); a ``TestCase`` run without the plugin has none."""

    engine: str | None = None
    seed: int | None = None
    out: Path | None = None
    #: The test's id when its machine runs in more than one test of the session (one suite
    #: collected under several names or in several files): each test's seed then derives
    #: from the run's seed and this id (``item_seed``), so no two fuzz the same examples.
    item: str | None = None


def machine_for(
    target_or_factory: str | EngineFactory | Target | ResolvedTarget | None = None,
    *,
    role: Role | str | None = None,
    faults: bool | str | Iterable[str] = True,
    twins: bool = True,
    reference: str | EngineFactory | Target | ResolvedTarget | None = None,
    model: Callable[[], ReferenceModel] | None = None,
    base: type[ShardMachine] = ShardMachine,
    name: str | None = None,
    extreme_values: bool = True,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
    concurrency: int = 1,
    worker_command: str | None = None,
) -> type[ShardMachine]:
    """A ``RuleBasedStateMachine`` fuzzing the engine against the reference model; collect
    its ``TestCase`` with pytest.

    ``role`` pins the shard role (None or "any" draws one per example); ``faults``
    is True/"all", False/"none" or a list of kinds; ``twins`` turns the twin
    oracle on; ``reference`` builds the twins from another engine, which fuzzes
    the target differentially against it (same statuses, same outputs); ``base`` is
    the machine class to extend with the fault rules and ``model`` builds the reference
    model (None: the ``model_factory`` of ``base``; see docs/extending.md). ``isolate`` runs every engine in
    a child process, whose calls get ``step_timeout`` seconds each and whose memory
    ``worker_memory_mb`` limits; ``step_timeout`` also applies to a remote target.
    ``concurrency`` of 2 or 3 ends examples with that many lanes of calls sent to the
    engine at the same time, checked for linearizability (docs/contract.md#linearizability);
    the engine must declare ``concurrent_calls`` in its capabilities. ``worker_command``
    names the engine instead of ``target_or_factory``: a command, in any language, that
    serves contract v1 on the address the kit puts in its ``{address}``; the kit starts it
    as isolated workers, whose deaths are failures like an isolated engine's
    (docs/any-language.md). ``extreme_values`` False never sends a middle or tail rows at
    the edges of its dtype's range (docs/numerics.md#extreme-values).
    """
    options = MachineOptions(
        role=role,  # type: ignore[arg-type]  # MachineOptions reads "any" as None
        faults=faults,  # type: ignore[arg-type]  # MachineOptions makes it canonical
        twins=twins,
        extreme_values=extreme_values,
        reference=reference,  # type: ignore[arg-type]  # typed by MachineOptions
        model=model,
        base=base,
        isolate=isolate,
        step_timeout=step_timeout,
        worker_memory_mb=worker_memory_mb,
        concurrency=concurrency,
    )
    return _suite_machine(engine_target(target_or_factory, worker_command), options, name)


def _suite_machine(
    target: Target | ResolvedTarget, options: MachineOptions, name: str | None = None
) -> type[ShardMachine]:
    """A machine whose ``TestCase`` runs as ``run_as_test`` says and whose failures under a fuzzer are kept."""
    return build_machine(target, options, name=name, suite_runner=run_as_test, fuzzer_failures=keep_fuzzer_failures)


def suite_seed(machine: type[ShardMachine], derandomized: bool) -> int:
    """The seed of a pytest run that names none: derived from the machine's identity when
    the profile is derandomized (every run repeats the same examples), else a fresh one,
    which a failure prints."""
    if derandomized:
        return int.from_bytes(hashlib.sha256(machine_identity(machine).encode()).digest()[:4], "little")
    return random.SystemRandom().randrange(2**32)


def item_seed(base: int, item: str) -> int:
    """The seed of one test among several that run the same machine: derived from the run's
    seed and the test's id, never from the worker or the order tests run in, so it is the
    same however pytest-xdist hands out the tests."""
    return int.from_bytes(hashlib.sha256(f"shardkit-item:{base}:{item}".encode()).digest()[:4], "little")


def suite_out(overrides: SuiteOverrides) -> Path:
    """Where a suite's traces go: ``--shardkit-out``, else ``$SHARDKIT_OUT``, else ``DEFAULT_OUT``."""
    if overrides.out is not None:
        return overrides.out
    return Path(os.environ[OUT_ENVIRONMENT]) if os.environ.get(OUT_ENVIRONMENT) else DEFAULT_OUT


def keep_fuzzer_failures(machine: type[ShardMachine]) -> Callable[[FailureReport], object]:
    """What a machine's failures become when a fuzzer such as HypoFuzz drives it directly:
    the shortest failure this process has seen, as a trace and regression test in
    ``suite_out`` (``shardkit replay`` reproduces it). No seed names it: the fuzzer's inputs
    are not a seed's."""
    return Artefacts(machine, suite_out(SuiteOverrides()), seed=None).keep_shortest


def run_as_test(machine: type[ShardMachine], test: unittest.TestCase) -> None:
    """What a machine's ``TestCase`` runs under pytest: the same run as ``shardkit fuzz``,
    raising ``SuiteFailure`` with the minimal failure and how to rerun it.

    With ``--shardkit-seed N`` the run is exactly ``shardkit fuzz … --seed N`` (same
    settings, no example database); otherwise it runs under the suite's settings or profile
    (``suite_settings``) with a seed derived as ``suite_seed`` says. ``SHARDKIT_DATABASE``,
    when set, is the example database of every run, as it is ``shardkit fuzz``'s default."""
    __tracebackhide__ = True  # pytest: show the failure, not the runner's frames
    overrides = getattr(test, "shardkit_overrides", None)
    if not isinstance(overrides, SuiteOverrides):
        overrides = SuiteOverrides()
    explicit = getattr(test, "settings", None)
    try:
        if overrides.engine is not None:
            machine = _suite_machine(engine_target(overrides.engine, None), options_of(machine))
        run_settings, _ = suite_settings(explicit if isinstance(explicit, settings) else None)
        if overrides.seed is not None:
            base_seed = overrides.seed
            run_settings = settings(run_settings, database=None, derandomize=False)
        else:
            base_seed = suite_seed(machine, run_settings.derandomize)
        seed = item_seed(base_seed, overrides.item) if overrides.item is not None else base_seed
        derandomized = run_settings.derandomize
        shared = database_from_environment()
        if shared is not None:
            # Derandomized profiles too, where Hypothesis would drop any database: shardkit seeds
            # every run itself, so the database only adds its saved failures before the seed's examples.
            run_settings = settings(run_settings, database=open_database(shared), derandomize=False)
        result = run_machine(machine, run_settings, seed=seed, out=suite_out(overrides))
    except ShardkitError as error:
        if isinstance(error, KitBug):
            raise
        # A suite set up wrong (an engine that does not declare what the machine needs, a
        # target that does not build): the message says what to fix, and the kit's frames
        # would bury it under a page of traceback (a cause, such as the engine's own import
        # error, is still shown).
        raise error.with_traceback(None) from error.__cause__
    if result.failure is not None:
        engine = f" --shardkit-engine {shlex.quote(overrides.engine)}" if overrides.engine is not None else ""
        # pytest names the running test in PYTEST_CURRENT_TEST ("path::Class::test (call)"):
        # rerun that test alone, not every suite the project's testpaths collect.
        current = os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]
        selected = f" {shlex.quote(current)}" if current else ""
        rerun_command = f"{_database_variables(shared)}pytest{selected} --shardkit-seed {seed}{engine}"
        if overrides.item is not None:
            # Run alone, the test is its machine's only one, so the seed printed is its own.
            rerun_command += f"  (this test's own seed, derived from the run's seed {base_seed} and its id)"
        elif overrides.seed is None and derandomized:
            rerun_command += "  (or plain pytest: the profile is derandomized)"
        message = render_failure(replace(result, rerun_command=rerun_command))
        if result.write_error:
            # The failure stands; what it could not leave on disk is said with it, not lost.
            message += f"\n(no trace was kept: {result.write_error})"
        raise SuiteFailure(message, message[message.index("reproduce:") :])


def _database_variables(shared: DatabaseChoice | None) -> str:
    """The variables that give a rerun the same example database (none when none was named);
    a password stays in the environment it came from."""
    if shared is None:
        return ""
    value = f'"${DATABASE_VARIABLE}"' if shared.shown != shared.value else shlex.quote(shared.value)
    read_only = f"{READ_ONLY_VARIABLE}=1 " if shared.read_only else ""
    return f"{DATABASE_VARIABLE}={value} {read_only}"


settle(__name__, globals())
