"""The bundled fixture engine: SPEC §2 lifecycle, §3 output properties and §4 faults.

Expected statuses are written by hand from SPEC, never taken from the reference model,
so that fuzzing the engine against the model checks two independent readings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.contract import (
    FAULT_KINDS,
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineError,
    EngineTensor,
    Fault,
    FaultInjectable,
    LoadRequest,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    TokenOutput,
)
from shardkit.engines import FakeShardEngine, FakeShardEngineConfig
from shardkit.engines import fake as fake_module
from shardkit.engines.fake import FakeEngineCrash

HIDDEN, VOCAB, LAYERS, ARCHITECTURE = 8, 32, 4, "shardkit-fake"
RANGES = {"head": (0, 1), "middle": (1, 2), "tail": (2, 3), "full": (0, 3)}
ROLES = tuple(RANGES)
Op = Literal["prefill", "decode"]
PROPERTY_SETTINGS = settings(max_examples=100, deadline=None)
_ROW_INDEX_SIDEBAND: Any = object()


def loaded(role: str = "full", *, model_id: str = "fixture-model", **config: Any) -> FakeShardEngine:
    return loaded_range(*RANGES[role], model_id=model_id, **config)


def loaded_range(start: int, end: int, *, model_id: str = "fixture-model", **config: Any) -> FakeShardEngine:
    engine = FakeShardEngine(FakeShardEngineConfig(**config))
    assert engine.load(LoadRequest(model_id, start, end, LAYERS)).status.ok
    return engine


def residual(
    rows: Sequence[Sequence[float]] | np.ndarray,
    *,
    session: str = "s",
    epoch: int = 0,
    step: int = 0,
    point: str = "post_head_residual",
    architecture: str = ARCHITECTURE,
    sideband: tuple[int, ...] | None = _ROW_INDEX_SIDEBAND,
    tensors: tuple[EngineTensor, ...] | None = None,
) -> BoundaryBundle:
    array = np.asarray(rows, dtype=np.float32).reshape(-1, HIDDEN)
    if sideband is _ROW_INDEX_SIDEBAND:
        sideband = tuple(range(len(array)))
    tensors = tensors if tensors is not None else (EngineTensor.from_array("residual", array),)
    return BoundaryBundle(session, epoch, step, point, architecture, tensors, sideband)


def rows_for(tokens: Sequence[int]) -> np.ndarray:
    """Synthetic residual rows, one per token, for feeding middle and tail shards."""
    return np.array([[(token + column) / 64 for column in range(HIDDEN)] for token in tokens], dtype=np.float32)


def request(
    op: Op, role: str, tokens: Sequence[int], *, session: str = "s", epoch: int = 0, step: int = 0
) -> PrefillRequest | DecodeRequest:
    """A well-formed request carrying ``tokens`` (or rows made from them) in the role's input kind."""
    cls = PrefillRequest if op == "prefill" else DecodeRequest
    if role in ("head", "full"):
        return cls(session, epoch, step, token_ids=tuple(tokens))
    bundle = residual(rows_for(tokens), session=session, epoch=epoch, step=step, sideband=tuple(tokens))
    return cls(session, epoch, step, bundle=bundle)


def send(engine: FakeShardEngine, built: PrefillRequest | DecodeRequest) -> StepResult:
    return engine.prefill(built) if isinstance(built, PrefillRequest) else engine.decode(built)


def call(engine: FakeShardEngine, op: Op, role: str, tokens: Sequence[int], **ids: Any) -> StepResult:
    return send(engine, request(op, role, tokens, **ids))


def prefill(engine: FakeShardEngine, tokens: Sequence[int], **ids: Any) -> StepResult:
    return call(engine, "prefill", "full", tokens, **ids)


def decode(engine: FakeShardEngine, token: int, **ids: Any) -> StepResult:
    return call(engine, "decode", "full", [token], **ids)


def assert_ok(result: StepResult, cache: CacheResult) -> None:
    assert (result.status.code, result.cache, result.status.retryable) == (StatusCode.OK, cache, False)
    assert result.output is not None


def assert_refused(result: StepResult, code: StatusCode, *, retryable: bool = False) -> None:
    assert (result.status.code, result.cache, result.output) == (code, CacheResult.MISS, None)
    assert result.status.retryable is retryable
    assert result.status.message


def occupancy(engine: FakeShardEngine) -> tuple[int, int]:
    metrics = engine.metrics()
    return metrics.active_sessions, metrics.kv_tokens


def residual_rows(result: StepResult) -> np.ndarray:
    assert isinstance(result.output, BoundaryBundle)
    return result.output.tensors[0].to_array()


def token_of(result: StepResult) -> int:
    assert isinstance(result.output, TokenOutput)
    return result.output.token_id


class SleepRecorder:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


# --- configuration ----------------------------------------------------------------------


def test_config_defaults_are_the_ones_spec_fixes() -> None:
    """SPEC §1 fixes 4 layers, hidden 8, vocab 32, 4 sessions, 64 kv tokens; every knob is off."""
    config = FakeShardEngineConfig()
    sizes = (config.total_layers, config.hidden_size, config.vocab_size, config.max_sessions, config.max_kv_tokens)
    assert sizes == (4, 8, 32, 4, 64)
    assert (config.dtype, config.architecture) == ("float32", "shardkit-fake")
    assert (config.step_delay_seconds, config.malformed_output, config.crash_after_calls) == (0.0, False, None)
    assert isinstance(config.crash_exception_factory(), RuntimeError)


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("total_layers", 0),
        ("hidden_size", 0),
        ("vocab_size", 0),
        ("max_sessions", 0),
        ("max_kv_tokens", -1),
        ("step_delay_seconds", -0.5),
        ("step_delay_seconds", float("nan")),
        ("crash_after_calls", 0),
        ("crash_after_calls", -3),
        ("dtype", "float16"),
    ],
)
def test_config_rejects_a_bad_value_naming_the_field_and_the_value(field_name: str, value: Any) -> None:
    """A bad knob fails at construction, with the field and the value in the message."""
    with pytest.raises(ValueError, match=rf"FakeShardEngineConfig\.{field_name} must .*got {value!r}"):
        FakeShardEngineConfig(**{field_name: value})


