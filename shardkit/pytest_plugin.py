"""The pytest plugin (entry point ``pytest11``): options to point the stateful
suites at another engine and seed, the seed in the header, and the replay
command in a failing suite's report. A thin adapter: the work is in ``shardkit._run.suite``."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Registers the shardkit-* profiles as pytest loads this plugin, before Hypothesis's own
# plugin loads the profile --hypothesis-profile names.
from shardkit._machine import profiles as _profiles
from shardkit._process import session as session_supervision

if TYPE_CHECKING:
    from shardkit._run.suite import SuiteOverrides

__all__ = ()  # pytest's hooks only

ENGINE_OPTION = "--shardkit-engine"
SEED_OPTION = "--shardkit-seed"
OUT_OPTION = "--shardkit-out"


#: Where this session's overrides are kept on pytest's config.
OVERRIDES_KEY: pytest.StashKey[SuiteOverrides] = pytest.StashKey()
#: The ids of the tests whose machine runs in more than one test of the session.
SHARED_MACHINE_TESTS_KEY: pytest.StashKey[frozenset[str]] = pytest.StashKey()
#: The session's exit status, for the verdict a supervised session sends (docs/process.md).
EXIT_STATUS_KEY: pytest.StashKey[int] = pytest.StashKey()
#: How the pytest-xdist controller hands its seed to its workers (``workerinput``).
WORKER_SEED_KEY = "shardkit_seed"


def _seed(text: str) -> int:
    from shardkit._run.runner import parse_seed

    try:
        return parse_seed(text, SEED_OPTION)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


def _check_out_folder(out: str | None, named_by: str) -> None:
    """Where the traces go must be a folder (or not exist yet): a failure found must never
    lose its trace to a typo, found out only once a suite has failed."""
    if out is None:
        return
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise pytest.UsageError(f"{named_by} {out} is a file, not a folder; name a folder for the failure traces")
    existing = next((parent for parent in folder.parents if parent.exists()), Path("."))
    if not existing.is_dir():
        raise pytest.UsageError(f"{named_by} {out} cannot be created: {existing} is a file, not a folder")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardkit", "shardkit: fuzzing shard engines")
    group.addoption(
        ENGINE_OPTION,
        dest="shardkit_engine",
        default=None,
        metavar="TARGET",
        help="fuzz this engine (package.module:factory or path.py:factory) in the shardkit suites, "
        "and replay generated regression tests against it",
    )
    group.addoption(
        SEED_OPTION,
        dest="shardkit_seed",
        default=None,
        metavar="N",
        help="seed the shardkit suites (an integer, or 'random'); default: the profile's (derandomized in CI)",
    )
    group.addoption(
        OUT_OPTION,
        dest="shardkit_out",
        default=None,
        metavar="DIR",
        help="where failure traces go ($SHARDKIT_OUT if set, else .shardkit/failures)",
    )


def pytest_configure(config: pytest.Config) -> None:
    from shardkit._run.suite import OUT_ENVIRONMENT, SuiteOverrides

    engine = config.getoption("shardkit_engine")
    seed_text = config.getoption("shardkit_seed")
    out = config.getoption("shardkit_out")
    if engine is not None:
        from shardkit._transport.resolve import resolve_target

        try:
            resolve_target(engine)
        except ValueError as error:
            raise pytest.UsageError(f"{ENGINE_OPTION}: {error}") from None
    _check_out_folder(out, OUT_OPTION)
    _check_out_folder(os.environ.get(OUT_ENVIRONMENT) or None, f"${OUT_ENVIRONMENT}")
    # Under pytest-xdist every worker takes the controller's seed: "--shardkit-seed random"
    # parsed in each worker would give each its own, and not the one the header printed.
    worker_input = getattr(config, "workerinput", None)
    if isinstance(worker_input, dict) and WORKER_SEED_KEY in worker_input:
        seed = worker_input[WORKER_SEED_KEY]
    else:
        seed = _seed(seed_text) if seed_text is not None else None
    config.stash[OVERRIDES_KEY] = SuiteOverrides(engine=engine, seed=seed, out=Path(out) if out else None)
    config.stash[SHARED_MACHINE_TESTS_KEY] = frozenset()
    session_supervision.begin_session(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """A session that runs shardkit suites runs its tests in a child process whose verdict
    the engine cannot change by ending it (docs/process.md)."""
    session_supervision.supervise_session(session)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tell a supervising parent which test runs: the one a process's end is blamed on."""
    session_supervision.on_test_start(item)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[EXIT_STATUS_KEY] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    session_supervision.end_session(config, config.stash.get(EXIT_STATUS_KEY, int(pytest.ExitCode.INTERNAL_ERROR)))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller, as it starts a worker: hand it the seed it drew."""
    node.workerinput[WORKER_SEED_KEY] = node.config.stash[OVERRIDES_KEY].seed


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find the tests whose machine runs in more than one test of the session (one suite
    collected under several names or from several files): each gets a seed of its own
    (``item_seed``). Every pytest-xdist worker collects the same tests, so each worker
    finds the same ones, however the tests are then handed out."""
    machines = {item.nodeid: getattr(getattr(item, "cls", None), "shardkit_machine", None) for item in items}
    counts = Counter(machine for machine in machines.values() if machine is not None)
    shared = frozenset(nodeid for nodeid, machine in machines.items() if machine is not None and counts[machine] > 1)
    config.stash[SHARED_MACHINE_TESTS_KEY] = shared


def pytest_report_header(config: pytest.Config) -> str:
    """What the shardkit suites will run; it must not promise a profile or a seed the run
    does not use. Suites that set ``TestCase.settings`` keep their own sizes."""
    chosen, source = _profiles.suite_settings(None)
    overrides = config.stash[OVERRIDES_KEY]
    seed = overrides.seed
    if seed is not None:
        seeding = f"seed {seed} (--shardkit-seed)"
    elif chosen.derandomize:
        seeding = "derandomized: each suite's seed derives from its engine"
    else:
        seeding = "a fresh seed each run, printed with a failure"
    sizes = f"{chosen.max_examples} examples × {chosen.stateful_step_count} steps"
    engine = overrides.engine or "each suite's own"
    return f"shardkit: {seeding}; {source} ({sizes}) unless a suite sets its own; engine {engine}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Hand the command line's overrides to a shardkit suite's ``TestCase`` as it runs."""
    instance = getattr(item, "instance", None)
    if instance is not None and hasattr(instance, "shardkit_overrides"):
        overrides = item.config.stash[OVERRIDES_KEY]
        if item.nodeid in item.config.stash[SHARED_MACHINE_TESTS_KEY]:
            overrides = replace(overrides, item=item.nodeid)
        instance.shardkit_overrides = overrides


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.failed and call.when == "call" and call.excinfo is not None:
        reproduce = getattr(call.excinfo.value, "shardkit_reproduce", None)
        if isinstance(reproduce, str):
            report.sections.append(("shardkit: reproduce", reproduce))
    return report
