"""Checks of what an engine returns (contract §3 "shape and range").

These compare one observed result with what the contract allows for the
request that produced it; they know nothing of Hypothesis or of the model's
state, so the machine, the static contract and replay all share them.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np

from shardkit._core.model import StepRequest, input_length
from shardkit._core.steps import ROW_KINDS, row_codes_of, row_kinds_text, split_row_code
from shardkit._dtypes import numpy_dtype
from shardkit.contract import (
    OUTPUT_BOUNDARY_POINT,
    RESIDUAL_TENSOR,
    BoundaryBundle,
    EngineCapabilities,
    MetricsResult,
    StepResult,
    TokenOutput,
)

__all__ = [
    "HistoryMemo",
    "MemoStore",
    "Payload",
    "Tolerance",
    "largest_difference",
    "max_abs_difference",
    "metrics_text",
    "output_problems",
    "payload_difference",
    "payloads_agree",
    "payloads_of",
]


#: What the messages of a non-finite answer start with.
NON_FINITE = "non-finite"


def output_problems(caps: EngineCapabilities, request: StepRequest, result: StepResult) -> list[str]:
    """Everything wrong with ``result`` as an answer to the well-formed ``request``."""
    if not result.status.ok:
        return [] if result.output is None else [f"a {result.status.code.name} result carries an output"]
    output = result.output
    if caps.role in ("tail", "full"):
        if not isinstance(output, TokenOutput):
            return [f"a {caps.role} must return a TokenOutput, returned {type(output).__name__}"]
        if not 0 <= output.token_id < caps.vocab_size:
            return [f"token id {output.token_id} is outside the vocabulary [0, {caps.vocab_size})"]
        if output.margin is not None and not math.isfinite(output.margin):
            # The top-1 minus top-2 logit of finite logits is finite: the logits were not.
            return [
                f"margin is {output.margin!r}: the logits it was taken from were not finite{_after_input(caps, request)}"
            ]
        return []
    if not isinstance(output, BoundaryBundle):
        return [f"a {caps.role} must return a BoundaryBundle, returned {type(output).__name__}"]
    return _bundle_problems(caps, request, output)


def _bundle_problems(caps: EngineCapabilities, request: StepRequest, bundle: BoundaryBundle) -> list[str]:
    problems: list[str] = []
    expected_point = OUTPUT_BOUNDARY_POINT[caps.role]
    if bundle.boundary_point != expected_point:
        problems.append(f"boundary point is {bundle.boundary_point!r}, expected {expected_point!r}")
    if bundle.architecture != caps.architecture:
        problems.append(f"architecture is {bundle.architecture!r}, expected {caps.architecture!r}")
    echoed = (bundle.session_id, bundle.epoch, bundle.step)
    asked = (request.session_id, request.epoch, request.step)
    if echoed != asked:
        problems.append(f"bundle echoes (session, epoch, step) {echoed!r}, the request was {asked!r}")
    rows = input_length(request)
    problems += [problem + _after_input(caps, request, problem) for problem in _residual_problems(caps, bundle, rows)]
    expected_sideband = _expected_sideband(caps, request)
    if bundle.token_id_sideband != expected_sideband:
        problems.append(f"sideband is {bundle.token_id_sideband!r}, expected {expected_sideband!r}")
    return problems


def _residual_problems(caps: EngineCapabilities, bundle: BoundaryBundle, rows: int) -> list[str]:
    if len(bundle.tensors) != 1 or bundle.tensors[0].name != RESIDUAL_TENSOR:
        names = [tensor.name for tensor in bundle.tensors]
        return [f"bundle must hold exactly one tensor named {RESIDUAL_TENSOR!r}, holds {names}"]
    tensor = bundle.tensors[0]
    expected_shape = (rows, caps.hidden_size)
    if tensor.shape != expected_shape:
        return [f"residual shape is {tensor.shape}, expected {expected_shape}"]
    if tensor.dtype != caps.dtype:
        return [f"residual dtype is {tensor.dtype!r}, expected {caps.dtype!r}"]
    try:
        dtype = _wire_dtype(caps.dtype)
    except TypeError:
        return [f"residual dtype {caps.dtype!r} is not one numpy knows"]
    expected_bytes = rows * caps.hidden_size * dtype.itemsize
    if len(tensor.data) != expected_bytes:
        return [f"residual holds {len(tensor.data)} bytes, shape {tensor.shape} needs {expected_bytes}"]
    values = _rows(tensor.data, dtype, tensor.shape)
    finite = np.isfinite(values)
    if not finite.all():
        row, column = (int(index) for index in np.argwhere(~finite)[0])
        return [f"residual holds a non-finite value ({values[row, column]} at row {row + 1}, column {column + 1})"]
    return []


def _after_input(caps: EngineCapabilities, request: StepRequest, problem: str = NON_FINITE) -> str:
    """For a non-finite answer to an input of extreme values: what the input held, and that it
    was legal. The kit's bundles name their rows (``row_codes_of``); "" for any other problem."""
    bundle = request.bundle
    if NON_FINITE not in problem or bundle is None or bundle.token_id_sideband is None or len(bundle.tensors) != 1:
        return ""
    codes = row_codes_of(caps, bundle.tensors[0].data, bundle.token_id_sideband)
    held = row_kinds_text(codes, caps.dtype)
    if not held:
        return ""
    kinds = {ROW_KINDS[split_row_code(code)[1]] for code in codes}
    causes = []
    if kinds & {"huge", "mixed"}:
        causes.append("an engine that squares a row in its dtype overflows there")
    if kinds & {"subnormal", "zero", "mixed"}:
        causes.append("one that divides by a row's norm with no epsilon divides by zero there")
    return (
        f", after an input whose {held}: finite input, which the engine must answer with finite values "
        f"({'; '.join(causes)}: docs/contract.md#extreme-values)"
    )


