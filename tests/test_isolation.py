"""``--isolate``: engines in a worker process whose deaths are ordinary, shrunk, replayable failures.

The five dying planted engines (``tests/planted/dying.py``) abort, segfault, hang,
exit and allocate without bound; each is fuzzed once per module in a worker
process, and must be found under its property, shrunk to its minimal sequence
and replayed, while this process survives and no worker outlives its run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from shardkit import FakeShardEngine, LoadRequest, machine_for
from shardkit._cli.main import main
from shardkit._core.driver import Driver
from shardkit._core.steps import Action, step_action
from shardkit._core.targets import IsolationOptions
from shardkit._run.options import DEFAULT_BUDGETS
from shardkit._run.replay import load_trace, replay
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit._transport.isolation import isolated_target, target_with_options
from shardkit.errors import InvalidTarget, RemoteEngineError, RemoteProtocolError, ShardkitError
from tests.planted.dying import DYING, DyingEngine

pytest.importorskip("grpc")

SEED = 3


def worker_children() -> set[int]:
    """This process's descendants that are shardkit workers, alive (zombies excluded): the
    workers, and the fork server and waiters they are forked from (its command line, which
    they share, is ``shardkit serve TARGET --worker --fork-server FD``)."""
    parents: dict[int, int] = {}
    workers = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        state, parent = fields[0], int(fields[1])
        parents[int(entry.name)] = parent
        if state != "Z" and b"serve" in command and b"--worker" in command:
            workers.add(int(entry.name))
    return {pid for pid in workers if os.getpid() in ancestors(pid, parents)}


def ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    found: set[int] = set()
    while pid in parents and parents[pid] not in found:
        pid = parents[pid]
        found.add(pid)
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


DYING_BUDGETS = replace(DEFAULT_BUDGETS, shrink_examples=100)


def options_for(engine: type[DyingEngine]) -> IsolationOptions:
    return IsolationOptions(engine.STEP_TIMEOUT or 5.0, engine.WORKER_MEMORY)


@pytest.fixture(scope="module")
def dying_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[type[DyingEngine], tuple[FuzzResult, set[int]]]:
    """Each dying engine fuzzed in a worker with --seed 3, and the workers left after its run.

    Hypothesis's shrinking gets 100 examples instead of 3 000: every example it tries
    restarts a dead worker (the fixture took 5-6 minutes of CI). The replay minimiser
    finishes the job, and the test still asks for the minimal sequence, 1-minimal."""
    runs = {}
    for engine in DYING:
        before = worker_children()
        result = fuzz(
            f"tests.planted.dying:{engine.__name__}",
            seed=SEED,
            role=engine.ROLE,
            out=tmp_path_factory.mktemp(engine.__name__),
            isolate=options_for(engine),
            budgets=DYING_BUDGETS,
        )
        runs[engine] = (result, worker_children() - before)
    return runs


@pytest.mark.parametrize("engine", DYING, ids=lambda engine: engine.__name__)
def test_each_dying_engine_is_found_shrunk_and_replayed_in_a_worker(
    engine: type[DyingEngine], dying_runs: dict[type[DyingEngine], tuple[FuzzResult, set[int]]]
) -> None:
    result, leftovers = dying_runs[engine]
    failure = result.failure
    assert failure is not None, f"{engine.__name__} ({engine.BUG}) was not found"
    assert failure.violation.property == engine.PROPERTY, failure.violation.message
    assert len(failure.records) == len(engine.MINIMAL), failure.violation.message
    assert result.minimized is not None
    assert result.minimized.one_minimal
    assert "engine process " in failure.violation.message
    assert f"during step {len(engine.MINIMAL)}: " in failure.violation.message
    assert leftovers == set(), f"worker processes outlived the run: {leftovers}"
    assert result.trace_path is not None
    trace = load_trace(result.trace_path)
    assert trace.isolation == options_for(engine)
    replayed = replay(result.trace_path)
    assert replayed.reproduced, replayed.failure
    assert len(replayed.records) == len(engine.MINIMAL)
    assert "--isolate" in result.rerun_command


def test_each_death_names_how_the_process_ended_and_what_it_printed(
    dying_runs: dict[type[DyingEngine], tuple[FuzzResult, set[int]]],
) -> None:
    messages = {engine: run.failure.violation.message for engine, (run, _) in dying_runs.items() if run.failure}
    segfault = messages[DYING[1]]
    assert "engine process killed by SIGSEGV during step 3: decode(session='a'" in segfault
    assert "Fatal Python error: Segmentation fault" in segfault
    assert "dying.py" in segfault  # faulthandler's stack names the engine's line
    assert "engine process killed by SIGABRT during step 2" in messages[DYING[0]]
    hang = messages[DYING[2]]
    assert f"missed its {DYING[2].STEP_TIMEOUT:g} s step deadline (the kit killed it)" in hang
    assert "in decode" in hang  # the hung thread's stack, dumped before the kill
    assert "engine process exited with code 3 during step 3" in messages[DYING[3]]
    memory = messages[DYING[4]]
    assert "ran out of memory within --worker-memory 512 MB" in memory
    assert "MemoryError" in memory


def test_a_dying_engines_regression_test_fails_and_the_cli_replays_it(
    dying_runs: dict[type[DyingEngine], tuple[FuzzResult, set[int]]],
    capsys: pytest.CaptureFixture[str],
    repo_root: Path,
) -> None:
    result, _ = dying_runs[DYING[1]]
    assert result.trace_path is not None
    assert result.regression_path is not None
    assert main(["replay", str(result.trace_path)]) == 1
    assert "engine process killed by SIGSEGV during step 3" in capsys.readouterr().out
    test_run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(result.regression_path)],
        capture_output=True,
        text=True,
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        timeout=120,
    )
    assert test_run.returncode == 1, test_run.stdout + test_run.stderr
    assert "1 failed" in test_run.stdout


def test_the_fake_isolated_finds_nothing_and_leaves_no_worker(tmp_path: Path) -> None:
    before = worker_children()
    result = fuzz("shardkit:FakeShardEngine", seed=1, examples=40, steps=30, out=tmp_path, isolate=True)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert result.coverage[("prefill", "CRASH")] + result.coverage[("decode", "CRASH")] > 0
    assert worker_children() - before == set()


def test_an_injected_crash_really_kills_the_worker() -> None:
    """Native (the fake raises in the worker, which then exits) and at the boundary (the kit kills it)."""
    for name in ("shardkit:FakeShardEngine", "tests.planted:DelegatingEngine"):
        target = isolated_target(name)
        assert target.isolation is not None
        try:
            driver = Driver(target, LoadRequest("m", 0, 3, 4), faults=frozenset({"crash"}))
            worker = driver.target.isolation.pids[0]  # type: ignore[union-attr]
            driver.execute(Action("fault", {"kind": "crash", "value": 1.0}))
            record = driver.execute(step_action("prefill", "a", 0, 0, (1,)))
            assert record.outcome == "CRASH"
            assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
            assert driver.target.isolation.pids
            assert worker not in driver.target.isolation.pids
            assert driver.execute(step_action("prefill", "a", 0, 0, (1,))).outcome == "OK"
        finally:
            target.isolation.close()


def test_a_worker_dying_in_load_is_a_clear_error() -> None:
    target = isolated_target("tests.planted.dying:ExitsOnLoad")
    try:
        with pytest.raises(ShardkitError, match=r"engine process of .*ExitsOnLoad exited with code 4 while loading"):
            Driver(target, LoadRequest("m", 0, 3, 4))
        assert target.isolation.workers_forked == target.isolation.workers_started == 1  # type: ignore[union-attr]
    finally:
        target.isolation.close()  # type: ignore[union-attr]


def test_a_garbage_answer_is_named_and_the_worker_replaced() -> None:
    target = isolated_target("shardkit:FakeShardEngine")
    pool = target.isolation
    assert pool is not None
    assert isolated_target(target) is target
    with pytest.raises(ValueError, match="already isolated"):
        isolated_target(target, IsolationOptions(1.0))
    try:
        engine = target()
        first = pool.pids[0]
        error = RemoteProtocolError("bad", address=engine.url, operation="decode(...)")  # type: ignore[attr-defined]
        death = pool.death(error)
        assert death is not None
        assert death.property == "garbage answer"
        assert first not in pool.pids
        target().load(LoadRequest("m", 0, 3, 4))  # a fresh worker serves the next engine
        assert pool.pids
        assert first not in pool.pids
    finally:
        pool.close()
    assert pool.pids == []


def test_a_worker_ends_when_the_kit_dies_without_closing_it(tmp_path: Path, repo_root: Path) -> None:
    script = tmp_path / "kit.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            from shardkit._transport.isolation import isolated_target
            target = isolated_target("shardkit:FakeShardEngine")
            target()
            print(target.isolation.pids[0], target.isolation.fork_server_pid, flush=True)
            os._exit(0)  # no close, no atexit: as if the kit were killed
            """
        )
    )
    kit = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        timeout=60,
    )
    worker, fork_server = (int(pid) for pid in kit.stdout.split()[:2])
    for pid in (worker, fork_server):
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} (worker {worker}, fork server {fork_server}) outlived its kit"


