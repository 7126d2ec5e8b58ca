"""A machine as pytest and HypoFuzz meet it: ``Machine.TestCase`` (``SuiteTestCase``), whose
test runs the kit's whole run through the machine's ``suite_runner``, and the machine a
coverage-guided fuzzer drives example by example (``fuzzing_machine``), whose failures go to
the machine's ``fuzzer_failures`` sink. The rules know nothing of either."""

from __future__ import annotations

import unittest
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

from hypothesis import settings

from shardkit._machine import profiles as _profiles
from shardkit._machine.hypothesis_adapter import mark_as_state_machine_test
from shardkit._machine.observer import FailureReport, RunObserver
from shardkit.errors import UsageError

#: A ``ShardMachine`` subclass, typed loosely: the machine's module imports this one, which
#: never imports it back.
MachineClass = type[Any]

__all__ = ["FailureSink", "SuiteRunner", "SuiteTestCase", "fuzzing_machine"]

#: What a machine's ``TestCase`` runs: the kit's run of the machine (``machine_for`` sets it).
SuiteRunner = Callable[[MachineClass, "unittest.TestCase"], None]
#: Given the machine, what each failure is handed to when Hypothesis drives the machine
#: directly, with no run of the kit around it (``fuzzing_machine``).
FailureSink = Callable[[MachineClass], Callable[["FailureReport"], object]]


class SuiteTestCase:
    """``Machine.TestCase``: a ``unittest.TestCase`` whose test runs ``suite_runner`` on the
    machine. One class per machine, made on first use, so ``Machine.TestCase.settings = …``
    sticks; it runs under the ``shardkit-ci`` profile unless a profile is loaded
    (``--hypothesis-profile``) or ``settings`` is set on it."""

    def __get__(self, instance: object, owner: MachineClass) -> type[unittest.TestCase]:
        made: type[unittest.TestCase] | None = owner.__dict__.get("_suite_test_case")
        if made is None:
            made = _suite_test_case(owner)
            type.__setattr__(owner, "_suite_test_case", made)
        return made


class _FuzzerFailures:
    """The ``on_failure`` of a fuzzing machine's observer: asks the machine's
    ``_fuzzer_failures`` hook for the sink on the first failure (the engine is met then,
    not when pytest collects the suite), and hands it every failure."""

    def __init__(self, machine: MachineClass) -> None:
        self.machine = machine
        self.sink: Callable[[FailureReport], object] | None = None

    def __call__(self, failure: FailureReport) -> None:
        hook = self.machine._fuzzer_failures
        if hook is None:
            return
        if self.sink is None:
            self.sink = hook(self.machine)
        self.sink(failure)


class _FuzzerSettingsHolder:
    """``TestCase`` of a fuzzing machine, as Hypothesis's ``get_state_machine_test`` reads it
    (``Machine.TestCase.settings``) when the suite's own ``TestCase.settings`` is None: the
    settings the suite runs under (its own, else the profile, as ``suite_settings`` says),
    without a deadline or health checks, read when HypoFuzz asks for them."""

    def __init__(self, machine: MachineClass) -> None:
        self.machine = machine

    def __get__(self, instance: object, owner: type) -> SimpleNamespace:
        explicit = getattr(self.machine.TestCase, "settings", None)
        chosen, _ = _profiles.suite_settings(explicit if isinstance(explicit, settings) else None)
        return SimpleNamespace(settings=_profiles.time_independent(chosen))


def fuzzing_machine(machine: MachineClass) -> MachineClass:
    """``machine`` as a coverage-guided fuzzer runs it (HypoFuzz collects it from the suite's
    ``TestCase``): Hypothesis drives it directly, so there is no run of the kit to count its
    examples and write its trace. One observer for the process counts them, and hands each
    failure to the sink ``machine._fuzzer_failures`` makes (``machine_for``'s keeps the
    shortest failure as a trace). It keeps the machine's name, so its
    identity (trace names) is the machine's."""
    namespace = {
        "_observer": RunObserver(on_failure=_FuzzerFailures(machine)),
        "TestCase": _FuzzerSettingsHolder(machine),
        "__qualname__": machine.__qualname__,
    }
    return type(machine.__name__, (machine,), namespace)


def _suite_test_case(machine: MachineClass) -> type[unittest.TestCase]:
    class ShardMachineTestCase(unittest.TestCase):
        settings: settings | None = None
        #: Set by the pytest plugin from its command-line options before the test runs.
        shardkit_overrides: object = None
        #: The machine it runs (the plugin counts the tests of each machine in a session).
        shardkit_machine: ClassVar[MachineClass] = machine

        def runTest(self) -> None:
            __tracebackhide__ = True
            runner = machine._suite_runner
            if runner is None:
                message = (
                    f"{machine.__name__} has no engine to run: build the machine with "
                    "shardkit.machine_for(TARGET, base=...) and collect that class's TestCase"
                )
                raise UsageError(message)
            runner(machine, self)

        # HypoFuzz runs the fuzzing machine itself, example after example, rather than
        # runTest (which runs the kit's whole run on each call).
        mark_as_state_machine_test(runTest, fuzzing_machine(machine) if machine._suite_runner is not None else None)

    ShardMachineTestCase.__name__ = f"{machine.__name__}.TestCase"
    ShardMachineTestCase.__qualname__ = f"{machine.__qualname__}.TestCase"
    return ShardMachineTestCase
