"""A failure found with a custom operation replays as printed: the trace records the extended machine.

The extension example (stateful/test_extending_rules.py) adds ``rollback`` through a
``ShardMachine`` subclass with ``custom_ops`` and a ``ReferenceModel`` subclass. Its
planted bug, fuzzed to a trace, must reproduce under ``shardkit replay`` and under the
generated regression test, which used to fail with "op 'rollback' … does not know".
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit import ReferenceModel, TraceFormatError, machine_for, replay
from shardkit._cli.main import main
from shardkit._run.report import render_failure
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit._run.trace import trace_document
from stateful.test_extending_rules import RollbackKeepsTokens, RollbackMachine, RollbackModel

MODULE = "stateful.test_extending_rules"
HERE = "tests.test_replay_extended_machine"


class RollbackRuleAlone(RollbackMachine):
    """The example's rule without its model, which a run then gives separately (``model=``):
    the trace must name both."""

    model_factory = ReferenceModel


@pytest.fixture(scope="module")
def rollback_run(tmp_path_factory: pytest.TempPathFactory) -> FuzzResult:
    """The example's planted bug, found and shrunk to three steps ending in ``rollback``."""
    result = fuzz(
        RollbackKeepsTokens,
        seed=3,
        examples=200,
        steps=50,
        role="full",
        model=RollbackModel,
        base=RollbackRuleAlone,
        out=tmp_path_factory.mktemp("rollback"),
    )
    assert result.failure is not None
    assert result.failure.records[-1].action.op == "rollback"
    assert result.trace_path is not None
    return result


def _trace(result: FuzzResult) -> Path:
    assert result.trace_path is not None
    return result.trace_path


