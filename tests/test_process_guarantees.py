"""A run's verdict survives whatever the engine does to its process (docs/process.md).

Each engine here misbehaves as a process, as native libraries and schedulers do: it ends the
process (a native ``exit(0)`` from C, and ``os._exit`` standing in for one), registers an
``atexit`` handler that does, leaves a thread running that never ends, or starts a child
process that outlives it. Before the supervising parent, the first three exited 0, the
thread hung the run after ``no failure found``, and the children were left behind, one per
isolated worker. Every command here runs as users run it, through ``python -m shardkit``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit._process.supervisor import EXIT_GRACE_SECONDS

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--examples", "10", "--steps", "10", "--seed", "1"]
#: Enough for the planted stale-epoch bug to be found (it needs longer examples than SMALL).
FINDING = ["--examples", "50", "--seed", "1"]
#: Long enough for any command here on a busy machine; the thread test waits the grace on top.
RUN_SECONDS = 300

ENGINES = """
    import atexit
    import ctypes
    import os
    import subprocess
    import threading

    from shardkit import FakeShardEngine
    from shardkit._planted import StaleEpochAccepted


    class NativeExitInDecode(FakeShardEngine):
        def decode(self, request):
            ctypes.CDLL(None).exit(0)  # what a C library's exit(0) does


    class ExitsInDecode(FakeShardEngine):
        def decode(self, request):
            os._exit(0)


    class ExitsInLoad(FakeShardEngine):
        def load(self, request):
            os._exit(0)


    class BuggyAndExitsZeroAtExit(StaleEpochAccepted):
        def load(self, request):
            atexit.register(os._exit, 0)
            return super().load(request)


    _never = threading.Event()
    # One thread, one child per process (not one per engine: a run builds hundreds of engines).
    _started = []


    class LeavesAThreadRunning(FakeShardEngine):
        def load(self, request):
            if not _started:
                _started.append(threading.Thread(target=_never.wait, name="scheduler-loop"))
                _started[0].start()
            return super().load(request)


    class LeavesAnOrphanRunning(FakeShardEngine):
        def load(self, request):
            if not _started:
                # sh starts sleep in the background and ends: sleep is no child of this process.
                command = ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]
                _started.append(subprocess.run(command, capture_output=True, text=True, check=True))
                with open(os.environ["CHILDREN_FILE"], "a") as pids:
                    pids.write(_started[0].stdout)
            return super().load(request)


    class LeavesAChildRunning(FakeShardEngine):
        def load(self, request):
            if not _started:
                _started.append(subprocess.Popen(["sleep", "600"]))
                with open(os.environ["CHILDREN_FILE"], "a") as pids:
                    pids.write(f"{_started[0].pid}\\n")
            return super().load(request)
"""


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    path = tmp_path / "misbehaving.py"
    path.write_text(textwrap.dedent(ENGINES), encoding="utf-8")
    return path


def shardkit(folder: Path, *argv: str, timeout: float = RUN_SECONDS) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CHILDREN_FILE": str(folder / "children.txt")}
    environment.pop("SHARDKIT_IN_PROCESS", None)
    command = [sys.executable, "-m", "shardkit", *argv]
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=timeout)


def fake_trace(folder: Path) -> str:
    """A trace of a planted bug: replayed against another engine, it loads that engine."""
    run = shardkit(folder, "fuzz", "shardkit._planted:StaleEpochAccepted", *FINDING, "--out", "found")
    assert run.returncode == 1, run.stdout + run.stderr
    traces = sorted((folder / "found").glob("*.json"))
    assert traces, run.stdout
    return str(traces[0])


# --- an engine that ends the process never passes ----------------------------------------------------


@pytest.mark.parametrize("engine", ["NativeExitInDecode", "ExitsInDecode", "ExitsInLoad"])
def test_fuzz_of_an_engine_that_ends_the_process_exits_2_saying_so(engines: Path, engine: str) -> None:
    run = shardkit(engines.parent, "fuzz", f"misbehaving.py:{engine}", *SMALL, "--out", "found")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "ended (exit status 0) before the run reached a verdict" in run.stderr
    assert "--isolate" in run.stderr  # where such an engine is fuzzed to a shrunk failure
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["replay", "contract"])
def test_replay_and_contract_of_an_engine_that_ends_the_process_exit_2(engines: Path, command: str) -> None:
    folder = engines.parent
    argv = [command, fake_trace(folder), "--engine"] if command == "replay" else [command]
    run = shardkit(folder, *argv, "misbehaving.py:ExitsInLoad")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "before the run reached a verdict" in run.stderr


def test_a_verdict_stands_whatever_an_atexit_handler_exits_with(engines: Path) -> None:
    run = shardkit(engines.parent, "fuzz", "misbehaving.py:BuggyAndExitsZeroAtExit", *FINDING, "--out", "found")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILURE" in run.stdout
    assert "after its verdict (exit 1) the run's process ended with exit status 0" in run.stderr


# --- nothing left behind -----------------------------------------------------------------------------


def test_a_thread_left_running_ends_the_run_after_its_verdict_and_is_named(engines: Path) -> None:
    run = shardkit(engines.parent, "fuzz", "misbehaving.py:LeavesAThreadRunning", *SMALL, "--out", "found")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no failure found" in run.stdout
    assert f"did not end within {EXIT_GRACE_SECONDS:g} s of the verdict" in run.stderr
    assert "'scheduler-loop'" in run.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_no_process_the_engine_started_outlives_the_run(engines: Path, isolate: bool) -> None:
    folder = engines.parent
    run = shardkit(folder, "fuzz", "misbehaving.py:LeavesAChildRunning", *SMALL, "--out", "found", *(["--isolate"] if isolate else []))
    children = [int(line) for line in (folder / "children.txt").read_text().split()]
    left = [pid for pid in children if _alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(children) > 1 if isolate else len(children) == 1  # one per worker, or one
    assert left == [], f"{len(left)} of {len(children)} children outlived the run"
    if not isolate:
        # In process, the run's own end leaves it: named. Isolated, each worker's group goes with it.
        assert f"the run left 1 process running, now killed: {children[0]} (sleep 600)" in run.stderr


def test_a_correct_engine_runs_as_before_and_says_nothing_more(tmp_path: Path) -> None:
    run = shardkit(tmp_path, "fuzz", "shardkit:FakeShardEngine", *SMALL, "--out", "found")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr == ""
    assert "no failure found" in run.stdout


@pytest.mark.parametrize("command", ["fuzz", "campaign", "replay", "contract", "bench"])
def test_a_supervised_commands_help_exits_0(tmp_path: Path, command: str) -> None:
    run = shardkit(tmp_path, command, "--help")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith(f"usage: shardkit {command}")
    assert run.stderr == ""


# --- the same under pytest ---------------------------------------------------------------------------

SUITE = """
    import os

    from shardkit import machine_for

    TestEngine = machine_for(os.environ["SUITE_ENGINE"]).TestCase