def test_a_worker_that_cannot_start_is_a_clear_error_and_is_not_left_behind() -> None:
    before = worker_children()
    expected = r"worker process for shardkit:FakeShardEngine exited with code 2 before serving: .* give it at least \d+"
    machine = machine_for("shardkit:FakeShardEngine", isolate=True, worker_memory_mb=1)  # starts nothing yet
    assert worker_children() - before == set()
    with pytest.raises(InvalidTarget, match=expected):
        machine.prepare()
    assert worker_children() - before == set()


def test_options_that_cannot_apply_are_refused() -> None:
    with pytest.raises(ValueError, match="needs isolate=True"):
        target_with_options("shardkit:FakeShardEngine", worker_memory_mb=100)
    with pytest.raises(ValueError, match="needs isolate=True"):
        target_with_options("shardkit:FakeShardEngine", step_timeout=1.0)
    with pytest.raises(InvalidTarget, match="already out of process"):
        isolated_target("grpc://127.0.0.1:1")
    with pytest.raises(InvalidTarget, match="import by name"):
        isolated_target(lambda: FakeShardEngine())

    def make_engine() -> FakeShardEngine:
        return FakeShardEngine()

    make_engine.__module__, make_engine.__qualname__ = "__main__", "make_engine"  # a script's own factory
    with pytest.raises(InvalidTarget, match="'__main__:make_engine'"):
        isolated_target(make_engine)
    with pytest.raises(ValueError, match="step_timeout"):
        IsolationOptions(0.0)
    with pytest.raises(ValueError, match="worker_memory_mb"):
        IsolationOptions(1.0, 0)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["fuzz", "--worker-memory", "100"], "worker_memory_mb (--worker-memory) limits a worker process: it needs isolate=True (--isolate)"),
        (["fuzz", "--step-timeout", "1"], "step_timeout (--step-timeout) is the deadline of calls to another process"),
        (["fuzz", "grpc://127.0.0.1:9", "--isolate"], "is already out of process"),
        (["fuzz", "--isolate", "--step-timeout", "0"], "(--step-timeout) must be a number of seconds in (0, 3600]"),
        (["fuzz", "--isolate", "--worker-memory", "lots"], "--worker-memory must be a positive integer"),
    ],
)
def test_isolation_usage_errors_exit_2_with_one_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert fragment in error
    assert error.count("\n") == 1


