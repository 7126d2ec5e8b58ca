"""Contract v1: the vocabulary every shard engine and every shardkit tool share.

Value types are frozen dataclasses whose ``__post_init__`` checks types and
structure only. Ranges, lengths and vocabulary membership are deliberately
*not* checked here: judging them is the engine's job (contract §2 rule 2), and the
kit must be able to build a malformed request in order to send it.
"""

from __future__ import annotations

import abc
import enum
import math
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from shardkit._dtypes import numpy_dtype
from shardkit._public import settle

__all__ = [
    "ACCEPTED_BOUNDARY_POINTS",
    "DEFAULT_RELATIVE_TOLERANCES",
    "EPOCH_STEP_LIMIT",
    "FAULT_KINDS",
    "OUTPUT_BOUNDARY_POINT",
    "RESIDUAL_TENSOR",
    "BoundaryBundle",
    "CacheResult",
    "DecodeRequest",
    "EngineCapabilities",
    "EngineError",
    "EngineTensor",
    "Fault",
    "FaultInjectable",
    "FaultKind",
    "HealthResult",
    "LoadRequest",
    "LoadResult",
    "MetricsResult",
    "PrefillRequest",
    "Role",
    "ShardEngine",
    "StatusCode",
    "StepResult",
    "StructuredStatus",
    "TokenOutput",
    "role_of",
]

Role = Literal["head", "middle", "tail", "full"]
#: Every role, in the order the machine draws them.
ROLES: tuple[Role, ...] = ("full", "head", "tail", "middle")
FaultKind = Literal["delay", "memory_pressure", "malformed_output", "crash"]
FAULT_KINDS: tuple[FaultKind, ...] = ("delay", "memory_pressure", "malformed_output", "crash")
EVIDENCE_CLASSES = ("fixture", "real")

#: Epochs and steps live in ``[0, EPOCH_STEP_LIMIT)``.
EPOCH_STEP_LIMIT = 2**63
#: The one tensor a boundary bundle carries.
RESIDUAL_TENSOR = "residual"
#: The boundary point a role's output bundle is tagged with.
OUTPUT_BOUNDARY_POINT: Mapping[str, str] = types.MappingProxyType(
    {"head": "post_head_residual", "middle": "post_middle_residual"}
)
#: The boundary points a role accepts as input (only upstream ones).
ACCEPTED_BOUNDARY_POINTS: Mapping[str, frozenset[str]] = types.MappingProxyType(
    {
        "middle": frozenset({"post_head_residual"}),
        "tail": frozenset({"post_head_residual", "post_middle_residual"}),
    }
)


class StatusCode(enum.Enum):
    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    CANCELLED = "CANCELLED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNIMPLEMENTED = "UNIMPLEMENTED"


class CacheResult(enum.Enum):
    HIT = "HIT"
    MISS = "MISS"


# --- structural checks shared by the value types -------------------------------------


def _fail(owner: str, name: str, expected: str, value: object) -> TypeError:
    return TypeError(f"{owner}.{name} must be {expected}, got {value!r} ({type(value).__name__})")


def _check_int(owner: str, name: str, value: object) -> None:
    # bool is an int subclass, but True as an epoch is always a bug in the caller.
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise _fail(owner, name, "an int", value)


def _check_str(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str):
        raise _fail(owner, name, "a str", value)


