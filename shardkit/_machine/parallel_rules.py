"""The rules of the parallel phase, added only to a machine built with ``concurrency`` of 2
or more (a machine without them draws exactly the examples it drew before).

``lane_step`` adds one step to a lane and runs nothing; ``run_lanes`` sends every lane to
the engine at the same time (``shardkit._parallel.phase``), and nothing runs after it: the
example ends there. Each step is three small integers, like a sequential rule's, so
shrinking deletes lane steps one by one and lowers what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition

from shardkit._core.steps import Action, step_action
from shardkit._machine.state_machine import ShardMachine, step_rule

__all__ = ["LANE_OPS", "MAX_CONCURRENCY", "parallel_rules"]

#: What a lane step does, simplest first.
LANE_OPS = ("decode", "prefill", "cancel", "release")
#: Lanes a machine may run at once: races need two, and three already make most orders.
MAX_CONCURRENCY = 3


def parallel_rules(concurrency: int) -> dict[str, Callable[..., Any]]:
    """The rules a machine of ``concurrency`` lanes adds, by name."""

    @step_rule(lane=st.integers(0, concurrency - 1), op=st.integers(0, len(LANE_OPS) - 1), session=st.integers(0, 7))
    def lane_step(self: ShardMachine, lane: int, op: int, session: int) -> None:
        """Add a step to a lane: a decode, a two-token prefill, a cancel at the session's
        epoch or a release. ``lane`` 0 is the next lane in turn (so the simplest phase has
        a step in every lane), 1 the one after. A prefill or decode takes the step after
        the session's last one in the model, counting the steps this lane already holds
        for it (two lanes that step the same session race for the same step)."""
        lane = (sum(len(held) for held in self.lanes) + lane) % concurrency
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        name = LANE_OPS[op]
        held = self.lanes[lane]
        step += sum(1 for action in held if action.op in ("prefill", "decode") and action.args["session"] == sid)
        if name == "decode":
            action = step_action("decode", sid, epoch, step, (self.token(step + lane),))
        elif name == "prefill":
            action = step_action("prefill", sid, epoch, step, self.chunk(1, sid))
        elif name == "cancel":
            action = Action("cancel", {"session": sid, "epoch": epoch})
        else:
            action = Action("release", {"session": sid})
        held.append(action)

    @precondition(lambda self: sum(1 for lane in self.lanes if lane) >= 2)
    @step_rule()
    def run_lanes(self: ShardMachine) -> None:
        """Send every lane to the engine at the same time (two lanes hold steps at least):
        the example's last steps."""
        self.run_phase([list(lane) for lane in self.lanes])

    return {"lane_step": lane_step, "run_lanes": run_lanes}
