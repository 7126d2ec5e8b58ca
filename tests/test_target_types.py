"""Targets are read once, into three types: ``parse_target`` tells a Python target, an engine
server's address and a worker command apart, and below the entry points nothing reads a
target's text again. The structure checks read the source with ``ast`` and have a self-test
each, which fails if the finder stops finding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shardkit import FakeShardEngine
from shardkit._core.targets import (
    PythonTarget,
    RemoteAddress,
    ResolvedTarget,
    WorkerCommand,
    engine_target,
    parse_target,
)
from shardkit.errors import InvalidTarget, UsageError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "shardkit"
#: The one module that tells a target's kind from its text.
TARGETS = "_core/targets.py"
#: Where an address is split into what gRPC dials or listens on (or a worker listens beside it): the kind is known there.
ADDRESS_PARSERS = ("_transport/client.py", "_transport/server.py", "_transport/calls_socket.py")
#: The entry points, which hold a target's text as the user or a trace gave it: the command
#: line, the pytest plugin, the public functions (``fuzz``, ``machine_for``, ``replay`` and the
#: options they take), a trace being read and trusted, a campaign, the bench, ``serve``.
ENTRY_POINTS = (
    "_cli/",
    "_bench/",
    "_campaign/",
    "pytest_plugin.py",
    "_run/runner.py",
    "_run/suite.py",
    "_machine/spec.py",
    "_run/replay.py",
    "_run/trust.py",
    "_planted/traces.py",
    "_transport/resolve.py",
    "_transport/isolation.py",
    "_transport/server.py",
    "remote.py",
    TARGETS,
)
#: How a target's kind was told from its text before the types: each a prefix test.
KIND_PREFIXES = ("grpc://", "unix:", "worker-command:")


# --- the types ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("grpc://127.0.0.1:7000", RemoteAddress("grpc://127.0.0.1:7000")),
        ("unix:/tmp/engine.sock", RemoteAddress("unix:/tmp/engine.sock")),
        ("worker-command:build/w --listen {address}", WorkerCommand("build/w --listen {address}")),
        ("shardkit:FakeShardEngine", PythonTarget("shardkit:FakeShardEngine")),
        ("engines/mine.py:build", PythonTarget("engines/mine.py:build")),
    ],
)
def test_a_target_s_text_is_read_into_its_type_and_named_back_as_it_was(text: str, expected: object) -> None:
    parsed = parse_target(text)
    assert parsed == expected
    assert parsed.name == text  # what traces record, unchanged
    assert parse_target(parsed) is parsed


def test_a_factory_is_a_python_target_named_by_its_module_and_qualified_name() -> None:
    target = parse_target(FakeShardEngine)
    assert target == PythonTarget(FakeShardEngine)
    assert target.name == "shardkit:FakeShardEngine"
    assert target.label == "FakeShardEngine"


def test_labels_and_shown_names_come_from_the_type() -> None:
    assert PythonTarget("pkg.mod:build").label == "build"
    assert RemoteAddress("grpc://localhost:1").label == "grpc://localhost:1"
    command = WorkerCommand("python3 tools/my_worker.py --listen {address}")
    assert command.label == "my_worker"
    assert command.shown == "the worker command 'python3 tools/my_worker.py --listen {address}'"
    assert command.argv == ["python3", "tools/my_worker.py", "--listen", "{address}"]


@pytest.mark.parametrize(
    ("address", "local"),
    [("unix:/tmp/x.sock", True), ("grpc://127.0.0.1:1", True), ("grpc://localhost:1", True), ("grpc://[::1]:1", True),
     ("grpc://10.0.0.1:1", False), ("grpc://example.org:1", False)],
)
def test_an_address_knows_whether_it_stays_on_this_machine(address: str, local: bool) -> None:
    assert RemoteAddress(address).on_this_machine is local


def test_a_worker_command_without_its_address_field_is_refused_as_it_is_built() -> None:
    with pytest.raises(InvalidTarget, match=r"has no \{address\}"):
        WorkerCommand("build/worker --listen")
    with pytest.raises(InvalidTarget, match=r"has no \{address\}"):
        parse_target("worker-command:build/worker")
    with pytest.raises(InvalidTarget, match="must be a 'module:attr' string or a callable"):
        parse_target(42)  # type: ignore[arg-type]


def test_the_engine_of_a_run_is_a_target_or_a_worker_command_never_both() -> None:
    assert engine_target("shardkit:FakeShardEngine", None) == PythonTarget("shardkit:FakeShardEngine")
    assert engine_target(None, "w {address}") == WorkerCommand("w {address}")
    resolved = ResolvedTarget(PythonTarget(FakeShardEngine), FakeShardEngine)
    assert engine_target(resolved, None) is resolved
    with pytest.raises(UsageError, match="give one of them"):
        engine_target("shardkit:FakeShardEngine", "w {address}")
    with pytest.raises(UsageError, match="name the engine to fuzz"):
        engine_target(None, None)
    with pytest.raises(UsageError, match=r"has no \{address\}"):
        engine_target(None, "w")


# --- the structure ---------------------------------------------------------------------------------


def kind_tests(source: str) -> list[str]:
    """Each place ``source`` tells a target's kind from its text: a ``startswith`` test with one of
    ``KIND_PREFIXES`` or ``REMOTE_PREFIXES``, or a ``worker-command:`` literal (sorted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("worker-command:"):
            found.append(f"line {node.lineno}: the literal {node.value!r}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "startswith" or not node.args:
            continue
        argument = node.args[0]
        values = argument.elts if isinstance(argument, ast.Tuple) else [argument]
        for value in values:
            if isinstance(value, ast.Constant) and value.value in KIND_PREFIXES:
                found.append(f"line {node.lineno}: .{node.func.attr}({value.value!r})")
            if isinstance(value, ast.Name) and value.id == "REMOTE_PREFIXES":
                found.append(f"line {node.lineno}: .{node.func.attr}(REMOTE_PREFIXES)")
    return sorted(found)


def parse_calls(source: str) -> list[int]:
    """The lines of ``source`` that call ``parse_target``, ``typed_target`` or ``engine_target``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("parse_target", "typed_target", "engine_target")
    ]


def test_the_finders_find_every_form() -> None:
    source = """
a = name.startswith("grpc://")
b = name.startswith(("grpc://", "unix:"))
c = name.startswith(REMOTE_PREFIXES)
d = name.removeprefix("worker-command:")
e = name.startswith("other") or url.removeprefix("unix:")
f = parse_target(name)
g = engine_target(name, None)
h = typed_target(name)
"""
    assert kind_tests(source) == [
        "line 2: .startswith('grpc://')",
        "line 3: .startswith('grpc://')",
        "line 3: .startswith('unix:')",
        "line 4: .startswith(REMOTE_PREFIXES)",
        "line 5: the literal 'worker-command:'",
    ]
    assert parse_calls(source) == [7, 8, 9]


def _modules() -> list[tuple[str, str]]:
    return [
        (path.relative_to(PACKAGE_ROOT).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
        if "proto" not in path.parts
    ]


def test_only_the_targets_module_tells_a_target_s_kind_from_its_text() -> None:
    found = {
        module: places
        for module, source in _modules()
        if module != TARGETS and not module.startswith(ADDRESS_PARSERS)
        if (places := kind_tests(source))
    }
    assert not found, f"tell a target's kind by its type (shardkit._core.targets), not its text: {found}"


def test_below_the_entry_points_no_module_parses_a_target() -> None:
    found = {
        module: lines
        for module, source in _modules()
        if not module.startswith(ENTRY_POINTS)
        if (lines := parse_calls(source))
    }
    assert not found, f"parse a target at the entry point and pass its type down: {found}"