# --- the fork server ---------------------------------------------------------------------------------------

COUNTING_TARGET = '''
import os

from shardkit import FakeShardEngine

BUILT = []


def make_engine():
    """Counts the engines built in this process, in a file beside this one."""
    BUILT.append(1)
    with open(os.path.join(os.path.dirname(__file__), "built.txt"), "a") as log:
        log.write(f"{os.getpid()} {len(BUILT)}\\n")
    return FakeShardEngine()
'''


def test_workers_are_forked_from_one_fork_server_that_never_builds_an_engine(tmp_path: Path) -> None:
    """25 workers in a row, each killed after one engine: all forked from one zygote, each serving
    gRPC, each starting from the module state the import made (its first engine is its first)."""
    (tmp_path / "counting.py").write_text(COUNTING_TARGET)
    target = isolated_target(f"{tmp_path / 'counting.py'}:make_engine")
    pool = target.isolation
    assert pool is not None
    assert tmp_path / "built.txt" not in tmp_path.iterdir()  # resolving the target built nothing
    try:
        served = []
        for _ in range(25):
            target().load(LoadRequest("m", 0, 3, 4))
            worker = pool.pids[0]
            served.append(worker)
            zygote = pool.fork_server_pid
            assert zygote is not None
            assert parent_of(parent_of(worker)) == zygote  # the zygote forked its waiter, which forked it
            assert os.getsid(worker) == worker != os.getsid(0)  # its own session: a Ctrl-C of the kit misses it
            pool.kill()
        assert pool.fork_note is None
        assert pool.fork_server_pid == zygote
        assert pool.workers_forked == pool.workers_started >= 25
        builds = [tuple(int(field) for field in line.split()) for line in (tmp_path / "built.txt").read_text().splitlines()]
        assert sorted(builds) == sorted((worker, 1) for worker in served)
    finally:
        pool.close()
    assert pool.fork_server_pid is None


