"""A trace is data; running code is the user's decision.

Replay reads a trace as strict data (regular files only, bounded, no repeated key,
exact types), says what it will build before building it, and builds recorded code
only if it is shardkit's own, lies inside the current project, or the user chose it
(``target=``/``--engine``, ``trust=True``/``--trust``). Each hostile case here must be
refused without running anything: the crafted targets write a marker file when
imported or called, and the tests check that no marker appeared.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardkit import TraceFormatError
from shardkit._cli.main import main
from shardkit._run.replay import replay
from shardkit._run.trace_reader import MAX_TRACE_BYTES, read_trace
from shardkit.errors import InvalidTarget, UntrustedTarget

#: A valid trace of one step that fails on the fake's bug-free behaviour: nothing here needs a bug.
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


def _write(folder: Path, document: dict[str, Any] | str, name: str = "trace.json") -> Path:
    path = folder / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


#: Engine code that leaves a marker beside itself when its module is imported and when it is called.
MARKING_ENGINE = """
from pathlib import Path

from shardkit import FakeShardEngine

Path(__file__).with_name("imported.marker").write_text("imported")


def make():
    Path(__file__).with_name("called.marker").write_text("called")
    return FakeShardEngine()
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current folder: a project with nothing in it yet."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the project, where a hostile trace's code could be."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def _markers(*folders: Path) -> list[str]:
    return sorted(path.name for folder in folders for path in folder.rglob("*.marker"))


# --- what is refused before anything is read --------------------------------------------------------


def _finishes(call: Callable[[], object], seconds: float = 10.0) -> BaseException | None:
    """Run ``call`` in a thread; fail the test if it is still running after ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:
            outcome.append(error)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still reading after {seconds}s"
    return outcome[0]


def test_a_fifo_is_refused_at_once_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    error = _finishes(lambda: read_trace(fifo))
    assert isinstance(error, TraceFormatError)
    assert "is a FIFO (named pipe), not a trace file" in str(error)


def test_a_fifo_swapped_in_after_the_check_is_refused_by_the_open_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file opened is checked again (no hang, no read): a swap between stat and open changes nothing."""
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    regular = os.stat(__file__)
    real_stat = os.stat
    monkeypatch.setattr(
        os, "stat", lambda path, *args, **kwargs: regular if Path(path) == fifo else real_stat(path, *args, **kwargs)
    )
    error = _finishes(lambda: read_trace(fifo))
    assert isinstance(error, TraceFormatError)
    assert "FIFO" in str(error)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_before_it_is_read(device: str) -> None:
    if not Path(device).exists():
        pytest.skip(f"no {device} here")
    error = _finishes(lambda: read_trace(device))
    assert isinstance(error, TraceFormatError)
    assert "is a character device, not a trace file" in str(error)


def test_a_link_to_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "trace.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(TraceFormatError, match="character device"):
        read_trace(link)


