"""The same seed gives the same failure: on a loaded machine, under pytest, whatever else is imported.

Nothing that decides which failure is reported may read the clock, and Hypothesis's draws
must not depend on the modules a process happens to have loaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from shardkit._machine.hypothesis_adapter import deterministic_hypothesis, local_constants_hook_available
from shardkit._run.options import Budgets
from shardkit._run.runner import fuzz
from tests.determinism_targets import SlowedCancelLeak

SHARDKIT = str(Path(sys.executable).with_name("shardkit"))
TARGET = "tests.determinism_targets:SlowedCancelLeak"
TIMING = re.compile(r"\d+(\.\d+)?s \([\d,]+ steps/s\)")


def _env(repo_root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(repo_root), **extra}
    env.pop("SHARDKIT_TEST_CALL_DELAY", None)
    env.update(extra)
    return env


def _cli_run(repo_root: Path, work: Path, *, loaded: bool) -> dict[str, Any]:
    """One ``shardkit fuzz`` of the planted cancel leak; with ``loaded``, two processes burn
    both cores and every engine call is slowed down, as on a busy CI machine."""
    work.mkdir()
    out, report = work / "out", work / "report.json"
    command = [SHARDKIT, "fuzz", TARGET, "--seed", "3", "--examples", "100", "--out", str(out), "--report", str(report)]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)] if loaded else []
    try:
        env = _env(repo_root, SHARDKIT_TEST_CALL_DELAY="0.0015") if loaded else _env(repo_root)
        finished = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert finished.returncode == 1, finished.stdout + finished.stderr
    document = json.loads(report.read_text())
    del document["elapsed_s"]
    files = {path.name: path.read_bytes() for path in sorted(out.iterdir())}
    shutil.rmtree(work)  # the next run writes to the same paths
    return {"report": document, "stdout": TIMING.sub("<time>", finished.stdout), "files": files}


def test_a_loaded_machine_reports_the_same_failure_byte_for_byte(repo_root: Path, tmp_path: Path) -> None:
    """Two runs of one seed, the second with both cores busy and a slowed engine: the same report,
    trace and regression test, apart from the timing fields."""
    quiet = _cli_run(repo_root, tmp_path / "run", loaded=False)
    busy = _cli_run(repo_root, tmp_path / "run", loaded=True)
    assert quiet["report"] == busy["report"]
    assert quiet["files"] == busy["files"]
    assert quiet["stdout"] == busy["stdout"]
    assert "FAILURE (§2 metrics) in 2 steps" in quiet["stdout"]


def test_a_shrink_cut_short_by_its_budget_is_cut_at_the_same_place_however_slow_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shrink budget counts steps: a slow engine spends more time, not fewer shrinks."""
    budgets = Budgets(shrink_steps=150, minimize_replays=40)
    fast = fuzz(SlowedCancelLeak, seed=3, examples=100, steps=50, budgets=budgets)
    monkeypatch.setenv("SHARDKIT_TEST_CALL_DELAY", "0.001")
    slow = fuzz(SlowedCancelLeak, seed=3, examples=100, steps=50, budgets=budgets)
    assert fast.shrink_cut
    assert slow.shrink_cut
    assert fast.failure is not None
    assert slow.failure is not None
    assert [r.action for r in fast.failure.records] == [r.action for r in slow.failure.records]
    assert (fast.examples, fast.steps, fast.shrink_examples, fast.shrink_steps) == (
        slow.examples,
        slow.steps,
        slow.shrink_examples,
        slow.shrink_steps,
    )
    assert slow.elapsed_s > fast.elapsed_s


class _WideDraws(RuleBasedStateMachine):
    """Draws integers wide enough for Hypothesis's local constants to apply."""

    drawn: ClassVar[list[int]] = []

    @rule(value=st.integers(0, 2**40))
    def draw(self, value: int) -> None:
        _WideDraws.drawn.append(value)


def _draws_with(extra_module: Path | None) -> list[int]:
    if extra_module is not None:
        sys.path.insert(0, str(extra_module.parent))
        try:
            __import__(extra_module.stem)
        finally:
            sys.path.remove(str(extra_module.parent))
    _WideDraws.drawn = []
    run = settings(max_examples=150, stateful_step_count=10, database=None, deadline=None)
    with deterministic_hypothesis():
        run_state_machine_as_test(_seeded(_WideDraws), settings=run)
    return list(_WideDraws.drawn)


def _seeded(machine: type[RuleBasedStateMachine]) -> type[RuleBasedStateMachine]:
    from hypothesis import seed

    return seed(11)(machine)  # type: ignore[no-any-return]


@pytest.mark.skipif(not local_constants_hook_available(), reason="this Hypothesis collects no local constants")
def test_modules_imported_later_do_not_change_what_a_seed_draws(tmp_path: Path) -> None:
    """A local module full of integer constants, imported between two runs of one seed, changes
    nothing: the hook holds Hypothesis's local-constants pool empty while shardkit draws."""
    before = _draws_with(None)
    constants = ", ".join(str(1_000_003 * index + 777) for index in range(1, 400))
    module = tmp_path / "shardkit_test_many_constants.py"
    module.write_text(f"VALUES = ({constants},)\n")
    after = _draws_with(module)
    assert before == after
    from hypothesis.internal.conjecture import providers

    collected = providers._get_local_constants().integers
    assert 1_000_003 + 777 in collected, (
        "the module's constants are collected outside the hook: the test proves nothing"
    )


SUITE = """
import shardkit_test_extra_constants  # a local module full of integer constants
from shardkit import machine_for

TestCancelLeak = machine_for("tests.planted:CancelLeaksKvTokens").TestCase
"""


def test_the_cli_and_a_pytest_run_report_the_same_failure_from_one_seed(
    pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shardkit fuzz --seed 3`` and ``pytest --shardkit-seed 3`` on a suite that imports other
    modules write the same trace."""
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    constants = ", ".join(str(7_000_001 * index) for index in range(1, 300))
    pytester.makepyfile(shardkit_test_extra_constants=f"VALUES = ({constants},)\n", test_suite=textwrap.dedent(SUITE))
    cli = subprocess.run(
        [SHARDKIT, "fuzz", "tests.planted:CancelLeaksKvTokens", "--seed", "3", "--out", "cli"],
        cwd=pytester.path,
        env=_env(repo_root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert cli.returncode == 1, cli.stdout + cli.stderr
    result = pytester.runpytest_subprocess("test_suite.py", "--shardkit-seed", "3", "--shardkit-out", "suite")
    result.assert_outcomes(failed=1)
    cli_traces = sorted((pytester.path / "cli").glob("*.json"))
    suite_traces = sorted((pytester.path / "suite").glob("*.json"))
    assert [path.name for path in cli_traces] == [path.name for path in suite_traces]
    assert len(cli_traces) == 1
    assert json.loads(cli_traces[0].read_text()) == json.loads(suite_traces[0].read_text())


def test_hypothesis_does_not_stop_shrinking_on_the_clock_inside_a_shardkit_run() -> None:
    """Hypothesis ends a shrink after five minutes of wall-clock time; shardkit's counted budget
    bounds shrinking instead, so inside a run that limit is lifted, and restored after."""
    from hypothesis.internal.conjecture import engine

    before = engine.MAX_SHRINKING_SECONDS
    with deterministic_hypothesis(), deterministic_hypothesis():
        assert engine.MAX_SHRINKING_SECONDS >= 10**9
    assert before == engine.MAX_SHRINKING_SECONDS
