"""FuzzOptions: validated once, the one home of the defaults and of the rerun command; each
option declared once, beside its field, and checked nowhere below the edge."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path

import pytest

from shardkit._core.targets import IsolationOptions, PythonTarget
from shardkit._run.options import FuzzOptions
from shardkit._run.runner import fuzz
from shardkit.contract import ROLES
from shardkit.errors import UsageError


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"examples": 0}, "examples (--examples)"),
        ({"steps": -1}, "steps (--steps)"),
        ({"examples": True}, "examples (--examples)"),
        ({"role": "edge"}, "role (--role)"),
        ({"faults": "flood"}, "faults (--faults)"),
        ({"step_timeout": 0.0}, "step_timeout (--step-timeout)"),
        ({"worker_memory_mb": 0}, "worker_memory_mb (--worker-memory)"),
        ({"base": int}, "base (--machine)"),
    ],
)
def test_a_bad_option_is_a_usage_error_naming_it_and_the_value(changes: dict[str, object], named: str) -> None:
    with pytest.raises(UsageError) as raised:
        FuzzOptions(**changes)  # type: ignore[arg-type]
    assert str(raised.value).startswith(named)
    assert repr(next(iter(changes.values()))) in str(raised.value)


def test_faults_and_role_are_held_in_one_canonical_form() -> None:
    assert FuzzOptions(faults=True).faults == "all"
    assert FuzzOptions(faults=False).faults == "none"
    assert FuzzOptions(faults=["crash", "delay"]).faults == "delay,crash"  # type: ignore[arg-type]
    assert FuzzOptions(role="any").role is None  # type: ignore[arg-type]


def test_the_rerun_command_names_only_what_differs_from_the_defaults() -> None:
    assert FuzzOptions().command(PythonTarget("t:f"), 7, None, None) == "shardkit fuzz t:f --seed 7"
    changed = FuzzOptions(examples=500, steps=20, role="tail", faults="delay", twins=False)
    assert changed.command(PythonTarget("t:f"), 7, PythonTarget("r:g"), None) == (
        "shardkit fuzz t:f --seed 7 --role tail --examples 500 --steps 20 --faults delay --no-twins --reference r:g"
    )
    isolated = FuzzOptions(isolate=True, step_timeout=2.0)
    assert isolated.command(PythonTarget("t:f"), 1, None, IsolationOptions(step_timeout=2.0)).endswith(
        "--isolate --step-timeout 2"
    )


def test_fuzz_takes_options_or_their_fields_by_name_and_refuses_unknown_ones() -> None:
    from_fields = fuzz("shardkit:FakeShardEngine", seed=3, examples=5, steps=5, faults="none")
    from_options = fuzz("shardkit:FakeShardEngine", FuzzOptions(examples=5, steps=5, faults="none"), seed=3)
    assert from_fields.steps == from_options.steps
    assert from_fields.rerun_command == from_options.rerun_command
    assert from_fields.rerun_command.endswith("--examples 5 --steps 5 --faults none")
    with pytest.raises(UsageError, match=r"unknown fuzz option.*exmaples"):
        fuzz("shardkit:FakeShardEngine", seed=3, exmaples=5)


def test_the_rerun_command_says_when_the_command_line_cannot_name_the_rules() -> None:
    from shardkit import ReferenceModel, ShardMachine

    class LocalMachine(ShardMachine):
        pass

    class LocalModel(ReferenceModel):
        pass

    local = FuzzOptions(base=LocalMachine).command(PythonTarget("t:f"), 7, None, None)
    assert local.endswith(
        "# needs the machine test_the_rerun_command_says_when_the_command_line_cannot_name_the_rules.<locals>.LocalMachine, which cannot be imported by name: rerun from Python"
    )
    model = FuzzOptions(model=LocalModel).command(PythonTarget("t:f"), 7, None, None)
    assert model.startswith("shardkit fuzz t:f --seed 7  # needs the model ")
    assert FuzzOptions(model=ReferenceModel).command(PythonTarget("t:f"), 7, None, None) == "shardkit fuzz t:f --seed 7"


# --- each option declared and checked once ------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"
#: Where the options are declared, each with its default, help text and check.
DECLARATIONS = ("_machine/spec.py", "_run/options.py")
#: The edge: the command line reads its text (and the combinations of its options that name
#: no field's value), the typed target is made from what an entry point was given, and a
#: target meets its isolation where it is resolved, for every command that runs an engine.
EDGE = ("_cli/", "_core/targets.py", "_transport/isolation.py")


def declared_options() -> list[tuple[str, str]]:
    return [(each.name, each.metadata["option"].flag) for each in fields(FuzzOptions) if "option" in each.metadata]


def option_checks(source: str, options: list[tuple[str, str]]) -> list[str]:
    """The strings of ``source`` (docstrings aside) that word a check of a declared option: they
    name it as its check's message does ("role (--role) …") or say what its flag "must" be."""
    patterns = [pattern for name, flag in options for pattern in (f"{name} ({flag})", f"{flag} must")]
    return strings_holding(source, patterns)


