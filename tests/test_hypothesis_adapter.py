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