"""


def pytest_run(folder: Path, engine: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``pytest`` of a shardkit suite of ``engine``, as a top-level session of its own."""
    (folder / "test_suite_of_engine.py").write_text(textwrap.dedent(SUITE), encoding="utf-8")
    environment = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{REPO_ROOT}", "SUITE_ENGINE": f"misbehaving:{engine}"}
    environment["CHILDREN_FILE"] = str(folder / "children.txt")
    for inherited in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_CURRENT_TEST", "SHARDKIT_IN_PROCESS"):
        environment.pop(inherited, None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-profile", "shardkit-ci", *argv]
    command.append("test_suite_of_engine.py")
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=RUN_SECONDS)


@pytest.mark.parametrize("engine", ["NativeExitInDecode", "ExitsInDecode"])
def test_a_pytest_session_whose_engine_ends_the_process_fails_naming_the_test(engines: Path, engine: str) -> None:
    run = pytest_run(engines.parent, engine)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "the pytest process ended (exit status 0) while running test_suite_of_engine.py::TestEngine::runTest" in run.stderr


def test_under_pytest_xdist_the_controller_reports_the_crashed_worker(engines: Path) -> None:
    run = pytest_run(engines.parent, "ExitsInDecode", "-n", "2")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "crashed while running 'test_suite_of_engine.py::TestEngine::runTest'" in run.stdout


def test_a_pytest_verdict_stands_whatever_an_atexit_handler_exits_with(engines: Path) -> None:
    run = pytest_run(engines.parent, "BuggyAndExitsZeroAtExit")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout
    assert "after its verdict (exit 1) the pytest process ended with exit status 0" in run.stderr


def test_a_pytest_session_ends_after_its_verdict_whatever_threads_the_engine_left(engines: Path) -> None:
    run = pytest_run(engines.parent, "LeavesAThreadRunning")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert "'scheduler-loop'" in run.stderr


LEFT_BEHIND = ["LeavesAChildRunning", "LeavesAnOrphanRunning"]


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["pytest", "pytest-n-2"])
@pytest.mark.parametrize("engine", LEFT_BEHIND)
def test_no_process_a_suite_s_engine_started_outlives_the_session(engines: Path, engine: str, xdist: list[str]) -> None:
    """In a supervised session, the supervisor is a subreaper; a pytest-xdist worker is not,
    and finds the processes its tests started by the mark in their environment."""
    folder = engines.parent
    run = pytest_run(folder, engine, *xdist)
    started = [int(line) for line in (folder / "children.txt").read_text().split()]
    left = [pid for pid in started if _alive(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(started) == 1
    assert left == [], f"{len(left)} of {len(started)} processes outlived the session"
    assert f"the session left 1 process running, now killed: {started[0]} (sleep 600)" in run.stderr


def test_a_correct_suite_passes_and_says_nothing_more(engines: Path) -> None:
    (engines.parent / "misbehaving.py").write_text("from shardkit import FakeShardEngine as Correct\n", encoding="utf-8")
    run = pytest_run(engines.parent, "Correct")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert run.stderr == ""


def test_under_pytest_xdist_a_worker_names_the_threads_its_tests_left(engines: Path) -> None:
    threads = pytest_run(engines.parent, "LeavesAThreadRunning", "-n", "2")
    assert threads.returncode == 0, threads.stdout + threads.stderr
    assert "the session's tests left non-daemon threads running: 'scheduler-loop'" in threads.stderr
