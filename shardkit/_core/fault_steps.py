"""Fault steps, and the kit's own check that an injected malformed output is detected.

This module owns which fault kinds an engine takes natively and which at its boundary
(``usable_faults``), arming a fault when a step asks for one (a crash countdown, a malformed
output, memory pressure the model then enforces, a delay), and the self-check after an
injected malformed output: the kit's checks must catch it, and a miss is a bug of the kit's,
never the engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar, cast

from shardkit._core.faults import BOUNDARY_FAULTS, FaultInjectingEngine
from shardkit._core.model import Prediction, StepRequest
from shardkit._core.outcomes import Fail, status_text
from shardkit._core.output_checks import OutputChecks, SessionLog
from shardkit._core.steps import Action
from shardkit.contract import (
    EngineCapabilities,
    Fault,
    FaultInjectable,
    ShardEngine,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit.errors import UsageError

__all__ = ["FaultSteps", "fault_injectable", "usable_faults"]

T = TypeVar("T")


def usable_faults(
    caps: EngineCapabilities, engine: object, wanted: frozenset[str]
) -> tuple[frozenset[str], frozenset[str]]:
    """Split ``wanted`` into (native, at the boundary); kinds in neither cannot be injected."""
    injectable = fault_injectable(engine) is not None
    native = frozenset(kind for kind in wanted if kind in caps.supported_faults and injectable)
    return native, (wanted - native) & BOUNDARY_FAULTS


def fault_injectable(engine: object) -> FaultInjectable | None:
    """``engine`` if it has an ``inject_fault`` method, else None: the check of
    ``isinstance(engine, FaultInjectable)`` without typing's protocol machinery, which cost
    a fifth of a millisecond on every engine the kit builds (one or more per example)."""
    return cast(FaultInjectable, engine) if callable(getattr(engine, "inject_fault", None)) else None


class FaultSteps(OutputChecks):
    """Base of the driver: its fault state, the fault step, and the malformed-output self-check."""

    wanted_faults: frozenset[str]
    native_faults: frozenset[str]
    boundary_faults: frozenset[str]
    engine: ShardEngine
    _fault_target: FaultInjectable | None
    _counted_calls: int
    _crash_at: int | None
    _malformed_armed: bool
    notes: list[str]
    caveats: set[str]

    if TYPE_CHECKING:
        # The driver's call to the engine (``Driver._call`` in shardkit._core.driver).
        def _call(
            self, call: str, run: Callable[[], object], returns: type[T], *, counted: bool = True
        ) -> T | None: ...

    @property
    def armed_fault(self) -> str | None:
        """The injected fault still waiting for the call it spoils (a crash or a malformed
        output), or None."""
        if self._crash_at is not None:
            return f"a crash at call {self._crash_at}"
        if self._malformed_armed:
            return "a malformed_output"
        return None

    @property
    def injectable_faults(self) -> frozenset[str]:
        return self.native_faults | self.boundary_faults

    def _run_fault(self, action: Action) -> tuple[str, str, str]:
        fault = Fault(action.args["kind"], float(action.args["value"]))
        if fault.kind not in self.wanted_faults:
            enabled = ", ".join(sorted(self.wanted_faults)) or "none"
            message = (
                f"a {fault.kind!r} fault step, but this run injects only these faults: {enabled}; "
                f"enable it (--faults, or faults= in machine_for/Driver) or drop the step"
            )
            raise UsageError(message)
        if fault.kind not in self.injectable_faults:
            message = (
                f"fault {fault.kind!r} cannot be injected into {self.target.name}: it is not in the engine's "
                f"supported_faults {sorted(self.caps.supported_faults)} and cannot be injected at the boundary "
                f"(which takes {', '.join(sorted(BOUNDARY_FAULTS))}); run against an engine that supports it, "
                "or without that fault"
            )
            raise UsageError(message)
        injector: FaultInjectable = self.engine if fault.kind in self.boundary_faults else self._fault_target  # type: ignore[assignment]
        status = self._call("inject_fault", lambda: injector.inject_fault(fault), StructuredStatus, counted=False)
        assert status is not None
        if not status.ok and fault.kind in self.boundary_faults:
            # The kit's own injector refused: the value never came from the engine.
            message = f"the kit cannot inject {fault} at the engine's boundary: {status.message}"
            raise UsageError(message)
        if not status.ok:
            raise Fail(f"§4 {fault.kind}", "OK (the fault is armed)", status_text(status))
        if fault.kind == "crash":
            due = self._counted_calls + int(fault.value)
            self._crash_at = min(due, self._crash_at or due)
        elif fault.kind == "malformed_output":
            self._malformed_armed = True
        elif fault.kind == "memory_pressure":
            self.model.memory_pressure(int(fault.value))
            capabilities = self._call("capabilities", self.engine.capabilities, EngineCapabilities, counted=False)
            assert capabilities is not None
            reported = capabilities.max_kv_tokens
            if reported != int(fault.value):
                raise Fail("§4 memory_pressure", f"capabilities().max_kv_tokens == {int(fault.value)}", str(reported))
        return "OK (armed)", "OK (armed)", "OK"

    def _boundary_original(self) -> StepResult | None:
        """The engine's own result of the last step, if the boundary replaced its output."""
        engine = self.engine
        return engine.last_original if isinstance(engine, FaultInjectingEngine) else None

    def _injection_outcome(
        self,
        request: StepRequest,
        predicted: Prediction,
        delivered: StepResult,
        log: SessionLog,
        *,
        original: StepResult | None,
    ) -> str:
        """An injected malformed output must be caught by the kit's checks (§4 malformed_output).

        ``original`` is the engine's own result when the kit corrupted it at the boundary
        (None: the engine corrupted its output itself). Returns the note for the step's
        observed text; raises a ``KitBug`` when the checks miss a wrong output, and a
        failure of the engine when it armed the fault natively but did not corrupt."""
        problems, unreferenced = self._output_problems(request, predicted, delivered, log, strict=True)
        if problems:
            return " — the injected malformed output was detected"
        assert delivered.output is not None
        if unreferenced:
            histories = ", ".join(str(list(history)) for history in unreferenced)
            what = (
                f"the malformed output injected {'at the boundary' if original is not None else 'by the engine'} "
                f"went undetected: no reference answer exists for history {histories} "
                f"(twins {'on' if self.use_twins else 'off'})"
            )
            raise self._kit_bug(what, delivered=delivered.output, original=original)
        # The output agrees with the reference wherever it was compared: it is not wrong.
        one_token = isinstance(delivered.output, TokenOutput) and self.caps.vocab_size == 1
        if original is None and not one_token:
            raise Fail(
                "§4 malformed_output",
                "a wrong output (the engine accepted the malformed_output fault)",
                f"{status_text(delivered.status, delivered.cache)} agreeing with the reference: {delivered.output!r}",
                "the engine armed the fault but did not corrupt this output, the next OK one it returned",
            )
        if original is None:
            changed = False
        elif isinstance(delivered.output, TokenOutput) and isinstance(original.output, TokenOutput):
            changed = delivered.output.token_id != original.output.token_id
        else:
            changed = delivered.output != original.output
        if isinstance(delivered.output, TokenOutput) and (changed or one_token):
            # The kit's corruption landed on an answer a correct engine may give (a near tie
            # the engine reported), or there is no other token: nothing wrong to detect.
            index, action = self._step
            why = "a near tie" if changed else "the vocabulary has one token"
            where = "by the engine" if original is None else "at the boundary"
            self.notes.append(
                f"step {index}: the malformed output injected {where} into {action.describe()} "
                f"is a valid answer here ({why}); not counted as an injection"
            )
            self.caveats.add(
                "malformed_output detection (docs/contract.md#fault-malformed-output): an injected output "
                "happened to be a valid answer (a near tie, or a one-token vocabulary)"
            )
            return f" — the injected output happened to be a valid answer ({why}); not counted"
        what = "the malformed output injected at the boundary went undetected: " + (
            "the corruption did not change the output" if not changed else "it agrees with the reference"
        )
        raise self._kit_bug(what, delivered=delivered.output, original=original)
