"""What a step comes to, and how it is put into words.

This module owns the vocabulary of a step's outcome: the record of a step, the violation
a failure names (its stable property and a message a person can act on), the exceptions
that carry them, and the wording of statuses, outputs and metrics in a step's expected
and observed lines. ``StepContext`` is the part of the driver every failure names (the
engine, its load request, the steps recorded and the one running): from it come the
failure an engine process's death is, and the ``KitBug`` raised when the kit's own
bookkeeping fails.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import numpy as np

from shardkit._core.checks import Payload
from shardkit._core.steps import Action
from shardkit._core.targets import ProcessDeath, ResolvedTarget
from shardkit.contract import CacheResult, LoadRequest, StepResult, StructuredStatus
from shardkit.errors import KitBug, ShardkitError

__all__ = [
    "CRASHED",
    "KIT_BUG_ENDING",
    "Fail",
    "StepContext",
    "StepFailed",
    "StepRecord",
    "Violation",
    "raised",
    "show",
    "show_whole",
    "status_text",
]

CRASHED = "CRASH"
KIT_BUG_ENDING = "this is a bug in shardkit; please report it with this trace"
#: The longest text a trace's field may hold: the trace reader refuses a longer one.
TRACE_TEXT_LIMIT = 65_536
#: The most characters of compared rows a failure keeps (``Violation.rows``): what a trace
#: can hold, less room for the note that says where they were cut.
ROWS_TEXT_LIMIT = TRACE_TEXT_LIMIT - 64


@dataclass(frozen=True)
class StepRecord:
    index: int
    action: Action
    expected: str
    observed: str
    outcome: str


@dataclass(frozen=True)
class Violation:
    """``property`` is stable across runs (e.g. "§2 rule 4", "§3 determinism");
    ``message`` says what happened at which step, expected vs observed."""

    property: str
    message: str
    #: The rows a determinism failure compared, whole (its message names only the largest
    #: difference): printed on request (``--full-rows``), kept in the trace and the report.
    rows: str = ""


class StepFailed(ShardkitError):
    def __init__(self, violation: Violation, record: StepRecord) -> None:
        super().__init__(violation.message)
        self.violation = violation
        self.record = record


class Fail(Exception):
    """A check's finding while a step runs: ``Driver.execute`` turns it into ``StepFailed``."""

    def __init__(self, property_name: str, expected: str, observed: str, detail: str = "", rows: str = "") -> None:
        super().__init__(detail)
        self.property = property_name
        self.expected = expected
        self.observed = observed
        self.detail = detail
        # Cut to what a trace may hold (TRACE_TEXT_LIMIT).
        self.rows = rows if len(rows) <= ROWS_TEXT_LIMIT else f"{rows[:ROWS_TEXT_LIMIT]} … (cut at {ROWS_TEXT_LIMIT:,} characters)"


def raised(error: BaseException) -> str:
    """``RuntimeError: boom`` for an exception; ``SystemExit(0)`` for another BaseException,
    whose message alone ("0") would not say what happened."""
    if isinstance(error, Exception):
        return "".join(traceback.format_exception_only(error)).strip()
    return repr(error)


def status_text(status: StructuredStatus, cache: CacheResult | None = None) -> str:
    text = status.code.name + (f"/{cache.name}" if cache is not None else "")
    if status.retryable:
        text += " retryable"
    return text + (f" ({status.message})" if status.message else "")


def show(payload: Payload) -> str:
    """A token, or a row's first and last values and its width: a message names where rows
    differ (``payload_difference``), and 64 values or more of each hide it."""
    if isinstance(payload, tuple):
        return f"token {payload[0]}"
    shown = np.array2string(payload, precision=4, max_line_width=200, threshold=8, edgeitems=2)
    return f"row {shown} ({payload.size} values)"


def show_whole(payload: Payload) -> str:
    """Every value of a row (``--full-rows``), each as the shortest text that reads back as
    that value, or a token."""
    if isinstance(payload, tuple):
        return f"token {payload[0]}"
    # Every digit that tells two float32 values apart: the difference may be in the last one.
    return "row " + np.array2string(payload, max_line_width=200, threshold=payload.size + 1, floatmode="unique")


class StepContext:
    """Base of the driver: where it is (the engine under test, its load request, the steps
    recorded and the one running), which every failure and kit bug names."""

    target: ResolvedTarget
    load_request: LoadRequest
    records: list[StepRecord]
    _step: tuple[int, Action]

    def _death(self, error: BaseException) -> ProcessDeath | None:
        """How an isolated engine's process ended the call that raised ``error``, if it did."""
        isolation = self.target.isolation
        return isolation.death(error) if isolation is not None else None

    def _death_failure(
        self, death: ProcessDeath, expected: str, *, in_twin: bool = False, twin_call: str | None = None
    ) -> Fail:
        """E.g. "engine process killed by SIGSEGV during step 7: decode(…)", and what it printed last.
        ``twin_call`` is the twin's own call that died, when known: it need not be the step's."""
        index, action = self._step
        serving = " while serving a twin of the oracle" if in_twin else ""
        if in_twin and twin_call:
            serving += f" (its {twin_call})"
        observed = f"engine process {death.summary}{serving} during step {index}: {action.describe()}"
        return Fail(death.property, expected, observed, death.output_detail())

    def _kit_bug(
        self,
        what: str,
        *,
        delivered: object = None,
        original: StepResult | None = None,
    ) -> KitBug:
        """A check or the bookkeeping of the kit failed, not the engine: name the step and the
        steps before it, so the report reproduces it."""
        index, action = self._step
        lines = [f"shardkit's own check failed at step {index}: {what}"]
        if original is not None:
            lines.append(f"  the engine returned: {original.output!r}")
        if delivered is not None:
            lines.append(f"  the kit checked: {delivered!r}")
        lines.append(f"  engine {self.target.name}, {self.load_request}; the steps:")
        lines += [f"    step {record.index}: {record.action.describe()}" for record in self.records]
        lines.append(f"    step {index}: {action.describe()}")
        lines.append(KIT_BUG_ENDING)
        return KitBug("\n".join(lines))