def test_config_accepts_a_zero_kv_budget_and_compares_without_its_callables() -> None:
    """max_kv_tokens=0 is a legal (if useless) budget; injected callables do not affect equality."""
    assert FakeShardEngineConfig(max_kv_tokens=0, sleep=SleepRecorder()) == FakeShardEngineConfig(max_kv_tokens=0)


# --- loading and capabilities --------------------------------------------------------------


def test_capabilities_before_load_describe_the_largest_loadable_range() -> None:
    """Before load: layers 0..total-1, the configured architecture, fixture evidence, exact tolerance."""
    caps = FakeShardEngine().capabilities()
    assert (caps.shard_start, caps.shard_end, caps.total_layers, caps.role) == (0, 3, 4, "full")
    assert (caps.architecture, caps.evidence_class, caps.tolerance) == (ARCHITECTURE, "fixture", 0.0)
    assert (caps.hidden_size, caps.vocab_size, caps.dtype) == (HIDDEN, VOCAB, "float32")
    assert (caps.max_sessions, caps.max_kv_tokens) == (4, 64)
    assert caps.supported_faults == frozenset(FAULT_KINDS)
    assert FakeShardEngine.EVIDENCE_CLASS == "fixture"


@pytest.mark.parametrize("role", ROLES)
def test_capabilities_after_load_describe_the_loaded_range(role: str) -> None:
    """After load the capabilities name the loaded range, hence the role."""
    caps = loaded(role).capabilities()
    assert (caps.shard_start, caps.shard_end) == RANGES[role]
    assert caps.role == role


def test_a_second_load_raises_failed_precondition() -> None:
    """Loading twice is misuse, reported as EngineError(FAILED_PRECONDITION)."""
    engine = loaded("head")
    with pytest.raises(EngineError, match=r"already serves layers 0\.\.1") as raised:
        engine.load(LoadRequest("fixture-model", 0, 3, LAYERS))
    assert raised.value.status.code is StatusCode.FAILED_PRECONDITION
    assert engine.capabilities().role == "head"


def test_a_load_with_another_total_layers_raises_invalid_argument() -> None:
    """A model of another depth cannot be served; the message says how to fix it."""
    engine = FakeShardEngine()
    with pytest.raises(EngineError, match="total_layers=5, but the model has 4; pass 4") as raised:
        engine.load(LoadRequest("fixture-model", 0, 4, 5))
    assert raised.value.status.code is StatusCode.INVALID_ARGUMENT
    assert not engine.health().serving


def test_a_recipe_architecture_reaches_the_load_result_capabilities_and_bundles() -> None:
    """recipe['architecture'] replaces the configured architecture everywhere, and inputs must carry it."""
    engine = FakeShardEngine()
    result = engine.load(LoadRequest("fixture-model", 0, 1, LAYERS, {"architecture": "llama-ish"}))
    assert (result.status.code, result.architecture) == (StatusCode.OK, "llama-ish")
    assert engine.capabilities().architecture == "llama-ish"
    output = prefill(engine, [1, 2]).output
    assert isinstance(output, BoundaryBundle)
    assert output.architecture == "llama-ish"
    tail = FakeShardEngine()
    tail.load(LoadRequest("fixture-model", 2, 3, LAYERS, {"architecture": "llama-ish"}))
    assert tail.prefill(PrefillRequest("s", 0, 0, bundle=output)).status.ok
    mismatched = PrefillRequest("t", 0, 0, bundle=residual([[0.0] * HIDDEN], session="t"))
    assert_refused(tail.prefill(mismatched), StatusCode.INVALID_ARGUMENT)


def test_a_non_string_recipe_architecture_raises_invalid_argument() -> None:
    """The architecture tag must be a str; anything else is a load error, and nothing is loaded."""
    engine = FakeShardEngine()
    with pytest.raises(EngineError, match="must be a str") as raised:
        engine.load(LoadRequest("fixture-model", 0, 3, LAYERS, {"architecture": 7}))
    assert raised.value.status.code is StatusCode.INVALID_ARGUMENT
    assert not engine.health().serving


def test_health_is_not_serving_before_load_and_serving_after() -> None:
    """health() answers OK both times; only ``serving`` changes."""
    engine = FakeShardEngine()
    before = engine.health()
    assert (before.status.ok, before.serving) == (True, False)
    engine.load(LoadRequest("fixture-model", 0, 3, LAYERS))
    assert engine.health().serving


def test_the_model_id_selects_the_weights() -> None:
    """Outputs are a function of the load request: another model id gives other residuals."""
    first = residual_rows(prefill(loaded("head", model_id="a"), [1, 2, 3]))
    second = residual_rows(prefill(loaded("head", model_id="b"), [1, 2, 3]))
    assert first.tobytes() != second.tobytes()


# --- roles: input and output kinds ----------------------------------------------------------


def test_a_head_returns_a_post_head_residual_with_its_tokens_as_sideband() -> None:
    """Head: token ids in, one float32 (n, hidden) residual out, sideband = the input ids."""
    result = prefill(loaded("head"), [5, 6, 7], session="h", epoch=3)
    assert_ok(result, CacheResult.MISS)
    bundle = result.output
    assert isinstance(bundle, BoundaryBundle)
    assert (bundle.session_id, bundle.epoch, bundle.step) == ("h", 3, 0)
    assert (bundle.boundary_point, bundle.architecture, bundle.token_id_sideband) == (
        "post_head_residual",
        ARCHITECTURE,
        (5, 6, 7),
    )
    (tensor,) = bundle.tensors
    assert (tensor.name, tensor.dtype, tensor.shape, len(tensor.data)) == ("residual", "float32", (3, HIDDEN), 96)
    assert np.isfinite(tensor.to_array()).all()


