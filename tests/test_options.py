"""FuzzOptions: validated once, the one home of the defaults and of the rerun command."""

from __future__ import annotations

import pytest

from shardkit._core.targets import IsolationOptions, PythonTarget
from shardkit._run.options import FuzzOptions
from shardkit._run.runner import fuzz
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
    assert isolated.command(PythonTarget("t:f"), 1, None, IsolationOptions(step_timeout=2.0)).endswith("--isolate --step-timeout 2")


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
    assert local.endswith("# needs the machine test_the_rerun_command_says_when_the_command_line_cannot_name_the_rules.<locals>.LocalMachine, which cannot be imported by name: rerun from Python")
    model = FuzzOptions(model=LocalModel).command(PythonTarget("t:f"), 7, None, None)
    assert model.startswith("shardkit fuzz t:f --seed 7  # needs the model ")
    assert FuzzOptions(model=ReferenceModel).command(PythonTarget("t:f"), 7, None, None) == "shardkit fuzz t:f --seed 7"
