"""A deterministic fixture engine: SPEC §2 lifecycle exactly, SPEC §3 numerics by construction.

The numbers come from hashing rather than arithmetic. Each layer keeps, per session
epoch, a running sha256 digest over every row it has consumed (that digest chain is the
"KV cache"), and emits a row derived from the digest. A row therefore depends on exactly
the rows before it, however the history was chunked, and a head/middle/tail split hashes
the same bytes as the whole model, so composition holds bit for bit. Nothing else (session
id, epoch number, call counts, other sessions, sidebands) enters a hash.
"""

from __future__ import annotations

import array
import hashlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from shardkit.contract import (
    ACCEPTED_BOUNDARY_POINTS,
    EPOCH_STEP_LIMIT,
    FAULT_KINDS,
    OUTPUT_BOUNDARY_POINT,
    RESIDUAL_TENSOR,
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    EngineTensor,
    Fault,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    Role,
    ShardEngine,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)

__all__ = ["FakeEngineCrash", "FakeShardEngine", "FakeShardEngineConfig"]

_FLOAT32 = np.dtype("<f4")
_BIG_ENDIAN = sys.byteorder == "big"
_TWO_TO_MINUS_15 = 2.0**-15
_OK = StructuredStatus(StatusCode.OK)
_StepRequest = PrefillRequest | DecodeRequest


class FakeEngineCrash(RuntimeError):
    """The fake's simulated process death; the engine adds a note naming the dying call."""

    def __init__(self, message: str = "FakeShardEngine process died (simulated crash)") -> None:
        super().__init__(message)


@dataclass(frozen=True)
class FakeShardEngineConfig:
    """Sizes and budgets (SPEC §1 fixes the defaults) plus fault knobs, all off by default."""

    total_layers: int = 4
    hidden_size: int = 8
    vocab_size: int = 32
    max_sessions: int = 4
    max_kv_tokens: int = 64
    dtype: str = "float32"
    architecture: str = "shardkit-fake"
    step_delay_seconds: float = 0.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    malformed_output: bool = False
    crash_after_calls: int | None = None
    crash_exception_factory: Callable[[], BaseException] = field(default=FakeEngineCrash, compare=False)

    def __post_init__(self) -> None:
        delay, crash = self.step_delay_seconds, self.crash_after_calls
        checks = [
            ("dtype", self.dtype == "float32", "'float32' (the only dtype the fake computes in)"),
            ("total_layers", _is_int_at_least(self.total_layers, 1), "an int >= 1"),
            ("hidden_size", _is_int_at_least(self.hidden_size, 1), "an int >= 1"),
            ("vocab_size", _is_int_at_least(self.vocab_size, 1), "an int >= 1"),
            ("max_sessions", _is_int_at_least(self.max_sessions, 1), "an int >= 1"),
            ("max_kv_tokens", _is_int_at_least(self.max_kv_tokens, 0), "an int >= 0"),
            ("step_delay_seconds", math.isfinite(delay) and delay >= 0, "a finite number of seconds >= 0"),
            ("crash_after_calls", crash is None or _is_int_at_least(crash, 1), "a positive int or None"),
        ]
        for name, valid, expected in checks:
            if not valid:
                message = f"FakeShardEngineConfig.{name} must be {expected}, got {getattr(self, name)!r}"
                raise ValueError(message)


def _is_int_at_least(value: object, minimum: int) -> bool:
    # bool is an int subclass, but True as a budget is always a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# --- numerics: a hash "transformer" ------------------------------------------------------


def _u64(number: int) -> bytes:
    return number.to_bytes(8, "little")


def _unit_floats(material: bytes, count: int) -> npt.NDArray[np.float32]:
    """``count`` float32 values in [-1, 1): multiples of 2**-15, so finite and exact."""
    words = np.frombuffer(hashlib.shake_256(material).digest(2 * count), dtype="<u2")
    return (words.astype(np.float32) / np.float32(32768) - np.float32(1)).astype(_FLOAT32)


def _unit_float_bytes(material: bytes, count: int) -> bytes:
    """``_unit_floats(material, count).tobytes()`` without numpy: rows are hashed once
    per layer per token, and for a handful of values the array module is faster.
    Bit-identical: ``w / 2**15 - 1`` is exact in float64 and representable in float32."""
    words = array.array("H", hashlib.shake_256(material).digest(2 * count))
    if _BIG_ENDIAN:
        words.byteswap()
    values = array.array("f", [word * _TWO_TO_MINUS_15 - 1.0 for word in words])
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


