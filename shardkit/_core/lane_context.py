"""The engines' side of a parallel phase: whether the calling thread runs one of its lanes,
and ``yield_point``. The lanes themselves run in ``shardkit._parallel.lanes``, which sets
each lane thread's clock here; this module sits below the engines, so that an engine of
the kit's own (the batching transformers engine) may call ``yield_point`` too."""

from __future__ import annotations

import threading
from typing import Protocol

from shardkit._public import settle

__all__ = ["LaneClock", "in_parallel_phase", "set_lane_clock", "yield_point"]


class LaneClock(Protocol):
    """What a yield point asks of a phase's clock (``shardkit._parallel.lanes._Clock``)."""

    def wait_for_an_answer(self) -> None: ...


_lane = threading.local()


def set_lane_clock(clock: LaneClock | None) -> None:
    """Make the calling thread a lane of the phase ``clock`` keeps (None: no longer one)."""
    _lane.clock = clock


def in_parallel_phase() -> bool:
    """Whether the calling thread runs a lane of a parallel phase."""
    return getattr(_lane, "clock", None) is not None


def yield_point() -> None:
    """Give the other lanes of a parallel phase a turn: called by an engine inside a
    critical section (between reading shared state and writing it back), it waits until
    the other lanes are inside a call and one of them has answered or reached a yield
    point too, so a race there shows on every run where their calls meet, not once in
    many. It does nothing outside a parallel phase, and costs nothing to leave in an
    engine: a sequential run, a server and production never wait in it."""
    clock: LaneClock | None = getattr(_lane, "clock", None)
    if clock is not None:
        clock.wait_for_an_answer()


settle(__name__, globals())
