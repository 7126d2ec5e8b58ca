"""The pytest plugin (entry point ``pytest11``): options to point the stateful
suites at another engine and seed, the seed in the header, and the replay
command in a failing suite's report. A thin adapter: the work is in ``runner``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Registers the shardkit-* profiles as pytest loads this plugin, before Hypothesis's own
# plugin loads the profile --hypothesis-profile names.
from . import _profiles

__all__ = ["SessionOverrides", "session_overrides"]

ENGINE_OPTION = "--shardkit-engine"
SEED_OPTION = "--shardkit-seed"
OUT_OPTION = "--shardkit-out"


@dataclass
class SessionOverrides:
    """What the command line asked of every shardkit machine in this pytest session."""

    engine: str | None = None
    seed: int | None = None
    out: Path | None = None


_overrides = SessionOverrides()


def session_overrides() -> SessionOverrides:
    return _overrides


def _seed(text: str) -> int:
    from .runner import parse_seed

    try:
        return parse_seed(text, SEED_OPTION)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None


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
        help="where failure traces go (.shardkit/failures)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _overrides
    engine = config.getoption("shardkit_engine")
    seed_text = config.getoption("shardkit_seed")
    out = config.getoption("shardkit_out")
    if engine is not None:
        from .targets import resolve_target

        try:
            resolve_target(engine)
        except ValueError as error:
            raise pytest.UsageError(f"{ENGINE_OPTION}: {error}") from None
    _overrides = SessionOverrides(
        engine=engine, seed=_seed(seed_text) if seed_text is not None else None, out=Path(out) if out else None
    )


def pytest_report_header(config: pytest.Config) -> str:
    """What the shardkit suites will run; it must not promise a profile or a seed the run
    does not use. Suites that set ``TestCase.settings`` keep their own sizes."""
    chosen, source = _profiles.suite_settings(None)
    seed = _overrides.seed
    if seed is not None:
        seeding = f"seed {seed} (--shardkit-seed)"
    elif chosen.derandomize:
        seeding = "derandomized: each suite's seed derives from its engine"
    else:
        seeding = "a fresh seed each run, printed with a failure"
    sizes = f"{chosen.max_examples} examples × {chosen.stateful_step_count} steps"
    engine = _overrides.engine or "each suite's own"
    return f"shardkit: {seeding}; {source} ({sizes}) unless a suite sets its own; engine {engine}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.failed and call.when == "call":
        from .runner import rerun_hint

        hint = rerun_hint(getattr(getattr(item, "cls", None), "runTest", None))
        if hint is not None:
            report.sections.append(("shardkit: reproduce", hint))
    return report
