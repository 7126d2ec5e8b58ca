"""``--worker-command``: an engine in any language, started by the kit as isolated workers.

The worker here is ``tests/workers/standalone_worker.py``, written against gRPC and
protobuf only (no shardkit), standing in for a C++ or Rust worker: the kit knows nothing
of it but the command. Its ``--plant`` flags give a semantic bug (cancel keeps the KV
tokens) and a native-style death (``os.abort()`` on an epoch bump); both must be found at
several seeds, shrunk to their two steps and replayed from the trace and the printed
command, and every worker must end with its run. The C++ reference worker
(``workers/cpp``) is tested the same way in ``test_cpp_worker.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit import machine_for
from shardkit._cli.main import main
from shardkit._core.targets import IsolationOptions, WorkerCommand, parse_target
from shardkit._run.replay import replay
from shardkit._run.runner import fuzz
from shardkit._transport.worker import live_worker_pids
from shardkit.errors import InvalidTarget, UntrustedTarget, UsageError

pytest.importorskip("grpc")

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "standalone_worker.py"


def command(*plants: str) -> str:
    planted = "".join(f" --plant {plant}" for plant in plants)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(WORKER))}{planted} --listen {{address}}"


def no_worker_left(pids_before: set[int]) -> bool:
    return set(live_worker_pids()) <= pids_before


@pytest.mark.parametrize("seed", [1, 2])
def test_a_planted_bug_in_a_foreign_worker_is_found_and_shrunk(seed: int, tmp_path: Path) -> None:
    result = fuzz(worker_command=command("cancel-keeps-kv"), seed=seed, examples=100, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "§2 metrics"
    assert [record.action.op for record in result.failure.records] == ["prefill", "cancel"]
    assert live_worker_pids() == []


@pytest.mark.parametrize("seed", [1, 2])
def test_a_foreign_worker_that_aborts_is_a_shrunk_failure_and_replays(seed: int, tmp_path: Path) -> None:
    result = fuzz(worker_command=command("abort-on-restart"), seed=seed, examples=100, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "process killed by SIGABRT"
    assert [record.action.op for record in result.failure.records] == ["prefill", "prefill"]
    assert "--worker-command" in result.rerun_command
    assert "--isolate" not in result.rerun_command
    [trace_path] = tmp_path.glob("*.json")
    trace = json.loads(trace_path.read_text())
    assert parse_target(trace["target"]) == WorkerCommand(command("abort-on-restart"))
    assert trace["isolate"] == IsolationOptions().to_json()
    assert trace_path.name.startswith("standalone-worker-")

    # The program is an interpreter found outside the project: replay asks before running it.
    with pytest.raises(UntrustedTarget, match="--worker-command CMD"):
        replay(trace_path)
    replayed = replay(trace_path, trust=True)
    assert replayed.reproduced
    assert replayed.failure is not None
    assert replayed.failure.property == "process killed by SIGABRT"
    # Named by the user: another build of the worker (here the same one, unplanted) replays clean.
    fixed = replay(trace_path, target=WorkerCommand(command()))
    assert fixed.failure is None
    assert live_worker_pids() == []


def test_a_foreign_worker_that_hangs_misses_its_deadline_and_is_killed(tmp_path: Path) -> None:
    # 3 s, not 1: on a busy machine a correct call may take over a second, and the kit would
    # name that call's deadline instead of the hang.
    options = IsolationOptions(step_timeout=3.0)
    result = fuzz(worker_command=command("hang-on-release"), isolate=options, seed=1, examples=50, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "step deadline"
    # The twins of the oracle release their session after each answer: the first prefill's hangs.
    assert [record.action.op for record in result.failure.records] == ["prefill"]
    message = result.failure.violation.message
    assert "missed its 3 s step deadline (the kit killed it) while serving a twin of the oracle (its release(" in message
    assert "--step-timeout 3" in result.rerun_command
    assert live_worker_pids() == []


def test_a_foreign_worker_that_answers_its_engines_exception_is_an_unexplained_exception(tmp_path: Path) -> None:
    """The proto's convention, INTERNAL with the type in the trailing metadata, from a worker
    that lives on: named at once, not after a wait for an exit that never comes."""
    result = fuzz(worker_command=command("raise-on-cancel"), seed=1, examples=50, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "unexplained exception"
    assert [record.action.op for record in result.failure.records] == ["prefill", "cancel"]
    message = result.failure.violation.message
    assert "answered that its engine raised RuntimeError: cancel lost its session table (the kit ended it)" in message
    assert "| standalone_worker: cancel raised RuntimeError" in message
    assert live_worker_pids() == []


def test_replay_refuses_to_run_a_worker_command_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = fuzz(worker_command=command("cancel-keeps-kv"), seed=1, examples=100, out=tmp_path)
    assert result.trace_path is not None
    assert main(["replay", str(result.trace_path), "--trust", "--no-isolate"]) == 2
    err = capsys.readouterr().err
    assert "always runs in worker processes; drop --no-isolate" in err


def test_the_printed_rerun_and_the_regression_test_find_the_same_failure(tmp_path: Path) -> None:
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    arguments = ["fuzz", "--worker-command", command("cancel-keeps-kv"), "--seed", "1", "--examples", "100"]
    found = subprocess.run(
        [sys.executable, "-m", "shardkit", *arguments, "--out", "found"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 1, found.stdout + found.stderr
    assert "FAILURE (§2 metrics) in 2 steps:" in found.stdout
    first_line = found.stdout.splitlines()[0]
    rerun = [line for line in found.stdout.splitlines() if line.strip().startswith("the whole run:")]
    assert rerun
    assert rerun[0].split(":", 1)[1].strip() == first_line
    again = subprocess.run(
        [sys.executable, "-m", "shardkit", *shlex.split(first_line)[1:], "--out", "again"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 1
    assert "FAILURE (§2 metrics) in 2 steps:" in again.stdout
    [regression] = (tmp_path / "found").glob("test_*.py")
    tested = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(regression)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tested.returncode == 1, tested.stdout
    assert "kv_tokens=1" in tested.stdout


def test_a_correct_foreign_worker_passes_fuzz_and_contract(capsys: pytest.CaptureFixture[str]) -> None:
    result = fuzz(worker_command=command(), seed=4, examples=20)
    assert result.failure is None
    assert result.steps > 0
    assert main(["contract", "--worker-command", command()]) == 0
    assert "every contract check passed" in capsys.readouterr().out
    assert live_worker_pids() == []


def test_contract_reports_a_foreign_workers_death_as_a_failed_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", "--worker-command", command("abort-on-restart")]) == 1
    out = capsys.readouterr().out
    assert "[a stale epoch is ABORTED] the engine process killed by SIGABRT" in out
    assert live_worker_pids() == []


def test_contract_isolate_reports_a_python_engines_death_as_a_failed_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", "shardkit._planted.dying:SegfaultsOnDecodeAfterCancel", "--isolate"]) == 1
    out = capsys.readouterr().out
    assert "[cancel then decode is CANCELLED] the engine process killed by SIGSEGV" in out
    assert "Fatal Python error: Segmentation fault" in out


def test_a_suite_names_its_engine_by_worker_command() -> None:
    machine = machine_for(worker_command=command("cancel-keeps-kv"), role="full")
    assert machine._target.target == WorkerCommand(command("cancel-keeps-kv"))
    assert machine._target.isolation is not None
    machine._target.isolation.close()
    with pytest.raises(UsageError, match="give one of them"):
        machine_for("shardkit:FakeShardEngine", worker_command=command())
    with pytest.raises(UsageError, match="name the engine to fuzz"):
        machine_for()


def test_worker_memory_caps_a_foreign_worker(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import resource, sys\nprint('data limit', resource.getrlimit(resource.RLIMIT_DATA)[0] >> 20)\nsys.exit(3)\n")
    target = WorkerCommand(f"{shlex.quote(sys.executable)} {probe} {{address}}")
    options = IsolationOptions(worker_memory_mb=321)
    from shardkit._transport.isolation import isolated_target

    isolated = isolated_target(target, options)
    try:
        with pytest.raises(InvalidTarget, match=r"exited with code 3 before serving: data limit 321"):
            isolated()
    finally:
        assert isolated.isolation is not None
        isolated.isolation.close()


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["fuzz", "--worker-command", "my_worker --listen 127.0.0.1:9"], "has no {address}"),
        (["fuzz", "--worker-command", "my_worker 'unclosed {address}"], "does not split into words"),
        (["fuzz", "--worker-command", " "], "a worker command must be the command line"),
        (["fuzz", "shardkit:FakeShardEngine", "--worker-command", "w {address}"], "drop 'shardkit:FakeShardEngine'"),
        (["contract"], "name the engine"),
        (["contract", "--worker-command", "w"], "has no {address}"),
        (["replay", "t.json", "--worker-command", "w {address}", "--no-isolate"], "drop --no-isolate"),
        (["replay", "t.json", "--worker-command", "w {address}", "--engine", "x:y"], "drop --engine 'x:y'"),
    ],
)
def test_a_bad_worker_command_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], arguments: list[str], named: str
) -> None:
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert named in err


def test_a_worker_command_whose_program_is_missing_or_exits_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--worker-command", "./no/such/worker --listen {address}", "--examples", "1"]) == 2
    err = capsys.readouterr().err
    assert "could not be started" in err
    assert "no/such/worker" in err
    assert main(["contract", "--worker-command", "false {address}"]) == 2
    err = capsys.readouterr().err
    assert "exited with code 1 before serving" in err


def test_a_worker_commands_label_is_its_program_or_script() -> None:
    assert WorkerCommand("workers/cpp/build/shard_worker --listen {address}").label == "shard_worker"
    assert WorkerCommand("python3 tools/my_worker.py --listen {address}").label == "my_worker"
    assert WorkerCommand("docker run img:tag --listen {address}").label == "docker"