@dataclass(frozen=True)
class _Loaded:
    seed: bytes
    layers: range
    role: Role
    architecture: str

    def fresh_chains(self) -> list[bytes]:
        return [hashlib.sha256(self.seed + b"chain" + _u64(layer)).digest() for layer in self.layers]

    def embed(self, token_id: int, hidden_size: int) -> bytes:
        return _unit_float_bytes(self.seed + b"embed" + _u64(token_id), hidden_size)

    def run_layers(self, chains: list[bytes], rows: list[bytes], hidden_size: int) -> list[bytes]:
        """Push ``rows`` through the shard's layers in order, advancing ``chains`` in place."""
        outputs = []
        for row in rows:
            for index, layer in enumerate(self.layers):
                chains[index] = hashlib.sha256(chains[index] + _u64(layer) + row).digest()
                row = _unit_float_bytes(b"layer" + _u64(layer) + chains[index], hidden_size)
            outputs.append(row)
        return outputs


def _predict_token(final_row: bytes, vocab_size: int) -> TokenOutput:
    logits = _unit_floats(b"lm_head" + final_row, vocab_size)
    top_two = np.sort(logits)[-2:]
    margin = float(top_two[-1] - top_two[0]) if vocab_size > 1 else None
    return TokenOutput(token_id=int(np.argmax(logits)), margin=margin)


@dataclass
class _Session:
    """One session's current epoch: its step counter, cache and last accepted request."""

    epoch: int
    next_step: int
    chains: list[bytes]
    kv_tokens: int
    last_request: _StepRequest
    last_result: StepResult
    cancelled: bool = False


def _refusal(code: StatusCode, message: str, *, retryable: bool = False) -> StepResult:
    return StepResult(StructuredStatus(code, message, retryable), CacheResult.MISS)


def _unloaded(operation: str) -> StructuredStatus:
    return StructuredStatus(StatusCode.UNAVAILABLE, f"{operation} before load; call load() first")


def _identity_problem(session_id: str, **counters: int) -> str | None:
    """Rule 2's checks on the ids every step and cancel carry."""
    if not session_id:
        return "session_id is empty; pass a non-empty session id"
    for name, value in counters.items():
        if not 0 <= value < EPOCH_STEP_LIMIT:
            return f"{name}={value} is outside [0, 2**63); pass a value in that range"
    return None


def _semantically_wrong(output: BoundaryBundle | TokenOutput, vocab_size: int) -> BoundaryBundle | TokenOutput:
    """The ``malformed_output`` fault: valid shape, range and tags, wrong value; only an oracle can tell."""
    if isinstance(output, TokenOutput):
        token = output.token_id
        return replace(output, token_id=(token + 1) % vocab_size if token < vocab_size else token + 1)
    residual = output.tensors[0]
    # The fake's values lie in [-1, 1), so the shift stays finite and changes every value.
    shifted = (np.frombuffer(residual.data, dtype=_FLOAT32) + np.float32(0.5)).astype(_FLOAT32)
    return replace(output, tensors=(replace(residual, data=shifted.tobytes()),))


def _structurally_broken(output: BoundaryBundle | TokenOutput, vocab_size: int) -> BoundaryBundle | TokenOutput:
    """The ``malformed_output`` knob: an output that shape and range checks alone reject."""
    if isinstance(output, TokenOutput):
        return replace(output, token_id=vocab_size + output.token_id)
    residual = output.tensors[0]
    truncated = replace(residual, data=residual.data[: -_FLOAT32.itemsize])
    return replace(output, architecture=output.architecture + "-malformed", tensors=(truncated,))


