"""``FuzzResult``: what one fuzzing run found, as data.

Its own module so that the code that renders a result (``shardkit._run.report``) and
the code that produces one (``shardkit._run.runner``) both import it without importing
each other: the runner may use the report, never the other way round.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardkit._machine.minimize import MinimizedFailure
from shardkit._machine.observer import FailureReport
from shardkit._public import settle

__all__ = ["FuzzResult"]


@dataclass
class FuzzResult:
    target: str
    seed: int | None
    #: Examples run until the first failure (that one included), or all of them.
    examples: int
    #: Engine calls and fault injections of those examples.
    steps: int
    elapsed_s: float
    coverage: Counter[tuple[str, str]]
    failure: FailureReport | None = None
    #: Checks the run could not make, each with the number of examples it was skipped in.
    caveats: Counter[str] = field(default_factory=Counter)
    trace_path: Path | None = None
    regression_path: Path | None = None
    hypothesis_output: str = ""
    faults: frozenset[str] = field(default_factory=frozenset)
    #: The failure as Hypothesis's shrinker left it, before the second stage.
    hypothesis_failure: FailureReport | None = None
    minimized: MinimizedFailure | None = None
    #: The run was stopped with Ctrl-C after a failure was found; it was not minimised.
    interrupted: bool = False
    rerun_command: str = ""
    #: (examples run, seconds, its steps) when the first failing example was seen: the
    #: length a plain random walk would have reported, without any shrinking.
    first_failure: tuple[int, float, int] | None = None
    #: Hypothesis's shrinking spent its budget of steps (the replay minimiser finished the job).
    shrink_cut: bool = False
    #: Shrinking stopped when ``--shrink-examples`` (``FuzzOptions.shrink_examples``) ran out.
    shrink_budget_spent: bool = False
    #: Examples and replays every stage of shrinking ran (what ``--shrink-examples`` bounds).
    shrink_work: int = 0
    #: Examples and steps Hypothesis ran while shrinking the failure.
    shrink_examples: int = 0
    shrink_steps: int = 0
    #: Examples asked for (``--examples``): Hypothesis counts only the valid ones it generated
    #: against it, so a run without a failure runs a few more, which it discards.
    requested_examples: int | None = None
    #: Why a trace or regression test could not be written (the failure is still reported).
    write_error: str | None = None
    #: The same examples as ``coverage``, by the accepted decodes of their longest session
    #: epoch: {decodes: examples} (``shardkit._run.report.session_histogram`` buckets it).
    longest_session: Counter[int] = field(default_factory=Counter)

    @property
    def blob(self) -> str | None:
        """Hypothesis's ``@reproduce_failure`` line, if it printed one."""
        found = re.search(r"@reproduce_failure\([^)]*\)", self.hypothesis_output)
        return found.group(0) if found else None


settle(__name__, globals())
