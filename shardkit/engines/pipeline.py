"""A coordinator as an engine: stage engines chained head → middle(s) → tail into one full model.

``PipelineEngine`` is what a distributed runtime's coordinator does, packaged as a
``ShardEngine`` with the ``full`` role, so the kit can fuzz the coordination itself:
against the reference model, and differentially against a single full engine.

How the stages are kept consistent (contract §2: a non-OK result leaves *all* session
state unchanged, so no stage may be left advanced by a step the pipeline refuses):

* **The first stage's verdict is decisive.** Every stage receives the same
  (session, epoch, step) sequence, so every stage holds the same sessions, steps and
  token counts, and rules 3-6 decide alike everywhere. The coordinator checks rules
  1-2 itself (so stage 1 only sees well-formed requests, and every later stage gets
  the bundle of the stage before, which is well formed by construction).
* **Capacity (rule 7) agrees by construction.** Since every stage caches the same
  tokens for the same sessions, a later stage can only refuse for capacity what stage
  1 admitted if it has a tighter budget. ``load`` therefore requires the first stage
  to be the tightest (its ``max_sessions`` and ``max_kv_tokens`` are the minimum over
  the stages) and refuses the configuration otherwise; ``capabilities`` publishes that
  minimum.
* **No rollback.** A later stage that disagrees anyway (refuses a step stage 1
  accepted, or answers HIT where stage 1 answered MISS) is a desync: a bug in a stage
  or a budget changed under the coordinator's feet. Stage 1 has already advanced and
  cannot be rolled back, so the pipeline answers ``INTERNAL`` (not retryable), naming
  the stage and carrying its answer, rather than passing the stage's code through as
  if nothing had changed. Stage 1's own refusals are passed through (code, retryable
  flag, cache; the message prefixed with the stage).
* An exception out of a stage propagates: it is the death of that stage's process.

Bundles: stage 1 gets the request as is; each later stage gets a request of the same
type with the same session, epoch and step, carrying the previous stage's bundle. The
contract (§1) lets a middle accept only ``post_head_residual``, so with two or more middles the
bundle going into the second is re-tagged ``post_head_residual`` (to it, the stages
before it together are its head); rows and sideband are forwarded untouched.

Metrics: ``prefill_calls``/``decode_calls`` are the pipeline's own counters (every call
counted, including those the coordinator refuses without forwarding). ``active_sessions``
and ``kv_tokens`` are the per-field maximum over the stages: when the stages agree (they
must) that is the first stage's figure; when they disagree (a stage kept a session or
tokens the others freed) the maximum shows the leak, so the kit's metrics check reports
the desync right after the step that caused it (``MetricsResult`` carries no status, and
raising from ``metrics()`` would read as a process death rather than a desync).

``cancel`` and ``release`` go to every stage; if the stages answer with different codes
the pipeline answers ``INTERNAL`` naming each stage's code, else stage 1's status.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from shardkit._public import settle
from shardkit.contract import (
    OUTPUT_BOUNDARY_POINT,
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineError,
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
    role_of,
)
from shardkit.engines._checks import identity_problem, refusal
from shardkit.engines.base import one_call_at_a_time
from shardkit.engines.fake import FakeShardEngine

__all__ = ["PipelineEngine"]

StageFactory = Callable[[], ShardEngine]
_StepRequest = PrefillRequest | DecodeRequest
_OK = StructuredStatus(StatusCode.OK)
#: The figures every stage must agree on: they describe the one model the stages split.
_SHARED_FIGURES = ("total_layers", "architecture", "hidden_size", "vocab_size", "dtype")


@dataclass(frozen=True)
class _Stage:
    engine: ShardEngine
    number: int  # 1-based
    count: int
    start: int
    end: int
    role: Role

    @property
    def label(self) -> str:
        return f"stage {self.number} of {self.count} (layers {self.start}..{self.end})"


def _as_input_for(role: Role, bundle: BoundaryBundle) -> BoundaryBundle:
    """A middle accepts only ``post_head_residual`` (contract §1), so a middle's bundle going
    to a second middle is re-tagged: to the receiving stage, every stage before it
    together is its head. The tag is metadata; the rows and sideband are untouched."""
    head_point = OUTPUT_BOUNDARY_POINT["head"]
    if role == "middle" and bundle.boundary_point != head_point:
        return replace(bundle, boundary_point=head_point)
    return bundle


def _load_error(code: StatusCode, message: str) -> EngineError:
    return EngineError(StructuredStatus(code, message))


class PipelineEngine(ShardEngine):
    """Stage engines chained into one engine with the ``full`` role.

    ``cuts`` are the last layer of every stage but the final one: with 4 layers,
    ``(1, 2)`` makes stages 0..1 (head), 2..2 (middle) and 3..3 (tail); ``()`` is a
    single full stage. ``stage_factory`` builds each stage engine (default
    ``FakeShardEngine``); it is called once per stage, at construction.
    """

    def __init__(self, stage_factory: StageFactory | None = None, cuts: Sequence[int] = (1, 2)) -> None:
        if isinstance(cuts, (str, bytes)) or not isinstance(cuts, Sequence):
            message = f"PipelineEngine cuts must be a sequence of ints, got {cuts!r}"
            raise TypeError(message)
        for cut in cuts:
            if not isinstance(cut, int) or isinstance(cut, bool):
                message = f"PipelineEngine cuts must be ints, got {cut!r} ({type(cut).__name__}) in {cuts!r}"
                raise TypeError(message)
        if any(later <= earlier for earlier, later in itertools.pairwise(cuts)):
            message = f"PipelineEngine cuts must be strictly increasing (each the last layer of a stage), got {cuts!r}"
            raise ValueError(message)
        self._calls = threading.RLock()
        self._cuts: tuple[int, ...] = tuple(cuts)
        build = stage_factory if stage_factory is not None else FakeShardEngine
        self._engines: tuple[ShardEngine, ...] = tuple(build() for _ in range(len(self._cuts) + 1))
        self._stages: tuple[_Stage, ...] | None = None  # set once every stage has loaded
        self._load_started = False
        self._vocab_size = 0
        self._prefill_calls = 0
        self._decode_calls = 0

    @classmethod
    def factory(cls, stage_factory: StageFactory, cuts: Sequence[int] = (1, 2)) -> Callable[[], PipelineEngine]:
        """A zero-argument engine target building this pipeline over ``stage_factory``."""
        frozen_cuts = tuple(cuts)

        def build() -> PipelineEngine:
            return cls(stage_factory, frozen_cuts)

        stage_name = getattr(stage_factory, "__qualname__", None) or repr(stage_factory)
        build.__qualname__ = build.__name__ = f"{cls.__qualname__}.factory({stage_name}, {frozen_cuts})"
        build.__module__ = cls.__module__
        return build

    @property
    def stages(self) -> tuple[ShardEngine, ...]:
        """The stage engines, head first."""
        return self._engines

    @property
    def cuts(self) -> tuple[int, ...]:
        return self._cuts

    # --- loading and capabilities ------------------------------------------------------

    def _stage_ranges(self, total_layers: int) -> list[tuple[int, int]]:
        last = total_layers - 1
        for cut in self._cuts:
            if not 0 <= cut < last:
                message = (
                    f"PipelineEngine cut {cut} (of cuts {self._cuts}) does not fit a {total_layers}-layer model: "
                    f"each cut is the last layer of a stage and must lie in [0, {last - 1}] so the next stage "
                    "has a layer"
                )
                raise _load_error(StatusCode.INVALID_ARGUMENT, message)
        starts = [0, *(cut + 1 for cut in self._cuts)]
        ends = [*self._cuts, last]
        return list(zip(starts, ends, strict=True))

    def _combine(self, figures: Sequence[EngineCapabilities]) -> EngineCapabilities:
        """The pipeline's capabilities from the stages': shared figures must agree,
        budgets are the minimum, tolerances add up (contract §3 composition)."""
        first = figures[0]
        for number, caps in enumerate(figures[1:], start=2):
            for name in _SHARED_FIGURES:
                if getattr(caps, name) != getattr(first, name):
                    message = (
                        f"PipelineEngine stage {number} has {name}={getattr(caps, name)!r} but stage 1 has "
                        f"{getattr(first, name)!r}: the stages must split one model; build them alike"
                    )
                    raise _load_error(StatusCode.FAILED_PRECONDITION, message)
        real = all(caps.evidence_class == "real" for caps in figures)
        evidence: Literal["fixture", "real"] = "real" if real else "fixture"
        return EngineCapabilities(
            architecture=first.architecture,
            evidence_class=evidence,
            total_layers=first.total_layers,
            shard_start=0,
            shard_end=first.total_layers - 1,
            hidden_size=first.hidden_size,
            vocab_size=first.vocab_size,
            dtype=first.dtype,
            max_sessions=min(caps.max_sessions for caps in figures),
            max_kv_tokens=min(caps.max_kv_tokens for caps in figures),
            supported_faults=frozenset(),
            tolerance=sum(caps.tolerance for caps in figures),
            relative_tolerance=sum(caps.tolerances()[1] for caps in figures),
            margin_tolerance=sum(caps.tolerances()[2] for caps in figures),
            # Its calls run one at a time, so its stages never see two at once.
            concurrent_calls=True,
        )

    @one_call_at_a_time
    def capabilities(self) -> EngineCapabilities:
        return self._combine([engine.capabilities() for engine in self._engines])

    @one_call_at_a_time
    def load(self, request: LoadRequest) -> LoadResult:
        if self._stages is not None or self._load_started:
            state = "already serves" if self._stages is not None else "half-loaded its stages for"
            message = f"PipelineEngine {state} a model; construct a fresh PipelineEngine to load another"
            raise _load_error(StatusCode.FAILED_PRECONDITION, message)
        unloaded = [engine.capabilities() for engine in self._engines]
        largest = self._combine(unloaded)
        total = largest.total_layers
        if request.total_layers != total or request.role != "full":
            message = (
                f"PipelineEngine serves the whole model only: layers 0..{total - 1} of {total}, got layers "
                f"{request.shard_start}..{request.shard_end} of {request.total_layers}; load a stage engine "
                "directly to serve part of it"
            )
            raise _load_error(StatusCode.INVALID_ARGUMENT, message)
        ranges = self._stage_ranges(total)
        count = len(ranges)
        stages = [
            _Stage(engine, index + 1, count, start, end, role_of(start, end, total))
            for index, (engine, (start, end)) in enumerate(zip(self._engines, ranges, strict=True))
        ]
        self._check_first_stage_is_tightest(stages, unloaded)
        self._load_started = True
        architectures = set()
        for stage in stages:
            sub = LoadRequest(request.model_id, stage.start, stage.end, request.total_layers, request.recipe)
            try:
                loaded = stage.engine.load(sub)
            except EngineError as error:
                message = f"PipelineEngine {stage.label} refused to load: {error.status.message}"
                raise _load_error(error.status.code, message) from error
            if not loaded.status.ok:
                message = (
                    f"PipelineEngine {stage.label} refused to load: {loaded.status.code.name} {loaded.status.message}"
                )
                raise _load_error(loaded.status.code, message)
            caps = stage.engine.capabilities()
            if (caps.shard_start, caps.shard_end) != (stage.start, stage.end):
                message = (
                    f"PipelineEngine {stage.label} reports layers {caps.shard_start}..{caps.shard_end} after "
                    "loading them; the stage engine misreports its range"
                )
                raise _load_error(StatusCode.INTERNAL, message)
            architectures.add(loaded.architecture)
        if len(architectures) != 1:
            message = f"PipelineEngine stages loaded different architectures {sorted(architectures)}"
            raise _load_error(StatusCode.FAILED_PRECONDITION, message)
        combined = self._combine([stage.engine.capabilities() for stage in stages])
        self._vocab_size = combined.vocab_size
        self._stages = tuple(stages)
        return LoadResult(_OK, combined.architecture)

    @staticmethod
    def _check_first_stage_is_tightest(stages: Sequence[_Stage], figures: Sequence[EngineCapabilities]) -> None:
        """Rule 7 agrees across the stages only if stage 1 admits no more than any other."""
        for stage, caps in zip(stages[1:], figures[1:], strict=True):
            for name in ("max_sessions", "max_kv_tokens"):
                if getattr(caps, name) < getattr(figures[0], name):
                    message = (
                        f"PipelineEngine {stage.label} has {name}={getattr(caps, name)}, below stage 1's "
                        f"{getattr(figures[0], name)}: stage 1 admits each step for the whole pipeline, so it "
                        "must have the tightest budget; give it the smallest (or equal) budget"
                    )
                    raise _load_error(StatusCode.FAILED_PRECONDITION, message)

    # --- steps -------------------------------------------------------------------------

    @one_call_at_a_time
    def prefill(self, request: PrefillRequest) -> StepResult:
        self._prefill_calls += 1
        return self._step(request, "prefill")

    @one_call_at_a_time
    def decode(self, request: DecodeRequest) -> StepResult:
        self._decode_calls += 1
        return self._step(request, "decode")

    def _step(self, request: _StepRequest, operation: str) -> StepResult:
        stages = self._stages
        if stages is None:
            return refusal(StatusCode.UNAVAILABLE, f"{operation} before load; call load() first")
        problem = self._input_problem(request, operation)
        if problem is not None:
            return refusal(StatusCode.INVALID_ARGUMENT, f"{operation}: {problem}")
        first_cache: CacheResult | None = None
        forwarded: _StepRequest = request
        output: BoundaryBundle | TokenOutput | None = None
        for stage in stages:
            if stage.number > 1:
                assert isinstance(output, BoundaryBundle)
                forwarded = self._downstream_request(request, _as_input_for(stage.role, output))
            if isinstance(forwarded, PrefillRequest):
                result = stage.engine.prefill(forwarded)
            else:
                result = stage.engine.decode(forwarded)
            status = result.status
            if not status.ok:
                if stage.number == 1:
                    # Stage 1 decides: nothing has advanced anywhere, so its refusal is the pipeline's.
                    message = f"{stage.label}: {status.message}"
                    return StepResult(StructuredStatus(status.code, message, status.retryable), result.cache)
                return self._desync(stage, f"refused a step stage 1 accepted: {status.code.name} {status.message}")
            if first_cache is None:
                first_cache = result.cache
            elif result.cache is not first_cache:
                return self._desync(stage, f"answered {result.cache.name} where stage 1 answered {first_cache.name}")
            output = result.output
            last = stage.number == stage.count
            expected = TokenOutput if last else BoundaryBundle
            if not isinstance(output, expected):
                return self._desync(stage, f"answered OK with {type(output).__name__}, not a {expected.__name__}")
        assert first_cache is not None
        assert output is not None
        return StepResult(_OK, first_cache, output)

    def _downstream_request(self, request: _StepRequest, bundle: BoundaryBundle) -> _StepRequest:
        """What the next stage gets: the same operation, session, epoch and step, carrying the bundle."""
        return type(request)(request.session_id, request.epoch, request.step, bundle=bundle)

    @staticmethod
    def _desync(stage: _Stage, what: str) -> StepResult:
        message = (
            f"pipeline desync: {stage.label} {what}; the earlier stages have already advanced, so the stages "
            "no longer hold the same session state"
        )
        return refusal(StatusCode.INTERNAL, message)

    def _input_problem(self, request: _StepRequest, operation: str) -> str | None:
        """contract §2 rule 2 for the pipeline as a full engine, checked before any stage sees the request."""
        problem = identity_problem(request.session_id, epoch=request.epoch, step=request.step)
        if problem is not None:
            return problem
        if request.token_ids is None:
            return "the pipeline is a full engine and takes token_ids, got a bundle; send token_ids"
        if not request.token_ids:
            return "the input is empty; send at least one token"
        if operation == "decode" and len(request.token_ids) != 1:
            return f"a decode takes exactly one token, got {len(request.token_ids)}; send more with prefill"
        vocab = self._vocab_size
        outside = [token for token in request.token_ids if not 0 <= token < vocab]
        if outside:
            return f"token ids {outside} are outside the vocabulary [0, {vocab})"
        return None

    # --- session control ---------------------------------------------------------------

    @one_call_at_a_time
    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        stages = self._stages
        if stages is None:
            return StructuredStatus(StatusCode.UNAVAILABLE, "cancel before load; call load() first")
        problem = identity_problem(session_id, epoch=epoch)
        if problem is not None:
            return StructuredStatus(StatusCode.INVALID_ARGUMENT, f"cancel of session {session_id!r}: {problem}")
        return self._agreed("cancel", stages, [stage.engine.cancel(session_id, epoch) for stage in stages])

    @one_call_at_a_time
    def release(self, session_id: str) -> StructuredStatus:
        stages = self._stages
        if stages is None:
            return StructuredStatus(StatusCode.UNAVAILABLE, "release before load; call load() first")
        return self._agreed("release", stages, [stage.engine.release(session_id) for stage in stages])

    @staticmethod
    def _agreed(operation: str, stages: Sequence[_Stage], statuses: Sequence[StructuredStatus]) -> StructuredStatus:
        """Every stage got the call; they hold the same sessions, so they must answer alike."""
        codes = {status.code for status in statuses}
        if len(codes) > 1:
            answers = ", ".join(
                f"stage {stage.number}: {status.code.name}" for stage, status in zip(stages, statuses, strict=True)
            )
            message = f"pipeline desync: the stages answered {operation} differently ({answers})"
            return StructuredStatus(StatusCode.INTERNAL, message)
        first = statuses[0]
        if first.ok:
            return _OK
        return StructuredStatus(first.code, f"{stages[0].label}: {first.message}", first.retryable)

    @one_call_at_a_time
    def health(self) -> HealthResult:
        stages = self._stages
        if stages is None:
            return HealthResult(_OK, serving=False)
        for stage in stages:
            health = stage.engine.health()
            if not health.status.ok or not health.serving:
                message = f"{stage.label} is not serving: {health.status.code.name} {health.status.message}"
                return HealthResult(StructuredStatus(health.status.code, message, health.status.retryable), False)
        return HealthResult(_OK, serving=True)

    @one_call_at_a_time
    def metrics(self) -> MetricsResult:
        figures = [engine.metrics() for engine in self._engines]
        return MetricsResult(
            prefill_calls=self._prefill_calls,
            decode_calls=self._decode_calls,
            active_sessions=max(metrics.active_sessions for metrics in figures),
            kv_tokens=max(metrics.kv_tokens for metrics in figures),
        )


settle(__name__, globals())