def test_a_socket_and_a_folder_are_refused(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # a socket path must be short
        path = Path(short) / "s"
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(str(path))
            with pytest.raises(TraceFormatError, match="is a socket, not a trace file"):
                read_trace(path)
        finally:
            server.close()
    with pytest.raises(TraceFormatError, match="is a folder, not a trace file"):
        read_trace(tmp_path)


def test_a_file_larger_than_a_trace_may_be_is_refused_unread(tmp_path: Path) -> None:
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:
        file.truncate(MAX_TRACE_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    with pytest.raises(TraceFormatError, match="larger than a trace may be"):
        read_trace(huge)


def test_the_cli_refuses_a_device_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "/dev/zero"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "/dev/zero is a character device" in captured.err


# --- strict data -----------------------------------------------------------------------------------


def test_a_repeated_key_is_refused_rather_than_one_value_hiding_the_other(project: Path, outside: Path) -> None:
    """{"target": <fake>, ..., "target": <hostile>}: json keeps the last one; a trace must not have two."""
    (outside / "evil.py").write_text(MARKING_ENGINE)
    text = json.dumps(_document("shardkit:FakeShardEngine"))
    text = text[:-1] + f', "target": {json.dumps(str(outside / "evil.py") + ":make")}}}'
    trace = _write(project, text)
    with pytest.raises(TraceFormatError, match="the key 'target' appears twice in one object"):
        replay(trace, trust=True)
    assert _markers(outside) == []


def test_a_repeated_key_deep_in_a_step_is_refused(project: Path) -> None:
    text = json.dumps(_document("shardkit:FakeShardEngine"))
    text = text.replace('"session": "a", "epoch": 0', '"session": "a", "epoch": 0, "epoch": 1', 1)
    with pytest.raises(TraceFormatError, match="the key 'epoch' appears twice"):
        read_trace(_write(project, text))


@pytest.mark.parametrize("version", [True, 1.0, "1", [1]], ids=repr)
def test_version_1_is_the_integer_1_only(version: Any, project: Path) -> None:
    """JSON's true is a bool, which Python counts as the integer 1; 1.0 equals 1: neither is version 1."""
    trace = _write(project, _document("shardkit:FakeShardEngine", version=version))
    with pytest.raises(TraceFormatError, match=r"is a version .* trace; this shardkit reads version 1"):
        read_trace(trace)


def _set(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(document))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


#: A field of a valid trace, a value of the wrong type for it, and what the refusal names.
WRONG_TYPES: dict[str, tuple[tuple[Any, ...], Any, str]] = {
    "twins is 1": (("twins",), 1, "twins must be true or false, got 1"),
    "twins is a string": (("twins",), "yes", "twins must be true or false"),
    "seed is true": (("seed",), True, "seed must be an integer"),
    "seed is 1.5": (("seed",), 1.5, "seed must be an integer"),
    "seed is negative": (("seed",), -1, "seed must be an integer"),
    "total_layers is true": (("load_request", "total_layers"), True, "total_layers must be an integer"),
    "shard_end is 3.0": (("load_request", "shard_end"), 3.0, "shard_end must be an integer"),
    "recipe holds an object": (("load_request", "recipe"), {"a": {"b": 1}}, "recipe.a must be a string"),
    "recipe is a list": (("load_request", "recipe"), [1], "recipe must be an object"),
    "role disagrees": (("role",), "head", "role is 'head', but load_request is a full shard"),
    "token is true": (("steps", 0, "args", "tokens"), [True], "tokens[0] must be an integer"),
    "step is false": (("steps", 0, "args", "step"), False, "step must be an integer"),
    "malformed is a list": (("steps", 0, "args", "malformed"), ["x"], "not a known malformation"),
    "note is a number": (("steps", 0, "note"), 3, "note must be a string"),
    "expected is a list": (("steps", 0, "expected"), ["OK"], "expected must be a string"),
    "fault value is true": (
        ("steps", 0),
        {"op": "fault", "args": {"kind": "delay", "value": True}},
        "value must be a number",
    ),
    "fault kind is a list": (("steps", 0), {"op": "fault", "args": {"kind": ["delay"], "value": 0}}, "kind must be"),
    "unloaded call is a list": (("steps", 0), {"op": "unloaded", "args": {"call": ["health"]}}, "call must be"),
    "step timeout is true": (("isolate",), {"step_timeout": True}, "step_timeout must be a number"),
    "faults_enabled holds true": (("faults_enabled",), [True], "faults_enabled must be a list of"),
    "failure step is true": (("failure", "step"), True, "failure.step must be an integer"),
    "fault_steps is an object": (("fault_steps",), {}, "fault_steps must be a list of objects"),
    "reference is a number": (("reference",), 7, "reference must be a string"),
    "machine is not module:name": (("machine",), "RollbackMachine", "machine must name a class as 'module:QualName'"),
    "target_file is relative": (("target_file",), "engine.py", "target_file must be an absolute path"),
    "target_path is a list": (("target_path",), ["/"], "target_path must be a string"),
    "needs_python is true": (("needs_python",), True, "needs_python must be a string"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_every_field_must_have_exactly_its_type(
    case: str, project: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, value, named = WRONG_TYPES[case]
    (project / "engine.py").write_text(MARKING_ENGINE)
    trace = _write(project, _set(_document("engine.py:make"), path, value))
    assert main(["replay", str(trace)]) == 2
    captured = capsys.readouterr()
    assert named in captured.err, captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert "replaying against" not in captured.out  # refused before anything was announced or built
    assert _markers(project) == []


# --- recorded code is built only from the project, or when the user chooses it --------------------------


@pytest.mark.parametrize("target", ["os:abort", "posix:abort", "sys:exit", "builtins:exit", "os:fork"])
def test_a_recorded_standard_library_target_is_refused_without_being_called(target: str, project: Path) -> None:
    """os:abort would kill the process running the replay: that this test ends at all shows it was not called."""
    trace = _write(project, _document(target))
    with pytest.raises(UntrustedTarget) as refused:
        replay(trace)
    message = str(refused.value)
    assert repr(target) in message
    assert "not a file in the current project" in message or "outside the current project" in message
    assert "--trust" in message
    assert "--engine" in message


def test_an_installed_module_is_refused_and_said_to_be_installed(project: Path) -> None:
    trace = _write(project, _document("hypothesis:find"))
    with pytest.raises(UntrustedTarget, match=r"an installed or standard-library module at .*hypothesis"):
        replay(trace)


def test_a_target_file_outside_the_project_is_neither_imported_nor_called(project: Path, outside: Path) -> None:
    (outside / "evil.py").write_text(MARKING_ENGINE)
    for name in (f"{outside / 'evil.py'}:make", "../elsewhere/evil.py:make"):
        trace = _write(project, _document(name))
        with pytest.raises(UntrustedTarget) as refused:
            replay(trace)
        assert f"the file {outside / 'evil.py'}, outside the current project" in str(refused.value)
        assert _markers(outside) == []
    # The user chooses to run it: it is built, and says where its code is.
    announced: list[str] = []
    replay(trace, trust=True, announce=announced.append)
    assert _markers(outside) == ["called.marker", "imported.marker"]


def test_a_module_outside_the_project_is_refused_even_on_sys_path(
    project: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = outside / "evil_engines_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(MARKING_ENGINE)
    recorded = _write(project, _document("evil_engines_pkg:make", target_path=str(outside)))
    with pytest.raises(UntrustedTarget, match=r"at .*evil_engines_pkg/__init__\.py, outside the current project"):
        replay(recorded)
    monkeypatch.syspath_prepend(str(outside))
    with pytest.raises(UntrustedTarget, match="outside the current project"):
        replay(recorded)
    assert _markers(outside) == []


def test_a_module_no_file_holds_is_refused(project: Path) -> None:
    trace = _write(project, _document("no_such_module_anywhere:make"))
    with pytest.raises(UntrustedTarget, match=r"not found as a file on sys\.path or the current folder"):
        replay(trace)


REACHING_OUT = """
import os
from os import abort

from shardkit import FakeShardEngine


def make():
    return FakeShardEngine()
"""


@pytest.mark.parametrize("name", ["reach.py:abort", "reach.py:os.abort", "reach:os.abort", "reach.py:os.getcwd"])
def test_a_project_module_cannot_be_used_to_reach_the_standard_library(name: str, project: Path) -> None:
    (project / "reach.py").write_text(REACHING_OUT)
    trace = _write(project, _document(name))
    with pytest.raises(UntrustedTarget, match="reached through the project's module"):
        replay(trace)


@pytest.mark.parametrize("name", ["shardkit:machine_for", "shardkit:ReferenceModel", "shardkit._run.replay:replay"])
def test_a_shardkit_name_must_be_one_of_its_engines(name: str, project: Path) -> None:
    trace = _write(project, _document(name))
    with pytest.raises(UntrustedTarget, match="not one of shardkit's engines"):
        replay(trace)


def test_a_remote_engine_on_another_machine_needs_trust(project: Path) -> None:
    trace = _write(project, _document("grpc://example.invalid:7000"))
    with pytest.raises(UntrustedTarget, match="a server on another machine"):
        replay(trace)


@pytest.mark.parametrize("address", ["grpc://127.0.0.1:9", "grpc://localhost:9", "grpc://[::1]:9"])
def test_a_loopback_remote_engine_is_replayed_as_recorded(address: str, project: Path) -> None:
    """Nothing listens there: what matters is that it is tried (InvalidTarget), not refused as untrusted."""
    trace = _write(project, _document(address))
    with pytest.raises(InvalidTarget) as failed:
        replay(trace)
    assert not isinstance(failed.value, UntrustedTarget)


def test_a_target_in_the_project_is_built_and_announced_first(project: Path) -> None:
    (project / "engine.py").write_text(MARKING_ENGINE)
    events: list[str] = []
    trace = _write(project, _document("engine.py:make"))

    def announce(line: str) -> None:
        events.append(line)
        events.append(f"markers then: {_markers(project)}")

    result = replay(trace, announce=announce)
    assert result.failure is None
    assert events[0].startswith("replaying against engine.py:make (recorded in the trace; code in ")
    assert events[1] == "markers then: []"  # said before anything was imported
    assert _markers(project) == ["called.marker", "imported.marker"]


def test_a_package_module_in_the_project_is_built_when_the_current_folder_is_not_on_sys_path(project: Path) -> None:
    """As under the shardkit console script, whose sys.path holds its bin folder, not the current one."""
    package = project / "my_engines_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(MARKING_ENGINE)
    trace = _write(project, _document("my_engines_pkg.engine:make"))
    assert replay(trace).failure is None
    assert _markers(project) == ["called.marker", "imported.marker"]


# --- --engine replaces the target and the reference -------------------------------------------------------


def test_a_named_engine_replaces_the_recorded_reference_too(project: Path, outside: Path) -> None:
    (outside / "evil.py").write_text(MARKING_ENGINE)
    trace = _write(project, _document("os:abort", reference=f"{outside / 'evil.py'}:make"))
    announced: list[str] = []
    result = replay(trace, target="shardkit:FakeShardEngine", announce=announced.append)
    assert result.failure is None
    assert _markers(outside) == []
    assert announced == [
        f"replaying against shardkit:FakeShardEngine (named by you), twins from the engine itself "
        f"(the recorded reference {outside / 'evil.py'}:make is not built)"
    ]
    # Without a named engine, the recorded reference is subject to the rule like the target.
    with pytest.raises(UntrustedTarget, match="names the engine target 'os:abort'"):
        replay(trace)
    safe_target = _write(project, _document("shardkit:FakeShardEngine", reference=f"{outside / 'evil.py'}:make"))
    with pytest.raises(UntrustedTarget, match="names the reference"):
        replay(safe_target)
    assert _markers(outside) == []


def test_a_named_engine_and_a_named_reference_are_both_built(project: Path, outside: Path) -> None:
    (outside / "evil.py").write_text(MARKING_ENGINE)
    trace = _write(project, _document("os:abort", reference="os:abort"))
    result = replay(trace, target="shardkit:FakeShardEngine", reference=f"{outside / 'evil.py'}:make")
    assert result.failure is None
    assert "called.marker" in _markers(outside)


def test_a_reference_that_cannot_be_built_is_an_input_error_not_a_failure(project: Path) -> None:
    trace = _write(project, _document("shardkit:FakeShardEngine"))
    with pytest.raises(InvalidTarget, match=r"the reference .* could not be built"):
        replay(trace, reference=_refuses_to_build)


def _refuses_to_build() -> Any:
    message = "no weights"
    raise RuntimeError(message)


# --- the command line ------------------------------------------------------------------------------------


def test_the_cli_says_what_it_replays_against(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write(project, _document("shardkit:FakeShardEngine"))
    assert main(["replay", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "replaying against shardkit:FakeShardEngine (recorded in the trace)"


def test_the_cli_refuses_untrusted_code_in_one_line_and_trust_builds_it(
    project: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (outside / "evil.py").write_text(MARKING_ENGINE)
    trace = _write(project, _document(f"{outside / 'evil.py'}:make"))
    assert main(["replay", str(trace)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "shardkit: error:" in captured.err
    assert "--trust" in captured.err
    assert _markers(outside) == []
    assert main(["replay", str(trace), "--trust"]) == 0
    assert _markers(outside) == ["called.marker", "imported.marker"]


def test_the_cli_engine_option_skips_the_recorded_code(
    project: Path, outside: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (outside / "evil.py").write_text(MARKING_ENGINE)
    evil = f"{outside / 'evil.py'}:make"
    trace = _write(project, _document(evil, reference=evil))
    assert main(["replay", str(trace), "--engine", "shardkit:FakeShardEngine"]) == 0
    assert _markers(outside) == []
    assert "replaying against shardkit:FakeShardEngine (named by you)" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _no_leftover_modules() -> Iterator[None]:
    """Modules these tests import from their temporary folders are forgotten afterwards."""
    import sys

    before = set(sys.modules)
    path_before = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("evil_engines_pkg", "my_engines_pkg", "reach", "_shardkit_target_")):
            del sys.modules[name]
    sys.path[:] = path_before
