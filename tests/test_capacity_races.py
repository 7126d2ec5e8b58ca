"""Races at the edge of capacity: a phase may start with every session slot or KV token but
one (or none) taken, with the two calls that meet there alone in two lanes. The fill is
sized from the engine's capabilities (however many slots and tokens it declares), the
racing engines planted at the edge are found at every seed, and the bundled engines are
never flagged with three lanes."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from shardkit import FakeShardEngine, NumpyShardEngine, PipelineEngine, machine_for
from shardkit._core.steps import PARALLEL_OP, Action
from shardkit._machine import parallel_rules
from shardkit._machine.minimize import PHASE_RULE, _phase_at_each_edge
from shardkit._machine.observer import Choice
from shardkit._machine.parallel_rules import BATCH_RACE, EDGE_RACES, MAX_FILL_OPENINGS, edge_races, fill
from shardkit._machine.state_machine import SESSION_ID_POOLS, ShardMachine
from shardkit._planted.racy import (
    CancelOnFinalDecodePinsKv,
    LastSlotCheckThenAct,
    LastTokensCheckThenAct,
    RacyEngine,
    ReleaseFreesByIdLater,
)
from shardkit.engines.fake import FakeShardEngineConfig
from tests.test_parallel_racy import fuzzed

AT_THE_EDGE = (LastSlotCheckThenAct, LastTokensCheckThenAct, ReleaseFreesByIdLater, CancelOnFinalDecodePinsKv)


class TwelveSlots(FakeShardEngine):
    """More slots than any pool of session ids holds, and a larger KV budget than the fake's."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngineConfig(max_sessions=12, max_kv_tokens=1000))


class TooManySlots(FakeShardEngine):
    def __init__(self) -> None:
        super().__init__(
            FakeShardEngineConfig(max_sessions=MAX_FILL_OPENINGS + 10, max_kv_tokens=2 * MAX_FILL_OPENINGS)
        )


def started(engine: type[FakeShardEngine], id_pool: int = 0, concurrency: int = 2) -> ShardMachine:
    machine = machine_for(engine, role="full", faults="none", concurrency=concurrency)()
    machine.load_engine(layout=0, id_pool=id_pool)
    return machine


def served(machine: ShardMachine) -> list[str]:
    return [sid for sid, session in machine.sessions.items() if not session.cancelled]


def test_a_fill_of_slots_takes_all_but_the_last_whatever_the_engine_declares() -> None:
    # The family pool holds three ids: the other nine sessions open under ids of their own.
    machine = started(TwelveSlots, id_pool=1)
    fill(machine, "slots", 1, 1)
    assert len(machine.sessions) == 11
    assert list(machine.sessions)[:3] == list(SESSION_ID_POOLS[1])
    assert "slot-1" in machine.sessions
    assert all(record.outcome == "OK" for record in machine._driver.records)
    fill(machine, "slots", 0, 1)
    assert len(machine.sessions) == 12
    assert len(machine._driver.records) == 12  # one opening a step, nothing sent twice


def test_a_fill_of_slots_opens_at_most_its_limit() -> None:
    machine = started(TooManySlots)
    fill(machine, "slots", 1, 1)
    assert len(machine.sessions) == MAX_FILL_OPENINGS


@pytest.mark.parametrize("sessions", [1, 2])
@pytest.mark.parametrize("left", [1, 0])
def test_a_fill_of_tokens_leaves_what_it_is_asked_to_in_as_few_steps_as_it_can(sessions: int, left: int) -> None:
    machine = started(TwelveSlots)
    fill(machine, "tokens", left, sessions)
    assert machine.room() == left
    assert len(served(machine)) == sessions
    assert len(machine._driver.records) == sessions  # the last opening takes what is to be filled
    machine = started(TwelveSlots)
    machine.prefill(session=0, chunk=2)  # a session already served is filled, not a new one opened
    fill(machine, "tokens", left, 1)
    assert (machine.room(), len(served(machine)), len(machine._driver.records)) == (left, 1, 2)


def edge_naming(race: int, held: int) -> int:
    """The ``edge`` of ``run_lanes`` that starts ``EDGE_RACES[race]`` when the lanes hold
    ``held`` steps: edges count the races on from the lanes' length."""
    return (race - held) % len(EDGE_RACES) + 1


def test_a_phase_at_the_edge_starts_at_it_with_its_two_calls_alone_in_two_lanes() -> None:
    for race, (what, left, op, other, same) in enumerate(EDGE_RACES):
        machine = started(TwelveSlots)
        machine.lane_decode(lane=0, session=0)
        machine.lane_decode(lane=0, session=0)
        seen: dict[str, object] = {}

        def starts(lanes: list[list[Action]], machine: ShardMachine = machine, seen: dict[str, object] = seen) -> None:
            seen.update(lanes=lanes, slots=12 - len(machine.sessions), tokens=machine.room())

        machine._run_phase = starts  # type: ignore[method-assign]
        machine.run_lanes(edge=edge_naming(race, 2))
        assert seen[what] == left, (race, seen)
        lanes = seen["lanes"]
        assert isinstance(lanes, list)
        firsts = [lane[0] for lane in lanes]
        kinds = [action.op for action in firsts]
        expected = ["prefill" if name in ("open", "restart") else name for name in (op, other)]
        assert kinds == expected, (race, kinds)
        assert len({action.args["session"] for action in firsts}) == (1 if same else 2), (race, firsts)
        assert [len(lane) for lane in lanes] == [1, 1], (race, lanes)  # the decodes drawn before are gone

    def batch_edge(drawn: int) -> list[list[Action]]:
        """The lanes of a phase with three lanes, ``drawn`` steps drawn into them, at the batch's edge."""
        machine = started(TwelveSlots, concurrency=3)
        for _ in range(drawn):
            machine.lane_decode(lane=0, session=0)
        phases: list[list[list[Action]]] = []
        machine._run_phase = phases.append  # type: ignore[method-assign]
        machine.run_lanes(edge=len(EDGE_RACES) + 1)  # the batch race: with three lanes only
        assert machine.room() == 2
        return phases[0]

    for drawn in (2, 3):  # the batch race keeps its edge, however many steps the lanes hold
        decode, other, cancel = (lane[0] for lane in batch_edge(drawn))  # two sessions decode, the first is cancelled
        assert (decode.op, other.op, cancel.op) == ("decode", "decode", "cancel")
        assert cancel.args["session"] == decode.args["session"] != other.args["session"]