@functools.lru_cache(maxsize=64)
def _wire_dtype(name: str) -> np.dtype[Any]:
    """The dtype named ``name`` as ``EngineTensor`` data holds it (little-endian)."""
    return numpy_dtype(name).newbyteorder("<")


def _rows(data: bytes, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A read-only view of a tensor's data whose size was checked: the checks read every
    output of every twin, and ``EngineTensor.to_array`` copies."""
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _expected_sideband(caps: EngineCapabilities, request: StepRequest) -> tuple[int, ...] | None:
    if caps.role == "head":
        return request.token_ids
    assert request.bundle is not None
    return request.bundle.token_id_sideband


# --- determinism, isolation and chunking invariance (contract §3) -----------------------------

#: What an output says about one history: the residual row at its last position,
#: or the token predicted after it (with the engine's margin, if it knows it).
Payload = np.ndarray[Any, Any] | tuple[int, float | None]


def payloads_of(output: BoundaryBundle | TokenOutput, positions: int) -> list[Payload]:
    """One payload per history the output speaks for: every row of a bundle, or the
    token of the whole history (which is the last of ``positions``)."""
    if isinstance(output, TokenOutput):
        return [(output.token_id, output.margin)]
    tensor = output.tensors[0]
    try:
        rows = _rows(tensor.data, _wire_dtype(tensor.dtype), tensor.shape)
    except (TypeError, ValueError):
        rows = tensor.to_array()  # raises ValueError naming what does not fit
    return [rows[index] for index in range(min(positions, rows.shape[0]))]


@dataclass(frozen=True)
class Tolerance:
    """How far an output may stray from the reference's (contract §3): a residual value by
    ``absolute + relative·|reference|`` (both 0: bit for bit), a token only where a logit
    margin is below ``margin`` (a near tie)."""

    absolute: float
    relative: float = 0.0
    margin: float = 0.0

    @classmethod
    def of(cls, caps: EngineCapabilities) -> Tolerance:
        """The tolerance ``caps`` declares, its defaults filled in: an unset relative
        tolerance is the dtype's default (none when ``tolerance`` is 0: bit-exact), an
        unset margin tolerance the absolute one."""
        return cls(*caps.tolerances())

    @property
    def exact(self) -> bool:
        return self.absolute == 0.0 and self.relative == 0.0

    def allowed(self, expected: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """How far each value may differ from ``expected``'s, in float64."""
        with np.errstate(over="ignore", invalid="ignore"):
            allowed: np.ndarray[Any, Any] = self.absolute + self.relative * np.abs(expected.astype(np.float64))
        return allowed

    def text(self) -> str:
        """``0 (bit-exact)``, ``0.0001`` or ``0.01 + 0.016·|reference|``."""
        if self.exact:
            return "0 (bit-exact)"
        if not self.relative:
            return f"{self.absolute:.3g}"
        return f"{self.absolute:.3g} + {self.relative:.3g}·|reference|"


def payloads_agree(
    expected: Payload, observed: Payload, tolerance: Tolerance, *, near_ties_may_flip: bool = True
) -> bool:
    """Whether the two agree within ``tolerance`` (``payload_difference`` is None): the
    verdict without the words, which a step asks for many times (each path's answer)."""
    if isinstance(expected, tuple) and isinstance(observed, tuple):
        if expected[0] == observed[0]:
            return True
        margins = [margin for margin in (expected[1], observed[1]) if margin is not None]
        return near_ties_may_flip and bool(margins) and min(margins) < tolerance.margin
    if isinstance(expected, np.ndarray) and isinstance(observed, np.ndarray):
        if expected.shape != observed.shape:
            return False
        if tolerance.exact:
            return expected is observed or expected.tobytes() == observed.tobytes()
        excess = _excess(expected, observed, tolerance)
        return not excess.size or float(np.max(excess)) <= 0.0  # a NaN anywhere is no agreement: max is NaN
    return False


def payload_difference(
    expected: Payload, observed: Payload, tolerance: Tolerance, *, near_ties_may_flip: bool = True
) -> str | None:
    """None when the two agree within ``tolerance``; otherwise how they differ.

    A token may differ where a margin is below ``tolerance.margin`` (contract §3), unless
    ``near_ties_may_flip`` is False: to tell an injected wrong token from a near-tie."""
    if payloads_agree(expected, observed, tolerance, near_ties_may_flip=near_ties_may_flip):
        return None
    if isinstance(expected, tuple) and isinstance(observed, tuple):
        return f"token {observed[0]}, expected {expected[0]}"
    if isinstance(expected, np.ndarray) and isinstance(observed, np.ndarray):
        if expected.shape != observed.shape:
            return f"row of shape {observed.shape}, expected {expected.shape}"
        if tolerance.exact:
            return f"differs bit-wise: {largest_difference(expected, observed)}; tolerance 0 (bit-exact)"
        where = largest_difference(expected, observed, tolerance)
        return f"differs by more than the tolerance {tolerance.text()}: {where}"
    return f"{type(observed).__name__} where {type(expected).__name__} was expected"


def _excess(expected: np.ndarray[Any, Any], observed: np.ndarray[Any, Any], tolerance: Tolerance) -> np.ndarray[Any, Any]:
    """By how much each value's difference exceeds what ``tolerance`` allows there (NaN
    where one side is NaN, +inf where an infinity differs)."""
    with np.errstate(invalid="ignore", over="ignore"):
        excess: np.ndarray[Any, Any] = (
            np.abs(expected.astype(np.float64) - observed.astype(np.float64)) - tolerance.allowed(expected)
        )
    return excess


def largest_difference(
    expected: Payload,
    observed: Payload,
    tolerance: Tolerance | None = None,
) -> str:
    """``by 2.3e-06 at column 9 (0.006315 where 0.006313 was expected)``: where a row
    differs most (a NaN or an infinity on one side only counts as the largest), or for
    tokens ``token 5, expected 7``. With a ``tolerance`` that has a relative part, the
    place is where the difference exceeds what is allowed there most, and that allowance
    is named."""
    if not isinstance(expected, np.ndarray) or not isinstance(observed, np.ndarray):
        shown = [f"token {payload[0]}" if isinstance(payload, tuple) else "a row" for payload in (observed, expected)]
        return f"{shown[0]} where {shown[1]} was expected"
    relative = tolerance is not None and tolerance.relative > 0
    with np.errstate(invalid="ignore", over="ignore"):
        wide = np.abs(expected.astype(np.float64) - observed.astype(np.float64))
    one_sided_nan = np.isnan(wide) & (np.isnan(expected) != np.isnan(observed))
    ranking = _excess(expected, observed, tolerance) if relative and tolerance is not None else wide.copy()
    ranking[one_sided_nan] = np.inf
    ranking[np.isnan(ranking)] = -np.inf
    place = np.unravel_index(int(np.argmax(ranking)), ranking.shape)
    where = ", ".join(str(int(index)) for index in place)
    difference = np.inf if one_sided_nan[place] else wide[place]
    text = f"by {difference:.3g} at column {where} ({observed[place]:.7g} where {expected[place]:.7g} was expected"
    if relative and tolerance is not None:
        text += f"; {tolerance.allowed(expected[place]).item():.3g} allowed there"
    return text + ")"


def max_abs_difference(expected: np.ndarray[Any, Any], observed: np.ndarray[Any, Any]) -> float:
    """The largest absolute difference of two arrays' values, in float64 (0.0 when empty)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.max(np.abs(expected.astype(np.float64) - observed.astype(np.float64)), initial=0.0))


class MemoStore:
    """The twins' answers of one run, shared by its examples, by (scope, history): Hypothesis
    draws many examples that share their first steps, and a history answered in one need
    not be answered again in the next (in a run of the fake, 200 examples of 50 steps, 742
    of 4,244 recomputes were of histories not answered before). Bounded in bytes, oldest
    out first, so a long campaign or a large hidden size cannot make it grow without limit;
    a history dropped is answered again when it comes round.

    What makes sharing safe: the memo only ever speeds up a pass. A verdict of failure is
    never taken on a memo's word: before any output is judged wrong, every path answers that
    history again on engines loaded for it alone (``fresh_answers``), whatever the memo held."""

    MAX_BYTES: ClassVar[int] = 64 << 20

    def __init__(self) -> None:
        self._entries: dict[tuple[Hashable, tuple[int, ...]], dict[str, Payload]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[Hashable, tuple[int, ...]]) -> Mapping[str, Payload]:
        return self._entries.get(key, _NOTHING)

    def remember(self, key: tuple[Hashable, tuple[int, ...]], path: str, payload: Payload) -> None:
        with self._lock:
            paths = self._entries.get(key)
            if paths is None:
                paths = self._entries[key] = {}
                self._bytes += _key_bytes(key)
            if path not in paths:
                paths[path] = payload
                self._bytes += _payload_bytes(payload)
            self._evict()

    def replace(self, key: tuple[Hashable, tuple[int, ...]], answers: Mapping[str, Payload]) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= _key_bytes(key) + sum(map(_payload_bytes, old.values()))
            self._entries[key] = dict(answers)
            self._bytes += _key_bytes(key) + sum(map(_payload_bytes, answers.values()))
            self._evict()

    def items(self) -> list[tuple[tuple[Hashable, tuple[int, ...]], Mapping[str, Payload]]]:
        with self._lock:
            return list(self._entries.items())

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _evict(self) -> None:
        # The newest entry stays even alone over the bound: the step being judged reads it.
        while self._bytes > self.MAX_BYTES and len(self._entries) > 1:
            key = next(iter(self._entries))  # dicts keep insertion order
            self._bytes -= _key_bytes(key) + sum(map(_payload_bytes, self._entries.pop(key).values()))


_NOTHING: Mapping[str, Payload] = MappingProxyType({})


def _key_bytes(key: tuple[Hashable, tuple[int, ...]]) -> int:
    return 64 + 8 * len(key[1])


def _payload_bytes(payload: Payload) -> int:
    return 32 + (payload.nbytes if isinstance(payload, np.ndarray) else 16)


@dataclass
class HistoryMemo:
    """Reference payloads keyed by input history (token ids from the session epoch's
    first step), one per path of the twin oracle that computed it. Filled by twin
    engines, never by the engine under test, so a wrong output can only ever be
    compared against, not remembered. ``scope`` (the load request) keeps apart the
    answers of different layer ranges in a ``store`` shared by a run's examples."""

    store: MemoStore = field(default_factory=MemoStore)
    scope: Hashable = None

    def get(self, history: tuple[int, ...]) -> Mapping[str, Payload]:
        """Each path's payload for ``history`` (empty when none has answered for it)."""
        return self.store.get((self.scope, history))

    def remember(self, history: tuple[int, ...], path: str, payload: Payload) -> None:
        self.store.remember((self.scope, history), path, payload)

    def correct(self, history: tuple[int, ...], answers: Mapping[str, Payload]) -> None:
        """Take ``answers`` for ``history`` in place of what the twins had answered."""
        self.store.replace((self.scope, history), answers)

    @property
    def references(self) -> dict[tuple[int, ...], Mapping[str, Payload]]:
        """Every history of this scope the store holds, with its paths' payloads."""
        return {history: paths for (scope, history), paths in self.store.items() if scope == self.scope}


def metrics_text(metrics: MetricsResult) -> str:
    """The four counters as every message about metrics shows them."""
    return (
        f"prefill_calls={metrics.prefill_calls} decode_calls={metrics.decode_calls} "
        f"active_sessions={metrics.active_sessions} kv_tokens={metrics.kv_tokens}"
    )
