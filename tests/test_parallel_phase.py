"""The parallel phase on real engines: a thread-safe engine is never flagged, and races a
sequential run cannot see are (a lost update of a counter, a shared scratch buffer that
hands one session another's output). Each race opens its window with ``time.sleep(0)``,
which gives up the interpreter as a real engine's I/O or native call would, so the race
shows in most runs; a run counts how often."""

from __future__ import annotations

import random
import re
import threading
from typing import Any, ClassVar

import pytest
from hypothesis import settings

from shardkit._core.driver import Driver, StepFailed
from shardkit._core.steps import Action, step_action
from shardkit._core.targets import PythonTarget
from shardkit._machine.build import build_machine
from shardkit._machine.spec import MachineOptions
from shardkit._parallel.phase import LINEARIZABILITY, run_parallel
from shardkit._planted.base import DelegatingEngine as PlantedBase
from shardkit._planted.racy import DecodeCounterLostUpdate, SharedScratchToken
from shardkit._run.runner import run_machine
from shardkit._run.suite import machine_for
from shardkit._transport.resolve import resolve_target
from shardkit.contract import (
    DecodeRequest,
    LoadRequest,
    StepResult,
    StructuredStatus,
)
from shardkit.errors import UsageError

FULL = LoadRequest("shardkit-fuzz", 0, 3, 4)


#: The fake is thread-safe (every call whole, under its lock); the planted engines are
#: not, each in one way (shardkit._planted.racy).
LockedFake = PlantedBase
DecodeCounterRaces = DecodeCounterLostUpdate


def driver_with_sessions(engine: Any, sessions: str = "ab") -> Driver:
    driver = Driver(resolve_target(engine), FULL)
    for number, session in enumerate(sessions):
        driver.execute(step_action("prefill", session, 0, 0, (number + 1, 2)))
    return driver


def decodes(session: str, tokens: tuple[int, ...]) -> list[Action]:
    return [step_action("decode", session, 0, step, (token,)) for step, token in enumerate(tokens, start=1)]


def test_a_thread_safe_engine_is_never_flagged() -> None:
    rng = random.Random(1)
    for _ in range(30):
        driver = driver_with_sessions(LockedFake, "abc")
        lanes = []
        for lane in range(3):
            session = "abc"[lane]
            steps: list[Action] = decodes(session, tuple(rng.randrange(32) for _ in range(rng.randint(1, 4))))
            if rng.random() < 0.5:
                steps.insert(
                    rng.randrange(len(steps) + 1), Action("cancel", {"session": "abc"[rng.randrange(3)], "epoch": 0})
                )
            if rng.random() < 0.3:
                steps.append(Action("release", {"session": "abc"[rng.randrange(3)]}))
            lanes.append(steps)
        records = run_parallel(driver, lanes)
        assert len(records) == sum(len(lane) for lane in lanes)


def test_the_calls_are_judged_in_an_order_that_explains_them() -> None:
    driver = driver_with_sessions(LockedFake)
    records = run_parallel(driver, [decodes("a", (5, 6)), [Action("cancel", {"session": "a", "epoch": 0})]])
    outcomes = {
        record.action.describe().split("(")[0] + str(record.action.args.get("step", "")): record.outcome
        for record in records
    }
    assert outcomes["cancel"] == "OK"
    # Whatever the interleaving, a decode after the cancel was refused, and the model agrees.
    assert set(outcomes.values()) <= {"OK", "CANCELLED"}
    assert driver.model.sessions["a"].cancelled


def racing_two_sessions(engine: Any, runs: int = 10) -> list[StepFailed]:
    """The failures of ``runs`` phases of two lanes of decodes, one lane per session."""
    failures = []
    for _ in range(runs):
        driver = driver_with_sessions(engine)
        try:
            run_parallel(driver, [decodes("a", (3, 4, 5)), decodes("b", (6, 7, 8))])
        except StepFailed as failed:
            failures.append(failed)
    return failures


def test_a_lost_update_of_the_decode_counter_is_not_linearizable() -> None:
    failures = racing_two_sessions(DecodeCounterRaces)
    assert len(failures) >= 5, f"the lost update showed in {len(failures)} of 10 runs"
    for failed in failures:
        assert failed.violation.property == LINEARIZABILITY
        message = failed.violation.message
        assert "parallel phase, 2 lanes at the same time" in message
        assert "no order of these calls explains their answers" in message
        assert "metrics after the lanes: metrics() answered" in message
        assert "decode_calls=" in message


def test_a_shared_scratch_buffer_hands_one_session_anothers_token() -> None:
    failures = racing_two_sessions(SharedScratchToken)
    assert len(failures) >= 5, f"the scratch race showed in {len(failures)} of 10 runs"
    for failed in failures:
        assert failed.violation.property == "§3 determinism"
        message = failed.violation.message
        assert "taken in the order" in message
        assert "which explains every status" in message
        assert "expected: token" in message


def test_an_exception_in_a_lane_names_the_call() -> None:
    class Raises(LockedFake):
        def release(self, session_id: str) -> StructuredStatus:
            if session_id == "b":
                raise KeyError(session_id)
            return super().release(session_id)

    driver = driver_with_sessions(Raises)
    with pytest.raises(StepFailed) as failed:
        run_parallel(driver, [decodes("a", (3,)), [Action("release", {"session": "b"})]])
    assert failed.value.violation.property == "unexplained exception"
    assert "B1 release(session='b') raised KeyError: 'b'" in failed.value.violation.message


def test_a_phase_refuses_to_start_with_a_fault_armed() -> None:
    driver = Driver(resolve_target(LockedFake), FULL, faults=frozenset({"crash"}))
    driver.execute(step_action("prefill", "a", 0, 0, (1,)))
    driver.execute(Action("fault", {"kind": "crash", "value": 2.0}))
    with pytest.raises(ValueError, match="no fault armed, and a crash at call"):
        run_parallel(driver, [decodes("a", (3,))])


# --- the phase drawn by a machine --------------------------------------------------------


def fuzz_with_lanes(engine: Any, seed: int, examples: int) -> Any:
    """A run of a machine with two lanes, not minimised (tests/test_parallel_repro.py minimises)."""
    machine = build_machine(PythonTarget(engine), MachineOptions(faults="none", concurrency=2))
    run_settings = settings(max_examples=examples, stateful_step_count=50, database=None, deadline=None)
    return run_machine(machine, run_settings, seed=seed, out=None, minimize=False)


class RecordsItsCallers(LockedFake):
    """Remembers the threads that decoded on it, in a set shared by every instance."""

    callers: ClassVar[set[str]] = set()

    def decode(self, request: DecodeRequest) -> StepResult:
        self.callers.add(threading.current_thread().name)
        return super().decode(request)


def test_a_machine_with_lanes_never_flags_a_thread_safe_engine() -> None:
    """The machine's lanes really run on threads of their own (finding races is
    tests/test_parallel_racy.py's, never flagging the fake at ten seeds too)."""
    RecordsItsCallers.callers.clear()
    result = fuzz_with_lanes(RecordsItsCallers, 1, 60)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert {"shardkit-lane-0", "shardkit-lane-1"} <= RecordsItsCallers.callers  # the lanes did run


def test_a_machine_refuses_a_concurrency_it_cannot_run() -> None:
    for bad in (0, 4, 2.0, "2"):
        expected = re.escape(f"concurrency (--concurrency) must be a number of lanes from 1 to 3, got {bad!r}")
        with pytest.raises(UsageError, match=expected):
            machine_for(LockedFake, concurrency=bad)  # type: ignore[arg-type]
