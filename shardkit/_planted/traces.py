"""A planted engine's ``MINIMAL`` as a trace file, for ``shardkit replay`` to run.

The trace is the real one (``shardkit._run.trace.trace_document``): the same format a fuzz
run writes, so a replay of it goes through exactly the path a user's replay does. Its
placeholders are resolved against the capabilities of an engine built from the target and
loaded with the trace's load request, just before the trace is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shardkit._core.outcomes import StepRecord, Violation
from shardkit._core.targets import IsolationOptions, parse_target
from shardkit._machine.spec import parse_faults
from shardkit._planted.minimal import Step, actions, load_request_for
from shardkit._run.trace import trace_document
from shardkit.contract import ShardEngine

__all__ = ["minimal_trace"]

#: What a trace written from a MINIMAL says in place of what a run saw: no run has happened.
NOT_RUN = "(not run: written from the engine's MINIMAL)"


def minimal_trace(
    engine: Callable[[], ShardEngine],
    target: str,
    *,
    steps: Sequence[Step] | None = None,
    reference: str | None = None,
    isolation: IsolationOptions | None = None,
) -> dict[str, Any]:
    """The trace document of ``engine.MINIMAL`` (or of ``steps``) against ``target``, which
    names ``engine``. The engine's ``ROLE`` (default "full") chooses the load request and its
    ``FAULTS`` (default "all") the faults enabled; ``PROPERTY`` is the failure it records.
    ``isolation`` records a worker process for the replay (an engine that kills its process);
    the probe that reads the capabilities runs in this process, and makes no step."""
    chosen: Sequence[Step] = steps if steps is not None else getattr(engine, "MINIMAL")  # noqa: B009
    probe = engine()
    request = load_request_for(getattr(engine, "ROLE", "full"), probe.capabilities())
    loaded = probe.load(request)
    if not loaded.status.ok:
        message = f"{target} refused {request}: {loaded.status.code.name} {loaded.status.message}"
        raise ValueError(message)
    concrete = actions(chosen, probe.capabilities())
    records = [StepRecord(index, action, NOT_RUN, NOT_RUN, "") for index, action in enumerate(concrete, start=1)]
    name = getattr(engine, "__name__", target)
    violation = Violation(getattr(engine, "PROPERTY"), f"{name}.MINIMAL: {getattr(engine, 'BUG', '')}")  # noqa: B009
    return trace_document(
        target=parse_target(target),
        load_request=request,
        faults=parse_faults(getattr(engine, "FAULTS", "all")),
        records=records,
        violation=violation,
        seed=None,
        reference=parse_target(reference) if reference is not None else None,
        isolation=isolation,
    )
