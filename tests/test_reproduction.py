"""Reproduction as a product: traces replay, regression tests fail on the bug, damaged traces are refused."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from shardkit import FakeShardEngine, TraceFormatError, machine_for, replay
from shardkit._cli.main import main
from shardkit._machine.minimize import replay_actions
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit.errors import UntrustedTarget
from tests.planted import PLANTED, PlantedEngine

PlantedRuns = Mapping[type[PlantedEngine], FuzzResult]


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
    out = capsys.readouterr().out
    # The whole sequence as fuzz printed it: the header, then the violation as render_failure indents it.
    count = len(result.failure.records)
    assert f"FAILURE ({result.failure.violation.property}) in {count} step{'s' if count != 1 else ''}:" in out
    assert textwrap.indent(result.failure.violation.message, "  ") in out


def test_replay_against_the_fixed_engine_does_not_reproduce(
    planted_runs: PlantedRuns, capsys: pytest.CaptureFixture[str]
) -> None:
    for result in planted_runs.values():
        trace = _trace(result)
        assert main(["replay", str(trace), "--engine", "shardkit:FakeShardEngine"]) == 0
        assert result.failure is not None
        steps = len(result.failure.records)
        assert f"did not reproduce: all {steps} step{'' if steps == 1 else 's'} matched the model" in capsys.readouterr().out


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
    # Each failure reads as shardkit prints it, not as pytest's repr of the result objects.
    on_bugs.stdout.fnmatch_lines(["*  expected: *"])
    on_bugs.stdout.no_fnmatch_line("*Violation(*")
    on_fake = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shardkit-engine", "shardkit:FakeShardEngine")
    on_fake.assert_outcomes(passed=len(planted_runs))


def test_a_trace_records_the_spec_fields(planted_runs: PlantedRuns) -> None:
    from tests.planted import MemoryPressureIgnored

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
    from tests.planted import ReleaseLeaksKvTokens

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


def test_a_run_report_given_to_replay_points_to_shardkit_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"target": "x:y", "seed": 1, "coverage": {}, "failures": []}))
    assert main(["replay", str(report)]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1, line
    assert "it is a run report: replay a trace its failures name, or draw it with `shardkit report`" in line


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
    """Fails on every decode of an unknown session; at the third such decode the user presses
    Ctrl-C. The first is the failure found, so the third comes while it is being shrunk,
    however many decodes of live sessions the run made before."""

    BUG = "decode of an unknown session is served"
    PROPERTY = "§2 rule 3"
    MINIMAL = ("decode(a)",)
    calls = 0

    def decode(self, request: Any) -> Any:
        result = self.inner.decode(request)
        from shardkit import CacheResult, StatusCode, StepResult, StructuredStatus, TokenOutput

        if result.status.code is not StatusCode.NOT_FOUND:
            return result
        type(self).calls += 1
        if type(self).calls >= 3:
            raise KeyboardInterrupt
        return StepResult(StructuredStatus(StatusCode.OK), CacheResult.MISS, TokenOutput(0))


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
    from shardkit._run import runner

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

    from shardkit._run import runner
    from tests.planted import FailedCallsNotCounted

    seen: list[list[str]] = []

    def interrupted_while_minimising(*args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(path.name for path in tmp_path.iterdir()))
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "minimize_failure", interrupted_while_minimising)
    machine = machine_for(FailedCallsNotCounted, role="full")
    result = runner.run_machine(machine, settings(max_examples=50, database=None), seed=1, out=tmp_path)
    assert len(seen) == 1, seen
    [on_disk] = seen[0]
    assert on_disk.startswith("failedcallsnotcounted-")
    assert on_disk.endswith("-in-progress.json")
    assert result.interrupted
    assert result.trace_path is not None
    assert result.regression_path is not None
    assert result.regression_path.name.startswith("test_failedcallsnotcounted_")
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [result.trace_path.name, result.regression_path.name]
    )



def _hypothesis_turns_the_interrupt_into(error: BaseException) -> Any:
    """What Hypothesis does when Ctrl-C lands inside its own machinery (computing a database
    key, say): it raises another error while handling the ``KeyboardInterrupt``."""

    def landed(*args: Any, **kwargs: Any) -> Any:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise error  # noqa: B904 - the interrupt stays its context, as in Hypothesis

    return landed


@pytest.mark.parametrize("stage", ["search", "minimisation"])
def test_ctrl_c_that_hypothesis_turns_into_another_error_is_still_an_interrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Seen in a campaign: the interrupt landed while Hypothesis computed a database key, and
    came out as an ``AssertionError`` of Hypothesis's, which was reported as a bug of the kit."""
    from hypothesis import settings

    from shardkit._run import runner
    from tests.planted import FailedCallsNotCounted

    machine = machine_for(FailedCallsNotCounted, role="full")
    if stage == "search":
        monkeypatch.setattr(runner, "run_state_machine_as_test", _hypothesis_turns_the_interrupt_into(AssertionError()))
        with pytest.raises(KeyboardInterrupt):
            runner.run_machine(machine, settings(max_examples=50, database=None), seed=1, out=tmp_path)
        return
    monkeypatch.setattr(runner, "minimize_failure", _hypothesis_turns_the_interrupt_into(AssertionError()))
    result = runner.run_machine(machine, settings(max_examples=50, database=None), seed=1, out=tmp_path)
    assert result.interrupted
    assert result.failure is not None
    assert result.trace_path is not None