def test_each_edge_names_each_race_once_counted_on_from_the_lanes_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis makes many examples by copying choices within one it ran, ``edge`` with
    them: the race an edge names moves on with each step the lanes hold, so copies that
    lengthen the lanes reach other races, and at any length every race has its edge."""
    races: list[tuple[Any, ...]] = []
    monkeypatch.setattr(parallel_rules, "_race_at_edge", lambda machine, race: races.append(race))

    def race_started(edge: int, held: int, concurrency: int = 2) -> tuple[Any, ...]:
        machine = started(TwelveSlots, concurrency=concurrency)
        for _ in range(held):
            machine.lane_decode(lane=0, session=0)
        machine._run_phase = lambda lanes: None  # type: ignore[method-assign]
        machine.run_lanes(edge=edge)
        return races[-1]

    for held in (2, 3, 9):
        named = [race_started(edge_naming(race, held), held) for race in range(len(EDGE_RACES))]
        assert named == list(EDGE_RACES), held
    assert race_started(1, 3) == EDGE_RACES[3] != race_started(1, 2) == EDGE_RACES[2]
    for held in (2, 3):
        named = [race_started(edge, held, concurrency=3) for edge in range(1, len(EDGE_RACES) + 2)]
        assert sorted(named, key=str) == sorted(edge_races(3), key=str), held
        assert named[-1] == BATCH_RACE, held


def test_the_batch_race_is_drawn_with_three_lanes_only() -> None:
    """With two lanes the races are drawn as before it existed: the same seeds, the same phases."""
    assert edge_races(2) == EDGE_RACES
    assert edge_races(3) == (*EDGE_RACES, BATCH_RACE)


@pytest.mark.parametrize("engine", AT_THE_EDGE, ids=lambda engine: engine.__name__)
def test_a_race_at_the_edge_is_found_at_every_seed(engine: type[RacyEngine]) -> None:
    missed = []
    for seed in range(1, 6):
        failure = fuzzed(engine, seed, 200, 2).failure
        if failure is None or failure.violation.property not in engine.PROPERTIES:
            missed.append(seed)
        else:
            assert failure.records[-1].action.op == PARALLEL_OP, failure.violation.message
    assert not missed, f"{engine.__name__} ({engine.RACE}) missed at seeds {missed} of 1-5"


LLAMA = "shardkit.engines.llama_cpp:LlamaCppShardEngine"
BUNDLED = (FakeShardEngine, NumpyShardEngine, PipelineEngine, LLAMA)


@pytest.mark.parametrize("seed", range(1, 6))
@pytest.mark.parametrize(
    "engine", BUNDLED, ids=lambda engine: getattr(engine, "__name__", str(engine).rpartition(":")[2])
)
def test_the_bundled_engines_are_never_flagged_with_three_lanes(engine: object, seed: int) -> None:
    if engine == LLAMA and importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("SHARDKIT_REQUIRE_LLAMA") == "1":
            pytest.fail("llama.cpp is not installed (SHARDKIT_REQUIRE_LLAMA=1): pip install 'shardkit[llama]'")
        pytest.skip("llama.cpp is not installed: pip install 'shardkit[llama]'")
    result = fuzzed(engine, seed, 100, 3)
    assert result.failure is None, result.failure.violation.message if result.failure else ""
    assert result.coverage[(PARALLEL_OP, "OK")] > 0


def test_the_minimiser_tries_the_closing_phase_at_each_edge_and_keeps_the_shortest() -> None:
    drawn = [Choice("prefill", (("session", index), ("chunk", 0))) for index in range(5)]
    lanes = [Choice("lane_decode", (("lane", 0), ("session", index))) for index in range(8)]
    long_phase = [*drawn, *lanes, Choice(PHASE_RULE, ())]
    fails_at = {0: 21, 3: 40, 4: 40}  # calls of the failure at each edge: none at 1 and 2
    shrunk_to = {3: 3, 4: 9}  # and once shrunk
    tried: list[int] = []

    def failing_length(choices: list[Choice]) -> int | None:
        edge = dict(choices[-1].arguments).get("edge", 0)
        return fails_at.get(edge) if len(choices) == len(long_phase) else shrunk_to[edge]

    def shrink(choices: list[Choice]) -> list[Choice]:
        tried.append(dict(choices[-1].arguments)["edge"])
        return [lanes[0], lanes[1], choices[-1]]

    shortest = _phase_at_each_edge(long_phase, failing_length, shrink, range(1, len(EDGE_RACES) + 1))
    assert shortest == [lanes[0], lanes[1], Choice(PHASE_RULE, (("edge", 3),))]
    assert tried == [3, 4]  # only the edges whose phase still fails are shrunk
    shrunk_to.update({3: 30, 4: 21})  # no edge gives a shorter failure: the choices stay as they were
    assert _phase_at_each_edge(long_phase, failing_length, shrink, range(1, 5)) == long_phase
    assert _phase_at_each_edge(drawn, failing_length, shrink, range(1, 5)) == drawn  # no phase, nothing to try
