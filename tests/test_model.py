"""Unit tests for the reference model, written from SPEC §2 alone.

Each test drives ``ReferenceModel`` directly (no engine) and checks what it
predicts against a sentence of §2: the numbered rules for prefill/decode,
their precedence, cancel, release, health and metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shardkit._core.model import Prediction, ReferenceModel
from shardkit.contract import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineTensor,
    MetricsResult,
    PrefillRequest,
    StatusCode,
)

OK = StatusCode.OK
INVALID = StatusCode.INVALID_ARGUMENT
NOT_FOUND = StatusCode.NOT_FOUND
PRECONDITION = StatusCode.FAILED_PRECONDITION
ABORTED = StatusCode.ABORTED
CANCELLED = StatusCode.CANCELLED
EXHAUSTED = StatusCode.RESOURCE_EXHAUSTED
UNAVAILABLE = StatusCode.UNAVAILABLE
HIT = CacheResult.HIT
MISS = CacheResult.MISS

ARCH = "arch"
HIDDEN = 8
VOCAB = 32
DTYPE = "float32"
LIMIT = 2**63

ROLES = ("head", "middle", "tail", "full")
TOKEN_ROLES = ("head", "full")
BUNDLE_ROLES = ("middle", "tail")
SHARD_RANGE = {"head": (0, 1), "middle": (1, 2), "tail": (2, 3), "full": (0, 3)}


# --- builders --------------------------------------------------------------------------


def caps(role: str = "head", *, max_sessions: int = 4, max_kv_tokens: int = 64) -> EngineCapabilities:
    start, end = SHARD_RANGE[role]
    capabilities = EngineCapabilities(
        architecture=ARCH,
        evidence_class="fixture",
        total_layers=4,
        shard_start=start,
        shard_end=end,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        dtype=DTYPE,
        max_sessions=max_sessions,
        max_kv_tokens=max_kv_tokens,
        supported_faults=frozenset(),
        tolerance=0.0,
    )
    assert capabilities.role == role
    return capabilities


def loaded(role: str = "head", **limits: int) -> ReferenceModel:
    model = ReferenceModel()
    model.load(caps(role, **limits))
    return model


def residual(rows: int, fill: float = 0.0, dtype: Any = np.float32, width: int = HIDDEN) -> EngineTensor:
    return EngineTensor.from_array("residual", np.full((rows, width), fill, dtype=dtype))


_DEFAULT = object()


def make_bundle(
    session_id: str,
    epoch: int,
    step: int,
    rows: int = 1,
    fill: float = 0.0,
    *,
    point: str = "post_head_residual",
    architecture: str = ARCH,
    tensors: Any = None,
    sideband: Any = _DEFAULT,
) -> BoundaryBundle:
    if sideband is _DEFAULT:
        sideband = (1,) * rows
    return BoundaryBundle(
        session_id=session_id,
        epoch=epoch,
        step=step,
        boundary_point=point,
        architecture=architecture,
        tensors=(residual(rows, fill),) if tensors is None else tuple(tensors),
        token_id_sideband=sideband,
    )


def inputs(role: str, session_id: str, epoch: int, step: int, n: int = 1, fill: int = 1) -> dict[str, Any]:
    """A well-formed input of ``n`` tokens (or rows) for ``role``; ``fill`` varies its content."""
    if role in TOKEN_ROLES:
        return {"token_ids": (fill,) * n}
    return {"bundle": make_bundle(session_id, epoch, step, n, float(fill))}


def prefill_request(
    role: str, sid: str = "s", epoch: int = 0, step: int = 0, n: int = 1, fill: int = 1
) -> PrefillRequest:
    return PrefillRequest(session_id=sid, epoch=epoch, step=step, **inputs(role, sid, epoch, step, n, fill))


def decode_request(role: str, sid: str = "s", epoch: int = 0, step: int = 1, fill: int = 1) -> DecodeRequest:
    return DecodeRequest(session_id=sid, epoch=epoch, step=step, **inputs(role, sid, epoch, step, 1, fill))


def prefill(
    model: ReferenceModel, role: str, sid: str = "s", epoch: int = 0, step: int = 0, n: int = 1, fill: int = 1
) -> Prediction:
    return model.prefill(prefill_request(role, sid, epoch, step, n, fill))


def decode(
    model: ReferenceModel, role: str, sid: str = "s", epoch: int = 0, step: int = 1, fill: int = 1
) -> Prediction:
    return model.decode(decode_request(role, sid, epoch, step, fill))


def expect(
    p: Prediction,
    op: str,
    code: StatusCode,
    *,
    cache: CacheResult = MISS,
    rule: str | None = None,
    retryable: bool = False,
    is_retry: bool = False,
) -> None:
    """Assert every field of a prediction; non-OK always means MISS (§2 preamble)."""
    assert isinstance(p, Prediction)
    assert p.op == op, p
    assert p.code is code, p
    assert p.cache is cache, p
    if rule is not None:
        assert p.rule == rule, p
    assert p.retryable is retryable, p
    assert p.is_retry is is_retry, p
    assert isinstance(p.because, str), p
    assert p.because.strip(), p


def ok(p: Prediction, op: str, cache: CacheResult) -> None:
    expect(p, op, OK, cache=cache, rule="rule 8")


def session_snapshot(model: ReferenceModel) -> dict[str, tuple[Any, ...]]:
    return {
        sid: (
            state.epoch,
            state.next_step,
            state.kv_tokens,
            state.cancelled,
            state.last_request,
            state.last_cache,
            tuple(state.history),
        )
        for sid, state in model.sessions.items()
    }


def state_snapshot(model: ReferenceModel) -> tuple[Any, ...]:
    metrics = model.expected_metrics()
    return session_snapshot(model), metrics.active_sessions, metrics.kv_tokens


def counters(model: ReferenceModel) -> tuple[int, int]:
    metrics = model.expected_metrics()
    return metrics.prefill_calls, metrics.decode_calls


# --- health, metrics and rule 1 ---------------------------------------------------------


def test_an_unloaded_model_is_not_serving_and_holds_nothing() -> None:
    model = ReferenceModel()
    assert model.serving is False
    assert dict(model.sessions) == {}
    metrics = model.expected_metrics()
    assert (metrics.prefill_calls, metrics.decode_calls, metrics.active_sessions, metrics.kv_tokens) == (0, 0, 0, 0)


@pytest.mark.parametrize("role", ROLES)
def test_a_loaded_model_is_serving(role: str) -> None:
    assert loaded(role).serving is True


@pytest.mark.parametrize("role", ROLES)
def test_rule_1_every_operation_before_load_is_unavailable(role: str) -> None:
    model = ReferenceModel()
    expect(prefill(model, role), "prefill", UNAVAILABLE, rule="rule 1")
    expect(decode(model, role, step=0), "decode", UNAVAILABLE, rule="rule 1")
    expect(model.cancel("s", 0), "cancel", UNAVAILABLE, rule="rule 1")
    expect(model.release("s"), "release", UNAVAILABLE, rule="rule 1")
    assert dict(model.sessions) == {}
    assert model.serving is False


def test_rule_1_calls_before_load_are_still_counted() -> None:
    model = ReferenceModel()
    prefill(model, "head")
    prefill(model, "head", sid="t")
    decode(model, "head")
    model.cancel("s", 0)
    model.release("s")
    metrics = model.expected_metrics()
    assert (metrics.prefill_calls, metrics.decode_calls) == (2, 1)
    assert (metrics.active_sessions, metrics.kv_tokens) == (0, 0)


def test_rule_1_comes_before_rule_2_so_malformed_requests_before_load_are_unavailable() -> None:
    model = ReferenceModel()
    expect(model.prefill(PrefillRequest("", -1, -1, token_ids=(-1,))), "prefill", UNAVAILABLE, rule="rule 1")
    expect(model.decode(DecodeRequest("s", 0, 0, token_ids=(1, 2, VOCAB))), "decode", UNAVAILABLE, rule="rule 1")
    expect(model.cancel("", -1), "cancel", UNAVAILABLE, rule="rule 1")
    expect(model.release(""), "release", UNAVAILABLE, rule="rule 1")


# --- rule 2: malformed input ------------------------------------------------------------

# A case builds the request's fields from (role, session_id, epoch, step). All of
# them carry at most one token or row, so each is malformed as a decode too.
Case = Callable[[str, str, int, int], dict[str, Any]]


def _req(sid: str, epoch: int, step: int, **fields: Any) -> dict[str, Any]:
    return {"session_id": sid, "epoch": epoch, "step": step, **fields}


def _with_bundle(**overrides: Any) -> Case:
    def build(role: str, sid: str, epoch: int, step: int) -> dict[str, Any]:
        return _req(sid, epoch, step, bundle=make_bundle(sid, epoch, step, **overrides))

    return build


def _with_tensor(tensor: EngineTensor, sideband: Any = None) -> Case:
    return _with_bundle(tensors=(tensor,), sideband=sideband)


def _nonfinite(value: float) -> EngineTensor:
    array = np.zeros((1, HIDDEN), np.float32)
    array[0, 3] = value
    return EngineTensor.from_array("residual", array)


TOKEN_ROLE_CASES: dict[str, Case] = {
    "bundle-instead-of-tokens": lambda role, sid, e, s: _req(sid, e, s, bundle=make_bundle(sid, e, s)),
    "empty-token-ids": lambda role, sid, e, s: _req(sid, e, s, token_ids=()),
    "token-id-minus-one": lambda role, sid, e, s: _req(sid, e, s, token_ids=(-1,)),
    "token-id-equal-to-vocab-size": lambda role, sid, e, s: _req(sid, e, s, token_ids=(VOCAB,)),
    "token-id-far-above-vocab": lambda role, sid, e, s: _req(sid, e, s, token_ids=(2**40,)),
}

BUNDLE_ROLE_CASES: dict[str, Case] = {
    "token-ids-instead-of-bundle": lambda role, sid, e, s: _req(sid, e, s, token_ids=(1,)),
    "empty-bundle-zero-rows": _with_bundle(rows=0, sideband=()),
    "wrong-architecture": _with_bundle(architecture="other-arch"),
    "hidden-size-too-small": _with_tensor(residual(1, width=HIDDEN - 1), sideband=(1,)),
    "hidden-size-too-large": _with_tensor(residual(1, width=HIDDEN + 1), sideband=(1,)),
    "dtype-float64": _with_tensor(residual(1, dtype=np.float64), sideband=(1,)),
    "dtype-float16": _with_tensor(residual(1, dtype=np.float16), sideband=(1,)),
    "dtype-unknown-to-numpy": _with_tensor(EngineTensor("residual", "bogus", (1, HIDDEN), bytes(4 * HIDDEN)), (1,)),
    "data-length-short": _with_tensor(EngineTensor("residual", DTYPE, (1, HIDDEN), bytes(4 * HIDDEN - 1)), (1,)),
    "data-length-long": _with_tensor(EngineTensor("residual", DTYPE, (1, HIDDEN), bytes(4 * HIDDEN + 4)), (1,)),
    "data-length-zero": _with_tensor(EngineTensor("residual", DTYPE, (1, HIDDEN), b""), (1,)),
    "two-residual-tensors": _with_bundle(tensors=(residual(1), residual(1))),
    "residual-plus-extra-tensor": _with_bundle(
        tensors=(residual(1), EngineTensor.from_array("extra", np.zeros((1, HIDDEN), np.float32)))
    ),
    "no-tensors": _with_bundle(tensors=(), sideband=None),
    "tensor-not-named-residual": _with_tensor(
        EngineTensor.from_array("hidden", np.zeros((1, HIDDEN), np.float32)), (1,)
    ),
    "rank-1-tensor": _with_tensor(EngineTensor.from_array("residual", np.zeros(HIDDEN, np.float32))),
    "rank-3-tensor": _with_tensor(EngineTensor.from_array("residual", np.zeros((1, 1, HIDDEN), np.float32))),
    "nan-value": _with_tensor(_nonfinite(math.nan), (1,)),
    "inf-value": _with_tensor(_nonfinite(math.inf), (1,)),
    "minus-inf-value": _with_tensor(_nonfinite(-math.inf), (1,)),
    "unknown-boundary-point": _with_bundle(point="post_unknown_residual"),
    "empty-boundary-point": _with_bundle(point=""),
    "sideband-longer-than-rows": _with_bundle(sideband=(1, 2)),
    "sideband-empty-for-one-row": _with_bundle(sideband=()),
    "bundle-session-id-differs": lambda role, sid, e, s: _req(sid, e, s, bundle=make_bundle(sid + "-other", e, s)),
    "bundle-epoch-differs": lambda role, sid, e, s: _req(sid, e, s, bundle=make_bundle(sid, e + 1, s)),
    "bundle-step-differs": lambda role, sid, e, s: _req(sid, e, s, bundle=make_bundle(sid, e, s + 1)),
}

MIDDLE_ONLY_CASES: dict[str, Case] = {
    "middle-given-post-middle-residual": _with_bundle(point="post_middle_residual"),
}


def _identifier_case(field: str, value: Any) -> Case:
    def build(role: str, sid: str, epoch: int, step: int) -> dict[str, Any]:
        values = {"session_id": sid, "epoch": epoch, "step": step, field: value}
        fields = inputs(role, values["session_id"], values["epoch"], values["step"])
        return {**values, **fields}

    return build


COMMON_CASES: dict[str, Case] = {
    "empty-session-id": _identifier_case("session_id", ""),
    "epoch-minus-one": _identifier_case("epoch", -1),
    "epoch-two-to-the-63": _identifier_case("epoch", LIMIT),
    "step-minus-one": _identifier_case("step", -1),
    "step-two-to-the-63": _identifier_case("step", LIMIT),
}


def _malformed_table() -> list[Any]:
    table = []
    for role in ROLES:
        cases = dict(COMMON_CASES)
        cases.update(TOKEN_ROLE_CASES if role in TOKEN_ROLES else BUNDLE_ROLE_CASES)
        if role == "middle":
            cases.update(MIDDLE_ONLY_CASES)
        for name, case in cases.items():
            table.append(pytest.param(role, case, id=f"{role}-{name}"))
    return table


MALFORMED = _malformed_table()


@pytest.mark.parametrize(("role", "case"), MALFORMED)
def test_rule_2_a_malformed_prefill_opening_a_session_is_invalid_and_allocates_nothing(role: str, case: Case) -> None:
    """Also rule 2 before 3: the session is unknown, yet the answer is INVALID_ARGUMENT."""
    model = loaded(role)
    expect(model.prefill(PrefillRequest(**case(role, "s", 0, 0))), "prefill", INVALID, rule="rule 2")
    assert dict(model.sessions) == {}
    assert model.expected_metrics() == MetricsResult(1, 0, 0, 0)


@pytest.mark.parametrize(("role", "case"), MALFORMED)
def test_rule_2_a_malformed_decode_to_an_unknown_session_is_invalid_not_not_found(role: str, case: Case) -> None:
    model = loaded(role)
    expect(model.decode(DecodeRequest(**case(role, "s", 0, 0))), "decode", INVALID, rule="rule 2")
    assert dict(model.sessions) == {}


@pytest.mark.parametrize("op", ["prefill", "decode"])
@pytest.mark.parametrize(("role", "case"), MALFORMED)
def test_rule_2_a_malformed_request_at_the_next_step_of_a_live_session_is_invalid_and_changes_nothing(
    role: str, case: Case, op: str
) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=3), "prefill", MISS)
    before = state_snapshot(model)
    request_type = PrefillRequest if op == "prefill" else DecodeRequest
    expect(getattr(model, op)(request_type(**case(role, "s", 0, 1))), op, INVALID, rule="rule 2")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_2_a_decode_with_two_tokens_or_rows_is_invalid_while_a_two_token_prefill_is_fine(role: str) -> None:
    model = loaded(role)
    two = inputs(role, "s", 0, 0, n=2)
    expect(model.decode(DecodeRequest("s", 0, 0, **two)), "decode", INVALID, rule="rule 2")
    ok(model.prefill(PrefillRequest("s", 0, 0, **two)), "prefill", MISS)
    expect(model.decode(DecodeRequest("s", 0, 1, **inputs(role, "s", 0, 1, n=2))), "decode", INVALID, rule="rule 2")
    assert model.sessions["s"].kv_tokens == 2


@pytest.mark.parametrize("role", TOKEN_ROLES)
def test_rule_2_one_bad_token_among_good_ones_makes_the_prefill_invalid(role: str) -> None:
    model = loaded(role)
    expect(model.prefill(PrefillRequest("s", 0, 0, token_ids=(0, 5, VOCAB))), "prefill", INVALID, rule="rule 2")
    expect(model.prefill(PrefillRequest("s", 0, 0, token_ids=(-1, 5, 6))), "prefill", INVALID, rule="rule 2")


@pytest.mark.parametrize("role", TOKEN_ROLES)
@pytest.mark.parametrize("token", [0, VOCAB - 1])
def test_rule_2_tokens_at_both_ends_of_the_vocabulary_are_accepted(role: str, token: int) -> None:
    model = loaded(role)
    ok(model.prefill(PrefillRequest("s", 0, 0, token_ids=(token,))), "prefill", MISS)
    ok(model.decode(DecodeRequest("s", 0, 1, token_ids=(token,))), "decode", HIT)


@pytest.mark.parametrize("role", ROLES)
def test_rule_2_the_largest_valid_epoch_is_accepted(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=LIMIT - 1), "prefill", MISS)
    ok(decode(model, role, epoch=LIMIT - 1, step=1), "decode", HIT)
    assert model.sessions["s"].epoch == LIMIT - 1


@pytest.mark.parametrize("role", ROLES)
def test_rule_2_the_largest_valid_step_is_not_malformed_only_out_of_order(role: str) -> None:
    """Step 2**63-1 passes rule 2; on an unknown session rule 3 refuses it."""
    model = loaded(role)
    expect(prefill(model, role, step=LIMIT - 1), "prefill", PRECONDITION, rule="rule 3")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize(
    "sid", ["séance", "会话-🚀", " ", "\x00", "s" * 1000], ids=["accents", "cjk-emoji", "space", "nul", "long"]
)
def test_rule_2_any_non_empty_string_is_a_valid_session_id(role: str, sid: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid=sid), "prefill", MISS)
    ok(decode(model, role, sid=sid), "decode", HIT)
    assert sid in model.sessions


@pytest.mark.parametrize("role", BUNDLE_ROLES)
def test_rule_2_a_bundle_without_sideband_is_accepted(role: str) -> None:
    model = loaded(role)
    bundle = make_bundle("s", 0, 0, rows=2, sideband=None)
    ok(model.prefill(PrefillRequest("s", 0, 0, bundle=bundle)), "prefill", MISS)
    assert model.sessions["s"].kv_tokens == 2


@pytest.mark.parametrize(
    ("role", "point"),
    [("middle", "post_head_residual"), ("tail", "post_head_residual"), ("tail", "post_middle_residual")],
)
def test_rule_2_each_role_accepts_every_upstream_boundary_point(role: str, point: str) -> None:
    model = loaded(role)
    ok(model.prefill(PrefillRequest("s", 0, 0, bundle=make_bundle("s", 0, 0, 3, point=point))), "prefill", MISS)
    ok(model.decode(DecodeRequest("s", 0, 1, bundle=make_bundle("s", 0, 1, 1, point=point))), "decode", HIT)


@pytest.mark.parametrize("role", ["head", "full", "tail"])
def test_rule_2_malformed_wins_over_a_stale_epoch(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=5), "prefill", MISS)
    case = (TOKEN_ROLE_CASES | BUNDLE_ROLE_CASES)["token-id-minus-one" if role in TOKEN_ROLES else "nan-value"]
    expect(model.prefill(PrefillRequest(**case(role, "s", 1, 0))), "prefill", INVALID, rule="rule 2")


# --- rule 3: unknown session ------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("epoch", [0, 7, LIMIT - 1])
def test_rule_3_a_prefill_at_step_0_opens_an_unknown_session_at_any_epoch(role: str, epoch: int) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=epoch, n=3), "prefill", MISS)
    state = model.sessions["s"]
    assert (state.epoch, state.next_step, state.kv_tokens, state.cancelled) == (epoch, 1, 3, False)
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (1, 3)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("step", [1, 2, 1000])
def test_rule_3_a_prefill_past_step_0_to_an_unknown_session_is_a_failed_precondition(role: str, step: int) -> None:
    model = loaded(role)
    expect(prefill(model, role, step=step), "prefill", PRECONDITION, rule="rule 3")
    assert dict(model.sessions) == {}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("step", [0, 1, 5])
def test_rule_3_a_decode_to_an_unknown_session_is_not_found(role: str, step: int) -> None:
    model = loaded(role)
    expect(decode(model, role, step=step), "decode", NOT_FOUND, rule="rule 3")
    assert dict(model.sessions) == {}


def test_rule_3_comes_before_rule_7_for_unknown_sessions() -> None:
    """With every slot taken, an unknown session still gets NOT_FOUND / FAILED_PRECONDITION."""
    model = loaded("head", max_sessions=1)
    ok(prefill(model, "head", sid="a"), "prefill", MISS)
    expect(decode(model, "head", sid="b"), "decode", NOT_FOUND, rule="rule 3")
    expect(prefill(model, "head", sid="b", step=1), "prefill", PRECONDITION, rule="rule 3")


# --- rule 4: epochs ---------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_rule_4_a_lower_epoch_is_aborted_for_prefill_and_decode(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=3), "prefill", MISS)
    before = state_snapshot(model)
    expect(prefill(model, role, epoch=2, step=0), "prefill", ABORTED, rule="rule 4")
    expect(prefill(model, role, epoch=0, step=1), "prefill", ABORTED, rule="rule 4")
    expect(decode(model, role, epoch=2, step=1), "decode", ABORTED, rule="rule 4")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_4_a_higher_epoch_prefill_at_step_0_restarts_the_session(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=5), "prefill", MISS)
    ok(decode(model, role, step=1), "decode", HIT)
    assert model.sessions["s"].kv_tokens == 6
    ok(prefill(model, role, epoch=4, n=2), "prefill", MISS)
    state = model.sessions["s"]
    assert (state.epoch, state.next_step, state.kv_tokens, state.cancelled) == (4, 1, 2, False)
    assert len(state.history) == 1
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (1, 2)
    ok(decode(model, role, epoch=4, step=1), "decode", HIT)
    expect(decode(model, role, epoch=0, step=2), "decode", ABORTED, rule="rule 4")


@pytest.mark.parametrize("role", ROLES)
def test_rule_4_epochs_may_jump_by_any_amount(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=0), "prefill", MISS)
    ok(prefill(model, role, epoch=LIMIT - 1), "prefill", MISS)
    assert model.sessions["s"].epoch == LIMIT - 1
    expect(prefill(model, role, epoch=LIMIT - 2), "prefill", ABORTED, rule="rule 4")


@pytest.mark.parametrize("role", ROLES)
def test_rule_4_any_other_request_at_a_higher_epoch_is_not_found(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    ok(decode(model, role, step=1), "decode", HIT)
    before = state_snapshot(model)
    expect(decode(model, role, epoch=1, step=0), "decode", NOT_FOUND, rule="rule 4")
    expect(decode(model, role, epoch=1, step=2), "decode", NOT_FOUND, rule="rule 4")
    expect(prefill(model, role, epoch=1, step=1), "prefill", NOT_FOUND, rule="rule 4")
    expect(prefill(model, role, epoch=9, step=2), "prefill", NOT_FOUND, rule="rule 4")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_4_comes_before_rule_5_a_stale_epoch_on_a_cancelled_session_is_aborted(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=2), "prefill", MISS)
    expect(model.cancel("s", 2), "cancel", OK, rule="cancel")
    expect(prefill(model, role, epoch=1), "prefill", ABORTED, rule="rule 4")
    expect(decode(model, role, epoch=1, step=1), "decode", ABORTED, rule="rule 4")
    expect(decode(model, role, epoch=3, step=1), "decode", NOT_FOUND, rule="rule 4")


# --- rule 5: cancelled sessions ---------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_rule_5_a_cancelled_session_answers_cancelled_for_prefill_and_decode(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    expect(model.cancel("s", 0), "cancel", OK, rule="cancel")
    before = state_snapshot(model)
    expect(decode(model, role, step=1), "decode", CANCELLED, rule="rule 5")
    expect(prefill(model, role, step=1), "prefill", CANCELLED, rule="rule 5")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_5_comes_before_rule_6_wrong_steps_and_retries_on_a_cancelled_session_are_cancelled(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    ok(decode(model, role, step=1), "decode", HIT)
    model.cancel("s", 0)
    expect(decode(model, role, step=1), "decode", CANCELLED, rule="rule 5")  # would be a retry
    expect(prefill(model, role, step=0), "prefill", CANCELLED, rule="rule 5")  # wrong step
    expect(decode(model, role, step=7), "decode", CANCELLED, rule="rule 5")  # wrong step


# --- rule 6: steps and idempotent retries -----------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_the_next_step_proceeds_and_a_prefill_may_follow_a_decode(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=4), "prefill", MISS)
    ok(decode(model, role, step=1), "decode", HIT)
    ok(decode(model, role, step=2), "decode", HIT)
    ok(prefill(model, role, step=3, n=5), "prefill", HIT)
    ok(decode(model, role, step=4), "decode", HIT)
    state = model.sessions["s"]
    assert (state.next_step, state.kv_tokens) == (5, 4 + 1 + 1 + 5 + 1)
    assert len(state.history) == 5


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_repeating_the_step_0_prefill_is_an_idempotent_retry_with_a_miss(role: str) -> None:
    model = loaded(role)
    request = prefill_request(role, n=3)
    ok(model.prefill(request), "prefill", MISS)
    before = state_snapshot(model)
    calls = counters(model)
    expect(model.prefill(request), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)
    expect(model.prefill(prefill_request(role, n=3)), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)
    assert state_snapshot(model) == before
    assert counters(model) == (calls[0] + 2, calls[1])


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_repeating_a_later_decode_is_an_idempotent_retry_with_a_hit(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    ok(decode(model, role, step=1, fill=7), "decode", HIT)
    before = state_snapshot(model)
    calls = counters(model)
    expect(decode(model, role, step=1, fill=7), "decode", OK, cache=HIT, rule="rule 6", is_retry=True)
    assert state_snapshot(model) == before
    assert counters(model) == (calls[0], calls[1] + 1)
    ok(decode(model, role, step=2), "decode", HIT)


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_repeating_a_later_prefill_chunk_is_an_idempotent_retry_with_a_hit(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    ok(prefill(model, role, step=1, n=3, fill=2), "prefill", HIT)
    before = state_snapshot(model)
    expect(prefill(model, role, step=1, n=3, fill=2), "prefill", OK, cache=HIT, rule="rule 6", is_retry=True)
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_the_retry_of_a_restart_repeats_its_miss(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    ok(decode(model, role, step=1), "decode", HIT)
    ok(prefill(model, role, epoch=1, n=2), "prefill", MISS)
    expect(prefill(model, role, epoch=1, n=2), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)
    assert model.sessions["s"].kv_tokens == 2


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_a_same_step_request_with_other_input_is_a_failed_precondition(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=2, fill=1), "prefill", MISS)
    ok(decode(model, role, step=1, fill=3), "decode", HIT)
    before = state_snapshot(model)
    expect(decode(model, role, step=1, fill=4), "decode", PRECONDITION, rule="rule 6")
    expect(prefill(model, role, step=0, n=2, fill=2), "prefill", PRECONDITION, rule="rule 6")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_a_same_step_request_of_the_other_operation_is_a_failed_precondition(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, fill=1), "prefill", MISS)
    ok(decode(model, role, step=1, fill=3), "decode", HIT)
    before = state_snapshot(model)
    expect(prefill(model, role, step=1, n=1, fill=3), "prefill", PRECONDITION, rule="rule 6")
    assert state_snapshot(model) == before
    ok(prefill(model, role, step=2, n=1, fill=5), "prefill", HIT)
    expect(decode(model, role, step=2, fill=5), "decode", PRECONDITION, rule="rule 6")


@pytest.mark.parametrize("role", BUNDLE_ROLES)
def test_rule_6_a_retry_compares_bundles_field_by_field_including_bytes_and_sideband(role: str) -> None:
    model = loaded(role)
    original = make_bundle("s", 0, 0, rows=2, fill=0.5, sideband=(3, 4))
    ok(model.prefill(PrefillRequest("s", 0, 0, bundle=original)), "prefill", MISS)
    same = make_bundle("s", 0, 0, rows=2, fill=0.5, sideband=(3, 4))
    expect(
        model.prefill(PrefillRequest("s", 0, 0, bundle=same)), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True
    )
    other_bytes = make_bundle("s", 0, 0, rows=2, fill=0.25, sideband=(3, 4))
    expect(model.prefill(PrefillRequest("s", 0, 0, bundle=other_bytes)), "prefill", PRECONDITION, rule="rule 6")
    other_sideband = make_bundle("s", 0, 0, rows=2, fill=0.5, sideband=(3, 5))
    expect(model.prefill(PrefillRequest("s", 0, 0, bundle=other_sideband)), "prefill", PRECONDITION, rule="rule 6")
    no_sideband = make_bundle("s", 0, 0, rows=2, fill=0.5, sideband=None)
    expect(model.prefill(PrefillRequest("s", 0, 0, bundle=no_sideband)), "prefill", PRECONDITION, rule="rule 6")


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("step", [2, 3, 1000, LIMIT - 1])
def test_rule_6_a_step_ahead_of_the_next_one_is_a_failed_precondition(role: str, step: int) -> None:
    model = loaded(role)
    ok(prefill(model, role), "prefill", MISS)
    before = state_snapshot(model)
    expect(decode(model, role, step=step), "decode", PRECONDITION, rule="rule 6")
    expect(prefill(model, role, step=step), "prefill", PRECONDITION, rule="rule 6")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_an_earlier_step_than_the_last_one_is_a_failed_precondition_even_if_identical(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, fill=1), "prefill", MISS)
    ok(decode(model, role, step=1, fill=2), "decode", HIT)
    ok(decode(model, role, step=2, fill=3), "decode", HIT)
    before = state_snapshot(model)
    expect(prefill(model, role, step=0, fill=1), "prefill", PRECONDITION, rule="rule 6")
    expect(decode(model, role, step=1, fill=2), "decode", PRECONDITION, rule="rule 6")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_6_a_retry_survives_a_refused_request_in_between(role: str) -> None:
    model = loaded(role, max_kv_tokens=4)
    ok(prefill(model, role, n=4), "prefill", MISS)
    expect(decode(model, role, step=1), "decode", EXHAUSTED, rule="rule 7", retryable=True)
    expect(prefill(model, role, n=4), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)


def test_rule_6_comes_before_rule_7_a_retry_needs_no_capacity() -> None:
    model = loaded("head", max_sessions=2, max_kv_tokens=6)
    ok(prefill(model, "head", sid="a", n=3), "prefill", MISS)
    ok(prefill(model, "head", sid="b", n=2), "prefill", MISS)
    ok(decode(model, "head", sid="b", step=1), "decode", HIT)
    # Both slots and every token are in use: only retries can still succeed.
    expect(prefill(model, "head", sid="c"), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    expect(decode(model, "head", sid="b", step=2), "decode", EXHAUSTED, rule="rule 7", retryable=True)
    before = state_snapshot(model)
    expect(prefill(model, "head", sid="a", n=3), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)
    expect(decode(model, "head", sid="b", step=1), "decode", OK, cache=HIT, rule="rule 6", is_retry=True)
    assert state_snapshot(model) == before


def test_rule_6_comes_before_rule_7_a_retry_needs_no_capacity_after_memory_pressure() -> None:
    model = loaded("full")
    ok(prefill(model, "full", n=10), "prefill", MISS)
    model.memory_pressure(0)
    expect(prefill(model, "full", n=10), "prefill", OK, cache=MISS, rule="rule 6", is_retry=True)


def test_rule_6_a_wrong_step_is_a_failed_precondition_even_when_capacity_would_refuse_it() -> None:
    model = loaded("head", max_kv_tokens=4)
    ok(prefill(model, "head", n=4), "prefill", MISS)
    expect(prefill(model, "head", step=5, n=10), "prefill", PRECONDITION, rule="rule 6")


# --- rule 7: capacity -------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_opening_a_session_beyond_max_sessions_is_exhausted_and_allocates_nothing(role: str) -> None:
    model = loaded(role)
    for index in range(4):
        ok(prefill(model, role, sid=f"s{index}"), "prefill", MISS)
    before = state_snapshot(model)
    expect(prefill(model, role, sid="s4"), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert "s4" not in model.sessions
    assert state_snapshot(model) == before
    assert model.expected_metrics().active_sessions == 4


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_released_slot_can_be_taken_by_a_new_session(role: str) -> None:
    model = loaded(role)
    for index in range(4):
        prefill(model, role, sid=f"s{index}")
    expect(model.release("s2"), "release", OK, rule="release")
    ok(prefill(model, role, sid="s4"), "prefill", MISS)
    assert model.expected_metrics().active_sessions == 4


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_cancelled_session_still_holds_its_slot(role: str) -> None:
    model = loaded(role, max_sessions=1)
    ok(prefill(model, role, sid="a"), "prefill", MISS)
    model.cancel("a", 0)
    expect(prefill(model, role, sid="b"), "prefill", EXHAUSTED, rule="rule 7", retryable=True)


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_exactly_reaching_the_token_limit_is_ok_and_one_more_is_exhausted(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=40), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=20), "prefill", MISS)
    for step in range(1, 5):
        ok(decode(model, role, sid="b", step=step), "decode", HIT)
    assert model.expected_metrics().kv_tokens == 64
    before = state_snapshot(model)
    expect(decode(model, role, sid="b", step=5), "decode", EXHAUSTED, rule="rule 7", retryable=True)
    expect(prefill(model, role, sid="a", step=1), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    expect(prefill(model, role, sid="c"), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert "c" not in model.sessions
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_first_prefill_larger_than_the_limit_allocates_nothing(role: str) -> None:
    model = loaded(role)
    expect(prefill(model, role, n=65), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert dict(model.sessions) == {}
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (0, 0)
    ok(prefill(model, role, n=64), "prefill", MISS)


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_refused_step_can_be_sent_again_once_tokens_are_freed(role: str) -> None:
    model = loaded(role, max_kv_tokens=10)
    ok(prefill(model, role, sid="a", n=5), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=5), "prefill", MISS)
    expect(prefill(model, role, sid="a", step=1, n=2), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert model.sessions["a"].next_step == 1
    model.release("b")
    ok(prefill(model, role, sid="a", step=1, n=2), "prefill", HIT)
    assert model.sessions["a"].kv_tokens == 7


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_restart_keeps_its_slot_when_every_slot_is_taken(role: str) -> None:
    model = loaded(role)
    for index in range(4):
        ok(prefill(model, role, sid=f"s{index}"), "prefill", MISS)
    ok(prefill(model, role, sid="s0", epoch=1, n=3), "prefill", MISS)
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (4, 6)


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_restart_counts_used_minus_old_plus_new_tokens(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=40), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=20), "prefill", MISS)
    # 60 - 40 + 44 = 64: allowed although 60 + 44 would not be.
    ok(prefill(model, role, sid="a", epoch=1, n=44), "prefill", MISS)
    assert model.sessions["a"].kv_tokens == 44
    assert model.expected_metrics().kv_tokens == 64


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_a_refused_restart_leaves_the_old_epoch_usable(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=40), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=20), "prefill", MISS)
    before = state_snapshot(model)
    # 60 - 40 + 45 = 65 > 64
    expect(prefill(model, role, sid="a", epoch=1, n=45), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert state_snapshot(model) == before
    state = model.sessions["a"]
    assert (state.epoch, state.next_step, state.kv_tokens, state.cancelled) == (0, 1, 40, False)
    ok(decode(model, role, sid="a", epoch=0, step=1), "decode", HIT)
    expect(prefill(model, role, sid="a", epoch=0, n=40), "prefill", PRECONDITION, rule="rule 6")


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_restarting_a_cancelled_session_counts_its_freed_tokens_as_zero(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=30), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=30), "prefill", MISS)
    model.cancel("a", 0)
    assert model.expected_metrics().kv_tokens == 30
    expect(prefill(model, role, sid="a", epoch=1, n=35), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert model.sessions["a"].cancelled is True
    ok(prefill(model, role, sid="a", epoch=1, n=34), "prefill", MISS)
    assert model.expected_metrics().kv_tokens == 64


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_after_memory_pressure_growth_beyond_the_new_limit_is_refused_and_live_caches_stay(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=10), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=6), "prefill", MISS)
    model.memory_pressure(5)
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (2, 16)
    assert (model.sessions["a"].kv_tokens, model.sessions["b"].kv_tokens) == (10, 6)
    expect(decode(model, role, sid="a", step=1), "decode", EXHAUSTED, rule="rule 7", retryable=True)
    expect(prefill(model, role, sid="c"), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    # A restart is checked as used - old + new: 16 - 10 + 1 = 7 > 5.
    expect(prefill(model, role, sid="a", epoch=1, n=1), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    model.release("b")
    ok(prefill(model, role, sid="a", epoch=1, n=5), "prefill", MISS)  # 10 - 10 + 5 = 5
    expect(decode(model, role, sid="a", epoch=1, step=1), "decode", EXHAUSTED, rule="rule 7", retryable=True)


@pytest.mark.parametrize("role", ROLES)
def test_rule_7_memory_pressure_limit_is_reachable_exactly(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=10), "prefill", MISS)
    model.memory_pressure(12)
    ok(decode(model, role, step=1), "decode", HIT)
    ok(decode(model, role, step=2), "decode", HIT)
    expect(decode(model, role, step=3), "decode", EXHAUSTED, rule="rule 7", retryable=True)
    assert model.expected_metrics().kv_tokens == 12


# --- rule 8: accepted steps ------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_rule_8_the_first_step_misses_and_later_steps_hit_while_state_advances(role: str) -> None:
    model = loaded(role)
    first = prefill_request(role, n=3)
    ok(model.prefill(first), "prefill", MISS)
    state = model.sessions["s"]
    assert (state.next_step, state.kv_tokens, state.last_request, state.last_cache) == (1, 3, first, MISS)
    assert len(state.history) == 1
    second = decode_request(role, step=1)
    ok(model.decode(second), "decode", HIT)
    state = model.sessions["s"]
    assert (state.next_step, state.kv_tokens, state.last_request, state.last_cache) == (2, 4, second, HIT)
    assert len(state.history) == 2
    metrics = model.expected_metrics()
    assert metrics == MetricsResult(1, 1, 1, 4)


@pytest.mark.parametrize("role", ROLES)
def test_rule_8_sessions_are_counted_independently(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=2), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=3), "prefill", MISS)
    ok(decode(model, role, sid="a", step=1), "decode", HIT)
    assert (model.sessions["a"].next_step, model.sessions["b"].next_step) == (2, 1)
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (2, 6)


# --- cancel -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sid", "epoch"),
    [("", 0), ("s", -1), ("s", LIMIT), ("", LIMIT)],
    ids=["empty-id", "epoch-minus-one", "epoch-two-to-the-63", "both"],
)
def test_cancel_with_an_empty_id_or_an_epoch_out_of_range_is_invalid(sid: str, epoch: int) -> None:
    model = loaded("head")
    ok(prefill(model, "head"), "prefill", MISS)
    before = state_snapshot(model)
    expect(model.cancel(sid, epoch), "cancel", INVALID, rule="cancel")
    assert state_snapshot(model) == before


def test_cancel_of_an_unknown_session_is_not_found() -> None:
    model = loaded("head")
    expect(model.cancel("nobody", 0), "cancel", NOT_FOUND, rule="cancel")
    assert dict(model.sessions) == {}


def test_cancel_at_a_lower_epoch_is_aborted_and_at_a_higher_epoch_is_not_found() -> None:
    model = loaded("head")
    ok(prefill(model, "head", epoch=3), "prefill", MISS)
    before = state_snapshot(model)
    expect(model.cancel("s", 2), "cancel", ABORTED, rule="cancel")
    expect(model.cancel("s", 4), "cancel", NOT_FOUND, rule="cancel")
    assert state_snapshot(model) == before
    assert model.sessions["s"].cancelled is False


@pytest.mark.parametrize("role", ROLES)
def test_cancel_frees_the_tokens_at_once_but_keeps_the_slot(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=5), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=3), "prefill", MISS)
    calls = counters(model)
    expect(model.cancel("a", 0), "cancel", OK, rule="cancel")
    assert model.sessions["a"].cancelled is True
    assert model.sessions["a"].kv_tokens == 0
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (2, 3)
    assert counters(model) == calls


def test_cancel_twice_is_ok() -> None:
    model = loaded("head")
    ok(prefill(model, "head"), "prefill", MISS)
    expect(model.cancel("s", 0), "cancel", OK, rule="cancel")
    before = state_snapshot(model)
    expect(model.cancel("s", 0), "cancel", OK, rule="cancel")
    assert state_snapshot(model) == before


@pytest.mark.parametrize("role", ROLES)
def test_after_cancel_a_restart_at_a_higher_epoch_clears_the_cancellation(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, n=4), "prefill", MISS)
    model.cancel("s", 0)
    expect(prefill(model, role, epoch=0), "prefill", CANCELLED, rule="rule 5")
    ok(prefill(model, role, epoch=2, n=2), "prefill", MISS)
    state = model.sessions["s"]
    assert (state.epoch, state.next_step, state.kv_tokens, state.cancelled) == (2, 1, 2, False)
    ok(decode(model, role, epoch=2, step=1), "decode", HIT)
    expect(model.cancel("s", 0), "cancel", ABORTED, rule="cancel")


# --- release ----------------------------------------------------------------------------


@pytest.mark.parametrize("sid", ["nobody", "", "s"], ids=["unknown", "empty", "live"])
def test_release_is_always_ok_once_loaded_and_idempotent(sid: str) -> None:
    """SPEC: "once loaded, always OK (idempotent)"."""
    model = loaded("head")
    ok(prefill(model, "head"), "prefill", MISS)
    expect(model.release(sid), "release", OK, rule="release")
    expect(model.release(sid), "release", OK, rule="release")


@pytest.mark.parametrize("role", ROLES)
def test_release_frees_the_slot_and_the_tokens(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, sid="a", n=5), "prefill", MISS)
    ok(prefill(model, role, sid="b", n=3), "prefill", MISS)
    calls = counters(model)
    expect(model.release("a"), "release", OK, rule="release")
    assert "a" not in model.sessions
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (1, 3)
    assert counters(model) == calls


def test_release_of_a_cancelled_session_frees_its_slot() -> None:
    model = loaded("head")
    ok(prefill(model, "head", n=5), "prefill", MISS)
    model.cancel("s", 0)
    expect(model.release("s"), "release", OK, rule="release")
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (0, 0)


@pytest.mark.parametrize("role", ROLES)
def test_a_released_id_is_unknown_afterwards_and_may_reopen_at_a_lower_epoch(role: str) -> None:
    model = loaded(role)
    ok(prefill(model, role, epoch=5, n=2), "prefill", MISS)
    ok(decode(model, role, epoch=5, step=1), "decode", HIT)
    model.release("s")
    expect(decode(model, role, epoch=5, step=2), "decode", NOT_FOUND, rule="rule 3")
    expect(prefill(model, role, epoch=5, step=2), "prefill", PRECONDITION, rule="rule 3")
    expect(model.cancel("s", 5), "cancel", NOT_FOUND, rule="cancel")
    ok(prefill(model, role, epoch=1), "prefill", MISS)
    state = model.sessions["s"]
    assert (state.epoch, state.next_step, state.kv_tokens, state.cancelled) == (1, 1, 1, False)


def test_a_released_cancelled_id_may_reopen_at_the_same_epoch() -> None:
    model = loaded("head")
    ok(prefill(model, "head", epoch=3), "prefill", MISS)
    model.cancel("s", 3)
    model.release("s")
    ok(prefill(model, "head", epoch=3), "prefill", MISS)
    assert model.sessions["s"].cancelled is False


# --- non-OK results change nothing; metrics count every call ----------------------------


def _populated(role: str) -> ReferenceModel:
    """Session a: epoch 2, three steps; b: cancelled; c: one step; 60 of 64 tokens, 3 of 4 slots."""
    model = loaded(role)
    ok(prefill(model, role, sid="a", epoch=2, n=30), "prefill", MISS)
    ok(decode(model, role, sid="a", epoch=2, step=1), "decode", HIT)
    ok(prefill(model, role, sid="a", epoch=2, step=2, n=4), "prefill", HIT)
    ok(prefill(model, role, sid="b", epoch=1, n=5), "prefill", MISS)
    expect(model.cancel("b", 1), "cancel", OK, rule="cancel")
    ok(prefill(model, role, sid="c", n=25), "prefill", MISS)
    metrics = model.expected_metrics()
    assert (metrics.active_sessions, metrics.kv_tokens) == (3, 60)
    return model


def _bad_token(role: str) -> dict[str, Any]:
    if role in TOKEN_ROLES:
        return {"token_ids": (VOCAB,)}
    return {"bundle": make_bundle("a", 2, 3, point="nowhere")}


Scenario = Callable[[ReferenceModel, str], Prediction]

NON_OK: dict[str, tuple[Scenario, str, StatusCode]] = {
    "malformed": (lambda m, r: m.prefill(PrefillRequest("a", 2, 3, **_bad_token(r))), "prefill", INVALID),
    "unknown-decode": (lambda m, r: decode(m, r, sid="z", epoch=0, step=0), "decode", NOT_FOUND),
    "unknown-prefill-step-1": (lambda m, r: prefill(m, r, sid="z", step=1), "prefill", PRECONDITION),
    "stale-epoch": (lambda m, r: decode(m, r, sid="a", epoch=1, step=3), "decode", ABORTED),
    "higher-epoch-decode": (lambda m, r: decode(m, r, sid="a", epoch=3, step=3), "decode", NOT_FOUND),
    "cancelled": (lambda m, r: decode(m, r, sid="b", epoch=1, step=1), "decode", CANCELLED),
    "wrong-step": (lambda m, r: decode(m, r, sid="a", epoch=2, step=5), "decode", PRECONDITION),
    "same-step-different": (lambda m, r: prefill(m, r, sid="a", epoch=2, step=2, n=4, fill=9), "prefill", PRECONDITION),
    "too-many-tokens": (lambda m, r: prefill(m, r, sid="c", step=1, n=5), "prefill", EXHAUSTED),
    "open-too-many-tokens": (lambda m, r: prefill(m, r, sid="d", n=5), "prefill", EXHAUSTED),
    "restart-too-many-tokens": (lambda m, r: prefill(m, r, sid="c", epoch=1, n=30), "prefill", EXHAUSTED),
    "cancel-invalid": (lambda m, r: m.cancel("a", -1), "cancel", INVALID),
    "cancel-unknown": (lambda m, r: m.cancel("z", 0), "cancel", NOT_FOUND),
    "cancel-lower-epoch": (lambda m, r: m.cancel("a", 1), "cancel", ABORTED),
    "cancel-higher-epoch": (lambda m, r: m.cancel("a", 3), "cancel", NOT_FOUND),
}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", list(NON_OK))
def test_a_non_ok_result_leaves_every_session_and_gauge_unchanged(role: str, name: str) -> None:
    scenario, op, code = NON_OK[name]
    model = _populated(role)
    before = state_snapshot(model)
    prefills, decodes = counters(model)
    p = scenario(model, role)
    expect(p, op, code, retryable=code is EXHAUSTED)
    assert state_snapshot(model) == before
    assert counters(model) == (prefills + (op == "prefill"), decodes + (op == "decode"))


def test_a_fifth_session_is_refused_on_the_populated_model_too() -> None:
    model = _populated("head")
    ok(prefill(model, "head", sid="d", n=1), "prefill", MISS)
    before = state_snapshot(model)
    expect(prefill(model, "head", sid="e", n=1), "prefill", EXHAUSTED, rule="rule 7", retryable=True)
    assert state_snapshot(model) == before


def test_every_prefill_and_decode_call_is_counted_whatever_its_result() -> None:
    model = loaded("head", max_kv_tokens=3)
    prefill(model, "head", n=3)  # OK
    prefill(model, "head", n=3)  # retry
    prefill(model, "head", step=1)  # exhausted
    prefill(model, "head", sid="z", step=4)  # unknown, wrong step
    model.prefill(PrefillRequest("s", 0, 1, token_ids=()))  # malformed
    decode(model, "head", step=1)  # exhausted
    decode(model, "head", sid="z")  # not found
    model.decode(DecodeRequest("s", 0, 1, token_ids=(1, 2)))  # malformed
    model.cancel("s", 0)
    decode(model, "head", step=1)  # cancelled
    model.release("s")
    metrics = model.expected_metrics()
    assert (metrics.prefill_calls, metrics.decode_calls) == (5, 4)
    assert (metrics.active_sessions, metrics.kv_tokens) == (0, 0)


@pytest.mark.parametrize("role", ROLES)
def test_every_prediction_names_its_operation_and_explains_itself(role: str) -> None:
    model = ReferenceModel()
    predictions = [prefill(model, role), decode(model, role), model.cancel("s", 0), model.release("s")]
    model.load(caps(role, max_sessions=1, max_kv_tokens=5))
    predictions += [
        model.prefill(PrefillRequest("", 0, 0, token_ids=(1,))),
        decode(model, role),
        prefill(model, role, step=3),
        prefill(model, role, epoch=1, n=2),
        prefill(model, role, epoch=1, n=2),
        prefill(model, role, sid="other"),
        prefill(model, role, epoch=0),
        decode(model, role, epoch=2),
        decode(model, role, epoch=1, step=4),
        decode(model, role, epoch=1, step=1),
        prefill(model, role, epoch=1, step=2, n=9),
        model.cancel("", 0),
        model.cancel("x", 0),
        model.cancel("s", 0),
        model.cancel("s", 2),
        model.cancel("s", 1),
        decode(model, role, epoch=1, step=2),
        model.release("s"),
        model.release("s"),
    ]
    for p in predictions:
        assert isinstance(p, Prediction)
        assert p.op in ("prefill", "decode", "cancel", "release")
        assert isinstance(p.because, str), p
        assert p.because.strip(), p
        assert p.rule in {f"rule {n}" for n in range(1, 9)} | {"cancel", "release"}, p
        if p.code is not OK:
            assert p.cache is MISS, p
        assert p.retryable is (p.code is StatusCode.RESOURCE_EXHAUSTED), p
