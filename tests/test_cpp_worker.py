"""The C++ reference worker (``workers/cpp``), built from a clean tree and fuzzed through
``--worker-command``: it passes the contract and a CI-sized fuzz run, and its two
compile-time plants, a semantic bug (cancel keeps the KV tokens) and a native crash (a
null dereference on a rare path), are found at several seeds, shrunk to their minimum and
replayed through the worker command.

The build needs Debian's ``libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
protobuf-compiler pkg-config`` and make; without them these tests skip, unless
``SHARDKIT_REQUIRE_CPP_WORKER=1`` (``.ci/run`` installs the packages and sets it) makes
that a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardkit._cli.main import main
from shardkit._core.targets import WorkerCommand
from shardkit._run.replay import replay
from shardkit._run.runner import fuzz
from shardkit._transport.worker import live_worker_pids
from tests import streams

pytest.importorskip("grpc")

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "workers" / "cpp"
#: The worker's minimal failing sequences, as the kit must shrink them.
CANCEL_LEAK_STEPS = ["prefill", "cancel"]
NULL_DEREF_STEPS = ["prefill", "decode", "decode"]  # a second decode at an epoch above 0


def _build_problem() -> str | None:
    if shutil.which("make") is None or shutil.which("g++") is None:
        return "make and g++ are not installed"
    if shutil.which("protoc") is None or shutil.which("grpc_cpp_plugin") is None:
        return "protoc and grpc_cpp_plugin are not installed (protobuf-compiler, protobuf-compiler-grpc)"
    found = subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False)
    if found.returncode != 0:
        return "pkg-config finds no grpc++ and protobuf (libgrpc++-dev, libprotobuf-dev, pkg-config)"
    return None


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker and its two planted variants, built once into a fresh folder."""
    problem = _build_problem() if shutil.which("pkg-config") else "pkg-config is not installed"
    if problem is not None:
        if os.environ.get("SHARDKIT_REQUIRE_CPP_WORKER") == "1":
            pytest.fail(f"SHARDKIT_REQUIRE_CPP_WORKER=1, but {problem}", pytrace=False)
        pytest.skip(f"the C++ worker cannot be built here: {problem}")
    folder = tmp_path_factory.mktemp("cpp-worker")
    made = subprocess.run(
        ["make", "-C", str(SOURCES), f"BUILD={folder}", "-j2", "all-variants"],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return folder


def worker(build: Path, variant: str = "") -> str:
    binary = build / (f"shard_worker-{variant}" if variant else "shard_worker")
    return f"{binary} --listen {{address}}"


def test_the_reference_worker_passes_the_contract(build: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", "--worker-command", worker(build)]) == 0
    out = capsys.readouterr().out
    assert "every contract check passed" in out
    assert "skipped" not in out  # it serves every role


def test_the_reference_worker_answers_the_calls_stream_as_its_rpcs(build: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="shardkit-") as folder:  # short: a socket path has a limit
        address = f"unix:{folder}/w.sock"
        command = [str(build / "shard_worker"), "--listen", address]
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as started:
            assert started.stdin is not None
            assert started.stdout is not None
            try:
                assert started.stdout.readline().startswith("listening on")
                streams.check_a_stream_answers_each_call_with_its_status_and_goes_on(address)
            finally:
                started.stdin.close()  # the worker exits at the end of its stdin
                started.wait(timeout=10)


def test_the_reference_worker_survives_a_ci_sized_fuzz_run(build: Path) -> None:
    # Workers an earlier test file in this pytest process keeps are not this run's.
    before = set(live_worker_pids())
    result = fuzz(worker_command=worker(build), seed=1, examples=150)
    assert result.failure is None, result.failure
    assert result.steps > 5_000
    assert {"crash", "delay", "malformed_output"} <= result.faults
    assert set(live_worker_pids()) - before == set()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_planted_cancel_leak_is_found_shrunk_and_replayed(build: Path, seed: int, tmp_path: Path) -> None:
    result = fuzz(worker_command=worker(build, "cancel-leak"), seed=seed, examples=100, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "§2 metrics"
    assert [record.action.op for record in result.failure.records] == CANCEL_LEAK_STEPS
    assert result.trace_path is not None
    replayed = replay(result.trace_path, trust=True)
    assert replayed.reproduced
    # The unplanted build, named by the user, no longer fails the trace.
    assert replay(result.trace_path, target=WorkerCommand(worker(build))).failure is None


@pytest.mark.parametrize("seed", [1, 2])
def test_the_planted_native_crash_is_found_shrunk_and_replayed(build: Path, seed: int, tmp_path: Path) -> None:
    before = set(live_worker_pids())
    result = fuzz(worker_command=worker(build, "null-deref"), seed=seed, examples=200, out=tmp_path)
    assert result.failure is not None
    assert result.failure.violation.property == "process killed by SIGSEGV"
    assert [record.action.op for record in result.failure.records] == NULL_DEREF_STEPS
    assert result.trace_path is not None
    assert result.trace_path.name.startswith("shard-worker-null-deref-")
    # Through the command line, naming the worker command as a user who rebuilt it would.
    command = [sys.executable, "-m", "shardkit", "replay", str(result.trace_path)]
    command += ["--worker-command", worker(build, "null-deref")]
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    replayed = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120, check=False)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "FAILURE (process killed by SIGSEGV) in 3 steps:" in replayed.stdout
    assert set(live_worker_pids()) - before == set()
