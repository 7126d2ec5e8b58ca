"""Reproduction as a product: traces replay, regression tests fail on the bug, damaged traces are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardkit import FakeShardEngine, TraceFormatError, replay
from shardkit.cli import main
from shardkit.machine import machine_for
from shardkit.minimize import replay_actions
from shardkit.runner import FuzzResult, fuzz

from .planted import PLANTED, PlantedEngine

PlantedRuns = dict[type[PlantedEngine], FuzzResult]


def _trace(result: FuzzResult) -> Path:
    assert result.failure is not None
    assert result.trace_path is not None
    return result.trace_path


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_the_trace_replays_to_the_same_failure(engine: type[PlantedEngine], planted_runs: PlantedRuns) -> None:
    result = planted_runs[engine]
    replayed = replay(_trace(result))
    assert replayed.reproduced
    assert replayed.failure is not None
    assert result.failure is not None
    assert replayed.failure.message == result.failure.violation.message


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_the_reported_sequence_is_one_minimal(engine: type[PlantedEngine], planted_runs: PlantedRuns) -> None:
    """Removing any single step makes the failure go away (checked by replay)."""
    result = planted_runs[engine]
    assert result.failure is not None
    assert result.minimized is not None
    assert result.minimized.one_minimal
    machine = machine_for(engine, role=engine.ROLE)
    actions = [record.action for record in result.failure.records]
    for index in range(len(actions)):
        shorter = actions[:index] + actions[index + 1 :]
        again = replay_actions(machine, result.failure, shorter)
        assert again is None or again.violation.property != result.failure.violation.property, (
            f"still fails without step {index + 1}: {[a.describe() for a in shorter]}"
        )


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_shardkit_replay_exits_1_with_the_same_message(
    engine: type[PlantedEngine], planted_runs: PlantedRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    result = planted_runs[engine]
    assert main(["replay", str(_trace(result))]) == 1
    assert result.failure is not None
    assert result.failure.violation.message in capsys.readouterr().out


def test_replay_against_the_fixed_engine_does_not_reproduce(
    planted_runs: PlantedRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    for result in planted_runs.values():
        trace = _trace(result)
        assert main(["replay", str(trace), "--engine", "shardkit:FakeShardEngine"]) == 0
        assert result.failure is not None
        steps = len(result.failure.records)
        assert f"did not reproduce: all {steps} steps matched the model" in capsys.readouterr().out


def test_regression_files_fail_on_the_buggy_engines_and_pass_on_the_fake(
    planted_runs: PlantedRuns, pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    for result in planted_runs.values():
        assert result.regression_path is not None
        shutil.copy(_trace(result), pytester.path)
        shutil.copy(result.regression_path, pytester.path)
    on_bugs = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    on_bugs.assert_outcomes(failed=len(planted_runs))
    on_fake = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shardkit-engine", "shardkit:FakeShardEngine")
    on_fake.assert_outcomes(passed=len(planted_runs))


def test_a_trace_records_the_spec_fields(planted_runs: PlantedRuns) -> None:
    from .planted import MemoryPressureIgnored

    document = json.loads(_trace(planted_runs[MemoryPressureIgnored]).read_text())
    assert document["format"] == "shardkit-trace"
    assert document["version"] == 1
    assert {"shardkit_version", "target", "role", "load_request", "fault_steps", "steps", "failure", "seed"} <= set(
        document
    )
    assert document["fault_steps"] == [{"kind": "memory_pressure", "value": 0.0, "step": 1}]
    assert document["steps"][-1]["expected"].startswith("RESOURCE_EXHAUSTED")


def test_no_trace_is_left_half_written_or_in_progress(planted_runs: PlantedRuns) -> None:
    for result in planted_runs.values():
        folder = _trace(result).parent
        assert sorted(path.suffix for path in folder.iterdir()) == [".json", ".py"]


# --- damaged and hostile traces --------------------------------------------------------------


@pytest.fixture
def good_trace(planted_runs: PlantedRuns) -> dict[str, Any]:
    from .planted import ReleaseLeaksKvTokens

    document: dict[str, Any] = json.loads(_trace(planted_runs[ReleaseLeaksKvTokens]).read_text())
    return document


def _with(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(document))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


DAMAGES: dict[str, Any] = {
    "wrong format": (("format",), "pytest-report"),
    "wrong version": (("version",), 2),
    "no version": (("version",), None),
    "steps not a list": (("steps",), {"op": "prefill"}),
    "no steps": (("steps",), []),
    "unknown op": (("steps", 0, "op"), "format_disk"),
    "huge epoch": (("steps", 0, "args", "epoch"), 10**400),
    "epoch is a bool": (("steps", 0, "args", "epoch"), True),
    "session not a string": (("steps", 0, "args", "session"), ["a"]),
    "unknown malformation": (("steps", 0, "args", "malformed"), "__import__('os')"),
    "too many tokens": (("steps", 0, "args", "tokens"), [0] * 70_000),
    "a day-long delay": (("steps", 0), {"op": "fault", "args": {"kind": "delay", "value": 86_400}}),
    "unknown fault": (("steps", 0), {"op": "fault", "args": {"kind": "meteor", "value": 1}}),
    "bad layer range": (("load_request", "shard_start"), 9),
    "unknown fault list": (("faults_enabled",), ["meteor"]),
    "failure missing": (("failure",), None),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_trace_that_does_not_fit_the_schema_is_refused_with_one_line(
    damage: str, good_trace: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, value = DAMAGES[damage]
    document = _with(good_trace, path, value)
    document["target"] = "tests.test_reproduction:ExplodingIfBuilt"
    trace = tmp_path / "damaged.json"
    trace.write_text(json.dumps(document))
    assert main(["replay", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err
    assert str(trace) in captured.err


class ExplodingIfBuilt(FakeShardEngine):
    """A target that must never be built: a refused trace executes nothing."""

    def __init__(self) -> None:
        message = "a damaged trace was executed"
        raise AssertionError(message)


RAW_DAMAGES: dict[str, bytes] = {
    "empty file": b"",
    "not JSON": b"\x89PNG\r\n\x1a\n\x00\x00",
    "a JSON array": b"[1, 2, 3]",
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "NaN": b'{"format": "shardkit-trace", "version": NaN}',
    "an integer with 5000 digits": b'{"format": "shardkit-trace", "version": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("damage", sorted(RAW_DAMAGES))
def test_a_file_that_is_not_a_trace_is_refused_with_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "raw.json"
    trace.write_bytes(RAW_DAMAGES[damage])
    assert main(["replay", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err


def test_a_truncated_trace_says_it_looks_truncated(good_trace: dict[str, Any], tmp_path: Path) -> None:
    text = json.dumps(good_trace, indent=2)
    trace = tmp_path / "cut.json"
    trace.write_text(text[: len(text) // 2])
    with pytest.raises(TraceFormatError, match="not valid JSON \\(the file looks truncated\\)"):
        replay(trace)


def test_a_missing_trace_or_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "absent.json")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    assert main(["replay", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_wrong_version_names_both_versions(good_trace: dict[str, Any], tmp_path: Path) -> None:
    trace = tmp_path / "v2.json"
    trace.write_text(json.dumps(_with(good_trace, ("version",), 2)))
    with pytest.raises(TraceFormatError, match="is a version 2 trace; this shardkit reads version 1"):
        replay(trace)


# --- interrupted runs ----------------------------------------------------------------------------


class InterruptedWhileShrinking(PlantedEngine):
    """Fails on every decode of an unknown session; at the 20th decode (while shrinking) the user presses Ctrl-C."""

    BUG = "decode of an unknown session is served"
    PROPERTY = "§2 rule 3"
    MINIMAL = ("decode(a)",)
    calls = 0

    def decode(self, request: Any) -> Any:
        type(self).calls += 1
        if type(self).calls >= 20:
            raise KeyboardInterrupt
        result = self.inner.decode(request)
        from shardkit import CacheResult, StatusCode, StepResult, StructuredStatus, TokenOutput

        if result.status.code is StatusCode.NOT_FOUND:
            return StepResult(StructuredStatus(StatusCode.OK), CacheResult.MISS, TokenOutput(0))
        return result


def test_ctrl_c_during_shrinking_still_leaves_a_trace(tmp_path: Path) -> None:
    InterruptedWhileShrinking.calls = 0
    result = fuzz(InterruptedWhileShrinking, seed=3, examples=500, steps=50, role="full", out=tmp_path)
    assert result.interrupted
    assert result.failure is not None
    trace = result.trace_path
    assert trace is not None
    assert json.loads(trace.read_text())["failure"]["property"] in {"§2 rule 3", "§2 rule 4"}  # both NOT_FOUND paths
    assert not list(tmp_path.glob("*in-progress*"))


def test_ctrl_c_before_any_failure_exits_130_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardkit import runner

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_state_machine_as_test", interrupted)
    assert main(["fuzz", "--seed", "1", "--out", str(tmp_path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_shortest_failure_is_on_disk_before_minimisation_and_ctrl_c_there_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed run leaves the in-progress trace; Ctrl-C while minimising still writes the final one."""
    from hypothesis import settings

    from shardkit import runner

    from .planted import FailedCallsNotCounted

    seen: list[list[str]] = []

    def interrupted_while_minimising(*args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(path.name for path in tmp_path.iterdir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "minimize_failure", interrupted_while_minimising)
    machine = machine_for(FailedCallsNotCounted, role="full")
    result = runner.run_machine(machine, settings(max_examples=50, database=None), seed=1, out=tmp_path)
    assert seen == [["failedcallsnotcounted-seed-1-in-progress.json"]]
    assert result.interrupted
    assert result.trace_path is not None
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        result.trace_path.name,
        "test_failedcallsnotcounted_seed_1_2_metrics.py",
    ]
