"""``SessionEngine``: the base class for writing an engine, and the types its hooks use.

``SessionEngine`` implements everything contract v1 asks of an engine that is not
arithmetic: rule 2's input validation, unknown sessions, epochs and restarts, cancel,
idempotent retries, capacity (slots and KV tokens), cache HIT/MISS, ``metrics()``,
``health()``, every contract §4 fault natively (delay, memory_pressure, malformed_output,
crash), and the step-delay, structural-corruption and scheduled-crash knobs. A subclass
supplies its numerics only, through four hooks:

- ``load_layers(request, layers, role)``: get ready to serve a layer range, or raise
  ``EngineError`` for one it cannot serve;
- ``fresh_cache()``: the per-session cache of a new session epoch (any object);
- ``forward(cache, step) -> (new_cache, produced)``: run one admitted step on top of the
  session's cache (see ``forward`` for what ``produced`` may be);
- ``release_cache(cache)`` (optional): a cache is dropped, for engines whose caches hold
  memory outside Python objects (llama.cpp's KV sequences).

plus an ``EngineSpec`` (sizes, budgets, architecture, dtype) passed to ``__init__`` and two
class variables: ``EVIDENCE_CLASS`` ("fixture" for a synthetic engine, "real" for real
model arithmetic) and ``TOLERANCE`` (the absolute tolerance on residual values and logit
margins; 0.0 is bit-exact). ``ENGINE_NAME``, the name used in messages, defaults to the
class name.

A minimal complete engine — one layer, so it serves the ``full`` role only; its "model"
predicts the sum of the history modulo the vocabulary, and its cache is the history::

    from shardkit import EngineSpec, SessionEngine, StepInput, TokenOutput

    class SumEngine(SessionEngine[tuple[int, ...]]):
        EVIDENCE_CLASS = "fixture"
        TOLERANCE = 0.0

        def __init__(self) -> None:
            super().__init__(EngineSpec(architecture="sum", total_layers=1, hidden_size=4, vocab_size=16,
                                        dtype="float32", max_sessions=4, max_kv_tokens=64))

        def load_layers(self, request, layers, role) -> None:
            pass  # nothing to load: one layer, always the full role

        def fresh_cache(self) -> tuple[int, ...]:
            return ()

        def forward(self, cache: tuple[int, ...], step: StepInput) -> tuple[tuple[int, ...], TokenOutput]:
            history = cache + (step.token_ids or ())
            return history, TokenOutput(sum(history) % 16)

``docs/extending.md`` walks through it and through an engine serving several roles.
"""

from __future__ import annotations

import abc
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Generic, Literal, TypeVar, cast

import numpy as np
import numpy.typing as npt

