"""The bare machine: a copy of a kit machine's shape whose rules only count, to measure
what Hypothesis alone costs against what the kit costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from shardkit._machine.hypothesis_adapter import rules_and_initializers
from shardkit._machine.state_machine import ShardMachine

__all__ = ["bare_machine_like", "bare_steps"]


def bare_machine_like(machine: type[ShardMachine]) -> type[RuleBasedStateMachine]:
    """A machine of the same shape as ``machine`` — the same rules drawing the same
    strategies — whose rules do nothing but count: what Hypothesis alone costs."""
    rules, initializers = rules_and_initializers(machine)
    namespace: dict[str, Any] = {"steps": 0}

    def counting(name: str) -> Callable[..., None]:
        def step(self: RuleBasedStateMachine, **arguments: int) -> None:
            type(self).steps += 1  # type: ignore[attr-defined]

        step.__name__ = name
        return step

    for name, _, arguments in initializers:
        namespace[name] = initialize(**arguments)(counting("init"))
    for name, _, arguments in rules:
        namespace[name] = rule(**arguments)(counting(name))
    return type(f"Bare{machine.__name__}", (RuleBasedStateMachine,), namespace)


def bare_steps(machine: type[ShardMachine], examples: int, steps: int, seed: int) -> int:
    """Run the bare machine of ``machine`` (``bare_machine_like``) and return the rules it ran.

    It draws exactly what the kit's machine draws at the same seed and sizes, but a rule is
    not a kit step: a kit step is one engine call or one fault, and one rule may make
    several (a run of decodes). So the kit and the bare machine are compared by time."""
    bare = bare_machine_like(machine)
    run_settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run_state_machine_as_test(hypothesis_seed(seed)(bare), settings=run_settings)
    counted: int = bare.steps  # type: ignore[attr-defined]
    return counted