def strings_holding(source: str, patterns: Iterable[str]) -> list[str]:
    """``line N: 'pattern'`` for each string of ``source`` (docstrings aside) holding a pattern."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return sorted(
        f"line {node.lineno}: {pattern!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        for pattern in patterns
        if pattern in node.value
    )


def test_the_option_check_finder_finds_a_check_in_any_string() -> None:
    source = '''
def check(role):
    """A docstring may say: role (--role) must be one of them."""
    if role not in ROLES:
        raise UsageError(f"role (--role) must be one of {ROLES}, got {role!r}")
    if lanes > 3:
        raise UsageError("--concurrency must be a number of lanes")
    print("--roles must")  # another option, not a declared one
'''
    assert option_checks(source, [("role", "--role"), ("concurrency", "--concurrency")]) == [
        "line 5: 'role (--role)'",
        "line 7: '--concurrency must'",
    ]


def test_below_the_edge_no_module_checks_a_declared_option() -> None:
    """Each option's check is written beside its field; the machine, the runner, traces and
    reports read the checked options and check nothing again."""
    options = declared_options()
    assert {"role", "faults", "concurrency", "examples", "step_timeout", "worker_memory_mb"} <= {n for n, _ in options}
    found = {
        module: lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if not (module := path.relative_to(PACKAGE).as_posix()).startswith(DECLARATIONS + EDGE)
        if (lines := option_checks(path.read_text(encoding="utf-8"), options))
    }
    assert not found, f"check the option where it is declared (shardkit/_machine/spec.py): {found}"


def test_build_machine_takes_checked_options_and_raises_no_usage_error() -> None:
    """What needs the engine is checked on first use (a ``ShardkitError``); nothing the user typed."""
    source = (PACKAGE / "_machine" / "build.py").read_text(encoding="utf-8")
    named = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    assert "UsageError" not in named
    assert "MachineOptions" in named


@pytest.mark.parametrize("command", ["fuzz", "campaign"])
def test_the_command_line_options_are_generated_from_the_declarations(command: str) -> None:
    """Flag, default, choices and help come from the field; a command may reword the help only."""
    from shardkit._cli.parser import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {flag: action for action in subparsers.choices[command]._actions for flag in action.option_strings}
    defaults = FuzzOptions()
    checked = 0
    for name, flag in declared_options():
        if flag not in actions:
            continue
        checked += 1
        action = actions[flag]
        if getattr(defaults, name) is True:  # on by default, turned off by its --no- flag
            assert flag.startswith("--no-")
            assert action.default is False
            assert action.const is True
            continue
        expected = getattr(defaults, name)
        if name == "role":
            assert action.default == "any"
            assert action.choices == [*ROLES, "any"]
        elif name not in ("reference", "base"):
            assert action.default == expected, (flag, action.default, expected)
    assert checked >= 6
    with pytest.raises(
        UsageError, match=f"shardkit {command}: --concurrency must be a number of lanes from 1 to 3, got '4'"
    ):
        build_parser().parse_args(
            [command, "--concurrency", "4", *(["--minutes", "1"] if command == "campaign" else [])]
        )


#: How a check of the isolation options' combinations words itself (``engine_plan``).
ISOLATION_CHECK_WORDING = ("it needs isolate=True", "it needs --isolate", "is already out of process")


def isolation_checks(source: str) -> list[str]:
    """The strings of ``source`` (not its docstrings) that word a check of how the isolation options combine."""
    return strings_holding(source, ISOLATION_CHECK_WORDING)


def test_the_isolation_check_finder_finds_a_check_in_an_f_string() -> None:
    source = '''
def check(target, isolate):
    """Docstrings may say it: --worker-memory needs --isolate."""
    if isolate and target.remote:
        raise UsageError(f"--isolate: {target} is already out of process")
'''
    assert isolation_checks(source) == ["line 5: 'is already out of process'"]


def test_how_the_isolation_options_combine_is_checked_in_one_place() -> None:
    """``engine_plan`` checks --isolate, --step-timeout, --worker-memory and the target together;
    the command line, the machine and replay call it rather than word the checks again."""
    found = {
        module: lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (module := path.relative_to(PACKAGE).as_posix()) != "_transport/isolation.py"
        if (lines := isolation_checks(path.read_text(encoding="utf-8")))
    }
    assert not found, f"check the combination in engine_plan (shardkit/_transport/isolation.py): {found}"
    assert isolation_checks((PACKAGE / "_transport" / "isolation.py").read_text(encoding="utf-8"))