def _check_type(owner: str, name: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise _fail(owner, name, f"{article} {cls.__name__}", value)


def _check_tolerance(owner: str, name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _fail(owner, name, "a float", value)
    if not (math.isfinite(value) and value >= 0):
        message = f"{owner}.{name} must be a finite float >= 0, got {value!r}"
        raise ValueError(message)


_JUST_INT = frozenset({int})


def _int_tuple(owner: str, name: str, value: object) -> tuple[int, ...]:
    """Accept any sequence of ints and freeze it, so equality is by value."""
    if type(value) is tuple and set(map(type, value)) <= _JUST_INT:
        return value  # the common case, checked at C speed: the kit builds several requests a step
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _fail(owner, name, "a tuple of ints", value)
    items = tuple(value)
    for index, item in enumerate(items):
        if not isinstance(item, (int, np.integer)) or isinstance(item, bool):
            raise _fail(owner, f"{name}[{index}]", "an int", item)
    return tuple(int(item) for item in items)


def _set(instance: object, name: str, value: object) -> None:
    object.__setattr__(instance, name, value)


# --- statuses and errors ---------------------------------------------------------------


@dataclass(frozen=True)
class StructuredStatus:
    code: StatusCode
    message: str = ""
    retryable: bool = False

    def __post_init__(self) -> None:
        _check_type("StructuredStatus", "code", self.code, StatusCode)
        _check_str("StructuredStatus", "message", self.message)
        _check_type("StructuredStatus", "retryable", self.retryable, bool)

    @property
    def ok(self) -> bool:
        return self.code is StatusCode.OK


class EngineError(Exception):
    """Raised only by ``load``/``capabilities`` misuse; carries a structured status."""

    def __init__(self, status: StructuredStatus) -> None:
        _check_type("EngineError", "status", status, StructuredStatus)
        super().__init__(f"{status.code.name}: {status.message}")
        self.status = status


# --- loading and capabilities ----------------------------------------------------------


@dataclass(frozen=True)
class LoadRequest:
    model_id: str
    shard_start: int
    shard_end: int
    total_layers: int
    recipe: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_str("LoadRequest", "model_id", self.model_id)
        for name in ("shard_start", "shard_end", "total_layers"):
            _check_int("LoadRequest", name, getattr(self, name))
        if not isinstance(self.recipe, Mapping):
            raise _fail("LoadRequest", "recipe", "a mapping", self.recipe)
        if not 0 <= self.shard_start <= self.shard_end < self.total_layers:
            message = (
                "LoadRequest needs 0 <= shard_start <= shard_end < total_layers, got "
                f"shard_start={self.shard_start}, shard_end={self.shard_end}, "
                f"total_layers={self.total_layers}"
            )
            raise ValueError(message)
        # A read-only copy: the request is a value, and a caller mutating its
        # dict afterwards must not change what was loaded.
        _set(self, "recipe", types.MappingProxyType(dict(self.recipe)))

    @property
    def role(self) -> Role:
        return role_of(self.shard_start, self.shard_end, self.total_layers)


def role_of(shard_start: int, shard_end: int, total_layers: int) -> Role:
    """The contract (§1): full covers every layer, head starts at 0, tail ends at the last."""
    covers_first = shard_start == 0
    covers_last = shard_end == total_layers - 1
    if covers_first and covers_last:
        return "full"
    if covers_first:
        return "head"
    if covers_last:
        return "tail"
    return "middle"


@dataclass(frozen=True)
class LoadResult:
    status: StructuredStatus
    architecture: str

    def __post_init__(self) -> None:
        _check_type("LoadResult", "status", self.status, StructuredStatus)
        _check_str("LoadResult", "architecture", self.architecture)


#: The relative tolerance an engine that declares an absolute ``tolerance`` above 0 gets
#: for its dtype unless it declares its own: float32, float16 and bfloat16 take
#: ``torch.testing.assert_close``'s defaults (about eleven, one and two units in the last
#: place), float64 about 450 units, a float8 format its epsilon. A dtype not listed gets 0.0:
#: only the absolute tolerance. docs/numerics.md shows what the bundled engines measure.
DEFAULT_RELATIVE_TOLERANCES: Mapping[str, float] = types.MappingProxyType(
    {
        "float64": 1e-7,
        "float32": 1.3e-6,
        "float16": 1e-3,
        "bfloat16": 1.6e-2,
        "float8_e4m3fn": 0.125,
        "float8_e5m2": 0.25,
    }
)


@dataclass(frozen=True)
class EngineCapabilities:
    architecture: str
    evidence_class: Literal["fixture", "real"]
    total_layers: int
    shard_start: int
    shard_end: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_sessions: int
    max_kv_tokens: int
    supported_faults: frozenset[str]
    tolerance: float
    #: The engine may be called from several threads at once (each call still whole: the
    #: answers must be those of some order of the calls). ``--concurrency`` needs it.
    concurrent_calls: bool = False
    #: A residual value may differ from the reference's by ``tolerance +
    #: relative_tolerance·|reference|``. None: ``DEFAULT_RELATIVE_TOLERANCES[dtype]`` when
    #: ``tolerance`` is above 0, else 0.0 (``tolerance`` 0.0 is bit-exact, whatever the dtype).
    relative_tolerance: float | None = None
    #: A token may differ from the reference's where the engine's logit margin is below it:
    #: a near tie on the logits' scale, which is not the residual's. None: ``tolerance``.
    margin_tolerance: float | None = None

    def __post_init__(self) -> None:
        owner = "EngineCapabilities"
        _check_str(owner, "architecture", self.architecture)
        if self.evidence_class not in EVIDENCE_CLASSES:
            message = f"{owner}.evidence_class must be 'fixture' or 'real', got {self.evidence_class!r}"
            raise ValueError(message)
        for name in (
            "total_layers",
            "shard_start",
            "shard_end",
            "hidden_size",
            "vocab_size",
            "max_sessions",
            "max_kv_tokens",
        ):
            _check_int(owner, name, getattr(self, name))
        _check_str(owner, "dtype", self.dtype)
        if isinstance(self.supported_faults, (str, bytes)) or not isinstance(
            self.supported_faults, (set, frozenset, tuple, list)
        ):
            raise _fail(owner, "supported_faults", "a frozenset of fault kinds", self.supported_faults)
        faults = frozenset(self.supported_faults)
        unknown = sorted(str(kind) for kind in faults - set(FAULT_KINDS))
        if unknown:
            message = f"{owner}.supported_faults has unknown kinds {unknown}; known: {list(FAULT_KINDS)}"
            raise ValueError(message)
        _set(self, "supported_faults", faults)
        _check_tolerance(owner, "tolerance", self.tolerance)
        _check_type(owner, "concurrent_calls", self.concurrent_calls, bool)
        _set(self, "tolerance", float(self.tolerance))
        # Unset stays None (resolved where outputs are compared), so that a replace() of
        # ``tolerance`` moves the defaults that follow it.
        for name in ("relative_tolerance", "margin_tolerance"):
            value = getattr(self, name)
            if value is not None:
                _check_tolerance(owner, name, value)
                _set(self, name, float(value))
        if self.tolerance == 0 and self.relative_tolerance:
            message = (
                f"{owner}.relative_tolerance is {self.relative_tolerance!r} with tolerance 0.0, which means "
                "bit-exact; declare an absolute tolerance above 0 with it, or leave relative_tolerance out"
            )
            raise ValueError(message)

    @property
    def role(self) -> Role:
        return role_of(self.shard_start, self.shard_end, self.total_layers)

    def tolerances(self) -> tuple[float, float, float]:
        """(absolute, relative, margin) tolerances with the defaults filled in: an unset
        relative tolerance is ``DEFAULT_RELATIVE_TOLERANCES[dtype]`` (0.0 when ``tolerance``
        is 0.0: bit-exact), an unset margin tolerance is ``tolerance``."""
        relative = self.relative_tolerance
        if relative is None:
            relative = DEFAULT_RELATIVE_TOLERANCES.get(self.dtype, 0.0) if self.tolerance > 0 else 0.0
        margin = self.tolerance if self.margin_tolerance is None else self.margin_tolerance
        return self.tolerance, relative, margin


# --- tensors and step inputs/outputs ---------------------------------------------------


@dataclass(frozen=True)
class EngineTensor:
    """An array as little-endian, C-order bytes, with its numpy dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        _check_str("EngineTensor", "name", self.name)
        _check_str("EngineTensor", "dtype", self.dtype)
        shape = _int_tuple("EngineTensor", "shape", self.shape)
        if shape and min(shape) < 0:
            message = f"EngineTensor.shape must not hold negative extents, got {shape!r}"
            raise ValueError(message)
        _set(self, "shape", shape)
        if isinstance(self.data, (bytearray, memoryview)):
            _set(self, "data", bytes(self.data))
        _check_type("EngineTensor", "data", self.data, bytes)

    @classmethod
    def from_array(cls, name: str, array: npt.ArrayLike) -> EngineTensor:
        values = np.asarray(array)
        little = values.astype(values.dtype.newbyteorder("<"), copy=False)
        return cls(
            name=name,
            dtype=values.dtype.name,
            shape=tuple(int(extent) for extent in values.shape),
            data=np.ascontiguousarray(little).tobytes(order="C"),
        )

    def to_array(self) -> npt.NDArray[Any]:
        """A fresh native array; raises ValueError if dtype or data length do not fit."""
        try:
            dtype = numpy_dtype(self.dtype).newbyteorder("<")
        except TypeError as error:
            message = f"EngineTensor {self.name!r} has dtype {self.dtype!r}, which numpy does not know"
            raise ValueError(message) from error
        expected = math.prod(self.shape) * dtype.itemsize
        if len(self.data) != expected:
            message = (
                f"EngineTensor {self.name!r} holds {len(self.data)} bytes, but shape {self.shape} "
                f"of {self.dtype} needs {expected}"
            )
            raise ValueError(message)
        values = np.frombuffer(self.data, dtype=dtype).reshape(self.shape)
        return values.astype(values.dtype.newbyteorder("="), copy=True)


@dataclass(frozen=True)
class BoundaryBundle:
    session_id: str
    epoch: int
    step: int
    boundary_point: str
    architecture: str
    tensors: tuple[EngineTensor, ...]
    token_id_sideband: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        owner = "BoundaryBundle"
        _check_str(owner, "session_id", self.session_id)
        _check_int(owner, "epoch", self.epoch)
        _check_int(owner, "step", self.step)
        _check_str(owner, "boundary_point", self.boundary_point)
        _check_str(owner, "architecture", self.architecture)
        if not isinstance(self.tensors, Sequence) or isinstance(self.tensors, (str, bytes)):
            raise _fail(owner, "tensors", "a tuple of EngineTensor", self.tensors)
        tensors = tuple(self.tensors)
        if not all(type(tensor) is EngineTensor for tensor in tensors):
            for index, tensor in enumerate(tensors):
                _check_type(owner, f"tensors[{index}]", tensor, EngineTensor)
        _set(self, "tensors", tensors)
        if self.token_id_sideband is not None:
            _set(self, "token_id_sideband", _int_tuple(owner, "token_id_sideband", self.token_id_sideband))


@dataclass(frozen=True)
class TokenOutput:
    token_id: int
    margin: float | None = None

    def __post_init__(self) -> None:
        _check_int("TokenOutput", "token_id", self.token_id)
        if self.margin is not None:
            if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool):
                raise _fail("TokenOutput", "margin", "a float or None", self.margin)
            _set(self, "margin", float(self.margin))


def _check_step_request(owner: str, request: _StepRequestFields) -> None:
    _check_str(owner, "session_id", request.session_id)
    _check_int(owner, "epoch", request.epoch)
    _check_int(owner, "step", request.step)
    if (request.token_ids is None) == (request.bundle is None):
        given = "both" if request.token_ids is not None else "neither"
        message = f"{owner} needs exactly one of token_ids and bundle, got {given}"
        raise ValueError(message)
    if request.token_ids is not None:
        _set(request, "token_ids", _int_tuple(owner, "token_ids", request.token_ids))
    else:
        _check_type(owner, "bundle", request.bundle, BoundaryBundle)


@dataclass(frozen=True)
class _StepRequestFields:
    """The fields prefill and decode share; each stays its own type, so a prefill is
    never equal to a decode with the same fields (a retry must repeat the operation)."""

    session_id: str
    epoch: int
    step: int
    token_ids: tuple[int, ...] | None = None
    bundle: BoundaryBundle | None = None

    def __post_init__(self) -> None:
        _check_step_request(type(self).__name__, self)


@dataclass(frozen=True)
class PrefillRequest(_StepRequestFields):
    """A chunk of one or more tokens (or bundle rows) for a session's next step."""


@dataclass(frozen=True)
class DecodeRequest(_StepRequestFields):
    """Exactly one token (or bundle row) for a session's next step."""


@dataclass(frozen=True)
class StepResult:
    """``output`` is None unless the status is OK; the kit checks that, not the type,
    so that an engine breaking the rule is reported rather than crashing."""

    status: StructuredStatus
    cache: CacheResult
    output: BoundaryBundle | TokenOutput | None = None

    def __post_init__(self) -> None:
        _check_type("StepResult", "status", self.status, StructuredStatus)
        _check_type("StepResult", "cache", self.cache, CacheResult)
        if self.output is not None and not isinstance(self.output, (BoundaryBundle, TokenOutput)):
            raise _fail("StepResult", "output", "a BoundaryBundle, a TokenOutput or None", self.output)


@dataclass(frozen=True)
class HealthResult:
    status: StructuredStatus
    serving: bool

    def __post_init__(self) -> None:
        _check_type("HealthResult", "status", self.status, StructuredStatus)
        _check_type("HealthResult", "serving", self.serving, bool)


@dataclass(frozen=True)
class MetricsResult:
    """The engine's counters (contract §2 metrics): ``prefill_calls`` and ``decode_calls``
    count every call received, refused ones and idempotent retries included (a retry
    changes nothing else, but it is a call); ``active_sessions`` the sessions holding a
    slot, cancelled ones included; ``kv_tokens`` the tokens cached over all sessions."""

    prefill_calls: int
    decode_calls: int
    active_sessions: int
    kv_tokens: int

    def __post_init__(self) -> None:
        for name in ("prefill_calls", "decode_calls", "active_sessions", "kv_tokens"):
            _check_int("MetricsResult", name, getattr(self, name))


# --- faults ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """``value``: seconds for delay, a token limit for memory_pressure, unused for
    malformed_output, and for crash the count of calls until the one that dies."""

    kind: FaultKind
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            message = f"Fault.kind must be one of {list(FAULT_KINDS)}, got {self.kind!r}"
            raise ValueError(message)
        if not isinstance(self.value, (int, float)) or isinstance(self.value, bool):
            raise _fail("Fault", "value", "a float", self.value)
        if not math.isfinite(self.value):
            message = f"Fault.value must be finite, got {self.value!r}"
            raise ValueError(message)
        _set(self, "value", float(self.value))


@runtime_checkable
class FaultInjectable(Protocol):
    def inject_fault(self, fault: Fault) -> StructuredStatus:
        """Arm ``fault``; ``UNIMPLEMENTED`` for a kind not in ``supported_faults``."""
        ...


# --- the engine interface --------------------------------------------------------------


class ShardEngine(abc.ABC):
    """One process serving a contiguous layer range, with a KV cache per session.

    Every operation but ``load`` and ``capabilities`` reports problems as a status,
    never by raising: an exception out of an engine is treated as a process death.
    """

    @abc.abstractmethod
    def load(self, request: LoadRequest) -> LoadResult: ...

    @abc.abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    @abc.abstractmethod
    def prefill(self, request: PrefillRequest) -> StepResult: ...

    @abc.abstractmethod
    def decode(self, request: DecodeRequest) -> StepResult: ...

    @abc.abstractmethod
    def cancel(self, session_id: str, epoch: int) -> StructuredStatus: ...

    @abc.abstractmethod
    def release(self, session_id: str) -> StructuredStatus: ...

    @abc.abstractmethod
    def health(self) -> HealthResult: ...

    @abc.abstractmethod
    def metrics(self) -> MetricsResult: ...


settle(__name__, globals())
