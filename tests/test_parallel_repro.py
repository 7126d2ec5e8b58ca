"""A race found by a machine with lanes is shrunk to the racing steps, written as a trace
that holds the phase, and replayed with its rate: by ``replay``, by ``shardkit replay`` and
by the generated regression test, each running the phase several times on fresh engines."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

from shardkit import replay
from shardkit._cli.main import main
from shardkit._core.driver import StepRecord, Violation
from shardkit._core.steps import PARALLEL_OP, Action, phase_action, step_action
from shardkit._core.targets import PythonTarget
from shardkit._machine.build import build_machine
from shardkit._machine.minimize import minimize_failure
from shardkit._machine.observer import FailureReport
from shardkit._machine.spec import MachineOptions
from shardkit._parallel.phase import LINEARIZABILITY
from shardkit._run.result import FuzzResult
from shardkit._run.runner import run_machine
from shardkit._run.trace_reader import read_trace
from shardkit.errors import TraceFormatError
from tests.test_parallel_phase import FULL, DecodeCounterRaces

LOCKED = "shardkit:FakeShardEngine"


def found(seed: int, out: Path) -> FuzzResult:
    machine = build_machine(PythonTarget(DecodeCounterRaces), MachineOptions(faults="none", concurrency=2))
    run_settings = settings(max_examples=300, stateful_step_count=50, database=None, deadline=None)
    result = run_machine(machine, run_settings, seed=seed, out=out)
    assert result.failure is not None, f"the lost update was not found at seed {seed}"
    return result


@pytest.fixture(scope="module")
def found_at_1(tmp_path_factory: pytest.TempPathFactory) -> FuzzResult:
    return found(1, tmp_path_factory.mktemp("seed-1"))


def phase_of(records: list[StepRecord]) -> list[list[Action]]:
    last = records[-1].action
    assert last.op == PARALLEL_OP, last
    return [list(lane) for lane in last.args["lanes"]]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_lost_update_shrinks_to_two_racing_decodes_and_replays_at_its_rate(seed: int, tmp_path: Path) -> None:
    result = found(seed, tmp_path)
    failure = result.failure
    assert failure is not None
    assert failure.violation.property == LINEARIZABILITY
    # The racing steps only: one phase of one decode in each of two lanes, nothing before it.
    assert len(failure.records) == 1, [record.action.describe() for record in failure.records]
    assert [[action.op for action in lane] for lane in phase_of(failure.records)] == [["decode"], ["decode"]]
    assert result.trace_path is not None
    replayed = replay(result.trace_path)
    assert replayed.runs == 20
    assert replayed.reproduced
    assert replayed.reproductions >= 10, f"reproduced in {replayed.reproductions} of 20 runs"
    assert replay(result.trace_path, LOCKED, runs=5).failure is None


def test_the_trace_holds_the_lanes_and_shardkit_replay_prints_the_rate(
    found_at_1: FuzzResult, capsys: pytest.CaptureFixture[str]
) -> None:
    result = found_at_1
    assert result.trace_path is not None
    document = json.loads(result.trace_path.read_text())
    lanes = document["steps"][-1]["args"]["lanes"]
    assert [[step["op"] for step in lane] for lane in lanes] == [["decode"], ["decode"]]
    assert read_trace(result.trace_path).actions[-1] == result.failure.records[-1].action  # type: ignore[union-attr]
    capsys.readouterr()
    assert main(["replay", str(result.trace_path), "--runs", "8"]) == 1
    out = capsys.readouterr().out
    assert "the trace holds a parallel phase: §2 linearizability reproduced in " in out
    assert " of 8 runs, each on a fresh engine" in out
    assert "no order of these calls explains their answers" in out
    assert main(["replay", str(result.trace_path), "--runs", "3", "--engine", LOCKED]) == 0
    out = capsys.readouterr().out
    assert "reproduced in 0 of 3 runs" in out
    assert "did not reproduce in any of 3 runs" in out


def test_the_regression_test_repeats_the_phase(
    tmp_path: Path, pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = found(2, tmp_path)
    assert result.trace_path is not None
    assert result.regression_path is not None
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    shutil.copy(result.trace_path, pytester.path)
    shutil.copy(result.regression_path, pytester.path)
    on_bug = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    on_bug.assert_outcomes(failed=1)
    on_bug.stdout.fnmatch_lines(["*(a parallel phase: * of 20 runs reproduced it)*"])
    on_fix = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shardkit-engine", LOCKED)
    on_fix.assert_outcomes(passed=1)


def test_the_minimiser_deletes_steps_from_the_lanes_and_the_steps_before() -> None:
    """From the concrete steps alone (no drawn choices): the prefills and the lane steps the
    race does not need go, each lane keeping its other steps."""
    machine = build_machine(PythonTarget(DecodeCounterRaces), MachineOptions(faults="none", concurrency=2))
    phase = phase_action(
        [
            [step_action("decode", "a", 0, 1, (3,)), Action("release", {"session": "b"})],
            [Action("cancel", {"session": "b", "epoch": 0}), step_action("decode", "b", 0, 1, (4,))],
        ]
    )
    prefills = [step_action("prefill", session, 0, 0, (1, 2)) for session in "ab"]
    records = [StepRecord(index, action, "", "", "OK") for index, action in enumerate([*prefills, phase], start=1)]
    failure = FailureReport(Violation(LINEARIZABILITY, "the lost update"), records, FULL, frozenset())
    minimized = minimize_failure(machine, failure)
    assert minimized.report.violation.property == LINEARIZABILITY
    assert len(minimized.report.records) == 1
    assert [[action.op for action in lane] for lane in phase_of(minimized.report.records)] == [["decode"], ["decode"]]
    assert minimized.one_minimal


def test_a_phase_in_a_trace_is_checked_like_any_step(found_at_1: FuzzResult, tmp_path: Path) -> None:
    result = found_at_1
    assert result.trace_path is not None
    document = json.loads(result.trace_path.read_text())
    for bad, says in (
        ([], "must be a list of 1 to 8 lanes"),
        (
            [[{"op": "health", "args": {}}]],
            "lanes[0][0].op must be one of ['cancel', 'decode', 'prefill', 'release'] in a lane",
        ),
        ([[{"op": "decode", "args": {"session": "a"}}]], "lanes[0][0].args"),
        ([[]], "lanes[0] must be a list of 1 to 1000 steps"),
    ):
        document["steps"][-1]["args"]["lanes"] = bad
        damaged = tmp_path / "damaged.json"
        damaged.write_text(json.dumps(document))
        with pytest.raises(TraceFormatError, match=re.escape(says)) as error:
            read_trace(damaged)
        assert "step 1.args.lanes" in str(error.value)
