"""Small checks the bundled engines share (private: engine authors get them through
``SessionEngine``, which applies them for every engine built on it)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardkit.contract import EPOCH_STEP_LIMIT, CacheResult, StatusCode, StepResult, StructuredStatus

__all__ = ["identity_problem", "is_int_at_least", "refusal", "shifted_clearly"]


def refusal(code: StatusCode, message: str, *, retryable: bool = False) -> StepResult:
    """A refused step: ``code`` with ``message``, no output, cache MISS."""
    return StepResult(StructuredStatus(code, message, retryable), CacheResult.MISS)


def identity_problem(session_id: str, **counters: int) -> str | None:
    """Rule 2's checks on the ids every step and cancel carry."""
    if not session_id:
        return "session_id is empty; pass a non-empty session id"
    for name, value in counters.items():
        if not 0 <= value < EPOCH_STEP_LIMIT:
            return f"{name}={value} is outside [0, 2**63); pass a value in that range"
    return None


def is_int_at_least(value: object, minimum: int) -> bool:
    """For constructors' checks: an int (bool excluded, it is always a caller's mistake) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_budgets(engine: str, max_sessions: object, max_kv_tokens: object, *, kv_minimum: int = 0) -> None:
    """A bundled engine's constructor check of its two budgets: ``max_sessions`` an int >= 1,
    ``max_kv_tokens`` an int >= ``kv_minimum``; a ValueError naming the bad one otherwise."""
    for name, value, minimum in (("max_sessions", max_sessions, 1), ("max_kv_tokens", max_kv_tokens, kv_minimum)):
        if not is_int_at_least(value, minimum):
            message = f"{engine} {name} must be an int >= {minimum}, got {value!r}"
            raise ValueError(message)


def is_tolerance(value: object) -> bool:
    """A tolerance as the contract takes one: a finite int or float >= 0 (bool excluded)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def shifted_clearly(values: np.ndarray[Any, Any], shift: float, relative: float = 0.0) -> np.ndarray[Any, Any]:
    """``values`` each moved by ``shift + relative·|value|``, in their own dtype, for the
    malformed-output fault (``relative``: beyond a relative tolerance too).

    Where the dtype cannot register the shift (float32 cannot add 1 to 2**25) or the sum
    overflows, the value is halved instead: every value changes by far more than rounding
    and stays finite, so only an oracle can tell the output is wrong."""
    with np.errstate(over="ignore", invalid="ignore"):
        wide = values.astype(np.float64)
        shifts = shift + relative * np.abs(wide)
        shifted: np.ndarray[Any, Any] = (wide + shifts).astype(values.dtype)
        moved = np.abs(shifted.astype(np.float64) - wide)
        lost = ~(moved >= shifts / 2) | ~np.isfinite(shifted)
    if lost.any():
        shifted = np.where(lost, values / 2, shifted).astype(values.dtype)
    return shifted
