"""The trust rule has no side doors.

- A program of a virtual environment inside the project (any folder with a ``pyvenv.cfg``
  above it) runs whatever its arguments say: a recorded worker command, or a target file,
  there is refused like one outside the project.
- A generated regression test names the code it runs in its own source (``CODE``): a trace
  beside it that names other code fails the test, in one line, and builds nothing; a test of
  the older form, which built whatever its trace named, fails asking to be regenerated.
- A bundled engine that kills its process (``shardkit._planted.dying``) replays in a worker
  process even when its trace records none, and never in the replaying process.

The hostile code leaves marker files when it runs; each test checks that none appeared.
Replays that could kill, hang or fill the process running them run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardkit._cli.main import main
from shardkit._planted.dying import (
    AllocatesWithoutBoundAfterRelease,
    DyingEngine,
    HangsOnSecondDecode,
    SegfaultsOnDecodeAfterCancel,
)
from shardkit._planted.traces import minimal_trace
from shardkit._run.replay import replay
from shardkit._run.runner import fuzz
from shardkit._run.trace_reader import read_trace
from shardkit._run.trust import admit
from shardkit.errors import UntrustedTarget

#: An engine that leaves a marker beside itself when imported and when called.
MARKING_ENGINE = """
from pathlib import Path

from shardkit import FakeShardEngine

Path(__file__).with_name("imported.marker").write_text("imported")


def make():
    Path(__file__).with_name("called.marker").write_text("called")
    return FakeShardEngine()
"""

#: A program that leaves a marker in the folder it is started from, whatever its arguments.
MARKING_PROGRAM = "#!/bin/sh\necho ran > ran.marker\n"

STEPS = [
    {"op": "prefill", "args": {"session": "a", "epoch": 0, "step": 0, "tokens": [1, 2]}, "note": ""},
    {"op": "release", "args": {"session": "a"}, "note": ""},
]


def _document(target: str, **extra: Any) -> dict[str, Any]:
    return {
        "format": "shardkit-trace",
        "version": 1,
        "shardkit_version": "0.1.0",
        "target": target,
        "role": "full",
        "load_request": {"model_id": "m", "shard_start": 0, "shard_end": 3, "total_layers": 4, "recipe": {}},
        "faults_enabled": [],
        "twins": True,
        "reference": None,
        "isolate": None,
        "fault_steps": [],
        "seed": 1,
        "steps": STEPS,
        "failure": {"property": "§2 metrics", "message": "step 2: release(session='a')", "step": 2},
        **extra,
    }


def _written(folder: Path, document: dict[str, Any]) -> Path:
    path = folder / "trace.json"
    path.write_text(json.dumps(document))
    return path


def _markers(*folders: Path) -> list[str]:
    return sorted(path.name for folder in folders for path in folder.rglob("*.marker"))


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


@pytest.fixture(autouse=True)
def _no_leftover_modules() -> Iterator[None]:
    before, path_before = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("venv_engines_pkg", "_shardkit_target_")):
            del sys.modules[name]
    sys.path[:] = path_before


# --- virtual environments -----------------------------------------------------------------------------


def _virtual_environment(project: Path, name: str = ".venv2") -> Path:
    """A virtual environment inside the project, as ``python -m venv --copies`` lays it out:
    its programs are files (python, pip), and python3 a link to python, all inside it."""
    venv = project / name
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    for program in ("python", "pip"):
        (venv / "bin" / program).write_text(MARKING_PROGRAM)
        (venv / "bin" / program).chmod(0o755)
    (venv / "bin" / "python3").symlink_to("python")
    return venv


@pytest.mark.parametrize(
    "command",
    [
        ".venv2/bin/python -c \"import os; os.system('touch pwned.marker')\" {address}",
        ".venv2/bin/python3 -m shardkit serve shardkit:FakeShardEngine {address}",
        ".venv2/bin/pip install --no-index /outside/dir {address}",
    ],
)
def test_a_worker_command_of_a_virtual_environment_in_the_project_is_refused(
    command: str, project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _virtual_environment(project)
    trace = project / "trace.json"
    trace.write_text(json.dumps(_document(f"worker-command:{command}")))
    with pytest.raises(UntrustedTarget) as refused:
        replay(trace)
    message = str(refused.value)
    program = command.split()[0]
    assert f"the program {program!r}, of the virtual environment {project / '.venv2'}" in message, message
    assert "--trust" in message
    assert "--worker-command CMD" in message
    assert main(["replay", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "of the virtual environment" in captured.err
    assert _markers(project) == []
    # The project's own programs, outside any virtual environment, still run as recorded.
    (project / "build").mkdir()
    (project / "build" / "worker").write_text(MARKING_PROGRAM)
    (project / "build" / "worker").chmod(0o755)
    own = _document("worker-command:build/worker {address}")
    admitted = admit(read_trace(_written(project, own)), "target", own["target"], trust=False)
    assert admitted.origin == project / "build" / "worker"
    assert _markers(project) == []


@pytest.mark.parametrize("where", ["a file target", "a module target"])
def test_python_code_in_a_virtual_environment_in_the_project_is_refused(where: str, project: Path) -> None:
    venv = _virtual_environment(project, "env")
    source = venv / "src"
    source.mkdir()
    if where == "a file target":
        (source / "engine.py").write_text(MARKING_ENGINE)
        document = _document("env/src/engine.py:make", target_file=str(source / "engine.py"))
        shown = f"the file {source / 'engine.py'}, in the virtual environment {venv}"
    else:
        (source / "venv_engines_pkg").mkdir()
        (source / "venv_engines_pkg" / "__init__.py").write_text(MARKING_ENGINE)
        document = _document("venv_engines_pkg:make", target_path=str(source))
        shown = f"at {source / 'venv_engines_pkg' / '__init__.py'}, in the virtual environment {venv}"
    trace = project / "trace.json"
    trace.write_text(json.dumps(document))
    with pytest.raises(UntrustedTarget) as refused:
        replay(trace)
    assert shown in str(refused.value), str(refused.value)
    assert _markers(project) == []


# --- a regression test runs the code it names -------------------------------------------------------------

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


def _pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", *args]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def leaky_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``shardkit fuzz leaky.py:Leaky`` run from a project: the project, its trace and its regression test."""
    project = tmp_path_factory.mktemp("leaky") / "project"
    project.mkdir()
    (project / "leaky.py").write_text(LEAKY_ENGINE)
    here = Path.cwd()
    os.chdir(project)
    try:
        result = fuzz("leaky.py:Leaky", seed=1, examples=200, steps=20, role="full", faults="none", out=Path("out"))
    finally:
        os.chdir(here)
    assert result.failure is not None
    assert result.trace_path is not None
    assert result.regression_path is not None
    return project, project / result.trace_path, project / result.regression_path


