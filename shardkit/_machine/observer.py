r"""What one run observes of its machine: the failing examples (``FailureReport``, with the
``Choice``\ s that replay them without Hypothesis), the counters of a run (``RunObserver``) and
the machine made for one run (``observed``). Below the machine, so that the runner, the
minimiser and the suite plumbing read a run's results without the rules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from shardkit._core.driver import StepRecord, Violation
from shardkit.contract import LoadRequest

#: A machine class (a ``ShardMachine`` subclass: the machine's module imports this one).
MachineT = TypeVar("MachineT", bound=type)

__all__ = ["Choice", "FailureReport", "RunObserver", "observed"]


@dataclass(frozen=True)
class Choice:
    """One rule as Hypothesis drew it: the rule's name and its small integers."""

    rule: str
    arguments: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        return f"{self.rule}({', '.join(f'{name}={value}' for name, value in self.arguments)})"


@dataclass
class FailureReport:
    """A failing example: its violation, the steps the driver recorded, and the
    drawn choices (layout and rules) that replay it without Hypothesis."""

    violation: Violation
    records: list[StepRecord]
    load_request: LoadRequest
    faults: frozenset[str]
    layout: int = 0
    #: Which of ``SESSION_ID_POOLS`` the example drew its session ids from.
    id_pool: int = 0
    choices: tuple[Choice, ...] = ()
    #: What the driver noted while running these steps (an engine restarted after an injected
    #: crash, an injection that landed on a valid answer): shown with the failure.
    notes: tuple[str, ...] = ()


@dataclass
class RunObserver:
    """What one run counts and how it is told about its examples: the runner makes one per
    run and hands it to a subclass of the machine made for that run (``observed``), so no
    two runs share counters and nothing is configured by mutating a shared class."""

    examples: int = 0
    steps: int = 0
    failures_seen: int = 0
    coverage: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: Each check the driver could not make, with the number of examples it was skipped in.
    caveats: Counter[str] = field(default_factory=Counter)
    #: Examples by the accepted decodes of their longest session epoch: {decodes: examples}.
    #: Kept current as each example runs (an example moves up as its session grows), so it
    #: always sums to ``examples`` and a snapshot at the first failure covers the same ones.
    longest_session: Counter[int] = field(default_factory=Counter)
    failure: FailureReport | None = None
    #: Called with each failing example as it happens (the runner writes its trace).
    on_failure: Callable[[FailureReport], object] | None = None
    #: Called as each example starts with (examples, steps, failures seen).
    on_example: Callable[[int, int, int], object] | None = None
    #: The failing example with the fewest steps so far.
    shortest: FailureReport | None = None
    #: Once ``steps`` passes this count, stop Hypothesis's shrinking: the replay minimiser takes
    #: over. A count of steps, never a time, so the same seed shrinks the same way on any machine.
    shrink_stop_at_step: int | None = None
    #: Likewise once ``examples`` passes this count (rules that make no step still cost examples).
    shrink_stop_at_example: int | None = None
    #: When set, a failure of any other property does not count (iterative deepening looks
    #: for a shorter failure of one property): the example is rejected instead.
    only_property: str | None = None


def observed(machine: MachineT, observer: RunObserver) -> MachineT:
    """``machine`` for one run, reporting to ``observer``. The subclass keeps the machine's
    name, so its identity (trace names, example-database keys) is the machine's."""
    return cast(
        "MachineT", type(machine.__name__, (machine,), {"_observer": observer, "__qualname__": machine.__qualname__})
    )