def _pytest_from(folder: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = [str(Path(sys.executable).with_name("pytest")), "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_trace_names_the_machine_and_the_model(rollback_run: FuzzResult, repo_root: Path) -> None:
    document = json.loads(_trace(rollback_run).read_text())
    assert document["machine"] == f"{HERE}:RollbackRuleAlone"
    assert document["model"] == f"{MODULE}:RollbackModel"
    assert document["machine_path"] == str(repo_root)
    assert "needs_python" not in document


def test_shardkit_replay_rebuilds_the_machine_and_reproduces(
    rollback_run: FuzzResult, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(repo_root)
    assert main(["replay", str(_trace(rollback_run))]) == 1
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith(f"replaying against {MODULE}:RollbackKeepsTokens (recorded in the trace")
    assert f"machine {HERE}:RollbackRuleAlone (recorded in the trace" in first
    assert f"model {MODULE}:RollbackModel (recorded in the trace" in first
    assert rollback_run.failure is not None
    # The whole sequence as fuzz printed it: the header, then the violation indented as render_failure does.
    count = len(rollback_run.failure.records)
    assert f"FAILURE ({rollback_run.failure.violation.property}) in {count} step{'s' if count != 1 else ''}:" in out
    assert textwrap.indent(rollback_run.failure.violation.message, "  ") in out


def test_replay_from_python_needs_no_custom_ops(rollback_run: FuzzResult) -> None:
    assert replay(_trace(rollback_run)).reproduced


def test_the_generated_regression_test_reproduces_from_another_folder(
    rollback_run: FuzzResult, tmp_path: Path, repo_root: Path
) -> None:
    assert rollback_run.regression_path is not None
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(_trace(rollback_run), suite)
    shutil.copy(rollback_run.regression_path, suite)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    on_bug = _pytest_from(elsewhere, str(suite))
    assert "1 failed" in on_bug.stdout, on_bug.stdout + on_bug.stderr
    fixed = _pytest_from(elsewhere, str(suite), "--shardkit-engine", f"{MODULE}:RollbackEngine", pythonpath=repo_root)
    assert "1 passed" in fixed.stdout, fixed.stdout + fixed.stderr


def test_a_machine_defined_in_a_function_is_said_not_to_replay_by_name(
    rollback_run: FuzzResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No command that fails: the report says why, and how to replay it from Python."""

    class LocalRollback(RollbackMachine):
        pass

    failure = rollback_run.failure
    assert failure is not None
    machine = machine_for(RollbackKeepsTokens, role="full", model=RollbackModel, base=LocalRollback)
    document = trace_document(
        target=machine._target.target,
        load_request=failure.load_request,
        faults=failure.faults,
        records=failure.records,
        violation=failure.violation,
        seed=3,
        machine=machine,
    )
    assert "machine" not in document
    assert "LocalRollback" in document["needs_python"]
    assert "replay it from Python with shardkit.replay(TRACE, custom_ops=..., model=...)" in document["needs_python"]
    trace = tmp_path / "local.json"
    trace.write_text(json.dumps(document))
    shown = render_failure(dataclasses.replace(rollback_run, trace_path=trace, regression_path=tmp_path / "test_x.py"))
    assert "cannot be replayed from the command line or as a generated test: its machine class" in shown
    assert "shardkit replay" not in shown
    assert "pytest " not in shown.split("reproduce:")[1]
    assert main(["replay", str(trace)]) == 2
    refusal = capsys.readouterr().err
    assert "this trace replays only from Python: its machine class" in refusal
    assert "LocalRollback" in refusal
    with pytest.raises(TraceFormatError, match="LocalRollback"):
        replay(trace)
    assert replay(trace, custom_ops=RollbackMachine.custom_ops, model=RollbackModel).reproduced


def test_a_model_that_is_a_lambda_is_said_not_to_replay_by_name(rollback_run: FuzzResult) -> None:
    failure = rollback_run.failure
    assert failure is not None
    machine = machine_for(RollbackKeepsTokens, role="full", model=lambda: RollbackModel(), base=RollbackMachine)
    document = trace_document(
        target=machine._target.target,
        load_request=failure.load_request,
        faults=failure.faults,
        records=failure.records,
        violation=failure.violation,
        seed=3,
        machine=machine,
    )
    assert document["machine"] == f"{MODULE}:RollbackMachine"
    assert "its reference model" in document["needs_python"]
    assert "<lambda>" in document["needs_python"]


def test_a_plain_machine_records_no_machine(rollback_run: FuzzResult) -> None:
    failure = rollback_run.failure
    assert failure is not None
    machine = machine_for("shardkit:FakeShardEngine", role="full")
    document = trace_document(
        target=machine._target.target,
        load_request=failure.load_request,
        faults=failure.faults,
        records=failure.records,
        violation=failure.violation,
        seed=3,
        machine=machine,
    )
    assert not {"machine", "model", "needs_python"} & set(document)


def test_shardkit_fuzz_runs_an_extended_machine_and_prints_a_rerun_that_names_it(
    tmp_path: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--machine`` on the command line: the rule finds the planted bug, the printed command reruns it."""
    monkeypatch.chdir(repo_root)
    engine, machine = f"{MODULE}:RollbackKeepsTokens", f"{MODULE}:RollbackMachine"
    arguments = ["fuzz", engine, "--machine", machine, "--role", "full", "--seed", "3", "--out", str(tmp_path)]
    assert main(arguments) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"shardkit fuzz {engine} --seed 3 --role full --machine {machine}"
    assert "FAILURE (§2 metrics) in 3 steps:" in out
    rerun = f"shardkit fuzz {engine} --seed 3 --role full --machine {machine}"
    assert rerun in out
    (trace,) = tmp_path.glob("*.json")
    document = json.loads(trace.read_text())
    assert document["machine"] == machine
    assert "model" not in document  # the machine brings it: model_factory
    assert main([*rerun.split()[1:], "--out", str(tmp_path / "again")]) == 1
    assert "FAILURE (§2 metrics) in 3 steps:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("machine", "complaint"),
    [
        (f"{MODULE}:RollbackModel", "not a ShardMachine subclass"),
        (f"{MODULE}:NoSuchMachine", "has no attribute 'NoSuchMachine'"),
        ("no_such_module_here:Machine", "cannot import 'no_such_module_here'"),
        ("RollbackMachine", "must look like 'package.module:Machine' or 'path/to/file.py:Machine'"),
    ],
)
def test_a_wrong_machine_is_one_line_and_exit_2(
    machine: str, complaint: str, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(repo_root)
    assert main(["fuzz", f"{MODULE}:RollbackEngine", "--machine", machine, "--examples", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("shardkit fuzz: --machine ") or line.startswith("shardkit: "), line
    assert complaint in line, line


def test_fuzz_from_python_prints_the_machine_in_its_rerun_command() -> None:
    result = fuzz(RollbackKeepsTokens, seed=3, examples=200, steps=50, role="full", base=RollbackMachine)
    assert result.rerun_command.endswith(f" --machine {MODULE}:RollbackMachine")
    result = fuzz(RollbackKeepsTokens, seed=3, examples=5, steps=5, role="full", base=f"{MODULE}:RollbackMachine")
    assert result.rerun_command.endswith(f" --machine {MODULE}:RollbackMachine")


@pytest.mark.parametrize(
    ("engine", "machine"),
    [
        (f"{MODULE}:RollbackEngine", "stateful/test_extending_rules.py:RollbackMachine"),
        ("stateful/test_extending_rules.py:RollbackEngine", f"{MODULE}:RollbackMachine"),
    ],
)
def test_an_engine_and_a_machine_named_in_different_forms_share_one_module(
    engine: str, machine: str, repo_root: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A module imported twice (by name and from its file) held two RollbackEngine classes:
    the rule's isinstance check then failed on a correct engine, a false alarm."""
    monkeypatch.chdir(repo_root)
    result = fuzz(engine, seed=1, examples=30, steps=30, role="full", base=machine, out=tmp_path)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