def test_a_forked_workers_end_is_read_from_its_waiter_even_after_the_fork_server_died() -> None:
    """The zygote killed: its worker still serves, its death is still named, and the next
    workers start as fresh interpreters, with a note saying why."""
    before = worker_children()
    target = isolated_target("shardkit:FakeShardEngine")
    pool = target.isolation
    assert pool is not None
    try:
        engine = target()
        engine.load(LoadRequest("m", 0, 3, 4))
        forked, zygote = pool.pids[0], pool.fork_server_pid
        assert zygote is not None
        os.kill(zygote, signal.SIGKILL)
        engine.health()  # the worker outlives the zygote
        os.kill(forked, signal.SIGABRT)
        _wait_until_gone(forked)  # a signal is delivered when the process next runs: a call may beat it
        with pytest.raises(RemoteEngineError) as raised:
            engine.health()
        death = pool.death(raised.value)
        assert death is not None
        assert death.property == "process killed by SIGABRT", death
        target().load(LoadRequest("m", 0, 3, 4))
        fresh = pool.pids[0]
        assert parent_of(fresh) == os.getpid()  # a fresh interpreter, the kit's own child
        assert pool.fork_note is not None
        assert "fresh interpreters: the fork server was killed by SIGKILL" in pool.fork_note
        assert pool.workers_forked == 1
        assert pool.workers_started >= 2
    finally:
        pool.close()
    assert worker_children() - before == set()


def _wait_until_gone(pid: int) -> None:
    """Until ``pid`` has ended (a zombie or reaped); an error after a minute."""
    status = Path(f"/proc/{pid}/status")
    for _ in range(6000):
        try:
            if "\nState:\tZ" in status.read_text():
                return
        except OSError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still runs a minute after it was killed")


THREADED_TARGET = '''
import threading
import time

from shardkit import FakeShardEngine

threading.Thread(target=time.sleep, args=(30,), name="target-poller", daemon=True).start()
make_engine = FakeShardEngine
'''


def test_a_target_whose_import_starts_a_thread_gets_fresh_interpreters(tmp_path: Path) -> None:
    """A forked worker would lack the thread: the zygote refuses to fork, and says so."""
    (tmp_path / "threaded.py").write_text(THREADED_TARGET)
    target = isolated_target(f"{tmp_path / 'threaded.py'}:make_engine")
    pool = target.isolation
    assert pool is not None
    try:
        target().load(LoadRequest("m", 0, 3, 4))
        assert pool.workers_forked == 0
        assert pool.fork_note is not None
        assert "importing the target started Python threads (target-poller)" in pool.fork_note
        assert pool.fork_server_pid is None
        assert parent_of(pool.pids[0]) == os.getpid()
    finally:
        pool.close()
