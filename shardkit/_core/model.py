"""The reference model of the session lifecycle (contract §2).

Pure: it calls no engine and draws nothing. Each operation returns a
``Prediction`` naming the numbered rule that decided it, and advances the
model's state exactly when the engine's state should advance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal

import numpy as np

from shardkit._dtypes import numpy_dtype
from shardkit._public import settle
from shardkit.contract import (
    ACCEPTED_BOUNDARY_POINTS,
    EPOCH_STEP_LIMIT,
    RESIDUAL_TENSOR,
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    MetricsResult,
    PrefillRequest,
    StatusCode,
)

__all__ = ["Prediction", "ReferenceModel", "SessionState", "StepRequest", "input_chunk", "malformed_reason"]

StepRequest = PrefillRequest | DecodeRequest
Operation = Literal["prefill", "decode", "cancel", "release"]
#: One accepted input in the form that defines a history (contract §3): token ids,
#: or the residual rows' bytes plus the sideband — never bundle metadata.
InputChunk = tuple[int, ...] | tuple[bytes, tuple[int, ...] | None]


@dataclass(frozen=True)
class Prediction:
    """What the engine must answer, and why: the model's verdict on one operation.

    ``op`` names the operation ("prefill", "decode", "cancel", "release", or one a backend
    adds); ``code`` is the status the engine must answer; ``rule`` names the rule that
    decided it (a failure is reported as the property ``"§2 " + rule``, e.g. "§2 rule 4"
    or "§2 fork"); ``because`` says why, in words a person can act on. The flags are
    keyword-only: ``retryable`` (the status's retryable flag), ``cache`` (HIT or MISS, for
    prefill and decode) and ``is_retry`` (an OK answer that repeats an earlier result)::

        Prediction("fork", StatusCode.OK, "fork", "session 'b' continues from 'a'")
        Prediction(op="fork", code=StatusCode.RESOURCE_EXHAUSTED, rule="fork", because="…", retryable=True)
    """

    op: str  # an Operation, or one a backend adds
    code: StatusCode
    rule: str
    because: str
    _: KW_ONLY
    retryable: bool = False
    cache: CacheResult = CacheResult.MISS
    is_retry: bool = False

    def __post_init__(self) -> None:
        problem = _prediction_problem(self)
        if problem is not None:
            message = f"Prediction({self.op!r}, …): {problem}"
            raise TypeError(message)

    def __str__(self) -> str:
        cache = f"/{self.cache.name}" if self.op in ("prefill", "decode") else ""
        retry = " retryable" if self.retryable else ""
        return f"{self.code.name}{cache}{retry} by §2 {self.rule}: {self.because}"


def _prediction_problem(prediction: Prediction) -> str | None:
    """What is wrong with a Prediction's field types (swapped positional arguments, most
    often), or None."""
    order = "the order is op, code, rule, because; or pass them by keyword"
    if not isinstance(prediction.code, StatusCode):
        return f"code must be a StatusCode, got {type(prediction.code).__name__} {prediction.code!r} ({order})"
    for name in ("op", "rule", "because"):
        value = getattr(prediction, name)
        if not isinstance(value, str):
            return f"{name} must be a str, got {type(value).__name__} {value!r} ({order})"
    if not isinstance(prediction.cache, CacheResult):
        return f"cache must be a CacheResult (HIT or MISS), got {type(prediction.cache).__name__} {prediction.cache!r}"
    for name in ("retryable", "is_retry"):
        if not isinstance(getattr(prediction, name), bool):
            return f"{name} must be a bool, got {getattr(prediction, name)!r}"
    return None


@dataclass
class SessionState:
    """The model's state of one session id: what the engine must hold for it.

    ``epoch`` is the session's current epoch and ``next_step`` the step it expects next
    (a live session has ``next_step >= 1``); ``kv_tokens`` the tokens (bundle rows) its
    epoch has cached (0 once cancelled); ``cancelled`` whether that epoch was cancelled;
    ``last_request`` and ``last_cache`` the last accepted step and its cache result (an
    exact repeat of it is an idempotent retry, rule 6); ``history`` the epoch's accepted
    inputs in order, one chunk per step (token ids, or a bundle's rows and sideband),
    from which the kit knows which outputs must agree. A rule of an extended model that
    changes a session sets every field the change affects, as ``ReferenceModel``'s own
    rules do.
    """

    epoch: int
    next_step: int = 0
    kv_tokens: int = 0
    cancelled: bool = False
    last_request: StepRequest | None = None
    last_cache: CacheResult = CacheResult.MISS
    history: tuple[InputChunk, ...] = field(default_factory=tuple)


def _in_id_range(value: int) -> bool:
    return 0 <= value < EPOCH_STEP_LIMIT


def input_chunk(request: StepRequest) -> InputChunk:
    """The part of a (well-formed) request that a session's history is made of."""
    if request.token_ids is not None:
        return request.token_ids
    assert request.bundle is not None
    return (request.bundle.tensors[0].data, request.bundle.token_id_sideband)


def input_length(request: StepRequest) -> int:
    """Tokens (or bundle rows) a well-formed request adds to the cache."""
    if request.token_ids is not None:
        return len(request.token_ids)
    assert request.bundle is not None
    return request.bundle.tensors[0].shape[0]


def _bundle_reason(caps: EngineCapabilities, request: StepRequest, bundle: BoundaryBundle) -> str | None:
    role = caps.role
    if bundle.architecture != caps.architecture:
        return f"bundle architecture {bundle.architecture!r} is not the engine's {caps.architecture!r}"
    accepted = ACCEPTED_BOUNDARY_POINTS.get(role, frozenset())
    if bundle.boundary_point not in accepted:
        return f"boundary point {bundle.boundary_point!r} is not upstream of a {role} (accepts {sorted(accepted)})"
    if len(bundle.tensors) != 1 or bundle.tensors[0].name != RESIDUAL_TENSOR:
        names = [tensor.name for tensor in bundle.tensors]
        return f"bundle must hold exactly one tensor named {RESIDUAL_TENSOR!r}, holds {names}"
    tensor = bundle.tensors[0]
    if len(tensor.shape) != 2:
        return f"residual must be rank 2, has shape {tensor.shape}"
    rows, width = tensor.shape
    if width != caps.hidden_size:
        return f"residual width {width} is not the hidden size {caps.hidden_size}"
    if tensor.dtype != caps.dtype:
        return f"residual dtype {tensor.dtype!r} is not the engine's {caps.dtype!r}"
    expected_bytes = rows * width * numpy_dtype(caps.dtype).itemsize
    if len(tensor.data) != expected_bytes:
        return f"residual holds {len(tensor.data)} bytes, shape {tensor.shape} needs {expected_bytes}"
    if rows == 0:
        return "empty input: the residual has no rows"
    if not np.isfinite(tensor.to_array()).all():
        return "residual holds a non-finite value"
    if bundle.token_id_sideband is not None and len(bundle.token_id_sideband) != rows:
        return f"sideband has {len(bundle.token_id_sideband)} ids for {rows} rows"
    echoed = (bundle.session_id, bundle.epoch, bundle.step)
    if echoed != (request.session_id, request.epoch, request.step):
        return (
            f"bundle is for session {bundle.session_id!r} epoch {bundle.epoch} step {bundle.step}, "
            f"the request for {request.session_id!r} epoch {request.epoch} step {request.step}"
        )
    return None


def malformed_reason(caps: EngineCapabilities, request: StepRequest) -> str | None:
    """Why contract §2 rule 2 refuses ``request`` on an engine with ``caps``, or None."""
    if request.session_id == "":
        return "empty session id"
    if not _in_id_range(request.epoch):
        return f"epoch {request.epoch} is outside [0, 2**63)"
    if not _in_id_range(request.step):
        return f"step {request.step} is outside [0, 2**63)"
    takes_tokens = caps.role in ("head", "full")
    if takes_tokens and request.token_ids is None:
        return f"a {caps.role} takes token_ids, got a bundle"
    if not takes_tokens and request.bundle is None:
        return f"a {caps.role} takes a bundle, got token_ids"
    if request.bundle is not None:
        reason = _bundle_reason(caps, request, request.bundle)
        if reason is not None:
            return reason
    else:
        assert request.token_ids is not None
        if not request.token_ids:
            return "empty input: no token ids"
        outside = [token for token in request.token_ids if not 0 <= token < caps.vocab_size]
        if outside:
            return f"token ids {outside} are outside [0, {caps.vocab_size})"
    if isinstance(request, DecodeRequest) and input_length(request) != 1:
        return f"a decode takes exactly one token, got {input_length(request)}"
    return None


class ReferenceModel:
    """Predicts every status, retryable flag and cache result of contract §2."""

    def __init__(self) -> None:
        self.capabilities: EngineCapabilities | None = None
        self.max_kv_tokens = 0
        self._sessions: dict[str, SessionState] = {}
        self.prefill_calls = 0
        self.decode_calls = 0

    # --- state the machine reads -----------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.capabilities is not None

    @property
    def serving(self) -> bool:
        return self.loaded

    @property
    def sessions(self) -> Mapping[str, SessionState]:
        """Each session id's state, in the order the ids were opened. Read-only: rules
        change a session through its ``SessionState`` or ``set_session``."""
        return self._sessions

    def set_session(self, session_id: str, state: SessionState) -> None:
        """Make ``state`` the state of ``session_id``, for a rule of an extended model: an
        unknown id is opened (it holds a slot, and its ``kv_tokens`` count), a known one
        is replaced. The built-in rules open and replace sessions themselves."""
        if not isinstance(state, SessionState):
            message = f"set_session({session_id!r}, …) takes a SessionState, got {type(state).__name__}: {state!r}"
            raise TypeError(message)
        self._sessions[session_id] = state

    @property
    def kv_tokens(self) -> int:
        return sum(session.kv_tokens for session in self._sessions.values())

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def expected_metrics(self) -> MetricsResult:
        return MetricsResult(
            prefill_calls=self.prefill_calls,
            decode_calls=self.decode_calls,
            active_sessions=self.active_sessions,
            kv_tokens=self.kv_tokens,
        )

    # --- lifecycle -------------------------------------------------------------------

    def load(self, capabilities: EngineCapabilities) -> None:
        """The engine loaded successfully and now reports ``capabilities``."""
        self.capabilities = capabilities
        self.max_kv_tokens = capabilities.max_kv_tokens

    def memory_pressure(self, max_kv_tokens: int) -> None:
        """The token limit is ``max_kv_tokens`` from now on; live caches stay."""
        self.max_kv_tokens = max_kv_tokens

    def prefill(self, request: PrefillRequest) -> Prediction:
        self.prefill_calls += 1
        return self._step("prefill", request)

    def decode(self, request: DecodeRequest) -> Prediction:
        self.decode_calls += 1
        return self._step("decode", request)

    def cancel(self, session_id: str, epoch: int) -> Prediction:
        def say(code: StatusCode, because: str) -> Prediction:
            return Prediction("cancel", code, "cancel", because)

        if self.capabilities is None:
            return Prediction("cancel", StatusCode.UNAVAILABLE, "rule 1", "the engine is not loaded")
        if session_id == "":
            return say(StatusCode.INVALID_ARGUMENT, "empty session id")
        if not _in_id_range(epoch):
            return say(StatusCode.INVALID_ARGUMENT, f"epoch {epoch} is outside [0, 2**63)")
        session = self._sessions.get(session_id)
        if session is None:
            return say(StatusCode.NOT_FOUND, f"session {session_id!r} is unknown")
        if epoch < session.epoch:
            return say(StatusCode.ABORTED, f"epoch {epoch} is stale: the session is at epoch {session.epoch}")
        if epoch > session.epoch:
            return say(StatusCode.NOT_FOUND, f"epoch {epoch} is ahead of the session's epoch {session.epoch}")
        freed = session.kv_tokens
        session.kv_tokens = 0
        session.cancelled = True
        return say(StatusCode.OK, f"session {session_id!r} cancelled at epoch {epoch}, {freed} tokens freed")

    def release(self, session_id: str) -> Prediction:
        if self.capabilities is None:
            return Prediction("release", StatusCode.UNAVAILABLE, "rule 1", "the engine is not loaded")
        session = self._sessions.pop(session_id, None)
        if session is None:
            because = f"release is idempotent: session {session_id!r} holds nothing"
        else:
            because = f"session {session_id!r} released, its slot and {session.kv_tokens} tokens freed"
        return Prediction("release", StatusCode.OK, "release", because)

    # --- prefill and decode ----------------------------------------------------------

    def _step(self, op: Literal["prefill", "decode"], request: StepRequest) -> Prediction:
        def refuse(code: StatusCode, rule: str, because: str) -> Prediction:
            return Prediction(op, code, rule, because)

        caps = self.capabilities
        if caps is None:
            return refuse(StatusCode.UNAVAILABLE, "rule 1", "the engine is not loaded")
        reason = malformed_reason(caps, request)
        if reason is not None:
            return refuse(StatusCode.INVALID_ARGUMENT, "rule 2", reason)
        sid = request.session_id
        opens_epoch = op == "prefill" and request.step == 0
        session = self._sessions.get(sid)
        if session is None:
            if opens_epoch:
                return self._admit(op, request, None)
            if op == "decode":
                return refuse(StatusCode.NOT_FOUND, "rule 3", f"session {sid!r} is unknown")
            because = f"session {sid!r} is unknown and a prefill at step {request.step} cannot open it"
            return refuse(StatusCode.FAILED_PRECONDITION, "rule 3", because)
        if request.epoch < session.epoch:
            because = f"epoch {request.epoch} is stale: session {sid!r} is at epoch {session.epoch}"
            return refuse(StatusCode.ABORTED, "rule 4", because)
        if request.epoch > session.epoch:
            if opens_epoch:
                return self._admit(op, request, session)
            because = (
                f"epoch {request.epoch} is ahead of session {sid!r}'s epoch {session.epoch}, "
                f"and only a prefill at step 0 may restart it"
            )
            return refuse(StatusCode.NOT_FOUND, "rule 4", because)
        if session.cancelled:
            return refuse(StatusCode.CANCELLED, "rule 5", f"session {sid!r} was cancelled at epoch {session.epoch}")
        if request.step == session.next_step:
            return self._admit(op, request, session)
        if request.step == session.next_step - 1 and request == session.last_request:
            because = f"an exact repeat of step {request.step}: the earlier result is returned again"
            return Prediction(op, StatusCode.OK, "rule 6", because, cache=session.last_cache, is_retry=True)
        because = f"step {request.step} does not follow: session {sid!r} expects step {session.next_step}"
        if request.step == session.next_step - 1:
            because += " (a repeat of the last step must equal it exactly)"
        return refuse(StatusCode.FAILED_PRECONDITION, "rule 6", because)

    def _admit(
        self, op: Literal["prefill", "decode"], request: StepRequest, session: SessionState | None
    ) -> Prediction:
        """Rules 7 and 8: check capacity, then advance the state."""
        sid = request.session_id
        new_tokens = input_length(request)
        restarting = session is not None and request.epoch > session.epoch
        if session is None and len(self._sessions) >= self._max_sessions():
            because = f"opening {sid!r} needs a slot and all {self._max_sessions()} are held"
            return Prediction(op, StatusCode.RESOURCE_EXHAUSTED, "rule 7", because, retryable=True)
        freed = session.kv_tokens if restarting and session is not None else 0
        needed = self.kv_tokens - freed + new_tokens
        if needed > self.max_kv_tokens:
            because = f"{self.kv_tokens} cached - {freed} freed + {new_tokens} new = {needed} > max_kv_tokens {self.max_kv_tokens}"
            return Prediction(op, StatusCode.RESOURCE_EXHAUSTED, "rule 7", because, retryable=True)
        if session is None or restarting:
            session = SessionState(epoch=request.epoch)
            self._sessions[sid] = session
            cache = CacheResult.MISS
            because = f"step 0 of session {sid!r} epoch {request.epoch}" + (" (restart)" if restarting else "")
        else:
            cache = CacheResult.HIT
            because = f"step {request.step} of session {sid!r} epoch {request.epoch}"
        session.next_step += 1
        session.kv_tokens += new_tokens
        session.last_request = request
        session.last_cache = cache
        session.history += (input_chunk(request),)
        return Prediction(op, StatusCode.OK, "rule 8", because, cache=cache)

    def _max_sessions(self) -> int:
        assert self.capabilities is not None
        return self.capabilities.max_sessions


settle(__name__, globals())