@pytest.mark.parametrize("sideband", [(9, 8), None])
def test_a_middle_returns_a_post_middle_residual_passing_its_sideband_through(sideband: tuple[int, ...] | None) -> None:
    """Middle: a post-head bundle in, a post-middle bundle out with the input sideband unchanged."""
    engine = loaded("middle")
    bundle = residual(rows_for([1, 2]), session="m", epoch=1, step=0, sideband=sideband)
    output = engine.prefill(PrefillRequest("m", 1, 0, bundle=bundle)).output
    assert isinstance(output, BoundaryBundle)
    assert (output.boundary_point, output.token_id_sideband) == ("post_middle_residual", sideband)
    assert (output.session_id, output.epoch, output.step, output.tensors[0].shape) == ("m", 1, 0, (2, HIDDEN))


@pytest.mark.parametrize("point", ["post_head_residual", "post_middle_residual"])
def test_a_tail_takes_a_residual_from_a_head_or_a_middle_and_returns_a_token(point: str) -> None:
    """Tail: either upstream boundary point in, a token inside the vocabulary out."""
    result = loaded("tail").prefill(PrefillRequest("s", 0, 0, bundle=residual(rows_for([3, 4]), point=point)))
    assert_ok(result, CacheResult.MISS)
    assert 0 <= token_of(result) < VOCAB


def test_a_full_shard_takes_tokens_and_returns_a_token_with_its_margin() -> None:
    """Full: token ids in, a TokenOutput in range out; the margin is top-1 minus top-2, so >= 0."""
    output = prefill(loaded("full"), [0, 31, 16]).output
    assert isinstance(output, TokenOutput)
    assert 0 <= output.token_id < VOCAB
    assert output.margin is not None
    assert output.margin >= 0


# --- rule 1: not loaded -------------------------------------------------------------------------


def test_every_session_call_before_load_is_unavailable() -> None:
    """Rule 1: prefill, decode, cancel and release answer UNAVAILABLE before load; calls still count."""
    engine = FakeShardEngine()
    assert_refused(prefill(engine, [1]), StatusCode.UNAVAILABLE)
    assert_refused(decode(engine, 1), StatusCode.UNAVAILABLE)
    assert engine.cancel("s", 0).code is StatusCode.UNAVAILABLE
    assert engine.release("s").code is StatusCode.UNAVAILABLE
    assert engine.metrics() == MetricsResult(prefill_calls=1, decode_calls=1, active_sessions=0, kv_tokens=0)


# --- rule 2: malformed input ----------------------------------------------------------------------

_ROW = [[0.25] * HIDDEN]
_MALFORMED: dict[str, tuple[str, Op, Any]] = {
    "bundle to a head": ("head", "prefill", {"bundle": residual(_ROW)}),
    "tokens to a middle": ("middle", "prefill", {"token_ids": (1,)}),
    "tokens to a tail": ("tail", "prefill", {"token_ids": (1,)}),
    "no tokens": ("full", "prefill", {"token_ids": ()}),
    "decode of two tokens": ("full", "decode", {"token_ids": (1, 2)}),
    "negative token": ("head", "prefill", {"token_ids": (1, -1)}),
    "token equal to the vocab size": ("full", "prefill", {"token_ids": (VOCAB,)}),
    "empty bundle": ("tail", "prefill", {"bundle": residual(np.zeros((0, HIDDEN)))}),
    "decode bundle of two rows": ("tail", "decode", {"bundle": residual(_ROW * 2)}),
    "wrong architecture": ("tail", "prefill", {"bundle": residual(_ROW, architecture="other")}),
    "wrong hidden size": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=(EngineTensor.from_array("residual", np.zeros((1, 7), np.float32)),))},
    ),
    "wrong dtype": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=(EngineTensor.from_array("residual", np.zeros((1, HIDDEN))),))},
    ),
    "short data": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=(EngineTensor("residual", "float32", (1, HIDDEN), bytes(31)),))},
    ),
    "rank-3 tensor": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=(EngineTensor.from_array("residual", np.zeros((1, 1, HIDDEN), "f4")),))},
    ),
    "two tensors": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=residual(_ROW).tensors * 2)},
    ),
    "no tensor": ("tail", "prefill", {"bundle": residual(_ROW, tensors=())}),
    "tensor not named residual": (
        "tail",
        "prefill",
        {"bundle": residual(_ROW, tensors=(EngineTensor.from_array("hidden", np.zeros((1, HIDDEN), "f4")),))},
    ),
    "nan value": ("tail", "prefill", {"bundle": residual([[float("nan")] + [0.0] * (HIDDEN - 1)])}),
    "infinite value": ("middle", "prefill", {"bundle": residual([[float("inf")] * HIDDEN])}),
    "middle given a middle's output": ("middle", "prefill", {"bundle": residual(_ROW, point="post_middle_residual")}),
    "tail given an unknown point": ("tail", "prefill", {"bundle": residual(_ROW, point="post_tail_logits")}),
    "sideband too long": ("tail", "prefill", {"bundle": residual(_ROW, sideband=(1, 2))}),
    "bundle of another session": ("tail", "prefill", {"bundle": residual(_ROW, session="other")}),
    "bundle of another epoch": ("tail", "prefill", {"bundle": residual(_ROW, epoch=1)}),
    "bundle of another step": ("middle", "prefill", {"bundle": residual(_ROW, step=1)}),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_input_is_invalid_argument_and_changes_nothing(case: str) -> None:
    """Rule 2: every malformed input listed in SPEC is refused with INVALID_ARGUMENT, no state change."""
    role, op, payload = _MALFORMED[case]
    engine = loaded(role)
    assert call(engine, "prefill", role, [1, 2], session="live").status.ok
    cls = PrefillRequest if op == "prefill" else DecodeRequest
    assert_refused(send(engine, cls("s", 0, 0, **payload)), StatusCode.INVALID_ARGUMENT)
    assert occupancy(engine) == (1, 2)


@pytest.mark.parametrize(
    ("session", "epoch", "step"),
    [("", 0, 0), ("s", -1, 0), ("s", 2**63, 0), ("s", 0, -1), ("s", 0, 2**63)],
)
@pytest.mark.parametrize("role", ["full", "tail"])
def test_a_bad_session_id_epoch_or_step_is_invalid_argument(role: str, session: str, epoch: int, step: int) -> None:
    """Rule 2: an empty session id, or an epoch or step outside [0, 2**63), is malformed."""
    engine = loaded(role)
    for op in ("prefill", "decode"):
        result = call(engine, op, role, [1], session=session, epoch=epoch, step=step)
        assert_refused(result, StatusCode.INVALID_ARGUMENT)
    assert occupancy(engine) == (0, 0)