def _copy_of_the_run(leaky_run: tuple[Path, Path, Path], folder: Path, **changes: Any) -> tuple[Path, Path]:
    """The regression test and its trace copied into ``folder``, the trace changed by ``changes``."""
    _, trace, test = leaky_run
    folder.mkdir(exist_ok=True)
    document = json.loads(trace.read_text())
    document.update(changes)
    (folder / trace.name).write_text(json.dumps(document))
    (folder / test.name).write_text(test.read_text())
    return folder / trace.name, folder / test.name


def test_the_generated_test_names_its_engine_in_its_own_code(leaky_run: tuple[Path, Path, Path]) -> None:
    project, _, test = leaky_run
    source = test.read_text()
    assert "CODE = {" in source
    assert "    'target': 'leaky.py:Leaky',\n" in source
    assert f"    'target_file': {str(project / 'leaky.py')!r},\n" in source
    assert "code=CODE" in source
    # Unchanged, it fails on the bug, from anywhere.
    outcome = _pytest_in(project.parent, str(test))
    assert "1 failed" in outcome.stdout, outcome.stdout + outcome.stderr
    assert "kv_tokens" in outcome.stdout


@pytest.mark.parametrize("swap", ["the target", "the target's file", "a reference"])
def test_a_trace_swapped_beside_a_regression_test_fails_it_in_one_line_and_builds_nothing(
    swap: str, leaky_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    (tmp_path / "elsewhere").mkdir()
    evil = tmp_path / "elsewhere" / "leaky.py"
    evil.write_text(MARKING_ENGINE.replace("def make", "def Leaky"))
    changes: dict[str, Any] = {
        "the target": {"target": f"{evil}:Leaky", "target_file": str(evil)},
        "the target's file": {"target_file": str(evil)},
        "a reference": {"reference": f"{evil}:Leaky", "reference_file": str(evil)},
    }[swap]
    _, test = _copy_of_the_run(leaky_run, tmp_path / "suite", **changes)
    outcome = _pytest_in(tmp_path / "suite", str(test))
    text = outcome.stdout
    assert outcome.returncode == 1, text + outcome.stderr
    assert "1 failed" not in text  # not "the bug is still there"
    lines = [line for line in text.splitlines() if "the regression test's CODE" in line]
    assert lines, text
    assert str(evil) in lines[0]
    assert "put back the trace it was generated with, or regenerate both" in lines[0]
    assert _markers(tmp_path / "elsewhere") == []


#: A regression test as shardkit wrote it before tests named their code: it builds what its trace names.
OLD_FORM_TEST = '''"""Regression test generated by shardkit 0.1.0: §2 metrics found by shardkit fuzz --seed 1.

It replays the trace {trace} (kept beside this file) without Hypothesis and
fails while the engine still violates §2 metrics. Replay it on another
engine with: pytest THIS_FILE --shardkit-engine package.module:factory
"""

from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit import PreparedReplay, prepare_replay

TRACE = Path(__file__).with_name({trace!r})


@pytest.fixture
def recorded_engine(request: pytest.FixtureRequest) -> Iterator[PreparedReplay]:
    """The trace's engine (or --shardkit-engine's), built and loaded: if that fails, the test errors."""
    engine = request.config.getoption("shardkit_engine", default=None)
    try:
        # This file is code you chose to run: build the engine the trace names, wherever pytest runs.
        prepared = prepare_replay(TRACE, target=engine, trust=True)
    except Exception as error:
        message = (
            f"cannot check this regression: the engine of {{TRACE.name}} could not be built "
            f"({{type(error).__name__}}: {{error}}); this is not the bug reproducing"
        )
        pytest.fail(message, pytrace=False)
    with prepared:
        yield prepared


def test_replay_no_longer_violates_2_metrics(recorded_engine: PreparedReplay) -> None:
    result = recorded_engine.run()
    if result.failure is not None:
        pytest.fail(result.failure.message, pytrace=False)
'''


def test_a_regression_test_of_the_older_form_asks_to_be_regenerated(
    leaky_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    evil = tmp_path / "elsewhere" / "leaky.py"
    evil.parent.mkdir()
    evil.write_text(MARKING_ENGINE.replace("def make", "def Leaky"))
    trace, test = _copy_of_the_run(leaky_run, tmp_path / "suite", target=f"{evil}:Leaky", target_file=str(evil))
    test.write_text(OLD_FORM_TEST.format(trace=trace.name))
    outcome = _pytest_in(tmp_path / "suite", str(test))
    text = outcome.stdout
    assert outcome.returncode == 1, text + outcome.stderr
    assert "written by an older shardkit" in text, text
    assert "regenerate it" in text
    assert _markers(tmp_path / "elsewhere") == []


# --- engines that die replay isolated, or not at all ------------------------------------------------------


def _dying_trace(folder: Path, engine: type[DyingEngine], **extra: Any) -> Path:
    document = minimal_trace(engine, f"shardkit._planted.dying:{engine.__name__}")
    assert document["isolate"] is None
    document.update(extra)
    path = folder / f"{engine.__name__}.json"
    path.write_text(json.dumps(document))
    return path


#: Before the fix the allocating engine ran in the replaying process: keep it from filling the machine.
_REPLAY_MEMORY_BYTES = 2**30
#: Sets the limit, then becomes ``python -m shardkit ARGV``. Not ``preexec_fn``: Python code run
#: between fork and exec in this process, which may hold gRPC's threads, can abort the child.
_LIMITED = (
    "import os, resource, sys\n"
    "limit = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'shardkit', *sys.argv[2:]])\n"
)


def _replay_in_a_subprocess(trace: Path, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _LIMITED, str(_REPLAY_MEMORY_BYTES), "replay", str(trace), *options]
    try:
        return subprocess.run(command, cwd=trace.parent, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the replay of {trace.name} hung in the replaying process: {expired}")


@pytest.mark.parametrize(
    "engine",
    [SegfaultsOnDecodeAfterCancel, HangsOnSecondDecode, AllocatesWithoutBoundAfterRelease],
    ids=lambda engine: engine.__name__,
)
def test_a_dying_engine_recorded_without_isolation_replays_in_a_worker_and_says_so(
    engine: type[DyingEngine], tmp_path: Path
) -> None:
    trace = _dying_trace(tmp_path, engine)
    replayed = _replay_in_a_subprocess(trace)
    output = replayed.stdout + replayed.stderr
    assert replayed.returncode == 1, output  # reproduced, and the replaying process lived to say so
    lines = replayed.stdout.splitlines()
    assert lines[0] == f"replaying against shardkit._planted.dying:{engine.__name__} (recorded in the trace)", output
    assert lines[1] == (
        f"shardkit._planted.dying:{engine.__name__} kills the process it runs in (one of shardkit's dying "
        "planted engines): replaying it in a worker process, though the trace records none"
    ), output
    assert f"FAILURE ({engine.PROPERTY}" in replayed.stdout, output


def test_a_dying_engine_is_never_replayed_in_process(tmp_path: Path) -> None:
    trace = _dying_trace(tmp_path, SegfaultsOnDecodeAfterCancel)
    replayed = _replay_in_a_subprocess(trace, "--no-isolate")
    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert replayed.stderr.count("\n") == 1, replayed.stderr
    assert "kills the process it runs in" in replayed.stderr
    assert "drop --no-isolate (isolate=False)" in replayed.stderr


def test_a_dying_reference_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    reference = f"shardkit._planted.dying:{SegfaultsOnDecodeAfterCancel.__name__}"
    trace = _dying_trace(tmp_path, SegfaultsOnDecodeAfterCancel, target="shardkit:FakeShardEngine", reference=reference)
    replayed = _replay_in_a_subprocess(trace)
    assert replayed.returncode == 2, replayed.stdout + replayed.stderr
    assert replayed.stderr.count("\n") == 1, replayed.stderr
    assert f"the reference {reference!r} kills the process it runs in" in replayed.stderr
    assert "--engine TARGET" in replayed.stderr
