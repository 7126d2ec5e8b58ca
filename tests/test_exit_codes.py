"""Exit codes never lie (issue 12 §4): 0 only when everything asked was checked, 1 only for a
failure found or reproduced, 2 for every input error, one line and no traceback.

Each test here failed before its fix: a target raising ``SystemExit`` passed with exit 0, an
engine's ``load`` raising printed a traceback, a lost server printed Hypothesis's
``FlakyStrategyDefinition``, and a report that could not be written turned a found failure
into exit 2.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit._cli.main import main
from shardkit.errors import KitBug

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--examples", "20", "--steps", "20"]


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Call ``shardkit`` in-process; return its exit code, stdout and stderr."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(code: int, out: str, err: str) -> str:
    """Exit 2, exactly one line on stderr, no traceback anywhere; return that line."""
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def write_engine(folder: Path, source: str, name: str = "engines_under_test.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


ENGINES = """
    import os

    from shardkit import EngineError, FakeShardEngine, StatusCode, StructuredStatus


    class DecodeExits(FakeShardEngine):
        def decode(self, request):
            raise SystemExit(0)


    class LoadRaises(FakeShardEngine):
        def load(self, request):
            raise RuntimeError("no GPU here")


    class CapabilitiesRaises(FakeShardEngine):
        def capabilities(self):
            raise KeyError("total_layers")


    class RefusesEveryRange(FakeShardEngine):
        def load(self, request):
            status = StructuredStatus(StatusCode.INVALID_ARGUMENT, "this engine serves layers 0..1 only")
            raise EngineError(status)


    def broken_reference():
        raise RuntimeError("reference weights missing")
"""


@pytest.fixture
def engines(tmp_path: Path) -> Path:
    return write_engine(tmp_path, ENGINES)


# --- SystemExit from the target is never the kit's exit ---------------------------------


def test_a_target_that_raises_system_exit_when_called_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = one_error_line(*run(capsys, "fuzz", "sys:exit", *SMALL, "--out", tmp_path))
    assert "'sys:exit' raised SystemExit()" in line


def test_an_engine_whose_decode_raises_system_exit_0_does_not_pass(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, engines: Path
) -> None:
    """It used to exit 0 with no output. It is the engine's failure, shrunk like any other."""
    code, out, err = run(capsys, "fuzz", f"{engines}:DecodeExits", "--seed", "1", *SMALL, "--out", tmp_path)
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    assert "FAILURE (unexplained exception) in 1 step:" in out
    assert "SystemExit(0)" in out


def test_system_exit_escaping_a_command_is_reported_not_obeyed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whatever the library lets through, main() never turns a SystemExit(0) into exit 0."""

    def exits(*args: object, **kwargs: object) -> None:
        raise SystemExit(0)

    monkeypatch.setattr("shardkit._run.runner.fuzz", exits)
    line = one_error_line(*run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path))
    assert "SystemExit(0)" in line
    assert "never the kit's own exit" in line


def test_help_and_version_still_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as exit_info:
            main([flag])
        assert exit_info.value.code == 0
    assert "shardkit" in capsys.readouterr().out


# --- load and capabilities that raise ------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "fragments"),
    [
        ("LoadRaises", ["load(layers 0..3 of 4) raised RuntimeError: no GPU here", "engines_under_test.py"]),
        ("CapabilitiesRaises", ["capabilities() raised KeyError: 'total_layers'", "engines_under_test.py"]),
    ],
)
def test_an_engine_whose_load_or_capabilities_raises_exits_2_naming_the_call_and_the_exception(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, engines: Path, engine: str, fragments: list[str]
) -> None:
    line = one_error_line(*run(capsys, "fuzz", f"{engines}:{engine}", *SMALL, "--out", tmp_path / "out"))
    for fragment in fragments:
        assert fragment in line
    assert "only EngineError" in line


def test_an_engine_whose_load_raises_only_sometimes_exits_2_naming_it_never_the_kit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A load that fails once, mid-run (a thread or memory limit reached), then works again:
    Hypothesis reports the example as flaky, which read as an internal error of the kit."""
    source = """
        from shardkit import FakeShardEngine

        _built = []


        class LoadFailsOnce(FakeShardEngine):
            def load(self, request):
                _built.append(1)
                if len(_built) == 40:
                    raise RuntimeError("can't start new thread")
                return super().load(request)
    """
    path = write_engine(tmp_path, source, "flaky_load.py")
    # No twins and no crash faults: every load is an example's first (a twin's, or a restart's, is a finding).
    argv = ["--examples", "50", "--seed", "1", "--faults", "none", "--no-twins"]
    line = one_error_line(*run(capsys, "fuzz", f"{path}:LoadFailsOnce", *argv))
    assert "internal error" not in line
    assert "raised RuntimeError: can't start new thread" in line
    assert "only sometimes" in line