def test_any_non_empty_string_is_a_session_id_and_epochs_may_start_anywhere() -> None:
    """Non-ASCII ids and the largest epoch are valid."""
    engine = loaded()
    assert_ok(prefill(engine, [1], session="セッション🙂", epoch=2**63 - 1), CacheResult.MISS)


# --- rules 3-4: unknown sessions and epochs ----------------------------------------------------


def test_a_prefill_at_step_zero_opens_an_unknown_session_at_its_epoch() -> None:
    """Rule 3: the first prefill opens the session at whatever epoch it names; its cache MISSes."""
    engine = loaded()
    assert_ok(prefill(engine, [1, 2], epoch=41), CacheResult.MISS)
    assert occupancy(engine) == (1, 2)
    assert_ok(decode(engine, 3, epoch=41, step=1), CacheResult.HIT)


def test_an_unknown_session_refuses_a_later_prefill_step_and_any_decode() -> None:
    """Rule 3: prefill at step > 0 is FAILED_PRECONDITION; decode is NOT_FOUND, even at step 0."""
    engine = loaded()
    assert_refused(prefill(engine, [1], step=1), StatusCode.FAILED_PRECONDITION)
    assert_refused(decode(engine, 1, step=0), StatusCode.NOT_FOUND)
    assert occupancy(engine) == (0, 0)


def test_a_stale_epoch_is_aborted() -> None:
    """Rule 4: any request below the session's epoch is ABORTED, whatever its step."""
    engine = loaded()
    prefill(engine, [1], epoch=5)
    assert_refused(prefill(engine, [1], epoch=4), StatusCode.ABORTED)
    assert_refused(decode(engine, 1, epoch=4, step=1), StatusCode.ABORTED)
    assert_ok(decode(engine, 1, epoch=5, step=1), CacheResult.HIT)


def test_a_higher_epoch_that_is_not_a_fresh_prefill_is_not_found() -> None:
    """Rule 4: at a higher epoch only prefill step 0 restarts; anything else is NOT_FOUND."""
    engine = loaded()
    prefill(engine, [1, 2])
    assert_refused(prefill(engine, [1], epoch=1, step=1), StatusCode.NOT_FOUND)
    assert_refused(decode(engine, 1, epoch=1, step=0), StatusCode.NOT_FOUND)
    assert occupancy(engine) == (1, 2)


def test_a_prefill_at_step_zero_and_a_higher_epoch_restarts_the_session() -> None:
    """Rule 4: a restart drops the old cache, MISSes, and counts steps from 0 again."""
    engine = loaded()
    prefill(engine, [1, 2, 3])
    decode(engine, 4, step=1)
    assert_ok(prefill(engine, [7], epoch=9), CacheResult.MISS)
    assert occupancy(engine) == (1, 1)
    assert_refused(decode(engine, 5, epoch=9, step=2), StatusCode.FAILED_PRECONDITION)
    assert_ok(decode(engine, 5, epoch=9, step=1), CacheResult.HIT)
    assert_refused(decode(engine, 5, epoch=0, step=2), StatusCode.ABORTED)


# --- rule 5: cancelled ----------------------------------------------------------------------------


def test_a_cancelled_session_answers_cancelled_even_to_a_retry() -> None:
    """Rule 5 precedes rule 6: after cancel, the next step and a retry of the last are both CANCELLED."""
    engine = loaded()
    prefill(engine, [1, 2])
    assert engine.cancel("s", 0).ok
    assert_refused(decode(engine, 3, step=1), StatusCode.CANCELLED)
    assert_refused(prefill(engine, [1, 2]), StatusCode.CANCELLED)
    assert_ok(prefill(engine, [1, 2], epoch=1), CacheResult.MISS)
    assert_ok(decode(engine, 3, epoch=1, step=1), CacheResult.HIT)


# --- rule 6: steps and idempotent retries ---------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_an_identical_retry_returns_the_identical_result_and_changes_nothing(role: str) -> None:
    """Rule 6: step == next_step - 1 with an equal request returns the very same result object."""
    engine = loaded(role)
    call(engine, "prefill", role, [1, 2, 3])
    first = call(engine, "decode", role, [4], step=1)
    before = engine.metrics()
    again = call(engine, "decode", role, [4], step=1)
    assert again is first
    after = engine.metrics()
    assert (after.active_sessions, after.kv_tokens, after.decode_calls) == (1, 4, before.decode_calls + 1)
    assert_ok(call(engine, "decode", role, [5], step=2), CacheResult.HIT)


def test_a_retry_of_a_first_step_repeats_its_cache_miss() -> None:
    """Rule 6: the retry's cache is the original's, so retrying step 0 reports MISS again."""
    engine = loaded()
    first = prefill(engine, [1, 2])
    assert prefill(engine, [1, 2]) is first
    assert first.cache is CacheResult.MISS


def test_a_retry_that_differs_in_any_field_or_operation_is_failed_precondition() -> None:
    """Rule 6: only an equal request of the same operation is a retry; other steps are out of order."""
    engine = loaded()
    prefill(engine, [1, 2])
    decode(engine, 3, step=1)
    assert_refused(decode(engine, 4, step=1), StatusCode.FAILED_PRECONDITION)
    assert_refused(prefill(engine, [3], step=1), StatusCode.FAILED_PRECONDITION)
    assert_refused(prefill(engine, [1, 2], step=0), StatusCode.FAILED_PRECONDITION)
    assert_refused(decode(engine, 3, step=3), StatusCode.FAILED_PRECONDITION)
    assert occupancy(engine) == (1, 3)


