"""The one adapter over Hypothesis's internals still does what the kit relies on, on every
Hypothesis release pyproject.toml allows (CI runs this file on the oldest and the newest)."""

from __future__ import annotations

import re
from pathlib import Path

import hypothesis
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from shardkit._machine import hypothesis_adapter
from shardkit._machine.hypothesis_adapter import (
    ShrinkBudgetSpent,
    deterministic_hypothesis,
    integer_range,
    mark_as_state_machine_test,
    stop_hypothesis,
)

ROOT = Path(__file__).resolve().parent.parent


def test_a_spent_shrink_budget_ends_the_run_through_hypothesis() -> None:
    """Raised from a rule, it leaves Hypothesis as itself: not swallowed, not a test failure."""
    steps: list[int] = []

    class StopsAtThree(RuleBasedStateMachine):
        @rule()
        def step(self) -> None:
            steps.append(1)
            if len(steps) == 3:
                stop_hypothesis()

    with pytest.raises(ShrinkBudgetSpent):
        run_state_machine_as_test(StopsAtThree, settings=settings(max_examples=10, database=None))
    assert len(steps) == 3


def test_integer_ranges_are_read_from_integer_strategies_only() -> None:
    assert integer_range(st.integers(0, 3)) == range(0, 4)
    assert integer_range(st.integers(2, 2)) == range(2, 3)
    assert integer_range(st.just(1)) is None
    assert integer_range(st.sampled_from([1, 2])) is None


def test_the_deterministic_block_nests_and_leaves_hypothesis_as_it_found_it() -> None:
    providers = hypothesis_adapter._providers()
    engine = hypothesis_adapter._engine()
    before = (getattr(providers, "_get_local_constants", None), getattr(engine, "MAX_SHRINKING_SECONDS", None))
    with deterministic_hypothesis():
        with deterministic_hypothesis():
            if engine is not None:
                assert engine.MAX_SHRINKING_SECONDS > 10**6
        if engine is not None:
            assert engine.MAX_SHRINKING_SECONDS > 10**6, "the outer block still holds"
    after = (getattr(providers, "_get_local_constants", None), getattr(engine, "MAX_SHRINKING_SECONDS", None))
    assert after == before
    home = providers if providers is not None else engine
    assert home is None or not hasattr(home, hypothesis_adapter._PATCH_ATTRIBUTE)