class FakeShardEngine(ShardEngine):
    """A deterministic ``ShardEngine`` with native support for every SPEC §4 fault."""

    EVIDENCE_CLASS: ClassVar[Literal["fixture"]] = "fixture"

    def __init__(self, config: FakeShardEngineConfig | None = None) -> None:
        self._config = config if config is not None else FakeShardEngineConfig()
        self._loaded: _Loaded | None = None
        self._sessions: dict[str, _Session] = {}
        self._max_kv_tokens = self._config.max_kv_tokens
        self._prefill_calls = 0
        self._decode_calls = 0
        # Calls to prefill/decode/cancel/release since construction, for scheduled crashes.
        self._counted_calls = 0
        self._crash_at_call = self._config.crash_after_calls
        self._death: str | None = None
        self._pending_delay = 0.0
        self._corrupt_next_output = False

    # --- process death -------------------------------------------------------------------

    def _check_alive(self, operation: str, *, counted: bool = False) -> None:
        """Raise as a dead process would; a counted call may be the scheduled one that dies."""
        if counted and self._death is None:
            self._counted_calls += 1
            if self._crash_at_call is not None and self._counted_calls >= self._crash_at_call:
                self._death = f"{operation}() (call #{self._counted_calls})"
        if self._death is not None:
            error = self._config.crash_exception_factory()
            # A zero-argument factory cannot know which call died, so the engine says so.
            error.add_note(f"FakeShardEngine.{operation}() raised: the process died in {self._death}")
            raise error

    # --- loading ---------------------------------------------------------------------------

    def load(self, request: LoadRequest) -> LoadResult:
        self._check_alive("load")
        if self._loaded is not None:
            served = f"{self._loaded.layers.start}..{self._loaded.layers.stop - 1}"
            message = f"FakeShardEngine already serves layers {served}; construct a fresh engine to load another"
            raise EngineError(StructuredStatus(StatusCode.FAILED_PRECONDITION, message))
        layers = self._config.total_layers
        if request.total_layers != layers:
            message = f"LoadRequest.total_layers={request.total_layers}, but the model has {layers}; pass {layers}"
            raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, message))
        architecture = request.recipe.get("architecture", self._config.architecture)
        if not isinstance(architecture, str):
            message = f"LoadRequest.recipe['architecture'] must be a str, got {architecture!r}"
            raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, message))
        seed = hashlib.sha256(request.model_id.encode("utf-8", "surrogatepass")).digest()
        span = range(request.shard_start, request.shard_end + 1)
        self._loaded = _Loaded(seed, span, request.role, architecture)
        return LoadResult(_OK, architecture)

    def capabilities(self) -> EngineCapabilities:
        self._check_alive("capabilities")
        span = self._loaded.layers if self._loaded else range(self._config.total_layers)
        return EngineCapabilities(
            architecture=self._loaded.architecture if self._loaded else self._config.architecture,
            evidence_class=self.EVIDENCE_CLASS,
            total_layers=self._config.total_layers,
            shard_start=span.start,
            shard_end=span.stop - 1,
            hidden_size=self._config.hidden_size,
            vocab_size=self._config.vocab_size,
            dtype=self._config.dtype,
            max_sessions=self._config.max_sessions,
            max_kv_tokens=self._max_kv_tokens,
            supported_faults=frozenset(FAULT_KINDS),
            tolerance=0.0,
        )

    # --- steps -------------------------------------------------------------------------------

    def prefill(self, request: PrefillRequest) -> StepResult:
        self._check_alive("prefill", counted=True)
        self._prefill_calls += 1
        return self._step(request, "prefill")

    def decode(self, request: DecodeRequest) -> StepResult:
        self._check_alive("decode", counted=True)
        self._decode_calls += 1
        return self._step(request, "decode")

    def _step(self, request: _StepRequest, operation: str) -> StepResult:
        """SPEC §2 rules 1-8, in order; the first rule that applies decides."""
        delay, self._pending_delay = self._config.step_delay_seconds + self._pending_delay, 0.0
        if delay > 0:
            self._config.sleep(delay)
        loaded = self._loaded
        if loaded is None:
            return StepResult(_unloaded(operation), CacheResult.MISS)
        problem = self._input_problem(request, operation, loaded)
        if problem is not None:
            return _refusal(StatusCode.INVALID_ARGUMENT, f"{operation}: {problem}")
        where = f"{operation} of session {request.session_id!r} epoch {request.epoch} step {request.step}"
        session = self._sessions.get(request.session_id)
        starts_epoch = isinstance(request, PrefillRequest) and request.step == 0
        if session is None or request.epoch > session.epoch:
            if starts_epoch:
                return self._advance(request, loaded, session, where)
            # An unknown id and a higher epoch alike name an epoch this engine never opened.
            unknown = session is None and isinstance(request, PrefillRequest)
            code = StatusCode.FAILED_PRECONDITION if unknown else StatusCode.NOT_FOUND
            return _refusal(code, f"{where}: no such session epoch; open one with prefill step 0")
        if request.epoch < session.epoch:
            return _refusal(StatusCode.ABORTED, f"{where}: stale epoch, the session is at epoch {session.epoch}")
        if session.cancelled:
            return _refusal(StatusCode.CANCELLED, f"{where}: cancelled; release it or restart at a higher epoch")
        if request.step == session.next_step - 1 and request == session.last_request:
            return self._deliver(session.last_result)
        if request.step != session.next_step:
            message = f"{where}: expected step {session.next_step} or an identical retry of the last step"
            return _refusal(StatusCode.FAILED_PRECONDITION, message)
        return self._advance(request, loaded, session, where)

    def _advance(self, request: _StepRequest, loaded: _Loaded, session: _Session | None, where: str) -> StepResult:
        """Rules 7-8 for a step that proceeds; ``session`` holds the id's slot, if any."""
        continues = session is not None and session.epoch == request.epoch
        rows = self._input_rows(request, loaded)
        if session is None and len(self._sessions) >= self._config.max_sessions:
            message = f"{where}: all {self._config.max_sessions} session slots are taken; release one and retry"
            return _refusal(StatusCode.RESOURCE_EXHAUSTED, message, retryable=True)
        # A restart gives back its old epoch's tokens, but only if it is admitted.
        used = self._kv_tokens_used() - (session.kv_tokens if session is not None and not continues else 0)
        if used + len(rows) > self._max_kv_tokens:
            message = (
                f"{where}: caching {len(rows)} more tokens on top of {used} would exceed "
                f"max_kv_tokens={self._max_kv_tokens}; release or cancel a session and retry"
            )
            return _refusal(StatusCode.RESOURCE_EXHAUSTED, message, retryable=True)
        chains = list(session.chains) if session is not None and continues else loaded.fresh_chains()
        output = self._output(request, loaded, loaded.run_layers(chains, rows, self._config.hidden_size))
        if self._config.malformed_output:
            output = _structurally_broken(output, self._config.vocab_size)
        # A retry of this step must return exactly what this call returns, corruption included.
        result = self._deliver(StepResult(_OK, CacheResult.HIT if continues else CacheResult.MISS, output))
        if session is not None and continues:
            session.next_step += 1
            session.chains, session.kv_tokens = chains, session.kv_tokens + len(rows)
            session.last_request, session.last_result = request, result
        else:
            self._sessions[request.session_id] = _Session(request.epoch, 1, chains, len(rows), request, result)
        return result

    def _input_problem(self, request: _StepRequest, operation: str, loaded: _Loaded) -> str | None:
        """Why rule 2 refuses ``request``, or None if its input is well formed."""
        problem = _identity_problem(request.session_id, epoch=request.epoch, step=request.step)
        if problem is not None:
            return problem
        role = loaded.role
        if role in ("head", "full"):
            if request.token_ids is None:
                return f"a {role} shard takes token_ids, got a bundle; send token_ids"
            row_count = len(request.token_ids)
        else:
            if request.bundle is None:
                return f"a {role} shard takes a bundle, got token_ids; send the upstream shard's bundle"
            problem = self._bundle_problem(request, request.bundle, loaded)
            if problem is not None:
                return problem
            row_count = request.bundle.tensors[0].shape[0]
        if row_count == 0:
            return "the input is empty; send at least one token"
        if operation == "decode" and row_count != 1:
            return f"a decode takes exactly one token, got {row_count}; send more with prefill"
        vocab = self._config.vocab_size
        outside = [token for token in request.token_ids or () if not 0 <= token < vocab]
        if outside:
            return f"token ids {outside} are outside the vocabulary [0, {vocab})"
        return None

    def _bundle_problem(self, request: _StepRequest, bundle: BoundaryBundle, loaded: _Loaded) -> str | None:
        for name in ("session_id", "epoch", "step"):
            if getattr(bundle, name) != getattr(request, name):
                mine, theirs = getattr(bundle, name), getattr(request, name)
                return f"bundle.{name}={mine!r} differs from the request's {theirs!r}; they must match"
        if bundle.architecture != loaded.architecture:
            return f"bundle.architecture={bundle.architecture!r}, but this engine serves {loaded.architecture!r}"
        accepted = sorted(ACCEPTED_BOUNDARY_POINTS[loaded.role])
        if bundle.boundary_point not in accepted:
            return f"a {loaded.role} shard takes boundary points {accepted}, got {bundle.boundary_point!r}"
        names = [tensor.name for tensor in bundle.tensors]
        if names != [RESIDUAL_TENSOR]:
            return f"a bundle must hold exactly one tensor named {RESIDUAL_TENSOR!r}, got {names}"
        tensor, hidden = bundle.tensors[0], self._config.hidden_size
        if tensor.dtype != self._config.dtype:
            return f"the residual's dtype must be {self._config.dtype!r}, got {tensor.dtype!r}"
        if len(tensor.shape) != 2 or tensor.shape[1] != hidden:
            return f"the residual's shape must be (rows, {hidden}), got {tensor.shape}"
        expected_bytes = tensor.shape[0] * hidden * _FLOAT32.itemsize
        if len(tensor.data) != expected_bytes:
            return f"the residual holds {len(tensor.data)} bytes, but shape {tensor.shape} needs {expected_bytes}"
        sideband = bundle.token_id_sideband
        if sideband is not None and len(sideband) != tensor.shape[0]:
            return f"the sideband holds {len(sideband)} ids for {tensor.shape[0]} rows; send one id per row"
        if not np.isfinite(np.frombuffer(tensor.data, dtype=_FLOAT32)).all():
            return "the residual holds a non-finite value (nan or inf)"
        return None

    def _input_rows(self, request: _StepRequest, loaded: _Loaded) -> list[bytes]:
        hidden = self._config.hidden_size
        if request.bundle is None:
            return [loaded.embed(token, hidden) for token in request.token_ids or ()]
        data, width = request.bundle.tensors[0].data, hidden * _FLOAT32.itemsize
        return [data[offset : offset + width] for offset in range(0, len(data), width)]

    def _output(self, request: _StepRequest, loaded: _Loaded, final_rows: list[bytes]) -> BoundaryBundle | TokenOutput:
        if loaded.role in ("tail", "full"):
            return _predict_token(final_rows[-1], self._config.vocab_size)
        # A head's sideband is its input ids; a middle passes its input sideband through.
        sideband = request.bundle.token_id_sideband if request.bundle is not None else request.token_ids
        shape = (len(final_rows), self._config.hidden_size)
        residual = EngineTensor(RESIDUAL_TENSOR, self._config.dtype, shape, b"".join(final_rows))
        point = OUTPUT_BOUNDARY_POINT[loaded.role]
        ids = (request.session_id, request.epoch, request.step)
        return BoundaryBundle(*ids, point, loaded.architecture, (residual,), sideband)

    def _deliver(self, result: StepResult) -> StepResult:
        """Hand out an OK result, spending an armed malformed_output fault on it."""
        if not self._corrupt_next_output:
            return result
        self._corrupt_next_output = False
        assert result.output is not None  # only OK results are delivered
        return replace(result, output=_semantically_wrong(result.output, self._config.vocab_size))

    # --- session control -------------------------------------------------------------------

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._check_alive("cancel", counted=True)
        if self._loaded is None:
            return _unloaded("cancel")
        where = f"cancel of session {session_id!r} epoch {epoch}"
        problem = _identity_problem(session_id, epoch=epoch)
        if problem is not None:
            return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")
        session = self._sessions.get(session_id)
        if session is None:
            return StructuredStatus(StatusCode.NOT_FOUND, f"{where}: unknown session")
        if epoch < session.epoch:
            return StructuredStatus(StatusCode.ABORTED, f"{where}: stale epoch, the session is at {session.epoch}")
        if epoch > session.epoch:
            return StructuredStatus(StatusCode.NOT_FOUND, f"{where}: the session is at epoch {session.epoch}")
        session.cancelled, session.kv_tokens, session.chains = True, 0, []
        return _OK

    def release(self, session_id: str) -> StructuredStatus:
        self._check_alive("release", counted=True)
        if self._loaded is None:
            return _unloaded("release")
        self._sessions.pop(session_id, None)
        return _OK

    def health(self) -> HealthResult:
        self._check_alive("health")
        return HealthResult(_OK, serving=self._loaded is not None)

    def metrics(self) -> MetricsResult:
        self._check_alive("metrics")
        # A cancelled session keeps its slot (SPEC §2), so it still counts as active.
        return MetricsResult(self._prefill_calls, self._decode_calls, len(self._sessions), self._kv_tokens_used())

    def _kv_tokens_used(self) -> int:
        return sum(session.kv_tokens for session in self._sessions.values())

    # --- faults ------------------------------------------------------------------------------

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        """Arm ``fault`` natively (SPEC §4); INVALID_ARGUMENT for a value it cannot mean."""
        self._check_alive("inject_fault")
        value = fault.value
        if fault.kind == "delay":
            if value < 0:
                return _invalid_fault(fault, "a delay must be >= 0 seconds")
            self._pending_delay += value
        elif fault.kind == "memory_pressure":
            if value < 0:
                return _invalid_fault(fault, "a token limit must be >= 0")
            self._max_kv_tokens = int(value)
        elif fault.kind == "malformed_output":
            self._corrupt_next_output = True
        else:
            if int(value) < 1:
                return _invalid_fault(fault, "a crash needs a call count >= 1 (1 = the very next call)")
            # Several armed crashes: the earliest one kills the process.
            at_call = self._counted_calls + int(value)
            self._crash_at_call = min(at_call, self._crash_at_call or at_call)
        return _OK


def _invalid_fault(fault: Fault, fix: str) -> StructuredStatus:
    return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"Fault(kind={fault.kind!r}, value={fault.value!r}): {fix}")