def test_an_error_without_an_interrupt_behind_it_is_not_taken_for_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hypothesis import settings

    from shardkit._run import runner
    from tests.planted import FailedCallsNotCounted

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a bug of the minimiser")

    monkeypatch.setattr(runner, "minimize_failure", broken)
    machine = machine_for(FailedCallsNotCounted, role="full")
    with pytest.raises(AssertionError, match="a bug of the minimiser"):
        runner.run_machine(machine, settings(max_examples=50, database=None), seed=1, out=tmp_path)

# --- a trace replays from anywhere; a test that cannot build its engine is an error ---------------------

LEAKY_ENGINE = """
from dataclasses import replace

from shardkit import FakeShardEngine


class Leaky(FakeShardEngine):
    \"\"\"Planted bug: release keeps counting the session's KV tokens.\"\"\"

    def __init__(self):
        super().__init__()
        self.leaked = 0

    def release(self, session_id):
        before = super().metrics().kv_tokens
        status = super().release(session_id)
        self.leaked += before - super().metrics().kv_tokens
        return status

    def metrics(self):
        metrics = super().metrics()
        return replace(metrics, kv_tokens=metrics.kv_tokens + self.leaked)
"""


def _pytest_from(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pytest ARGS`` as a user types it in ``folder``: the console script, no PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [str(Path(sys.executable).with_name("pytest")), "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def file_target_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FuzzResult:
    """``shardkit fuzz leaky.py:Leaky`` run from a project folder, its failure under ``out``."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "leaky.py").write_text(LEAKY_ENGINE)
    monkeypatch.chdir(project)
    result = fuzz("leaky.py:Leaky", seed=1, examples=200, steps=20, role="full", faults="none", out=Path("out"))
    assert result.failure is not None
    assert result.failure.violation.property == "§2 metrics"
    monkeypatch.chdir(tmp_path)
    return result


def test_a_file_target_is_recorded_with_its_absolute_file(file_target_run: FuzzResult, tmp_path: Path) -> None:
    document = json.loads((tmp_path / "project" / _trace(file_target_run)).read_text())
    assert document["target"] == "leaky.py:Leaky"
    assert document["target_file"] == str(tmp_path / "project" / "leaky.py")


def test_a_file_target_replays_from_another_folder_when_the_user_trusts_it(
    file_target_run: FuzzResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "no file at 'leaky.py'" (exit 2). Now: refused as outside the project, and replayed with --trust."""
    trace = (tmp_path / "project" / _trace(file_target_run)).resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(UntrustedTarget, match=r"the file .*project/leaky\.py, outside the current project"):
        replay(trace)
    assert replay(trace, trust=True).reproduced
    assert main(["replay", str(trace)]) == 2
    assert "--trust" in capsys.readouterr().err
    assert main(["replay", str(trace), "--trust"]) == 1
    # From the project folder it needs no --trust.
    monkeypatch.chdir(tmp_path / "project")
    assert main(["replay", str(trace)]) == 1


def test_a_file_targets_regression_test_fails_on_the_bug_from_another_folder(
    file_target_run: FuzzResult, tmp_path: Path
) -> None:
    """Before: InvalidTarget, reported as a test failure ("the bug is still there") for the wrong reason."""
    assert file_target_run.regression_path is not None
    test_file = (tmp_path / "project" / file_target_run.regression_path).resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    on_bug = _pytest_from(elsewhere, str(test_file))
    assert "1 failed" in on_bug.stdout, on_bug.stdout + on_bug.stderr
    assert "§2 metrics" in on_bug.stdout or "kv_tokens" in on_bug.stdout
    on_fake = _pytest_from(elsewhere, str(test_file), "--shardkit-engine", "shardkit:FakeShardEngine")
    assert "1 passed" in on_fake.stdout, on_fake.stdout + on_fake.stderr


def test_a_module_targets_regression_test_runs_from_another_folder_without_pythonpath(
    planted_runs: PlantedRuns, tmp_path: Path
) -> None:
    """``tests.planted:…`` is found again through the sys.path entry the trace recorded."""
    from tests.planted import ReleaseLeaksKvTokens

    result = planted_runs[ReleaseLeaksKvTokens]
    assert result.regression_path is not None
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(_trace(result), suite)
    shutil.copy(result.regression_path, suite)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outcome = _pytest_from(elsewhere, str(suite))
    assert "1 failed" in outcome.stdout, outcome.stdout + outcome.stderr


@pytest.mark.parametrize(
    "broken",
    ["the target names no engine", "the engine module is gone", "the named engine raises when built"],
)
def test_a_regression_test_whose_engine_cannot_be_built_is_an_error_not_a_failure(
    broken: str, planted_runs: PlantedRuns, pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.planted import ReleaseLeaksKvTokens

    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    result = planted_runs[ReleaseLeaksKvTokens]
    assert result.regression_path is not None
    document = json.loads(_trace(result).read_text())
    extra: list[str] = []
    if broken == "the target names no engine":
        document["target"] = "tests.planted:NoSuchEngine"
    elif broken == "the engine module is gone":
        document["target"] = "a_module_that_was_deleted:make"
        document["target_path"] = str(pytester.path / "gone")
    else:
        extra = ["--shardkit-engine", "tests.test_reproduction:ExplodingIfBuilt"]
    (pytester.path / _trace(result).name).write_text(json.dumps(document))
    shutil.copy(result.regression_path, pytester.path)
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider", *extra)
    outcome.assert_outcomes(errors=1)
    text = outcome.stdout.str()
    assert "could not be built" in text
    assert "this is not the bug reproducing" in text


# --- printed commands work as printed ----------------------------------------------------------------


def test_the_printed_replay_names_an_engine_file_outside_the_project_so_it_runs_as_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay builds a recorded engine only from inside the current folder's tree: for an
    engine file elsewhere the printed command names it with --engine, as the user did."""
    engines, project = tmp_path / "engines", tmp_path / "project"
    engines.mkdir()
    project.mkdir()
    (engines / "leaky.py").write_text(LEAKY_ENGINE, encoding="utf-8")
    monkeypatch.chdir(project)
    target = f"{engines / 'leaky.py'}:Leaky"
    result = fuzz(target, seed=1, examples=50, steps=20, faults="none", out=project / "failures")
    assert result.failure is not None
    from shardkit._run.report import render_failure

    line = next(line for line in render_failure(result).splitlines() if line.startswith("  this failure:"))
    command = line.removeprefix("  this failure:    ")
    assert command.endswith(f" --engine {shlex.quote(target)}"), command
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    replayed = subprocess.run(["bash", "-c", command], cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    bare = subprocess.run(
        ["bash", "-c", command.partition(" --engine ")[0]], cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert bare.returncode == 2, bare.stdout + bare.stderr  # what the line printed before
    assert "outside the current project" in bare.stderr


def test_the_printed_commands_run_as_printed_from_a_folder_with_a_space(repo_root: Path, tmp_path: Path) -> None:
    from shardkit._run.report import render_failure
    from tests.planted import ReleaseLeaksKvTokens

    out = tmp_path / "my failures" / "run 1"
    result = fuzz(
        f"tests.planted:{ReleaseLeaksKvTokens.__name__}", seed=3, examples=200, steps=50, role="full", out=out
    )
    text = render_failure(result)
    commands = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.strip().startswith(("this failure:", "as a test:"))
    }
    replay_command, test_command = commands["this failure"], commands["as a test"]
    assert replay_command.startswith("shardkit replay '")
    assert test_command.startswith("pytest '")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    replayed = subprocess.run(
        ["bash", "-c", replay_command], cwd=repo_root, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert result.failure is not None
    assert textwrap.indent(result.failure.violation.message, "  ") in replayed.stdout
    tested = subprocess.run(
        ["bash", "-c", f"{test_command} -p no:cacheprovider -q"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "1 failed" in tested.stdout, tested.stdout + tested.stderr