def test_an_isolated_worker_that_exits_in_load_is_named_with_its_exit_code(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It used to read "the engine server is unreachable"."""
    pytest.importorskip("grpc")
    code, out, err = run(capsys, "fuzz", "tests.planted.dying:ExitsOnLoad", "--isolate", *SMALL, "--out", tmp_path)
    line = one_error_line(code, out, err)
    assert "its worker process exited with code 4 during load(layers 0..3 of 4)" in line
    assert "unreachable" not in line


# --- replay and --reference: input errors, not findings ----------------------------------------


@pytest.fixture(scope="module")
def planted_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from shardkit._run.runner import fuzz

    result = fuzz("tests.planted:ReleaseLeaksKvTokens", seed=3, out=tmp_path_factory.mktemp("trace"))
    assert result.trace_path is not None
    return result.trace_path


def test_replay_against_an_engine_that_refuses_the_recorded_layers_exits_2(
    capsys: pytest.CaptureFixture[str], planted_trace: Path, engines: Path
) -> None:
    """It used to print an EngineError traceback and exit 1, which reads as "reproduced"."""
    line = one_error_line(*run(capsys, "replay", planted_trace, "--engine", f"{engines}:RefusesEveryRange"))
    assert "INVALID_ARGUMENT" in line
    assert "this engine serves layers 0..1 only" in line


def test_a_reference_that_cannot_be_built_exits_2_and_is_not_blamed_on_the_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, engines: Path
) -> None:
    argv = ["fuzz", "--seed", "1", *SMALL, "--reference", f"{engines}:broken_reference", "--out", tmp_path]
    code, out, err = run(capsys, *argv)
    line = one_error_line(code, out, err)
    assert "broken_reference" in line
    assert "reference weights missing" in line
    assert "FAILURE" not in out


# --- a bug of the kit -------------------------------------------------------------------------


def test_a_bug_of_the_kit_exits_2_and_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def undetected(*args: object, **kwargs: object) -> None:
        message = "the injected malformed output at step 4 passed every check: a check of shardkit failed"
        raise KitBug(message)

    monkeypatch.setattr("shardkit._run.runner.fuzz", undetected)
    line = one_error_line(*run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path))
    assert line.startswith("shardkit: internal error: the injected malformed output at step 4")
    assert "bug in shardkit" in line


def test_an_unexpected_exception_is_an_internal_error_not_a_failure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Exit 2 (never 1, which would read as a failure found), with the traceback for the report."""

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("shardkit._run.runner.fuzz", broken)
    code, _, err = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path)
    assert code == 2
    last = err.splitlines()[-1]
    assert last.startswith("shardkit: internal error: unexpected ZeroDivisionError: division by zero")
    assert "this is a bug in shardkit" in last


# --- any value the CLI accepts runs ---------------------------------------------------------------


def test_a_thousand_steps_per_example_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--steps 1000 used to crash with Hypothesis's FailedHealthCheck (from about 700 steps)."""
    code, out, err = run(capsys, "fuzz", "--seed", "1", "--steps", "1000", "--examples", "2", "--out", tmp_path)
    assert code == 0, out + err
    assert "no failure found" in out
    assert "Traceback" not in out + err


# --- a lost server --------------------------------------------------------------------------------

