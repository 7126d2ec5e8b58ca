"""The linearizability checker on hand-written histories: ones that are linearizable, ones
that are not, and ones where only an order that is neither the start nor the end order
works. The model is a counter whose ``inc`` answers the new value and a register; each
history is written as (lane, index, started, ended, step)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import pytest

from shardkit._parallel.linearize import Linearization, TimedStep, linearize

# A step is (operation, argument, observed answer); the state is the counter's value.
Step = tuple[str, int, int]


def apply_counter(value: int, step: Step) -> int | str:
    operation, argument, answer = step
    if operation == "inc":
        return value + 1 if answer == value + 1 else f"inc answers {value + 1}, not {answer}"
    if operation == "write":
        return argument
    if operation == "read":
        return value if answer == value else f"read answers {value}, not {answer}"
    raise AssertionError(operation)


def same_value(value: int) -> Hashable:
    return value


def history(*steps: tuple[int, int, int, int, Step]) -> list[TimedStep[Step]]:
    return [TimedStep(lane, index, started, ended, step) for lane, index, started, ended, step in steps]


def check(steps: list[TimedStep[Step]], **options: int) -> Linearization[Step]:
    found = linearize(steps, 0, apply_counter, same_value, **options)
    unmemoised = linearize(steps, 0, apply_counter, None, **options)
    assert found.linearizable == unmemoised.linearizable, "memoisation changed the verdict"
    return found


def names(order: tuple[TimedStep[Step], ...] | None) -> list[str]:
    assert order is not None
    return [timed.name for timed in order]


def test_sequential_steps_in_their_own_order() -> None:
    found = check(history((0, 0, 0, 1, ("inc", 0, 1)), (1, 0, 2, 3, ("inc", 0, 2)), (0, 1, 4, 5, ("read", 0, 2))))
    assert names(found.order) == ["A1", "B1", "A2"]


def test_overlapping_steps_may_take_effect_in_either_order() -> None:
    # A1 started first, but B1's write took effect before A1's: they overlap.
    found = check(history((0, 0, 0, 3, ("write", 1, 0)), (1, 0, 1, 2, ("write", 2, 0)), (0, 1, 4, 5, ("read", 0, 1))))
    assert names(found.order) == ["B1", "A1", "A2"]


def test_only_an_order_that_is_neither_start_nor_end_order_works() -> None:
    # A1 spans all of lane B: its inc answered 2, so it took effect between B1 and B2.
    steps = history(
        (0, 0, 0, 7, ("inc", 0, 2)),
        (1, 0, 1, 2, ("inc", 0, 1)),
        (1, 1, 3, 4, ("inc", 0, 3)),
    )
    found = check(steps)
    assert names(found.order) == ["B1", "A1", "B2"]
    by_start = sorted(steps, key=lambda timed: timed.started)
    by_end = sorted(steps, key=lambda timed: timed.ended)
    assert names(found.order) not in (names(tuple(by_start)), names(tuple(by_end)))


def test_a_step_that_ended_before_another_started_stays_before_it() -> None:
    # B1, A1 would explain the answers, but A1 was answered before B1 was invoked.
    found = check(history((0, 0, 0, 1, ("inc", 0, 2)), (1, 0, 2, 3, ("inc", 0, 1))))
    assert not found.linearizable
    assert not found.unknown
    assert names(found.closest) == []
    assert [(rejection.step.name, rejection.why) for rejection in found.breaks] == [("A1", "inc answers 1, not 2")]


def test_a_lost_update_is_not_linearizable_and_the_closest_order_is_named() -> None:
    # Two incs overlap and both answer 1: one update was lost; a read then sees 1.
    found = check(history((0, 0, 0, 3, ("inc", 0, 1)), (1, 0, 1, 2, ("inc", 0, 1)), (0, 1, 4, 5, ("read", 0, 1))))
    assert not found.linearizable
    assert len(found.closest) == 1
    assert [rejection.why for rejection in found.breaks] == ["inc answers 2, not 1"]


def three_lanes_of_reads() -> list[tuple[int, int, int, int, Step]]:
    """Three lanes of five reads of 0, each overlapping the others' steps of the same index."""
    return [
        (lane, index, 10 * index + lane, 10 * index + lane + 5, ("read", 0, 0))
        for lane in range(3)
        for index in range(5)
    ]


def test_three_lanes_of_five_steps_visit_few_states_with_memoisation() -> None:
    # Every interleaving explains fifteen reads of 0: without memoisation the search would
    # try 15! / (5!)^3 orders before any verdict on a history that has none.
    reads = three_lanes_of_reads()
    assert check(history(*reads)).linearizable
    impossible = [*reads[:-1], (2, 4, 42, 50, ("read", 0, 1))]
    found = linearize(history(*impossible), 0, apply_counter, same_value)
    assert not found.linearizable
    assert not found.unknown
    assert found.explored <= 6**3  # at most one state per (steps placed in each lane), value 0


def test_a_search_that_runs_out_of_budget_is_unknown_not_a_failure() -> None:
    reads = three_lanes_of_reads()
    impossible = [*reads[:-1], (2, 4, 42, 50, ("read", 0, 1))]
    found = linearize(history(*impossible), 0, apply_counter, None, max_states=50)
    assert found.unknown
    assert not found.linearizable
    assert found.explored == 51


def test_every_order_the_checker_returns_respects_real_time_and_the_model() -> None:
    # Exhaustively over small two-lane histories of incs: the verdict agrees with trying
    # every permutation, and a returned order is one of the valid ones.
    for answers in itertools.product((1, 2, 3), repeat=3):
        steps = history(
            (0, 0, 0, 3, ("inc", 0, answers[0])),
            (1, 0, 1, 2, ("inc", 0, answers[1])),
            (1, 1, 4, 5, ("inc", 0, answers[2])),
        )
        valid = [order for order in itertools.permutations(steps) if respects_time(order) and accepted(order)]
        found = check(steps)
        assert found.linearizable == bool(valid), answers
        if found.order is not None:
            assert found.order in valid


def respects_time(order: tuple[TimedStep[Step], ...]) -> bool:
    return all(not later.ended < earlier.started for earlier, later in itertools.combinations(order, 2))


def accepted(order: tuple[TimedStep[Step], ...]) -> bool:
    value: int | str = 0
    for timed in order:
        assert isinstance(value, int)
        value = apply_counter(value, timed.step)
        if isinstance(value, str):
            return False
    return True


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([(0, 0, 0, 1, ("read", 0, 0)), (1, 0, 1, 2, ("read", 0, 0))], "share a tick"),
        ([(0, 0, 0, 3, ("read", 0, 0)), (0, 1, 2, 4, ("read", 0, 0))], "A1 and A2 overlap"),
        ([(0, 0, 2, 2, ("read", 0, 0))], "not after it started"),
    ],
)
def test_an_impossible_clock_is_refused_with_the_steps_named(
    steps: list[tuple[int, int, int, int, Step]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        linearize(history(*steps), 0, apply_counter, same_value)