def supported_range() -> tuple[tuple[int, int], int]:
    """((major, minor) of the oldest release, the first major not allowed) from pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'"hypothesis>=(\d+)\.(\d+),<(\d+)"', text)
    assert found, "pyproject.toml bounds hypothesis as >=MAJOR.MINOR,<MAJOR"
    return (int(found.group(1)), int(found.group(2))), int(found.group(3))


def test_this_hypothesis_is_one_the_kit_supports() -> None:
    """pyproject.toml bounds Hypothesis; a release outside it would not be tested."""
    (oldest, first_unsupported) = supported_range()
    major, minor = (int(part) for part in hypothesis.__version__.split(".")[:2])
    assert oldest <= (major, minor)
    assert major < first_unsupported


def test_ci_tests_the_oldest_release_pyproject_allows() -> None:
    (major, minor), _ = supported_range()
    assert f"'hypothesis=={major}.{minor}.0'" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")

def test_a_spent_shrink_budget_ends_the_run_while_hypothesis_shrinks() -> None:
    """The case the runner needs: the budget runs out in the shrink phase, after a failure."""
    failures: list[int] = []

    class FailsLongThenStops(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        @rule(value=st.integers(0, 10))
        def step(self, value: int) -> None:
            self.count += 1
            if self.count >= 5:
                failures.append(value)
                if len(failures) > 2:
                    stop_hypothesis()  # the shrink's counted budget is spent
                raise AssertionError("a failure Hypothesis will try to shrink")

    with pytest.raises(ShrinkBudgetSpent):
        run_state_machine_as_test(
            FailsLongThenStops, settings=settings(max_examples=50, database=None, stateful_step_count=20)
        )


def test_a_suite_test_is_marked_as_hypothesis_marks_its_own_state_machine_tests() -> None:
    """Every attribute Hypothesis puts on its own machines' ``runTest`` (what its pytest plugin
    and HypoFuzz read), the kit's mark puts on a suite's, with the same values."""

    class Own(RuleBasedStateMachine):
        @rule()
        def step(self) -> None:
            pass

    def run_test() -> None:
        pass

    mark_as_state_machine_test(run_test, Own)
    own_marks = vars(Own.TestCase.runTest)
    assert own_marks, "Hypothesis no longer marks its state machine tests: the mark has nothing to follow"
    assert {name: getattr(run_test, name, None) for name in own_marks} == own_marks

    def not_fuzzed() -> None:
        pass

    mark_as_state_machine_test(not_fuzzed, None)
    assert getattr(not_fuzzed, "is_hypothesis_test", False) is True
    assert not hasattr(not_fuzzed, "_hypothesis_state_machine_class")


def test_a_machines_rules_and_initializers_are_read_as_it_declares_them() -> None:
    """What ``shardkit bench``'s bare machine copies: each ``@rule`` and ``@initialize`` of a
    machine, its own or inherited, by name, with its undecorated function and what draws each
    of its arguments; an invariant or a plain method is neither. A copy built from them runs
    under Hypothesis, drawing the same arguments."""
    from hypothesis.stateful import initialize, invariant, precondition

    from shardkit._machine.hypothesis_adapter import rules_and_initializers

    values, flags, starts = st.integers(0, 3), st.booleans(), st.integers(1, 2)
    calls: list[str] = []

    class Declares(RuleBasedStateMachine):
        @initialize(start=starts)
        def begin(self, start: int) -> None:
            calls.append(f"begin {start}")

        @precondition(lambda self: True)
        @rule(value=values, flag=flags)
        def step(self, value: int, flag: bool) -> None:
            calls.append(f"step {value} {flag}")

        @invariant()
        def holds(self) -> None:
            pass

        def helper(self) -> None:
            pass

    class Extends(Declares):
        @rule()
        def again(self) -> None:
            calls.append("again")

    rules, initializers = rules_and_initializers(Extends)
    assert [(name, arguments) for name, _, arguments in rules] == [
        ("again", {}),
        ("step", {"value": values, "flag": flags}),
    ]
    assert [(name, arguments) for name, _, arguments in initializers] == [("begin", {"start": starts})]
    assert rules_and_initializers(Declares) == ((rules[1],), initializers)
    machine = Extends()
    initializers[0][1](machine, start=2)
    rules[1][1](machine, value=3, flag=True)
    rules[0][1](machine)
    assert calls == ["begin 2", "step 3 True", "again"]

    drawn: list[tuple[str, tuple[str, ...]]] = []

    def counting(name: str) -> object:
        def record(self: RuleBasedStateMachine, **arguments: object) -> None:
            drawn.append((name, tuple(sorted(arguments))))

        return record

    namespace = {name: initialize(**arguments)(counting(name)) for name, _, arguments in initializers}
    namespace |= {name: rule(**arguments)(counting(name)) for name, _, arguments in rules}
    copy = type("Copy", (RuleBasedStateMachine,), namespace)
    sizes = settings(max_examples=5, stateful_step_count=5, database=None, derandomize=True)
    run_state_machine_as_test(copy, settings=sizes)
    assert set(drawn) == {("begin", ("start",)), ("step", ("flag", "value")), ("again", ())}


#: Hypothesis's names that no public API documents, which the kit reads or sets: only the
#: adapter may use them (with ``hypothesis.internal`` and any ``_hypothesis…`` attribute).
PRIVATE_HYPOTHESIS_NAMES = frozenset(
    {
        "setup_state",
        "initializers",
        "is_hypothesis_test",
        "RULE_MARKER",
        "INITIALIZE_RULE_MARKER",
        "wrapped_strategy",
        "MAX_SHRINKING_SECONDS",
        "CONSTANTS_CACHE",
    }
)


def private_hypothesis_uses(source: str) -> list[str]:
    """Each place ``source`` imports from ``hypothesis.internal`` or names one of Hypothesis's
    private attributes."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hypothesis.internal"):
            found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hypothesis"):
            found += [f"line {node.lineno}: {alias.name}" for alias in node.names if alias.name in PRIVATE_HYPOTHESIS_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("hypothesis.internal")]
        elif isinstance(node, ast.Attribute) and (node.attr in PRIVATE_HYPOTHESIS_NAMES or node.attr.startswith("_hypothesis")):
            found.append(f"line {node.lineno}: .{node.attr}")
    return sorted(found, key=lambda place: int(place.split(":")[0].removeprefix("line ")))


def test_the_finder_sees_every_form_of_a_private_hypothesis_name() -> None:
    source = """
from hypothesis.internal.conjecture import engine
import hypothesis.internal.detection
from hypothesis.stateful import RULE_MARKER, rule
shape = machine.setup_state()
test._hypothesis_state_machine_class = machine
public = settings.max_examples
"""
    assert private_hypothesis_uses(source) == [
        "line 2: from hypothesis.internal.conjecture",
        "line 3: import hypothesis.internal.detection",
        "line 4: RULE_MARKER",
        "line 5: .setup_state",
        "line 6: ._hypothesis_state_machine_class",
    ]


def test_no_private_hypothesis_name_is_used_outside_the_adapter() -> None:
    package = ROOT / "shardkit"
    adapter = package / "_machine" / "hypothesis_adapter.py"
    found = {
        path.relative_to(package).as_posix(): places
        for path in sorted(package.rglob("*.py"))
        if path != adapter and (places := private_hypothesis_uses(path.read_text(encoding="utf-8")))
    }
    assert not found, f"reach Hypothesis's internals through shardkit/_machine/hypothesis_adapter.py: {found}"
    assert private_hypothesis_uses(adapter.read_text(encoding="utf-8")), "the finder no longer sees the adapter's own uses"
