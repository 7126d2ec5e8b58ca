"""The rules of the parallel phase, added only to a machine built with ``concurrency`` of 2
or more (a machine without them draws exactly the examples it drew before).

``lane_step`` (and ``lane_decode``) adds one step to a lane and runs nothing; ``run_lanes``
makes the lanes' steps concrete from the sessions' state and sends every lane to the engine
at the same time (``shardkit._parallel.phase``), and nothing runs after it: the example ends
there. Each step is a few small integers, like a sequential rule's, so shrinking deletes
lane steps one by one and lowers what is left.

``run_lanes`` may start the phase at the edge of the engine's capacity, with the two calls
that meet there alone in two lanes: right before the lanes are sent, sequential steps take the
engine's session slots or KV tokens until one (or none) is left. Races that happen only
when two calls meet at the last slot or the last tokens need every slot or token before
them taken at the moment the phase starts, and the two calls that want it (or one that
frees it) in two lanes: steps drawn one by one made that phase about once in a hundred
for an engine of four slots. The edge is a choice of ``run_lanes``, not a rule of its
own: a rule more would be drawn instead of the others, and the races it does not start
were found less often.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition

from shardkit._core.steps import Action, step_action
from shardkit._machine.state_machine import LIVE_CHOICES, MAX_CHUNK, SESSION_ID_POOLS, ShardMachine, step_rule

__all__ = [
    "BATCH_RACE",
    "BATCH_RACE_LANES",
    "EDGE_RACES",
    "LANE_OPS",
    "MAX_CONCURRENCY",
    "MAX_FILL_OPENINGS",
    "edge_races",
    "fill",
    "lane_actions",
    "parallel_rules",
]

#: What a lane step does, simplest first: a decode, a two-token prefill (which opens an
#: unknown id), the opening of an id no session holds (two lanes opening race for the
#: last slots), a cancel at the session's epoch, a release, and a restart (a prefill of
#: step 0 at the next epoch: the bump racing the session's other calls).
LANE_OPS = ("decode", "prefill", "open", "cancel", "release", "restart")
#: Op choices past ``LANE_OPS`` count again every op but the continuing prefill, the
#: decode twice: it takes part in most races (two decodes that overlap, a decode racing a
#: restart, a cancel or a release), and a continuing prefill races as a decode does. With
#: decodes and openings only there (as first written), a restart racing a decode was
#: found at 4 seeds of 5 in 200 examples; with this mix, at 5.
LANE_OP_CHOICES = 2 * len(LANE_OPS)
_MORE_OFTEN = ("decode", "open", "restart", "cancel", "release", "decode")
#: Lanes a machine may run at once: races need two, and three already make most orders.
MAX_CONCURRENCY = 3
#: Steps a lane holds at most. A race needs a call or two per lane; longer lanes only push
#: the racing calls apart in time and leave the shrinker more steps to take out one by one,
#: each candidate run up to three times (an example's lanes fill as long as it goes on).
LANE_LENGTH = 8
#: The races at the edge of capacity a phase may start with (``run_lanes``'s ``edge``):
#: what the fill leaves free (session slots or KV tokens, one or none), the two lane steps
#: (``LANE_OPS``) and whether they name one session. Two openings for the last slot, two
#: sessions' decodes for the last token, the decode that takes the last token and a cancel
#: of its session; an opening and a release that frees the slot it needs, a decode and a
#: release of another session that frees the tokens it needs, a session's release and its
#: reopening at the next epoch (which takes the slot the release frees, or keeps its own), and
#: a session's decode of the last token and its restart at the next epoch (an engine that
#: lets calls in halfway through the bump serves the decode from a cache already wiped).
EDGE_RACES: tuple[tuple[Any, ...], ...] = (
    ("slots", 1, "open", "open", False),
    ("tokens", 1, "decode", "decode", False),
    ("tokens", 1, "decode", "cancel", True),
    ("slots", 0, "open", "release", False),
    ("tokens", 0, "decode", "release", False),
    ("slots", 0, "restart", "release", True),
    ("tokens", 1, "decode", "restart", True),
)
#: One more race with three lanes or more (after ``EDGE_RACES``, whose draws with two lanes
#: it leaves as they were): two tokens are left, and two sessions of different lengths (the
#: fill's) decode at once and are both served, the batch of two a batching scheduler makes.
#: Its sixth item is a third lane's step, on the first step's session: a cancel while the
#: batch is formed, where a scheduler may give the rows to the wrong sessions. (Made only
#: when the third lane held a step drawn before, it was there in half the phases, and a
#: planted bug that needs it was missed at two seeds of five.)
BATCH_RACE: tuple[Any, ...] = ("tokens", 2, "decode", "decode", False, "cancel")
#: The lanes the batch race needs: two decodes and a cancel.
BATCH_RACE_LANES = 3


def edge_races(concurrency: int) -> tuple[tuple[Any, ...], ...]:
    """The races at the edge of capacity a phase of ``concurrency`` lanes may start with."""
    return (*EDGE_RACES, BATCH_RACE) if concurrency >= BATCH_RACE_LANES else EDGE_RACES


#: The most sessions one fill opens: an engine with more slots than this (plus those already
#: held) is not filled to its last one, and its slot edge is not reached.
MAX_FILL_OPENINGS = 256
#: The most prefills one fill of tokens sends (each ``MAX_CHUNK`` tokens at most).
MAX_FILL_CHUNKS = 4
#: The ids opened once every id of the example's pool is live (a fill of more slots than the
#: pool has ids, or a lane's opening with the pool used up): ``slot-1``, ``slot-2``, …
EXTRA_ID_PREFIX = "slot-"


def lane_actions(machine: ShardMachine, lane: int, drawn: list[tuple[int, int, int]]) -> list[Action]:
    """The steps of ``lane`` from its drawn (op, session, offset) triples and the model's state.

    ``session`` picks as ``session_id`` does, counted from ``offset``: a step of
    ``lane_step`` counts from its lane, so choice 0 is the first live session in lane 0
    and the second in lane 1 and the simplest phase steps two sessions (a race between
    sessions); the two steps of ``lane_pair`` count from 0 and step one session. A
    prefill or decode takes the step after the session's last one in the model, counting
    the steps this lane holds for it before (two lanes that step the same session race for
    the same step)."""
    actions: list[Action] = []
    for op, choice, offset in drawn:
        name = LANE_OPS[op] if op < len(LANE_OPS) else _MORE_OFTEN[op - len(LANE_OPS)]
        opening = name == "open"
        if opening:
            unknown = _unknown_ids(machine, LANE_LENGTH * len(machine._lanes))
            sid = unknown[(choice + offset) % len(unknown)]
        else:
            sid = _lane_session(machine, choice + offset, name)
        epoch, step = machine.position(sid)
        step += sum(1 for action in actions if action.op in ("prefill", "decode") and action.args["session"] == sid)
        if name == "decode":
            action = step_action("decode", sid, epoch, step, (machine.token(step + lane),))
        elif name == "prefill" or opening:
            action = step_action("prefill", sid, epoch, step, machine.chunk(1, sid))
        elif name == "restart":
            known = sid in machine._driver.model.sessions
            action = step_action("prefill", sid, epoch + known, 0, machine.chunk(1, sid, restarting=known))
        elif name == "cancel":
            action = Action("cancel", {"session": sid, "epoch": epoch})
        else:
            action = Action("release", {"session": sid})
        actions.append(action)
    return actions


def _lane_session(machine: ShardMachine, choice: int, op: str) -> str:
    """A live session (a decode, prefill or cancel takes one that is not cancelled, when
    there is one: a race lives between calls that are served, and a decode and a cancel of
    one choice then name one session), or an unknown id."""
    sessions = machine._driver.model.sessions
    live = list(sessions)
    if op in ("decode", "prefill", "cancel"):
        live = [sid for sid in live if not sessions[sid].cancelled] or live
    if live and choice < LIVE_CHOICES:
        return live[choice % len(live)]
    return machine.session_id(choice)


def _unknown_ids(machine: ShardMachine, count: int) -> list[str]:
    """The ids of the example's pool that no session holds, in the pool's order; with every
    one of them live, ``count`` ids beyond the pool that none holds either."""
    live = machine._driver.model.sessions
    unknown = [sid for sid in SESSION_ID_POOLS[machine._id_pool] if sid not in live]
    number = 0
    while not unknown or (len(unknown) < count and number):
        number += 1
        if f"{EXTRA_ID_PREFIX}{number}" not in live:
            unknown.append(f"{EXTRA_ID_PREFIX}{number}")
    return unknown


def fill(machine: ShardMachine, what: str, left: int, sessions: int) -> None:
    """Bring the engine to ``left`` free session slots (``what`` "slots") or KV tokens
    ("tokens"), sized from the engine's capabilities and the model's state (a
    memory_pressure fault lowers the token limit), one sequential step at a time: release
    the newest sessions while more is taken than that (for tokens, those that hold some),
    then open sessions, or prefill. A fill of tokens opens sessions until ``sessions`` are
    served (the sessions the race's calls name), each with one token but the last, which
    takes what is to be filled; with enough served, it prefills the oldest. Stops at the
    first step not served."""
    model, caps = machine._driver.model, machine._driver.caps

    def served() -> list[str]:
        return [sid for sid, session in model.sessions.items() if not session.cancelled]

    if what == "slots":
        if not _released_while(machine, lambda: len(model.sessions) > caps.max_sessions - left, holding=False):
            return
        for _ in range(min(caps.max_sessions - left - len(model.sessions), MAX_FILL_OPENINGS)):
            if machine.room() < 1 or not _served(machine, _unknown_ids(machine, 1)[0], 1):
                return
        return
    if not _released_while(
        machine, lambda: machine.room() < left or (machine.room() == left and len(served()) < sessions), holding=True
    ):
        return
    for _ in range(MAX_FILL_CHUNKS + sessions):
        length = min(machine.room() - left, MAX_CHUNK)
        if length < 1:
            return
        if len(served()) >= sessions:
            sid = served()[0]
        elif len(model.sessions) < caps.max_sessions:
            sid = _unknown_ids(machine, 1)[0]
            length = length if len(served()) + 1 == sessions else 1
        else:
            return
        if not _served(machine, sid, length):
            return


def _released_while(machine: ShardMachine, too_much: Callable[[], bool], *, holding: bool) -> bool:
    """Release the newest session (of those holding KV tokens, if ``holding``) while
    ``too_much()``; whether it is no longer so."""
    sessions = machine._driver.model.sessions
    while too_much():
        newest = [sid for sid, session in sessions.items() if session.kv_tokens or not holding][-1:]
        if not newest or machine.run(Action("release", {"session": newest[0]})).outcome != "OK":
            return False
    return True


def _served(machine: ShardMachine, sid: str, length: int) -> bool:
    """Prefill the next ``length`` tokens of ``sid`` (opening it if unknown); whether it was served."""
    epoch, step = machine.position(sid)
    return machine.run(step_action("prefill", sid, epoch, step, _ramp(machine, length))).outcome == "OK"


def _ramp(machine: ShardMachine, length: int) -> tuple[int, ...]:
    vocab = machine._driver.caps.vocab_size
    return tuple(index * 3 % vocab for index in range(length))


def _race_at_edge(machine: ShardMachine, race: tuple[Any, ...]) -> None:
    """Make the lanes hold the two steps of ``race`` (of ``edge_races``) alone, one in lane 0
    and one in lane 1 (and its third, if it has one, in lane 2): the steps drawn into the
    lanes before would run first or after them, and take, free or hide what they race for
    (a release after the cancel that leaked, say)."""
    _, _, op, other, same, *third = race
    machine._lanes[:] = [[] for _ in machine._lanes]
    machine._lanes[0].append((LANE_OPS.index(op), 0, 0))
    machine._lanes[1].append((LANE_OPS.index(other), 0, 0 if same else 1))
    if third and len(machine._lanes) > 2:
        machine._lanes[2].append((LANE_OPS.index(third[0]), 0, 0))


def _add(machine: ShardMachine, lane: int, op: int, session: int, offset: int | None = None) -> None:
    """Add a step to ``lane`` counted from the next lane in turn, so that steps spread over
    the lanes, unless that lane holds ``LANE_LENGTH`` steps already; its session is counted
    from ``offset``, or from the lane it lands in."""
    lanes = machine._lanes
    index = (sum(len(held) for held in lanes) + lane) % len(lanes)
    if len(lanes[index]) < LANE_LENGTH:
        lanes[index].append((op, session, index if offset is None else offset))


def _ready(machine: ShardMachine) -> bool:
    return sum(1 for lane in machine._lanes if lane) >= 2 and machine._driver.armed_fault is None


def parallel_rules(concurrency: int, base: type[ShardMachine]) -> dict[str, Callable[..., Any]]:
    """The rules a machine of ``concurrency`` lanes adds to ``base``, by name, and the
    ``teardown`` that runs the lanes of an example that did not."""

    @step_rule(lane=st.integers(0, concurrency - 1), op=st.integers(0, LANE_OP_CHOICES - 1), session=st.integers(0, 7))
    def lane_step(self: ShardMachine, lane: int, op: int, session: int) -> None:
        """Add a step to a lane (``LANE_OPS``, and ``_MORE_OFTEN`` for ``op`` past them);
        ``lane`` 0 is the next lane in turn (so the simplest phase has a step in every
        lane), 1 the one after. The step is derived when the phase starts
        (``lane_actions``), from the model's state then: the sequential steps drawn in
        between would leave a step derived now stale."""
        _add(self, lane, op, session)

    @step_rule(lane=st.integers(0, concurrency - 1), session=st.integers(0, 7))
    def lane_decode(self: ShardMachine, lane: int, session: int) -> None:
        """``lane_step`` of a decode: a second rule that fills lanes, so that an example whose
        swarm of rules leaves one of the two out still reaches a phase, and reaches it
        holding the overlapping decodes most races between sessions live in."""
        _add(self, lane, 0, session)

    @step_rule(op=st.integers(0, LANE_OP_CHOICES - 1), other=st.integers(0, LANE_OP_CHOICES - 1), session=st.integers(0, 7))
    def lane_pair(self: ShardMachine, op: int, other: int, session: int) -> None:
        """Add two steps on one session to two lanes, ``op`` to the next lane in turn and
        ``other`` to the one after: most races live between two calls on one session (a
        release or cancel landing during a prefill, a restart during a decode), which
        steps drawn one by one rarely aim at the same session."""
        _add(self, 0, op, session, 0)
        _add(self, 0, other, session, 0)

    races = edge_races(concurrency)

    @precondition(_ready)
    @step_rule(edge=st.integers(0, len(races)))
    def run_lanes(self: ShardMachine, edge: int = 0) -> None:
        """Send every lane to the engine at the same time (two lanes hold steps at least, and
        no injected fault waits for a call: a lane's call would take it at random): the
        example's last steps. ``edge`` past 0 starts the phase at the edge of the engine's
        capacity (``_race_at_edge``) with a race of ``edge_races(concurrency)``: the one of
        ``EDGE_RACES`` that ``edge`` names counted on from the number of steps the lanes
        hold, or ``BATCH_RACE`` at the edge past them. (Named by ``edge`` alone, races came
        in clumps: Hypothesis makes many of its examples by copying choices within an
        example it ran, which leaves ``edge`` as it was, and at one seed 77 phases at the
        edge held six races and never the seventh. The copies change the lanes' length, and
        each edge still names each race once. The batch race keeps its edge: counted on with
        the others, it was missed at a seed where it had been found.)"""
        if not _ready(self):  # the minimiser replays rules without their preconditions
            return
        if edge:
            held = sum(len(lane) for lane in self._lanes)
            race = races[edge - 1] if edge > len(EDGE_RACES) else EDGE_RACES[(edge - 1 + held) % len(EDGE_RACES)]
            what, left, _, _, same, *_ = race
            _race_at_edge(self, race)
            fill(self, what, left, 1 if same else 2)
        self._run_phase([lane_actions(self, lane, drawn) for lane, drawn in enumerate(self._lanes)])

    def teardown(self: ShardMachine) -> None:
        """An example whose lanes hold steps ends with their phase even when it did not draw
        ``run_lanes``: Hypothesis turns off a random share of the rules in each example
        (swarm testing), which left three examples in four without a phase. Not after an
        example that ended by raising (a failed step): it has its failure already."""
        try:
            if sys.exc_info()[0] is None and not self._phase_ran and "_driver" in vars(self) and _ready(self):
                run_lanes(self)
        finally:
            base.teardown(self)

    return {
        "lane_step": lane_step,
        "lane_decode": lane_decode,
        "lane_pair": lane_pair,
        "run_lanes": run_lanes,
        "teardown": teardown,
    }