SERVED = """
    import os
    import signal

    from shardkit import FakeShardEngine
    from shardkit._planted import ReleaseLeaksKvTokens

    # The server kills itself (SIGKILL, as `kill -9` would) in the middle of a call, at a point
    # the kit's seeded run reaches deterministically.
    metrics_calls = 0
    failing_answers = 0


    def _die():
        os.kill(os.getpid(), signal.SIGKILL)


    class DiesAfter50Calls(FakeShardEngine):
        def metrics(self):
            global metrics_calls
            metrics_calls += 1
            if metrics_calls == 50:
                _die()
            return super().metrics()


    class LeaksThenDiesWhileShrinking(ReleaseLeaksKvTokens):
        def metrics(self):
            global failing_answers
            if self.leaked:
                failing_answers += 1
                if failing_answers == 5:  # the failure was found at the first; now it is shrinking
                    _die()
            return super().metrics()
"""


@pytest.fixture
def dying_server(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[str]]]]:
    """Serve a factory of SERVED over a unix socket in a subprocess; killed afterwards if alive."""
    pytest.importorskip("grpc")
    write_engine(tmp_path, SERVED, "served_engines.py")
    started: list[subprocess.Popen[str]] = []
    yield tmp_path, started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def _serve(folder: Path, factory: str, started: list[subprocess.Popen[str]]) -> str:
    address = f"unix:{folder}/server.sock"
    command = [sys.executable, "-m", "shardkit", "serve", f"{folder}/served_engines.py:{factory}", "--listen", address]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder)
    started.append(process)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("serving "), process.stderr.read() if process.stderr else ""
    return address


def _fuzz_subprocess(address: str, out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shardkit", "fuzz", address, "--seed", "3", "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False)


def test_a_server_killed_mid_run_is_one_error_line_naming_the_address(
    dying_server: tuple[Path, list[subprocess.Popen[str]]],
) -> None:
    folder, started = dying_server
    address = _serve(folder, "DiesAfter50Calls", started)
    out = folder / "failures"
    run = _fuzz_subprocess(address, out)
    assert started[0].wait(timeout=30) == -signal.SIGKILL
    line = one_error_line(run.returncode, run.stdout, run.stderr)
    assert line.startswith(f"shardkit: error: the engine server at {address} went away during ")
    assert "it left no in-progress trace" in line
    assert "FAILURE" not in run.stdout


def test_a_server_killed_while_shrinking_names_the_in_progress_trace_it_left(
    dying_server: tuple[Path, list[subprocess.Popen[str]]],
) -> None:
    """It used to print a FlakyStrategyDefinition traceback, or exit 2 without naming the trace."""
    folder, started = dying_server
    address = _serve(folder, "LeaksThenDiesWhileShrinking", started)
    out = folder / "failures"
    run = _fuzz_subprocess(address, out)
    assert started[0].wait(timeout=30) == -signal.SIGKILL
    line = one_error_line(run.returncode, run.stdout, run.stderr)
    assert line.startswith(f"shardkit: error: the engine server at {address} went away during ")
    kept = [path for path in out.iterdir() if "in-progress" in path.name]
    assert len(kept) == 1, sorted(out.iterdir())
    assert f"the shortest failure found before is kept in {kept[0]}" in line
    assert "§2 metrics" in kept[0].read_text()


# --- a found failure is exit 1, always ----------------------------------------------------------


def test_a_report_that_cannot_be_written_after_a_failure_still_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def disk_full(path: Path, document: object) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("shardkit._cli.fuzz.write_atomically", disk_full)
    report = tmp_path / "report.json"
    argv = ["fuzz", "tests.planted:ReleaseLeaksKvTokens", "--seed", "3", "--out", tmp_path / "out", "--report", report]
    code, out, err = run(capsys, *argv)
    assert code == 1, (out, err)
    assert "FAILURE (§2 metrics) in 2 steps:" in out
    assert err.splitlines() == [f"shardkit: could not write --report {report}: No space left on device"]


def test_a_report_that_cannot_be_written_without_a_failure_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def disk_full(path: Path, document: object) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("shardkit._cli.fuzz.write_atomically", disk_full)
    report = tmp_path / "report.json"
    code, out, err = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path, "--report", report)
    assert "no failure found" in out
    assert one_error_line(code, out, err) == f"shardkit: could not write --report {report}: No space left on device"
