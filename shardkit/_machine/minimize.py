"""Second-stage minimisation, by replay without Hypothesis.

After Hypothesis stops, the failing example is replayed without Hypothesis and
made smaller while the *same* property is still violated:

1. on the drawn choices — delete runs of rules (halves, quarters, … single
   ones), lower each small integer towards 0, then delete one rule while
   changing one argument of another to any value (two coordinated edits, for
   short failures), then move one step to the front and lower the arguments
   again (a fault injected first fails sooner), then start a closing parallel
   phase at each edge of capacity and shrink again (a race found in a long phase
   shows in two calls at its edge) — re-deriving every concrete step from the
   model's state, so later steps renumber themselves;
2. on the concrete steps themselves, the form a trace replays — delete runs
   again, down to single steps, until no single deletion keeps the failure; a
   parallel phase that ends the failure loses single steps of its lanes too.

Steps that hold a parallel phase replay up to ``_phase_runs`` times each (a race
shows on some runs only), so their 1-minimality is up to that many runs.

The shortest failure is the one of fewest calls: a step is one, a parallel phase
as many as its lanes hold.

The result is 1-minimal under trace replay by construction, unless the replay
budget ran out first (``MinimizedFailure.one_minimal`` says which).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from shardkit._core.driver import Driver, StepFailed
from shardkit._core.steps import PARALLEL_OP, Action, phase_action
from shardkit._machine.hypothesis_adapter import integer_range
from shardkit._machine.observer import Choice, FailureReport, RunObserver, observed
from shardkit._machine.state_machine import ShardMachine
from shardkit._parallel.runs import holds_phase, replay_runs

__all__ = ["MinimizedFailure", "minimize_failure", "replay_actions"]

T = TypeVar("T")


@dataclass
class MinimizedFailure:
    report: FailureReport
    replays: int
    seconds: float
    one_minimal: bool
    #: Why ``one_minimal`` is False: what a report says in place of "1-minimal".
    unproven: str = "replay budget ran out"


class _Budget:
    """A count of replays, never a time: the same failure minimises the same way anywhere."""

    def __init__(self, max_replays: int) -> None:
        self.max_replays = max_replays
        self.replays = 0

    @property
    def exhausted(self) -> bool:
        return self.replays >= self.max_replays


def replay_actions(
    machine: type[ShardMachine], failure: FailureReport, actions: Sequence[Action]
) -> FailureReport | None:
    """Run ``actions`` on a fresh engine; the failure they end in, if any. Steps that hold a
    parallel phase run up to ``machine._phase_runs`` times, until one run fails."""
    driver = Driver(
        machine._target,
        failure.load_request,
        faults=failure.faults,
        twins=machine._use_twins,
        reference=machine._reference,
        model_factory=machine.model_factory,
        custom_ops=machine.custom_ops,
    )
    for ran, failed in replay_runs(driver, actions, machine._phase_runs):
        if failed is not None:
            records = list(ran.records)
            return FailureReport(failed.violation, records, failure.load_request, failure.faults, notes=tuple(ran.notes))
    return None


def _replay_choices(
    machine: type[ShardMachine], failure: FailureReport, choices: Sequence[Choice]
) -> FailureReport | None:
    observer = RunObserver()  # minimisation is not part of the run's figures
    instance = observed(machine, observer)()
    try:
        instance.load_engine(layout=failure.layout, id_pool=failure.id_pool)
        for choice in choices:
            getattr(instance, choice.rule)(**dict(choice.arguments))
    except StepFailed:
        return observer.failure
    return None


def _calls(failure: FailureReport) -> int:
    """The calls a failure makes: a step is one, a parallel phase as many as its lanes hold
    (a phase of 16 calls is no shorter than 16 steps to the reader)."""
    return sum(
        sum(len(lane) for lane in record.action.args["lanes"]) if record.action.op == PARALLEL_OP else 1
        for record in failure.records
    )


def _delete_runs(items: list[T], still_fails: Callable[[list[T]], bool], budget: _Budget) -> tuple[list[T], bool]:
    """Delete runs of halving length, then single items until none can go.
    Returns the smaller list and whether it is 1-minimal (no single deletion fails)."""
    chunk = max(len(items) // 2, 1)
    while True:
        changed = False
        start = 0
        while start < len(items):
            if budget.exhausted:
                return items, False
            candidate = items[:start] + items[start + chunk :]
            if candidate and still_fails(candidate):
                items, changed = candidate, True
            else:
                start += chunk
        if chunk == 1 and not changed:
            return items, True
        chunk = max(chunk // 2, 1)


def _shrink_phase(
    actions: list[Action], still_fails: Callable[[list[Action]], bool], budget: _Budget
) -> tuple[list[Action], bool]:
    """Delete single steps from the lanes of the phase that ends ``actions``, keeping every
    other step in its lane (deleting a drawn lane step would move the later ones to other
    lanes). Returns the smaller list and whether no single lane step can go."""
    improved = True
    while improved:
        improved = False
        lanes = [list(lane) for lane in actions[-1].args["lanes"]]
        for lane, held in enumerate(lanes):
            for index in range(len(held)):
                if budget.exhausted:
                    return actions, False
                rest = [*lanes[:lane], held[:index] + held[index + 1 :], *lanes[lane + 1 :]]
                candidate = [*actions[:-1], phase_action([kept for kept in rest if kept])]
                if candidate[-1].args["lanes"] and still_fails(candidate):
                    actions, improved = candidate, True
                    break
            if improved:
                break
    return actions, True


def _lower_arguments(
    choices: list[Choice], still_fails: Callable[[list[Choice]], bool], budget: _Budget
) -> list[Choice]:
    """Lower each drawn integer to the smallest value that keeps the failure."""
    changed = True
    while changed and not budget.exhausted:
        changed = False
        for index, choice in enumerate(choices):
            for position, (name, value) in enumerate(choice.arguments):
                for smaller in range(value):
                    if budget.exhausted:
                        return choices
                    arguments = list(choice.arguments)
                    arguments[position] = (name, smaller)
                    candidate = [*choices[:index], Choice(choice.rule, tuple(arguments)), *choices[index + 1 :]]
                    if still_fails(candidate):
                        choices, choice, changed = candidate, candidate[index], True
                        break
    return choices


#: Replays of the shortest failure found before its steps are shrunk, when it holds a phase
#: (each replay runs the phase up to ``_phase_runs`` times).
REPRODUCE_TRIES = 3
#: Delete-and-repair costs about (arguments × values) n² replays; beyond this many steps it is skipped.
REPAIR_MAX_STEPS = 8
ArgumentRanges = dict[str, dict[str, range]]


def argument_ranges(machine: type[ShardMachine]) -> ArgumentRanges:
    """Each rule's integer arguments and the values their strategies draw (rules built
    with ``st.integers(lo, hi)``; anything else is left alone by the repair)."""
    ranges: ArgumentRanges = {}
    for attribute in dir(machine):
        if attribute == "TestCase":
            continue  # a descriptor that builds a class: no rule
        function = getattr(machine, attribute, None)
        strategies = getattr(function, "step_rule_arguments", None)
        if not isinstance(strategies, dict):
            continue
        for name, strategy in strategies.items():
            values = integer_range(strategy)
            if values is not None:
                ranges.setdefault(getattr(function, "__name__", attribute), {})[name] = values
    return ranges


def _delete_and_repair(
    choices: list[Choice], still_fails: Callable[[list[Choice]], bool], budget: _Budget, ranges: ArgumentRanges
) -> list[Choice]:
    """Delete one step, then change one argument of one remaining step to any value: a
    shorter failure that needs two coordinated edits (drop a fault, lengthen a chunk)."""
    improved = True
    while improved and len(choices) <= REPAIR_MAX_STEPS and not budget.exhausted:
        improved = False
        for removed in range(len(choices)):
            rest = choices[:removed] + choices[removed + 1 :]
            for index, choice in enumerate(rest):
                for position, (name, value) in enumerate(choice.arguments):
                    for other in ranges.get(choice.rule, {}).get(name, ()):
                        if other == value:
                            continue
                        if budget.exhausted:
                            return choices
                        arguments = list(choice.arguments)
                        arguments[position] = (name, other)
                        candidate = [*rest[:index], Choice(choice.rule, tuple(arguments)), *rest[index + 1 :]]
                        if still_fails(candidate):
                            choices, improved = candidate, True
                            break
                    if improved:
                        break
                if improved:
                    break
            if improved:
                break
    return choices


def _move_to_front(
    choices: list[Choice],
    failing_length: Callable[[list[Choice]], int | None],
    lower: Callable[[list[Choice]], list[Choice]],
    budget: _Budget,
) -> list[Choice]:
    """Move one step to the front and lower the arguments of the result; keep it when the
    failure got shorter. A reordering no deletion makes: ``prefill, fault, decode`` fails
    sooner as ``fault, prefill`` once the fault is injected first (a pressure of 0 tokens
    refuses the prefill itself)."""
    current = failing_length(choices)
    improved = True
    while improved and current is not None and len(choices) <= REPAIR_MAX_STEPS and not budget.exhausted:
        improved = False
        for index in range(1, len(choices)):
            candidate = [choices[index], *choices[:index], *choices[index + 1 :]]
            length = failing_length(candidate)
            if length is None:
                continue
            lowered = lower(candidate)
            if lowered != candidate:
                candidate, length = lowered, failing_length(lowered)
            if length is not None and length < current:
                choices, current, improved = candidate, length, True
                break
    return choices


#: The rule that runs an example's parallel phase, and its choice of an edge of capacity
#: (``shardkit._machine.parallel_rules``).
PHASE_RULE, EDGE_ARGUMENT = "run_lanes", "edge"


def _phase_at_each_edge(
    choices: list[Choice],
    failing_length: Callable[[list[Choice]], int | None],
    shrink: Callable[[list[Choice]], list[Choice]],
    edges: Sequence[int],
) -> list[Choice]:
    """Start the phase that ends ``choices`` at each edge of capacity in turn, shrink each
    one that still fails and keep the shortest failure: a race first found in a long phase
    of drawn lane steps (16 calls, after 33 steps) shows at its edge in two calls after the
    fill, a rewrite no deletion or lowering makes (the edge is an argument Hypothesis
    lowers towards no edge)."""
    if not choices or choices[-1].rule != PHASE_RULE:
        return choices
    best, shortest = choices, failing_length(choices)
    for edge in edges:
        if shortest is None:
            break
        candidate = [*choices[:-1], Choice(PHASE_RULE, ((EDGE_ARGUMENT, edge),))]
        if candidate[-1] == choices[-1] or failing_length(candidate) is None:
            continue
        shrunk = shrink(candidate)
        length = failing_length(shrunk)
        if length is not None and length < shortest:
            best, shortest = shrunk, length
    return best


def minimize_failure(
    machine: type[ShardMachine], failure: FailureReport, *, max_replays: int = 5000
) -> MinimizedFailure:
    """The smallest failure of the same property that replay can reach from ``failure``
    within ``max_replays`` replays (``seconds`` is measured for reports only)."""
    started = time.monotonic()
    budget = _Budget(max_replays)
    target = failure.violation.property
    best = failure

    def same_failure(found: FailureReport | None) -> bool:
        """Whether a replay still violates the same property; keeps the shortest one."""
        nonlocal best
        budget.replays += 1
        if found is None or found.violation.property != target:
            return False
        if _calls(found) <= _calls(best):
            best = found
        return True

    def choices_fail(choices: list[Choice]) -> bool:
        return same_failure(_replay_choices(machine, failure, choices))

    def failing_length(choices: list[Choice]) -> int | None:
        """The calls of the replay's failure of the same property (None: no such failure)."""
        found = _replay_choices(machine, failure, choices)
        return _calls(found) if same_failure(found) and found is not None else None

    def actions_fail(actions: list[Action]) -> bool:
        return same_failure(replay_actions(machine, failure, actions))

    # Half the replays at most go to the drawn choices (lowering every argument of rules
    # of three arguments is costly), so the steps themselves can still be proven 1-minimal.
    budget.max_replays = max_replays // 2
    if failure.choices and choices_fail(list(failure.choices)):
        choices, _ = _delete_runs(list(failure.choices), choices_fail, budget)
        choices = _lower_arguments(choices, choices_fail, budget)
        choices = _delete_and_repair(choices, choices_fail, budget, argument_ranges(machine))
        choices = _lower_arguments(choices, choices_fail, budget)
        choices = _move_to_front(
            choices, failing_length, lambda moved: _lower_arguments(moved, choices_fail, budget), budget
        )
        edges = argument_ranges(machine).get(PHASE_RULE, {}).get(EDGE_ARGUMENT, range(0))
        _phase_at_each_edge(
            choices, failing_length, lambda moved: _delete_runs(moved, choices_fail, budget)[0], edges[1:]
        )

    budget.max_replays = max_replays
    actions = [record.action for record in best.records]
    racy = holds_phase(actions)
    # A race with a low rate may miss one replay's runs of its phase: try it a few times.
    if not any(actions_fail(actions) for _ in range(REPRODUCE_TRIES if racy else 1)):
        unproven = (
            f"its race did not show again in {REPRODUCE_TRIES * machine._phase_runs} runs of the phase"
            if racy
            else "its steps did not fail again when replayed"
        )
        return MinimizedFailure(best, budget.replays, time.monotonic() - started, False, unproven)
    actions, one_minimal = _delete_runs(actions, actions_fail, budget)
    if actions[-1].op == PARALLEL_OP:
        shrunk, lanes_minimal = _shrink_phase(actions, actions_fail, budget)
        if shrunk != actions:
            _, one_minimal = _delete_runs(shrunk, actions_fail, budget)
        one_minimal = one_minimal and lanes_minimal
    return MinimizedFailure(best, budget.replays, time.monotonic() - started, one_minimal)