def test_a_bundle_retry_must_match_bundle_bytes_and_sideband() -> None:
    """Rule 6 compares bundles field by field, bytes and sideband included."""
    engine = loaded("tail")
    call(engine, "prefill", "tail", [1, 2])
    other_sideband = residual(rows_for([1, 2]), sideband=(7, 7))
    assert_refused(engine.prefill(PrefillRequest("s", 0, 0, bundle=other_sideband)), StatusCode.FAILED_PRECONDITION)
    assert call(engine, "prefill", "tail", [1, 2]).status.ok


def test_a_prefill_may_follow_a_decode() -> None:
    """Rule 8: chunked prefill can resume at any step; every later step HITs."""
    engine = loaded()
    prefill(engine, [1])
    decode(engine, 2, step=1)
    assert_ok(prefill(engine, [3, 4], step=2), CacheResult.HIT)
    assert occupancy(engine) == (1, 4)


# --- rule 7: capacity -------------------------------------------------------------------------------


def test_opening_a_session_beyond_max_sessions_is_retryable_resource_exhausted() -> None:
    """Rule 7: the fifth session is refused with retryable=True; nothing is allocated."""
    engine = loaded()
    for index in range(4):
        prefill(engine, [1], session=f"s{index}")
    assert_refused(prefill(engine, [1], session="s4"), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert occupancy(engine) == (4, 4)
    assert_ok(prefill(engine, [1, 2], session="s0", epoch=1), CacheResult.MISS)
    engine.release("s1")
    assert_ok(prefill(engine, [1], session="s4"), CacheResult.MISS)


def test_a_cancelled_session_still_holds_its_slot() -> None:
    """Cancel frees tokens, not the slot, so a new session can still be refused."""
    engine = loaded(max_sessions=1)
    prefill(engine, [1])
    engine.cancel("s", 0)
    assert_refused(prefill(engine, [1], session="t"), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert occupancy(engine) == (1, 0)


def test_kv_tokens_may_fill_the_budget_exactly_but_not_beyond() -> None:
    """Rule 7: used + new > max_kv_tokens is refused; == max is fine."""
    engine = loaded(max_kv_tokens=5)
    assert_ok(prefill(engine, [1, 2, 3]), CacheResult.MISS)
    assert_refused(prefill(engine, [1, 2, 3], session="t"), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert_refused(prefill(engine, [4, 5, 6], step=1), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert_ok(prefill(engine, [4, 5], step=1), CacheResult.HIT)
    assert_refused(decode(engine, 6, step=2), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert occupancy(engine) == (1, 5)


def test_a_restart_counts_its_old_tokens_as_freed_and_a_refused_one_keeps_the_old_epoch() -> None:
    """Rule 7: a restart is checked as used - old + new; if refused the old epoch lives on."""
    engine = loaded(max_kv_tokens=10)
    prefill(engine, [1] * 6, session="a")
    prefill(engine, [1] * 3, session="b")
    assert_refused(prefill(engine, [2] * 8, session="a", epoch=1), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert occupancy(engine) == (2, 9)
    assert_ok(decode(engine, 2, session="a", step=1), CacheResult.HIT)
    assert_ok(prefill(engine, [2] * 7, session="a", epoch=1), CacheResult.MISS)
    assert occupancy(engine) == (2, 10)


def test_a_failed_call_still_counts_but_changes_no_state() -> None:
    """Every call counts, refused ones too; a refused call leaves sessions and tokens alone."""
    engine = loaded(max_kv_tokens=2)
    prefill(engine, [1, 2])
    prefill(engine, [1], session="t")
    decode(engine, 9, session="nobody")
    decode(engine, 99, step=1)
    assert engine.metrics() == MetricsResult(prefill_calls=2, decode_calls=2, active_sessions=1, kv_tokens=2)


# --- cancel and release --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("session", "epoch", "expected"),
    [
        ("", 3, StatusCode.INVALID_ARGUMENT),
        ("s", -1, StatusCode.INVALID_ARGUMENT),
        ("s", 2**63, StatusCode.INVALID_ARGUMENT),
        ("unknown", 3, StatusCode.NOT_FOUND),
        ("s", 2, StatusCode.ABORTED),
        ("s", 4, StatusCode.NOT_FOUND),
        ("s", 3, StatusCode.OK),
    ],
)
def test_cancel_answers_by_session_and_epoch(session: str, epoch: int, expected: StatusCode) -> None:
    """cancel: bad ids are INVALID_ARGUMENT, unknown or higher NOT_FOUND, lower ABORTED, same OK."""
    engine = loaded()
    prefill(engine, [1, 2], epoch=3)
    assert engine.cancel(session, epoch).code is expected
    assert occupancy(engine) == (1, 0 if expected is StatusCode.OK else 2)


def test_cancel_frees_tokens_at_once_keeps_the_slot_and_may_be_repeated() -> None:
    """A cancelled session keeps its slot until released; cancelling twice is OK."""
    engine = loaded()
    prefill(engine, [1, 2, 3])
    prefill(engine, [1], session="other")
    assert engine.cancel("s", 0).ok
    assert occupancy(engine) == (2, 1)
    assert engine.cancel("s", 0).ok
    assert engine.release("s").ok
    assert occupancy(engine) == (1, 1)


def test_release_is_idempotent_and_forgets_the_session_entirely() -> None:
    """release is always OK once loaded; the id is unknown afterwards and may reopen at any epoch."""
    engine = loaded()
    prefill(engine, [1, 2], epoch=7)
    assert engine.release("s").ok
    assert engine.release("s").ok
    assert engine.release("never-seen").ok
    assert engine.release("").ok
    assert occupancy(engine) == (0, 0)
    assert_refused(decode(engine, 1, epoch=7, step=1), StatusCode.NOT_FOUND)
    assert_ok(prefill(engine, [1], epoch=0), CacheResult.MISS)


def test_two_interleaved_sessions_answer_as_if_each_ran_alone() -> None:
    """Sessions are isolated: interleaving two histories changes neither's outputs."""
    histories = {"a": [[1, 2, 3], [4], [5]], "b": [[9], [8, 7], [6]]}

    def run(engine: FakeShardEngine, session: str, step: int) -> int:
        tokens = histories[session][step]
        op: Op = "decode" if step and len(tokens) == 1 else "prefill"
        return token_of(call(engine, op, "full", tokens, session=session, step=step))

    alone: dict[str, list[int]] = {}
    for session in histories:
        engine = loaded()
        alone[session] = [run(engine, session, step) for step in range(3)]
    together: dict[str, list[int]] = {"a": [], "b": []}
    shared = loaded()
    for step in range(3):
        for session in ("a", "b"):
            together[session].append(run(shared, session, step))
    assert together == alone


# --- knobs ------------------------------------------------------------------------------------------


def test_step_delay_sleeps_before_every_step_without_changing_results() -> None:
    """step_delay_seconds goes to the injected sleep before each prefill and decode."""
    recorder = SleepRecorder()
    slow = loaded(step_delay_seconds=0.25, sleep=recorder)
    quick = loaded()
    assert prefill(slow, [1, 2]) == prefill(quick, [1, 2])
    assert decode(slow, 3, step=1) == decode(quick, 3, step=1)
    slow.cancel("s", 0)
    assert recorder.calls == [0.25, 0.25]


def test_the_malformed_output_knob_breaks_every_ok_output_structurally() -> None:
    """Config knob: tokens leave the vocabulary; bundles carry a wrong architecture and truncated data."""
    full = loaded(malformed_output=True)
    assert token_of(prefill(full, [1])) >= VOCAB
    assert token_of(decode(full, 2, step=1)) >= VOCAB
    assert_refused(decode(full, 2, step=5), StatusCode.FAILED_PRECONDITION)
    bundle = prefill(loaded("head", malformed_output=True), [1, 2]).output
    assert isinstance(bundle, BoundaryBundle)
    assert bundle.architecture != ARCHITECTURE
    assert len(bundle.tensors[0].data) < 2 * HIDDEN * 4


def test_crash_after_calls_lets_n_steps_succeed_and_kills_the_next_for_good() -> None:
    """N prefill/decode calls succeed (other operations do not count); the next one raises,
    naming the call, and every later call raises too."""
    engine = loaded(crash_after_calls=3)
    assert_ok(prefill(engine, [1]), CacheResult.MISS)
    for uncounted in (lambda: engine.cancel("x", 0), lambda: engine.release("x"), engine.health, engine.metrics):
        uncounted()
    engine.capabilities()
    assert_ok(decode(engine, 2, step=1), CacheResult.HIT)
    engine.release("t")
    assert_ok(prefill(engine, [3], step=2), CacheResult.HIT)
    with pytest.raises(FakeEngineCrash) as raised:
        decode(engine, 4, step=3)
    assert "decode() (prefill/decode call #4, crash_after_calls=3)" in "\n".join(raised.value.__notes__)
    for later in (engine.health, engine.metrics, engine.capabilities, lambda: prefill(engine, [1], session="t")):
        with pytest.raises(FakeEngineCrash):
            later()


def test_crash_after_calls_counts_refused_steps_too() -> None:
    """A refused prefill/decode is still a call: with N=1 the second call raises, whatever the first answered."""
    engine = loaded(crash_after_calls=1)
    assert_refused(decode(engine, 2, session="unknown"), StatusCode.NOT_FOUND)
    with pytest.raises(FakeEngineCrash):
        prefill(engine, [1])


def test_the_crash_exception_factory_decides_what_a_crash_raises() -> None:
    """A custom factory's exception is what escapes, even a BaseException."""

    class Killed(BaseException):
        pass

    engine = loaded(crash_after_calls=1, crash_exception_factory=Killed)
    prefill(engine, [1])
    engine.release("s")
    with pytest.raises(Killed):
        decode(engine, 2, step=1)


# --- faults -----------------------------------------------------------------------------------------


def test_the_engine_supports_every_fault_natively() -> None:
    """The fake satisfies FaultInjectable and lists all four kinds."""
    engine = FakeShardEngine()
    assert isinstance(engine, FaultInjectable)
    assert all(engine.inject_fault(Fault(kind)).ok for kind in ("delay", "memory_pressure", "malformed_output"))


@pytest.mark.parametrize(
    ("kind", "value"), [("delay", -1.0), ("memory_pressure", -1.0), ("crash", 0.0), ("crash", 0.5), ("crash", -2.0)]
)
def test_a_fault_value_that_means_nothing_is_invalid_argument(kind: Any, value: float) -> None:
    """Negative delays and limits, and crash counts below 1, are refused with the value in the message."""
    status = loaded().inject_fault(Fault(kind, value))
    assert status.code is StatusCode.INVALID_ARGUMENT
    assert repr(value) in status.message


def test_a_delay_fault_delays_only_the_next_step() -> None:
    """delay: the next prefill/decode sleeps that long first; the one after does not."""
    recorder = SleepRecorder()
    engine, reference = loaded(sleep=recorder), loaded()
    assert engine.inject_fault(Fault("delay", 1.5)).ok
    assert engine.cancel("s", 0).code is StatusCode.NOT_FOUND
    assert recorder.calls == []
    assert prefill(engine, [1, 2]) == prefill(reference, [1, 2])
    assert decode(engine, 3, step=1) == decode(reference, 3, step=1)
    assert recorder.calls == [1.5]


def test_memory_pressure_lowers_the_limit_but_keeps_live_caches() -> None:
    """memory_pressure: capabilities show the new limit; live tokens stay; growth past it is refused."""
    engine = loaded()
    prefill(engine, [1, 2, 3, 4])
    assert engine.inject_fault(Fault("memory_pressure", 5)).ok
    assert engine.capabilities().max_kv_tokens == 5
    assert occupancy(engine) == (1, 4)
    assert_ok(decode(engine, 5, step=1), CacheResult.HIT)
    assert_refused(decode(engine, 6, step=2), StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert engine.inject_fault(Fault("memory_pressure", 0)).ok
    assert decode(engine, 5, step=1).status.ok, "a retry is not checked for capacity"
    assert_refused(prefill(engine, [1], session="t"), StatusCode.RESOURCE_EXHAUSTED, retryable=True)


@pytest.mark.parametrize("role", ROLES)
def test_a_malformed_output_fault_corrupts_only_the_next_ok_output_and_keeps_it_valid(role: str) -> None:
    """malformed_output fault: one OK output is wrong yet well formed; the cache advances truthfully."""
    engine, clean = loaded(role), loaded(role)
    call(engine, "prefill", role, [1, 2])
    call(clean, "prefill", role, [1, 2])
    assert engine.inject_fault(Fault("malformed_output")).ok
    assert_refused(call(engine, "decode", role, [3], step=7), StatusCode.FAILED_PRECONDITION)
    wrong, right = call(engine, "decode", role, [3], step=1), call(clean, "decode", role, [3], step=1)
    assert_ok(wrong, CacheResult.HIT)
    assert wrong != right
    assert dataclasses.replace(wrong, output=None) == dataclasses.replace(right, output=None)
    if isinstance(right.output, TokenOutput):
        assert 0 <= token_of(wrong) < VOCAB
    else:
        assert isinstance(wrong.output, BoundaryBundle)
        assert isinstance(right.output, BoundaryBundle)
        assert dataclasses.replace(wrong.output, tensors=()) == dataclasses.replace(right.output, tensors=())
        assert residual_rows(wrong).shape == residual_rows(right).shape
        assert np.isfinite(residual_rows(wrong)).all()
    assert call(engine, "decode", role, [3], step=1) is wrong, "a retry returns what was returned"
    assert call(engine, "decode", role, [4], step=2) == call(clean, "decode", role, [4], step=2)


def test_a_malformed_output_fault_armed_before_a_retry_corrupts_the_retry() -> None:
    """The fault hits the next OK output, even a retry's, and leaves the stored result intact."""
    engine = loaded()
    first = prefill(engine, [1, 2])
    engine.inject_fault(Fault("malformed_output"))
    corrupted = prefill(engine, [1, 2])
    assert token_of(corrupted) != token_of(first)
    assert prefill(engine, [1, 2]) is first


def test_the_malformed_output_knob_and_fault_together_shift_the_truncated_residual() -> None:
    """Knob and fault compose: the knob truncates the bundle, then the fault shifts what is left by 0.5."""
    engine, knob_only = loaded("head", malformed_output=True), loaded("head", malformed_output=True)
    assert engine.inject_fault(Fault("malformed_output")).ok
    both, broken = prefill(engine, [1, 2]), prefill(knob_only, [1, 2])
    assert isinstance(both.output, BoundaryBundle)
    assert isinstance(broken.output, BoundaryBundle)
    assert both.output.architecture == broken.output.architecture == ARCHITECTURE + "-malformed"
    shifted = np.frombuffer(both.output.tensors[0].data, dtype="<f4")
    original = np.frombuffer(broken.output.tensors[0].data, dtype="<f4")
    assert len(shifted) == 2 * HIDDEN - 1
    assert np.array_equal(shifted, original + np.float32(0.5))
    assert prefill(engine, [1, 2]) is both, "a retry returns what was returned"


@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_crash_fault_kills_the_engine_on_the_counted_call(count: int) -> None:
    """crash: the value-th next prefill/decode/cancel/release raises; health and metrics do not count."""
    engine = loaded()
    prefill(engine, [1])
    assert engine.inject_fault(Fault("crash", count)).ok
    calls: list[Callable[[], object]] = [
        lambda: engine.cancel("x", 0),
        lambda: decode(engine, 2, step=1),
        lambda: engine.release("x"),
    ]
    for survivor in calls[: count - 1]:
        survivor()
        engine.health()
        engine.metrics()
    with pytest.raises(FakeEngineCrash):
        calls[count - 1]()
    with pytest.raises(FakeEngineCrash):
        engine.inject_fault(Fault("delay", 0))


class _UndoesPastTwoSessions(FakeShardEngine):
    """An override that calls the engine itself: it opens, then undoes an open past two
    sessions with ``super().release()`` (an admission limit of its own)."""

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = super().prefill(request)
        if result.status.ok and self.metrics().active_sessions > 2:
            super().release(request.session_id)
        return result


class _OneMoreOverride(_UndoesPastTwoSessions):
    def prefill(self, request: PrefillRequest) -> StepResult:
        super().cancel("nobody", 0)
        return super().prefill(request)


@pytest.mark.parametrize("engine_class", [_UndoesPastTwoSessions, _OneMoreOverride])
def test_a_crash_counts_each_call_of_the_kit_once_not_the_engines_calls_to_itself(
    engine_class: type[FakeShardEngine],
) -> None:
    """Contract §4 crash: an engine's calls to itself do not count. The third prefill runs a
    release (and, one class down, a cancel) inside it: still one call."""
    engine = engine_class()
    assert engine.load(LoadRequest("fixture-model", *RANGES["full"], LAYERS)).status.ok
    assert engine.inject_fault(Fault("crash", 4)).ok
    for session in ("a", "b", "c"):  # three counted calls, however many operations they ran
        assert prefill(engine, [1], session=session).status.ok
    assert engine.metrics().active_sessions == 2
    with pytest.raises(FakeEngineCrash, match=r"died in release\(\) \(call #4\)"):
        engine.release("a")


def test_the_earliest_armed_crash_wins() -> None:
    """Two crash faults: the one due first kills the process."""
    engine = loaded(crash_after_calls=10)
    engine.inject_fault(Fault("crash", 3))
    engine.inject_fault(Fault("crash", 5))
    engine.release("a")
    engine.release("b")
    with pytest.raises(FakeEngineCrash):
        engine.release("c")


# --- properties (SPEC §3) -----------------------------------------------------------------------------

Chunks = list[tuple[Op, tuple[int, ...]]]


@st.composite
def chunked_histories(draw: st.DrawFn, max_tokens: int = 12) -> Chunks:
    """A token history cut into a prefill, then prefill chunks and single-token decodes."""
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_tokens))
    chunks: Chunks = []
    while len(tokens) > sum(len(chunk) for _, chunk in chunks):
        start = sum(len(chunk) for _, chunk in chunks)
        size = draw(st.integers(1, len(tokens) - start))
        op: Op = "decode" if chunks and size == 1 and draw(st.booleans()) else "prefill"
        chunks.append((op, tuple(tokens[start : start + size])))
    return chunks


def run_pipeline(stages: Sequence[FakeShardEngine], chunks: Chunks, *, session: str = "s", epoch: int = 0) -> list[Any]:
    """Feed each chunk through the stages in order, one step each; return the last stage's outputs."""
    outputs = []
    for step, (op, tokens) in enumerate(chunks):
        cls = PrefillRequest if op == "prefill" else DecodeRequest
        output: Any = None
        for stage in stages:
            payload = {"token_ids": tokens} if output is None else {"bundle": output}
            result = send(stage, cls(session, epoch, step, **payload))
            assert result.status.ok, result.status
            output = result.output
        outputs.append(output)
    return outputs


def flatten(chunks: Chunks) -> tuple[int, ...]:
    return tuple(token for _, chunk in chunks for token in chunk)


@PROPERTY_SETTINGS
@given(chunked_histories())
def test_head_rows_do_not_depend_on_how_the_history_was_chunked(chunks: Chunks) -> None:
    """Chunking invariance: the head's rows equal those of one prefill of the whole history."""
    pieces = [output.tensors[0].to_array() for output in run_pipeline([loaded("head")], chunks)]
    whole = run_pipeline([loaded("head")], [("prefill", flatten(chunks))])[0].tensors[0].to_array()
    assert np.concatenate(pieces).tobytes() == whole.tobytes()


@PROPERTY_SETTINGS
@given(chunked_histories())
def test_full_tokens_depend_only_on_the_history_so_far(chunks: Chunks) -> None:
    """Chunking invariance: after each chunk, the token equals one prefill of that prefix."""
    tokens = run_pipeline([loaded()], chunks)
    reference = loaded()
    for index in range(len(chunks)):
        prefix = flatten(chunks[: index + 1])
        assert tokens[index] == run_pipeline([reference], [("prefill", prefix)], session=f"p{index}")[0]
        reference.release(f"p{index}")


SPLITS = [((0, a), (a + 1, 3)) for a in range(3)] + [
    ((0, a), (a + 1, b), (b + 1, 3)) for a in range(3) for b in range(a + 1, 3)
]


@PROPERTY_SETTINGS
@given(chunked_histories())
def test_every_layer_split_composes_to_the_full_model(chunks: Chunks) -> None:
    """Composition: head->tail and head->middle->tail equal the full shard, step by step, bit for bit."""
    full = run_pipeline([loaded()], chunks)
    for split in SPLITS:
        assert run_pipeline([loaded_range(*span) for span in split], chunks) == full, split


@PROPERTY_SETTINGS
@given(chunked_histories(), chunked_histories(max_tokens=4), st.text(min_size=1, max_size=5), st.integers(1, 2**62))
def test_outputs_do_not_depend_on_session_id_epoch_earlier_epochs_other_sessions_or_engine(
    chunks: Chunks, noise: Chunks, session: str, epoch: int
) -> None:
    """Determinism and isolation: the same load and history give the same outputs anywhere, at any epoch."""
    expected = run_pipeline([loaded("head"), loaded("tail")], chunks)
    head, tail = loaded("head"), loaded("tail")
    run_pipeline([head, tail], noise, session=session, epoch=0)
    run_pipeline([head, tail], noise, session="a-bystander", epoch=epoch)
    assert run_pipeline([head, tail], chunks, session=session, epoch=epoch) == expected
    assert run_pipeline([head, tail], chunks, session=session, epoch=epoch + 1) == expected


class _NothingKept(fake_module._PassMemo):
    MAX_BYTES = 0  # every pass computed afresh


def test_the_row_memo_changes_no_output_and_stays_within_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows and layer passes are memoised across fakes (the engine under test and its twins
    hash the same histories): the answers are those computed afresh, and a large hidden size
    cannot make the memos outgrow their bounds."""
    from shardkit.engines import fake

    def answers(config: FakeShardEngineConfig) -> list[object]:
        engine = FakeShardEngine(config)
        engine.load(LoadRequest("m", 0, config.total_layers - 1, config.total_layers))
        tokens = tuple(range(12))
        return [
            engine.prefill(PrefillRequest("s", 0, 0, token_ids=tokens[:5])).output,
            *(engine.decode(DecodeRequest("s", 0, step, token_ids=(tokens[step + 4],))).output for step in range(1, 8)),
        ]

    config = FakeShardEngineConfig(hidden_size=512)
    with monkeypatch.context() as unmemoised:
        unmemoised.setattr(fake, "_unit_float_bytes", fake._hashed_row)
        unmemoised.setattr(fake, "_PASS_MEMO", _NothingKept())
        computed = answers(config)
    monkeypatch.setattr(fake, "_ROW_MEMO", fake._RowMemo())
    monkeypatch.setattr(fake, "_PASS_MEMO", fake._PassMemo())
    first = answers(config)
    remembered = answers(config)  # every pass and row from the memos
    assert fake._PASS_MEMO._rows, "the passes were kept"
    monkeypatch.setattr(fake._BoundedMemo, "MAX_BYTES", 4096)  # about two rows of 2 KiB
    monkeypatch.setattr(fake, "_ROW_MEMO", fake._RowMemo())
    monkeypatch.setattr(fake, "_PASS_MEMO", fake._PassMemo())
    bounded = answers(config)
    assert computed == first == remembered == bounded
    for memo, size in ((fake._ROW_MEMO, len), (fake._PASS_MEMO, lambda kept: sum(map(len, kept[0])) + len(kept[1]))):
        assert 0 < memo._bytes <= 4096
        assert memo._bytes == sum(len(key) + size(value) for key, value in memo._rows.items())


@given(material=st.binary(max_size=64), count=st.integers(0, 300))
@settings(deadline=None)
def test_a_hashed_row_is_its_numpy_definition_bit_for_bit(material: bytes, count: int) -> None:
    """The fake hashes rows with the array module (faster for a handful of values); its
    definition is the numpy expression of ``_unit_floats``."""
    assert fake_module._hashed_row(material, count) == fake_module._unit_floats(material, count).tobytes()
