"""Faults (contract §4): injection at an engine's boundary for engines that lack it.

An engine that supports a fault natively lists it in ``supported_faults`` and
implements ``inject_fault``. ``FaultInjectingEngine`` wraps any other engine so
that ``delay``, ``malformed_output`` and ``crash`` can still be injected;
``memory_pressure`` needs the engine's own accounting and cannot be faked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from shardkit.contract import (
    RESIDUAL_TENSOR,
    BoundaryBundle,
    DecodeRequest,
    EngineCapabilities,
    EngineTensor,
    Fault,
    PrefillRequest,
    ShardEngine,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)
from shardkit.engines._checks import shifted_clearly
from shardkit.engines.delegating import DelegatingEngine
from shardkit.errors import InjectedCrash

__all__ = ["BOUNDARY_FAULTS", "FaultInjectingEngine", "corrupt_output"]

BOUNDARY_FAULTS = frozenset({"delay", "malformed_output", "crash"})


#: How far ``corrupt_output`` moves a residual value, at least (plus 4× the tolerance, absolute
#: and relative).
_SHIFT = 1.0


def corrupt_output(output: BoundaryBundle | TokenOutput, caps: EngineCapabilities) -> BoundaryBundle | TokenOutput:
    """A structurally valid but wrong version of ``output``: another in-vocab token,
    or residual rows whose every value moves by clearly more than the engine's tolerance.

    A value too large for the shift to register is halved instead (``shifted_clearly``). With a
    vocabulary of one token there is no other token: the output comes back unchanged.
    """
    if isinstance(output, TokenOutput):
        return TokenOutput((output.token_id + 1) % max(caps.vocab_size, 1), margin=None)
    rows = output.tensors[0].to_array()
    shifted = shifted_clearly(rows, _SHIFT + 4.0 * caps.tolerance, 4.0 * caps.tolerances()[1])
    return replace(output, tensors=(EngineTensor.from_array(RESIDUAL_TENSOR, shifted),))


class FaultInjectingEngine(DelegatingEngine[ShardEngine]):
    """Wraps ``inner`` and injects the boundary faults it does not support itself.

    It changes prefill, decode, cancel and release (the calls a crash countdown counts)
    and adds ``inject_fault``; the other operations are ``DelegatingEngine``'s."""

    def __init__(self, inner: ShardEngine, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(inner)
        self._sleep = sleep
        self._delay: float | None = None
        self._malformed = False
        self._crash_countdown: int | None = None
        #: The engine's own answer to the last prefill/decode, when ``malformed_output``
        #: replaced its output (None otherwise): the kit checks the engine on this, and
        #: its own detection on what was delivered.
        self.last_original: StepResult | None = None

    def __getattr__(self, name: str) -> object:
        # Operations a backend adds beyond contract v1 reach the wrapped engine.
        if name == "inner":  # not set yet: never look for it on itself
            raise AttributeError(name)
        return getattr(self.inner, name)

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        if fault.kind not in BOUNDARY_FAULTS:
            message = f"{fault.kind} cannot be injected at the engine boundary; the engine must support it natively"
            return StructuredStatus(StatusCode.UNIMPLEMENTED, message)
        if fault.kind == "delay":
            if fault.value < 0:
                return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"delay must be >= 0 seconds, got {fault.value}")
            self._delay = fault.value
        elif fault.kind == "malformed_output":
            self._malformed = True
        else:
            if fault.value < 1:
                message = f"crash needs a call count >= 1, got {fault.value}"
                return StructuredStatus(StatusCode.INVALID_ARGUMENT, message)
            # Several armed crashes: the earliest one kills the process.
            countdown = int(fault.value)
            self._crash_countdown = min(countdown, self._crash_countdown or countdown)
        return StructuredStatus(StatusCode.OK)

    def _count_call(self, call: str) -> None:
        if self._crash_countdown is None:
            return
        self._crash_countdown -= 1
        if self._crash_countdown == 0:
            self._crash_countdown = None
            message = f"injected crash: the engine process died during {call}"
            raise InjectedCrash(message)

    @property
    def malformed_armed(self) -> bool:
        """An injected ``malformed_output`` waits for the next OK output."""
        return self._malformed

    def _step(self, call: str, run: Callable[[], StepResult]) -> StepResult:
        self.last_original = None
        self._count_call(call)
        if self._delay is not None:
            delay, self._delay = self._delay, None
            self._sleep(delay)
        result = run()
        if self._malformed and result.status.ok and result.output is not None:
            self._malformed = False
            self.last_original = result
            result = replace(result, output=corrupt_output(result.output, self.inner.capabilities()))
        return result

    def prefill(self, request: PrefillRequest) -> StepResult:
        return self._step("prefill", lambda: self.inner.prefill(request))

    def decode(self, request: DecodeRequest) -> StepResult:
        return self._step("decode", lambda: self.inner.decode(request))

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._count_call("cancel")
        return self.inner.cancel(session_id, epoch)

    def release(self, session_id: str) -> StructuredStatus:
        self._count_call("release")
        return self.inner.release(session_id)