from shardkit._dtypes import is_dtype_name, numpy_dtype
from shardkit._public import settle
from shardkit.contract import (
    ACCEPTED_BOUNDARY_POINTS,
    EVIDENCE_CLASSES,
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
from shardkit.engines._checks import identity_problem, is_int_at_least, is_tolerance, refusal, shifted_clearly

__all__ = ["EngineSpec", "Produced", "SessionEngine", "StepInput"]

CacheT = TypeVar("CacheT")
StepRequest = PrefillRequest | DecodeRequest
#: What ``forward`` hands back besides the new cache: for a head or middle shard the output
#: residual rows (an ``(n, hidden_size)`` array, or its little-endian C-order bytes); for a
#: tail or full shard the last row's logits (a 1-D array: the base takes the greedy token
#: and its margin) or a ready ``TokenOutput``.
Produced = bytes | npt.NDArray[Any] | TokenOutput

_OK = StructuredStatus(StatusCode.OK)
#: How far the malformed_output fault moves a residual value, at least (and at least
#: ``_MALFORMED_TOLERANCES`` times the tolerance): far outside any rounding noise.
_MALFORMED_SHIFT = 0.5
_MALFORMED_TOLERANCES = 1000.0
#: ... and by at least this many times the relative tolerance of its value.
_MALFORMED_RELATIVE = 4.0


@dataclass(frozen=True)
class EngineSpec:
    """The sizes and budgets a ``SessionEngine`` reports in ``capabilities()``.

    ``total_layers`` is the whole model's depth (an engine then loads a range of it);
    ``hidden_size`` the width of a boundary residual row; ``vocab_size`` the number of
    token ids; ``dtype`` the residual's numpy dtype name; ``max_sessions`` and
    ``max_kv_tokens`` the budgets rule 7 enforces (slots, and cached tokens over all
    sessions)."""

    architecture: str
    total_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_sessions: int
    max_kv_tokens: int

    def __post_init__(self) -> None:
        checks = [
            ("architecture", isinstance(self.architecture, str) and self.architecture != "", "a non-empty str"),
            ("total_layers", is_int_at_least(self.total_layers, 1), "an int >= 1"),
            ("hidden_size", is_int_at_least(self.hidden_size, 1), "an int >= 1"),
            ("vocab_size", is_int_at_least(self.vocab_size, 1), "an int >= 1"),
            ("dtype", is_dtype_name(self.dtype), "a dtype name such as 'float32', 'bfloat16' or 'float16'"),
            ("max_sessions", is_int_at_least(self.max_sessions, 1), "an int >= 1"),
            ("max_kv_tokens", is_int_at_least(self.max_kv_tokens, 0), "an int >= 0"),
        ]
        for name, valid, expected in checks:
            if not valid:
                message = f"EngineSpec.{name} must be {expected}, got {getattr(self, name)!r}"
                raise ValueError(message)


@dataclass(frozen=True)
class _ServedRange:
    """The loaded layer range, its role, and the architecture tag its bundles carry."""

    layers: range
    role: Role
    architecture: str


@dataclass(frozen=True)
class StepInput:
    """An admitted step's input, already validated (rule 2): ``token_ids`` for a head or
    full shard, ``residual`` (the upstream bundle's tensor) for a middle or tail shard; the
    other one is None. A residual has the engine's dtype, shape ``(rows, hidden_size)``,
    the right data length and finite values; ``rows()`` decodes it. ``len(step)`` is the
    number of tokens (rows) the step adds to the session's cache."""

    token_ids: tuple[int, ...] | None
    residual: EngineTensor | None

    def __len__(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        assert self.residual is not None
        return self.residual.shape[0]

    def rows(self) -> npt.NDArray[Any]:
        """The residual as an ``(rows, hidden_size)`` array (a middle or tail shard's input)."""
        if self.residual is None:
            message = "StepInput.rows(): this step carries token ids (a head or full shard's input); read token_ids"
            raise ValueError(message)
        return self.residual.to_array()


def _token_from_logits(logits: npt.NDArray[Any]) -> TokenOutput:
    """Greedy decoding: the argmax, with top-1 minus top-2 as the margin (None for one logit)."""
    top_two = np.sort(logits)[-2:]
    margin = float(top_two[-1] - top_two[0]) if logits.size > 1 else None
    return TokenOutput(token_id=int(np.argmax(logits)), margin=margin)


@dataclass
class _Session(Generic[CacheT]):
    """One session's current epoch: its step counter, cache and last accepted request."""

    epoch: int
    next_step: int
    cache: CacheT | None
    kv_tokens: int
    last_request: StepRequest
    last_result: StepResult
    cancelled: bool = False
    #: The token a malformed_output fault puts in the last result's place: the least
    #: likely one, never a near tie (None: the engine produced no logits to choose from).
    wrong_token: int | None = None


def _unloaded(operation: str) -> StructuredStatus:
    return StructuredStatus(StatusCode.UNAVAILABLE, f"{operation} before load; call load() first")


def _invalid_fault(fault: Fault, fix: str) -> StructuredStatus:
    return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"Fault(kind={fault.kind!r}, value={fault.value!r}): {fix}")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def one_call_at_a_time(method: _Method) -> _Method:
    """A method of an engine whose ``_calls`` lock it holds while it runs: calls from
    several threads run one at a time (what ``concurrent_calls`` lets a kit rely on)."""

    @functools.wraps(method)
    def serialized(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._calls:
            return method(self, *args, **kwargs)

    return cast(_Method, serialized)


#: The operations a crash fault counts (contract §4 ``crash``).
_COUNTED_OPERATIONS = ("prefill", "decode", "cancel", "release")


class _KitCall(threading.local):
    """The counted operation a thread is in, on one engine: how deep (an override that calls
    ``super()``, the base's own operation), and whether it was counted yet."""

    depth = 0
    counted = False


def _one_counted_call(method: _Method) -> _Method:
    """A counted operation, the base's or an override of it: the kit's call is the outermost
    one, and counts once however many of the engine's operations it runs (an override's
    ``super().prefill()`` then ``super().release()`` is one call: contract §4 ``crash`` does
    not count an engine's calls to itself)."""
    if getattr(method, "_one_counted_call", False):
        return method

    @functools.wraps(method)
    def counted_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = self._kit_call
        if call.depth == 0:
            call.counted = False
        call.depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            call.depth -= 1

    counted_once._one_counted_call = True  # type: ignore[attr-defined]
    return cast(_Method, counted_once)


class SessionEngine(ShardEngine, Generic[CacheT]):
    """A ``ShardEngine`` whose lifecycle is contract §2 exactly, with every §4 fault native;
    a subclass adds the numerics through ``load_layers``, ``fresh_cache``, ``forward`` and
    optionally ``release_cache`` (see the module docstring for a complete example).

    ``CacheT`` is the type of one session epoch's cache: whatever ``forward`` needs to
    continue a history (the fake keeps a digest per layer, the numpy engine K/V arrays).
    The base never looks inside it."""

    #: The engine's name in messages ("X already serves layers …", "X.prefill() raised …");
    #: defaults to the class name.
    ENGINE_NAME: ClassVar[str]
    #: "fixture" for a synthetic engine (the fake), "real" for real model arithmetic.
    EVIDENCE_CLASS: ClassVar[Literal["fixture", "real"]]
    #: Absolute tolerance on residual values and logit margins (0.0 = bit-exact).
    TOLERANCE: ClassVar[float]
    #: Relative tolerance on residual values: one may differ by ``TOLERANCE +
    #: RELATIVE_TOLERANCE·|reference|``. None: the dtype's default (docs/numerics.md).
    RELATIVE_TOLERANCE: ClassVar[float | None] = None
    #: The logit margin below which a token may differ (a near tie). None: ``TOLERANCE``.
    MARGIN_TOLERANCE: ClassVar[float | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Each class its own name unless it sets one: a subclass of an engine that set
        # ENGINE_NAME is another engine, and its messages must not name its parent.
        if "ENGINE_NAME" not in cls.__dict__:
            cls.ENGINE_NAME = cls.__name__
        for operation in _COUNTED_OPERATIONS:
            if operation in cls.__dict__:
                setattr(cls, operation, _one_counted_call(cls.__dict__[operation]))

    def __init__(
        self,
        spec: EngineSpec,
        *,
        crash_exception_factory: Callable[[], BaseException] | None = None,
        step_delay_seconds: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        malformed_output: bool = False,
        crash_after_calls: int | None = None,
    ) -> None:
        """``spec`` gives the sizes and budgets. The knobs are for testing the kit itself and
        are all off by default: ``step_delay_seconds`` is slept before every prefill/decode;
        ``malformed_output`` breaks every OK output structurally; after ``crash_after_calls``
        prefill/decode calls have succeeded the next one raises ``crash_exception_factory()``
        (default: a ``RuntimeError`` saying the process died) and the engine stays dead
        (cancel, release, health, metrics and capabilities do not count). The injected
        ``crash`` fault raises the same exception."""
        name = type(self).__name__
        if not isinstance(spec, EngineSpec):
            message = f"{name}: SessionEngine.__init__ takes an EngineSpec, got {type(spec).__name__}: {spec!r}"
            raise TypeError(message)
        evidence = getattr(self, "EVIDENCE_CLASS", None)
        if evidence not in EVIDENCE_CLASSES:
            message = (
                f"{name}.EVIDENCE_CLASS must be 'fixture' (synthetic numerics) or 'real' (a real model's), "
                f"got {evidence!r}; set it as a class variable"
            )
            raise TypeError(message)
        tolerance = getattr(self, "TOLERANCE", None)
        if not is_tolerance(tolerance):
            message = (
                f"{name}.TOLERANCE must be a finite float >= 0 (0.0: outputs are bit-exact), got {tolerance!r}; "
                "set it as a class variable"
            )
            raise TypeError(message)
        for optional in ("RELATIVE_TOLERANCE", "MARGIN_TOLERANCE"):
            value = getattr(self, optional)
            if value is not None and not is_tolerance(value):
                message = f"{name}.{optional} must be None or a finite float >= 0, got {value!r}; set it as a class variable"
                raise TypeError(message)
        # Calls from several threads run one at a time (``concurrent_calls``), a subclass's
        # ``forward`` included; re-entrant, so an override may call ``super()``.
        self._calls = threading.RLock()
        self._kit_call = _KitCall()
        self._spec = spec
        self._crash_exception_factory = crash_exception_factory or self._default_crash
        self._step_delay_seconds = step_delay_seconds
        self._sleep = sleep
        self._break_outputs = malformed_output
        self._served: _ServedRange | None = None
        self._sessions: dict[str, _Session[CacheT]] = {}
        self._max_kv_tokens = spec.max_kv_tokens
        self._prefill_calls = 0
        self._decode_calls = 0
        # Calls to prefill/decode/cancel/release since construction, for the crash fault.
        self._counted_calls = 0
        self._crash_at_call: int | None = None
        # Prefill/decode calls since construction, for the crash_after_calls knob.
        self._step_calls = 0
        self._crash_after_steps = crash_after_calls
        self._death: str | None = None
        self._pending_delay = 0.0
        self._corrupt_next_output = False

    def _default_crash(self) -> BaseException:
        return RuntimeError(f"{self.ENGINE_NAME} process died (simulated crash)")

    @property
    def spec(self) -> EngineSpec:
        """The sizes and budgets this engine was built with (``max_kv_tokens`` as built:
        a memory_pressure fault lowers the limit ``capabilities()`` reports, not this)."""
        return self._spec

    # --- what a subclass supplies --------------------------------------------------------

    @abc.abstractmethod
    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        """Get ready to serve ``layers`` (a range of ``spec.total_layers``) in ``role``; raise
        ``EngineError`` (INVALID_ARGUMENT, saying what it serves) for a range this engine
        cannot serve. Called once, by the first ``load``; the base has checked
        ``total_layers`` and refuses a second load itself."""

    @abc.abstractmethod
    def fresh_cache(self) -> CacheT:
        """The cache of a session epoch that has seen nothing yet."""

    @abc.abstractmethod
    def forward(self, cache: CacheT, step: StepInput) -> tuple[CacheT, Produced]:
        """Run ``step`` on top of ``cache``; return the new cache and what the step produced
        (see ``Produced``: residual rows for a head or middle shard, logits or a
        ``TokenOutput`` for a tail or full shard).

        The base calls it only for a step it has admitted (rules 1-7 passed), and stores
        the new cache as the session's once it returns. It must leave ``cache`` as it was,
        so an exact retry or the twin oracle's replay sees the same history: build new
        arrays rather than writing into old ones. An engine whose cache is a handle to
        memory it manages itself (llama.cpp's KV sequences) writes the new positions there
        and returns the handle advanced."""

    def release_cache(self, cache: CacheT) -> None:
        """A session epoch's cache is dropped (cancel, release, an admitted restart). Engines
        whose cache lives outside Python objects (llama.cpp's KV sequences) free it here;
        the default does nothing."""

    # --- process death -------------------------------------------------------------------

    def _check_alive(self, operation: str, *, counted: bool = False) -> None:
        """Raise as a dead process would; a counted call may be the scheduled one that dies:
        the one an armed crash fault names (prefill, decode, cancel and release count, each
        call of the kit once: ``_one_counted_call``), or the first prefill/decode after
        ``crash_after_calls`` of them succeeded."""
        if counted and self._death is None and not self._kit_call.counted:
            self._kit_call.counted = True
            self._counted_calls += 1
            if self._crash_at_call is not None and self._counted_calls >= self._crash_at_call:
                self._death = f"{operation}() (call #{self._counted_calls})"
            elif operation in ("prefill", "decode") and self._crash_after_steps is not None:
                self._step_calls += 1
                if self._step_calls > self._crash_after_steps:
                    after = self._crash_after_steps
                    self._death = f"{operation}() (prefill/decode call #{self._step_calls}, crash_after_calls={after})"
        if self._death is not None:
            error = self._crash_exception_factory()
            # A zero-argument factory cannot know which call died, so the engine says so.
            error.add_note(f"{self.ENGINE_NAME}.{operation}() raised: the process died in {self._death}")
            raise error

    # --- loading ---------------------------------------------------------------------------

    @one_call_at_a_time
    def load(self, request: LoadRequest) -> LoadResult:
        self._check_alive("load")
        if self._served is not None:
            served = f"{self._served.layers.start}..{self._served.layers.stop - 1}"
            message = f"{self.ENGINE_NAME} already serves layers {served}; construct a fresh engine to load another"
            raise EngineError(StructuredStatus(StatusCode.FAILED_PRECONDITION, message))
        layers = self._spec.total_layers
        if request.total_layers != layers:
            message = f"LoadRequest.total_layers={request.total_layers}, but the model has {layers}; pass {layers}"
            raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, message))
        architecture = request.recipe.get("architecture", self._spec.architecture)
        if not isinstance(architecture, str):
            message = f"LoadRequest.recipe['architecture'] must be a str, got {architecture!r}"
            raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, message))
        span = range(request.shard_start, request.shard_end + 1)
        self.load_layers(request, span, request.role)
        self._served = _ServedRange(span, request.role, architecture)
        return LoadResult(_OK, architecture)

    @one_call_at_a_time
    def capabilities(self) -> EngineCapabilities:
        self._check_alive("capabilities")
        spec = self._spec
        span = self._served.layers if self._served else range(spec.total_layers)
        return EngineCapabilities(
            architecture=self._served.architecture if self._served else spec.architecture,
            evidence_class=self.EVIDENCE_CLASS,
            total_layers=spec.total_layers,
            shard_start=span.start,
            shard_end=span.stop - 1,
            hidden_size=spec.hidden_size,
            vocab_size=spec.vocab_size,
            dtype=spec.dtype,
            max_sessions=spec.max_sessions,
            max_kv_tokens=self._max_kv_tokens,
            supported_faults=frozenset(FAULT_KINDS),
            tolerance=self.TOLERANCE,
            relative_tolerance=self.RELATIVE_TOLERANCE,
            margin_tolerance=self.MARGIN_TOLERANCE,
            concurrent_calls=True,
        )

    # --- steps -------------------------------------------------------------------------------

    @_one_counted_call
    @one_call_at_a_time
    def prefill(self, request: PrefillRequest) -> StepResult:
        self._check_alive("prefill", counted=True)
        self._prefill_calls += 1
        return self._step(request, "prefill")

    @_one_counted_call
    @one_call_at_a_time
    def decode(self, request: DecodeRequest) -> StepResult:
        self._check_alive("decode", counted=True)
        self._decode_calls += 1
        return self._step(request, "decode")

    def _step(self, request: StepRequest, operation: str) -> StepResult:
        """contract §2 rules 1-8, in order; the first rule that applies decides."""
        delay, self._pending_delay = self._step_delay_seconds + self._pending_delay, 0.0
        if delay > 0:
            self._sleep(delay)
        served = self._served
        if served is None:
            return StepResult(_unloaded(operation), CacheResult.MISS)
        problem = self._input_problem(request, operation, served)
        if problem is not None:
            return refusal(StatusCode.INVALID_ARGUMENT, f"{operation}: {problem}")
        where = f"{operation} of session {request.session_id!r} epoch {request.epoch} step {request.step}"
        session = self._sessions.get(request.session_id)
        starts_epoch = isinstance(request, PrefillRequest) and request.step == 0
        if session is None or request.epoch > session.epoch:
            if starts_epoch:
                return self._advance(request, served, session, where)
            # An unknown id and a higher epoch alike name an epoch this engine never opened.
            unknown = session is None and isinstance(request, PrefillRequest)
            code = StatusCode.FAILED_PRECONDITION if unknown else StatusCode.NOT_FOUND
            return refusal(code, f"{where}: no such session epoch; open one with prefill step 0")
        if request.epoch < session.epoch:
            return refusal(StatusCode.ABORTED, f"{where}: stale epoch, the session is at epoch {session.epoch}")
        if session.cancelled:
            return refusal(StatusCode.CANCELLED, f"{where}: cancelled; release it or restart at a higher epoch")
        if request.step == session.next_step - 1 and request == session.last_request:
            return self._deliver(session.last_result, session.wrong_token)
        if request.step != session.next_step:
            message = f"{where}: expected step {session.next_step} or an identical retry of the last step"
            return refusal(StatusCode.FAILED_PRECONDITION, message)
        return self._advance(request, served, session, where)

    def _advance(
        self, request: StepRequest, served: _ServedRange, session: _Session[CacheT] | None, where: str
    ) -> StepResult:
        """Rules 7-8 for a request that opens, restarts or continues a session epoch;
        ``session`` holds the id's slot, if any."""
        continues = session is not None and session.epoch == request.epoch
        step_input = StepInput(request.token_ids, request.bundle.tensors[0] if request.bundle is not None else None)
        count = len(step_input)
        if session is None and len(self._sessions) >= self._spec.max_sessions:
            message = f"{where}: all {self._spec.max_sessions} session slots are taken; release one and retry"
            return refusal(StatusCode.RESOURCE_EXHAUSTED, message, retryable=True)
        # A restart gives back its old epoch's tokens, but only if it is admitted.
        used = self._kv_tokens_used() - (session.kv_tokens if session is not None and not continues else 0)
        if used + count > self._max_kv_tokens:
            message = (
                f"{where}: caching {count} more tokens on top of {used} would exceed "
                f"max_kv_tokens={self._max_kv_tokens}; release or cancel a session and retry"
            )
            return refusal(StatusCode.RESOURCE_EXHAUSTED, message, retryable=True)
        # A continuing session is never cancelled here (rule 5 came first), so its cache is live.
        cache = session.cache if session is not None and continues else None
        if session is not None and not continues and session.cache is not None:
            # An admitted restart: the old epoch's cache goes before the new one starts.
            self.release_cache(session.cache)
        new_cache, produced = self.forward(self.fresh_cache() if cache is None else cache, step_input)
        output = self._output(request, served, produced, count)
        wrong_token = _least_likely_token(produced, output)
        if self._break_outputs:
            output = self._structurally_broken(output)
        # A retry of this step must return exactly what this call returns, corruption included.
        clean = StepResult(_OK, CacheResult.HIT if continues else CacheResult.MISS, output)
        result = self._deliver(clean, wrong_token)
        if session is not None and continues:
            session.next_step += 1
            session.cache, session.kv_tokens = new_cache, session.kv_tokens + count
            session.last_request, session.last_result, session.wrong_token = request, result, wrong_token
        else:
            opened = _Session(request.epoch, 1, new_cache, count, request, result, wrong_token=wrong_token)
            self._sessions[request.session_id] = opened
        return result

    def _input_problem(self, request: StepRequest, operation: str, served: _ServedRange) -> str | None:
        """Why rule 2 refuses ``request``, or None if its input is well formed."""
        problem = identity_problem(request.session_id, epoch=request.epoch, step=request.step)
        if problem is not None:
            return problem
        role = served.role
        if role in ("head", "full"):
            if request.token_ids is None:
                return f"a {role} shard takes token_ids, got a bundle; send token_ids"
            row_count = len(request.token_ids)
        else:
            if request.bundle is None:
                return f"a {role} shard takes a bundle, got token_ids; send the upstream shard's bundle"
            problem = self._bundle_problem(request, request.bundle, served)
            if problem is not None:
                return problem
            row_count = request.bundle.tensors[0].shape[0]
        if row_count == 0:
            return "the input is empty; send at least one token"
        if operation == "decode" and row_count != 1:
            return f"a decode takes exactly one token, got {row_count}; send more with prefill"
        vocab = self._spec.vocab_size
        outside = [token for token in request.token_ids or () if not 0 <= token < vocab]
        if outside:
            return f"token ids {outside} are outside the vocabulary [0, {vocab})"
        return None

    def _bundle_problem(self, request: StepRequest, bundle: BoundaryBundle, served: _ServedRange) -> str | None:
        for name in ("session_id", "epoch", "step"):
            if getattr(bundle, name) != getattr(request, name):
                mine, theirs = getattr(bundle, name), getattr(request, name)
                return f"bundle.{name}={mine!r} differs from the request's {theirs!r}; they must match"
        if bundle.architecture != served.architecture:
            return f"bundle.architecture={bundle.architecture!r}, but this engine serves {served.architecture!r}"
        accepted = sorted(ACCEPTED_BOUNDARY_POINTS[served.role])
        if bundle.boundary_point not in accepted:
            return f"a {served.role} shard takes boundary points {accepted}, got {bundle.boundary_point!r}"
        names = [tensor.name for tensor in bundle.tensors]
        if names != [RESIDUAL_TENSOR]:
            return f"a bundle must hold exactly one tensor named {RESIDUAL_TENSOR!r}, got {names}"
        tensor, hidden, dtype = bundle.tensors[0], self._spec.hidden_size, self._spec.dtype
        if tensor.dtype != dtype:
            return f"the residual's dtype must be {dtype!r}, got {tensor.dtype!r}"
        if len(tensor.shape) != 2 or tensor.shape[1] != hidden:
            return f"the residual's shape must be (rows, {hidden}), got {tensor.shape}"
        wire = numpy_dtype(dtype).newbyteorder("<")
        expected_bytes = tensor.shape[0] * hidden * wire.itemsize
        if len(tensor.data) != expected_bytes:
            return f"the residual holds {len(tensor.data)} bytes, but shape {tensor.shape} needs {expected_bytes}"
        sideband = bundle.token_id_sideband
        if sideband is not None and len(sideband) != tensor.shape[0]:
            return f"the sideband holds {len(sideband)} ids for {tensor.shape[0]} rows; send one id per row"
        if not np.isfinite(np.frombuffer(tensor.data, dtype=wire)).all():
            return "the residual holds a non-finite value (nan or inf)"
        return None

    def _output(
        self, request: StepRequest, served: _ServedRange, produced: Produced, rows: int
    ) -> BoundaryBundle | TokenOutput:
        if served.role in ("tail", "full"):
            if isinstance(produced, TokenOutput):
                return produced
            assert not isinstance(produced, bytes), "a tail or full shard produces logits or a token"
            return _token_from_logits(produced)
        assert not isinstance(produced, TokenOutput), "a head or middle shard produces residual rows"
        shape = (rows, self._spec.hidden_size)
        if isinstance(produced, bytes):
            residual = EngineTensor(RESIDUAL_TENSOR, self._spec.dtype, shape, produced)
        else:
            residual = EngineTensor.from_array(RESIDUAL_TENSOR, np.asarray(produced, self._spec.dtype).reshape(shape))
        # A head's sideband is its input ids; a middle passes its input sideband through.
        sideband = request.bundle.token_id_sideband if request.bundle is not None else request.token_ids
        point = OUTPUT_BOUNDARY_POINT[served.role]
        ids = (request.session_id, request.epoch, request.step)
        return BoundaryBundle(*ids, point, served.architecture, (residual,), sideband)

    def _deliver(self, result: StepResult, wrong_token: int | None) -> StepResult:
        """Hand out an OK result, spending an armed malformed_output fault on it."""
        if not self._corrupt_next_output:
            return result
        self._corrupt_next_output = False
        assert result.output is not None  # only OK results are delivered
        return replace(result, output=self._semantically_wrong(result.output, wrong_token))

    def _semantically_wrong(
        self, output: BoundaryBundle | TokenOutput, wrong_token: int | None = None
    ) -> BoundaryBundle | TokenOutput:
        """The ``malformed_output`` fault: valid shape, range and tags, wrong value; only an oracle can tell.

        A token becomes ``wrong_token`` (the least likely one), so it is never a near tie
        that a correct engine could also have returned; without logits, the next id."""
        vocab_size = self._spec.vocab_size
        if isinstance(output, TokenOutput):
            token = output.token_id
            if token >= vocab_size:  # the structural knob already moved it out of the vocabulary
                return replace(output, token_id=token + 1)
            if wrong_token is not None and wrong_token != token:
                return replace(output, token_id=wrong_token)
            return replace(output, token_id=(token + 1) % vocab_size)
        residual = output.tensors[0]
        # Raw bytes, not to_array(): with the malformed_output knob on, the data is truncated.
        wire = numpy_dtype(self._spec.dtype).newbyteorder("<")
        values = np.frombuffer(residual.data, dtype=wire)
        relative = _MALFORMED_RELATIVE * self.capabilities().tolerances()[1]
        shifted = shifted_clearly(values, max(_MALFORMED_SHIFT, _MALFORMED_TOLERANCES * self.TOLERANCE), relative)
        return replace(output, tensors=(replace(residual, data=shifted.astype(wire).tobytes()),))

    def _structurally_broken(self, output: BoundaryBundle | TokenOutput) -> BoundaryBundle | TokenOutput:
        """The ``malformed_output`` knob: an output that shape and range checks alone reject."""
        if isinstance(output, TokenOutput):
            return replace(output, token_id=self._spec.vocab_size + output.token_id)
        residual = output.tensors[0]
        truncated = replace(residual, data=residual.data[: -numpy_dtype(residual.dtype).itemsize])
        return replace(output, architecture=output.architecture + "-malformed", tensors=(truncated,))

    # --- session control -------------------------------------------------------------------

    @_one_counted_call
    @one_call_at_a_time
    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._check_alive("cancel", counted=True)
        if self._served is None:
            return _unloaded("cancel")
        where = f"cancel of session {session_id!r} epoch {epoch}"
        problem = identity_problem(session_id, epoch=epoch)
        if problem is not None:
            return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")
        session = self._sessions.get(session_id)
        if session is None:
            return StructuredStatus(StatusCode.NOT_FOUND, f"{where}: unknown session")
        if epoch < session.epoch:
            return StructuredStatus(StatusCode.ABORTED, f"{where}: stale epoch, the session is at {session.epoch}")
        if epoch > session.epoch:
            return StructuredStatus(StatusCode.NOT_FOUND, f"{where}: the session is at epoch {session.epoch}")
        # The KV memory goes at once; the slot stays until release or a restart.
        if session.cache is not None:
            self.release_cache(session.cache)
        session.cancelled, session.kv_tokens, session.cache = True, 0, None
        return _OK

    @_one_counted_call
    @one_call_at_a_time
    def release(self, session_id: str) -> StructuredStatus:
        self._check_alive("release", counted=True)
        if self._served is None:
            return _unloaded("release")
        session = self._sessions.pop(session_id, None)
        if session is not None and session.cache is not None:
            self.release_cache(session.cache)
        return _OK

    @one_call_at_a_time
    def health(self) -> HealthResult:
        self._check_alive("health")
        return HealthResult(_OK, serving=self._served is not None)

    @one_call_at_a_time
    def metrics(self) -> MetricsResult:
        self._check_alive("metrics")
        # A cancelled session keeps its slot (contract §2), so it still counts as active.
        return MetricsResult(self._prefill_calls, self._decode_calls, len(self._sessions), self._kv_tokens_used())

    def _kv_tokens_used(self) -> int:
        return sum(session.kv_tokens for session in self._sessions.values())

    # --- faults ------------------------------------------------------------------------------

    @one_call_at_a_time
    def inject_fault(self, fault: Fault) -> StructuredStatus:
        """Arm ``fault`` natively (contract §4); INVALID_ARGUMENT for a value it cannot mean."""
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


def _least_likely_token(produced: Produced, output: BoundaryBundle | TokenOutput) -> int | None:
    """The malformed_output fault's token for this output: the lowest logit's, which no
    rounding can bring near the top (None without logits, or when every logit ties)."""
    if not isinstance(output, TokenOutput) or not isinstance(produced, np.ndarray) or produced.size < 2:
        return None
    least = int(np.argmin(produced))
    return None if least == output.token_id else least


settle(__name__, globals())
