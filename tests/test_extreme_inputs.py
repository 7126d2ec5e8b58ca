"""Extreme but finite inputs (issue 18): middle and tail bundles whose rows sit at the edges of
float32's finite range, drawn by the ``extreme_values`` rule; what the kit requires of the
answer (finite, deterministic); the bundled engines stay clean; a planted engine that
overflows on them is found and shrunk to one step; an ordinary failure never keeps them."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest

from shardkit import (
    CacheResult,
    DecodeRequest,
    EngineTensor,
    FakeShardEngine,
    LoadRequest,
    NumpyShardEngine,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
    machine_for,
)
from shardkit._core.checks import output_problems
from shardkit._core.output_checks import flat_history
from shardkit._core.steps import (
    ROW_KINDS,
    build_request,
    row_code,
    row_codes_of,
    split_row_code,
    step_action,
    synthetic_bundle,
    synthetic_rows,
)
from shardkit._machine.minimize import _replay_choices, minimize_failure
from shardkit._machine.observer import Choice, FailureReport
from shardkit._machine.state_machine import EXTREME_CHOICES
from shardkit._planted import LayerNormVarianceOverflows, PlantedEngine, ReleaseLeaksKvTokens
from shardkit._planted.extreme import one_pass_layer_norm
from shardkit._planted.minimal import prefill
from shardkit._run.runner import fuzz
from shardkit.engines import numpy_llama

FLOAT32 = np.finfo(np.float32)
TOKENS = (0, 1, 5, 31)


def caps_of(role: str = "middle") -> object:
    engine = FakeShardEngine()
    start, end = {"middle": (1, 2), "tail": (1, 3)}[role]
    engine.load(LoadRequest("m", start, end, 4))
    return engine.capabilities()


def rows_of(kind: str, tokens: tuple[int, ...] = TOKENS) -> np.ndarray:
    codes = tuple(row_code(token, ROW_KINDS.index(kind)) for token in tokens)
    return synthetic_rows(caps_of(), codes)


# --- the generator: each kind, legal values ----------------------------------------------------


def test_every_kind_is_finite_float32_and_holds_what_its_name_says() -> None:
    huge, subnormal, zero, mixed = (rows_of(kind) for kind in ROW_KINDS[1:])
    for rows in (huge, subnormal, zero, mixed):
        assert rows.dtype == np.float32
        assert rows.shape == (len(TOKENS), 8)
        assert np.isfinite(rows).all()  # legal: contract §2 rule 2 refuses only non-finite values
    assert (np.abs(huge) >= 2.8e38).all()
    assert (np.abs(huge) <= 0.9 * FLOAT32.max).all()
    assert (huge > 0).any()
    assert (huge < 0).any()
    assert ((subnormal != 0) & (np.abs(subnormal) < FLOAT32.tiny)).all()  # every value subnormal
    assert (np.abs(subnormal) == FLOAT32.smallest_subnormal).any()  # 1.4e-45 itself
    assert (zero == 0).all()
    assert np.signbit(zero).any()
    assert (~np.signbit(zero)).any()
    assert (np.abs(mixed) >= 2.8e38).any()
    assert ((mixed != 0) & (np.abs(mixed) < FLOAT32.tiny)).any()
    assert (mixed == 0).any()
    assert ((np.abs(mixed) > 0.01) & (np.abs(mixed) <= 1)).any()


def test_ordinary_rows_are_bit_for_bit_what_they_were() -> None:
    """The ordinary path is the old formula, unchanged: a token's row is sin(scale * column)."""
    columns = np.arange(1, 9, dtype=np.float64)
    expected = np.sin(np.multiply.outer(0.618 + 0.137 * np.asarray(TOKENS, np.float64), columns)).astype("float32")
    assert rows_of("ordinary").tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_kinds_are_legal_in_each_float_dtype(dtype: str) -> None:
    caps = replace(caps_of(), dtype=dtype)
    info = np.finfo(dtype)
    for kind in range(1, len(ROW_KINDS)):
        rows = synthetic_rows(caps, tuple(row_code(token, kind) for token in TOKENS))
        assert rows.dtype == np.dtype(dtype)
        assert np.isfinite(rows).all()
        assert (np.abs(rows) <= 0.9 * float(info.max)).all()


def test_row_codes_round_trip_and_the_sideband_holds_token_ids() -> None:
    caps = caps_of()
    for token in (0, 1, 31, 10**6):
        for kind in range(len(ROW_KINDS)):
            code = row_code(token, kind)
            assert split_row_code(code) == (token, kind)
            assert (code >= 0) == (kind == 0)
    codes = (0, row_code(3, 1), 6, row_code(6, 3))
    bundle = synthetic_bundle(caps, "a", 0, 0, codes)
    assert bundle.token_id_sideband == (0, 3, 6, 6)
    assert row_codes_of(caps, bundle.tensors[0].data, bundle.token_id_sideband) == codes
    ordinary = synthetic_bundle(caps, "a", 0, 0, (0, 3, 6, 6))
    assert row_codes_of(caps, ordinary.tensors[0].data, ordinary.token_id_sideband) == (0, 3, 6, 6)


def test_a_history_tells_a_tokens_extreme_rows_from_its_ordinary_ones() -> None:
    """The same sideband, other rows: another history (else the twins would answer the wrong one)."""
    from shardkit._core.model import ReferenceModel

    caps = caps_of()
    model = ReferenceModel()
    model.load(caps)
    for session, kind in (("a", 0), ("b", 1)):
        action = step_action("prefill", session, 0, 0, (row_code(0, kind), row_code(3, kind)))
        model.prefill(build_request(action, caps))
    assert flat_history(model.sessions["a"], caps) == (0, 3)
    assert flat_history(model.sessions["b"], caps) == (row_code(0, 1), row_code(3, 1))
    assert flat_history(model.sessions["b"]) == (0, 3)  # without caps: the sideband, as before


def test_a_step_prints_token_ids_and_what_the_rows_hold() -> None:
    action = step_action("prefill", "a", 0, 0, (row_code(0, 1), row_code(3, 1)))
    assert action.describe() == "prefill(session='a', epoch=0, step=0, tokens=[0, 3], rows='huge')"
    assert step_action("decode", "a", 0, 1, (5,)).describe() == "decode(session='a', epoch=0, step=1, tokens=[5])"
    assert str(prefill("a", rows="subnormal")) == "prefill(a, epoch=0, step=0, tokens=[0], rows='subnormal')"


def test_the_rule_draws_each_kind_for_prefill_and_decode_with_0_the_ordinary_rows() -> None:
    assert 1 + 2 * (len(ROW_KINDS) - 1) == EXTREME_CHOICES


# --- what the kit requires of the answer ------------------------------------------------------


def test_a_non_finite_residual_after_huge_input_names_the_input_and_the_fix() -> None:
    caps = caps_of()
    request = PrefillRequest("a", 0, 0, bundle=synthetic_bundle(caps, "a", 0, 0, (row_code(0, 1),)))
    engine = LayerNormVarianceOverflows()
    engine.load(LoadRequest("m", 1, 2, 4))
    (problem,) = output_problems(caps, request, engine.prefill(request))
    assert problem.startswith("residual holds a non-finite value (nan at row 1, column ")
    assert "row 1 of 1 holds values of ±2.9e38 to ±3.0e38 (the largest finite float32 is 3.4e38)" in problem
    assert "docs/contract.md#extreme-values" in problem


def test_a_tail_whose_logits_overflowed_is_caught_by_its_margin() -> None:
    caps = caps_of("tail")
    request = DecodeRequest("a", 0, 1, bundle=synthetic_bundle(caps, "a", 0, 1, (row_code(0, 4),)))
    nan_margin = StepResult(StructuredStatus(StatusCode.OK), CacheResult.HIT, TokenOutput(0, math.nan))
    (problem,) = output_problems(caps, request, nan_margin)
    assert problem.startswith("margin is nan: the logits it was taken from were not finite, after an input whose")
    assert output_problems(caps, request, replace(nan_margin, output=TokenOutput(0, 0.0))) == []


def test_the_planted_norm_is_clean_on_ordinary_rows_and_breaks_on_huge_ones_only() -> None:
    for kind in ROW_KINDS:
        normed = one_pass_layer_norm(rows_of(kind))
        assert np.isfinite(normed).all() == (kind not in ("huge", "mixed")), kind


# --- the bundled engines stay clean ----------------------------------------------------------------


@pytest.mark.parametrize("role", ["middle", "tail"])
def test_the_numpy_engine_answers_every_kind_finitely_and_without_a_warning(role: str) -> None:
    start, end = {"middle": (1, 2), "tail": (1, 3)}[role]
    for kind in range(len(ROW_KINDS)):
        engine = NumpyShardEngine()
        engine.load(LoadRequest("m", start, end, 4))
        caps = engine.capabilities()
        codes = tuple(row_code(token, kind) for token in (0, 3, 6))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = engine.prefill(PrefillRequest("a", 0, 0, bundle=synthetic_bundle(caps, "a", 0, 0, codes)))
            then = engine.decode(DecodeRequest("a", 0, 1, bundle=synthetic_bundle(caps, "a", 0, 1, (5,))))
        for op, step, sent, result in (("prefill", 0, codes, first), ("decode", 1, (5,), then)):
            assert result.status.ok, result.status
            request = build_request(step_action(op, "a", 0, step, sent), caps)
            assert output_problems(caps, request, result) == []


def test_the_numpy_norm_of_a_huge_row_keeps_float32_precision_and_ordinary_rows_are_unchanged() -> None:
    weight = np.ones(8, np.float32)
    huge = rows_of("huge")
    normed = numpy_llama._rms_norm(huge, weight, 1e-5)
    exact = huge.astype(np.float64) / np.sqrt(np.square(huge.astype(np.float64)).mean(axis=-1, keepdims=True))
    assert np.abs(normed - exact).max() <= 2 * np.finfo(np.float32).eps  # a subnormal float32 scale lost ~3 bits
    ordinary = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32) * 10
    scale = (1.0 / np.sqrt(np.square(ordinary, dtype=np.float64).mean(axis=-1, keepdims=True) + 1e-5)).astype("f4")
    assert numpy_llama._rms_norm(ordinary, weight, 1e-5).tobytes() == ((ordinary * scale) * weight).tobytes()


@pytest.mark.parametrize("role", ["middle", "tail"])
def test_the_fake_is_not_flagged_and_the_rule_sends_extreme_bundles(role: str) -> None:
    assert hasattr(machine_for(FakeShardEngine, role=role), "extreme_values")
    assert not hasattr(machine_for(FakeShardEngine, role="full"), "extreme_values")  # its draws stay as they were
    result = fuzz(FakeShardEngine, seed=5, examples=60, steps=40, role=role, faults="all")
    assert result.failure is None, result.failure and result.failure.violation.message


# --- the planted engine is found at any seed, shrunk to one step; an ordinary failure stays ordinary ---


@pytest.mark.parametrize("seed", [1, 2, 7])
def test_an_engine_that_overflows_on_huge_rows_is_found_and_shrunk_to_one_step(seed: int) -> None:
    engine: type[PlantedEngine] = LayerNormVarianceOverflows
    result = fuzz(engine, seed=seed, examples=200, steps=50, role=engine.ROLE)
    assert result.failure is not None, f"not found at seed {seed}"
    assert result.failure.violation.property == "§3 shape and range"
    steps = [record.action.describe() for record in result.failure.records]
    assert steps == ["prefill(session='a', epoch=0, step=0, tokens=[0], rows='huge')"]


def test_no_extreme_values_leaves_the_rule_out_and_says_so_in_the_rerun_line() -> None:
    """``--no-extreme-values``: an engine that overflows only on huge rows then passes, the
    machine has no ``extreme_values`` rule, and the rerun line keeps the option."""
    engine: type[PlantedEngine] = LayerNormVarianceOverflows
    assert not hasattr(machine_for(FakeShardEngine, role="middle", extreme_values=False), "extreme_values")
    result = fuzz(engine, seed=1, examples=200, steps=50, role=engine.ROLE, extreme_values=False)
    assert result.failure is None, result.failure and result.failure.violation.message
    assert "--no-extreme-values" in result.rerun_command


def test_a_failure_that_needs_no_extreme_values_shrinks_to_ordinary_bundles() -> None:
    """A bug of the session lifecycle met through an extreme prefill, as a middle: the
    minimiser lowers the rule's ``values`` to 0, so the shrunk steps hold ordinary rows."""
    machine = machine_for(ReleaseLeaksKvTokens, role="middle", faults="none")
    start = FailureReport(None, [], None, frozenset())  # type: ignore[arg-type]  # only layout and id_pool are read
    drawn = (
        Choice("extreme_values", (("session", 0), ("chunk", 9), ("values", 2))),
        Choice("release", (("session", 0),)),
    )
    failure = _replay_choices(machine, start, drawn)
    assert failure is not None, "the drawn steps do not fail"
    assert "rows='subnormal'" in failure.records[0].action.describe()
    shrunk = minimize_failure(machine, failure).report
    steps = [record.action.describe() for record in shrunk.records]
    assert steps == ["prefill(session='a', epoch=0, step=0, tokens=[0])", "release(session='a')"]


@pytest.mark.parametrize(
    ("kind", "cause"),
    [
        ("huge", "an engine that squares a row in its dtype overflows there"),
        ("subnormal", "one that divides by a row's norm with no epsilon divides by zero there"),
        ("zero", "one that divides by a row's norm with no epsilon divides by zero there"),
    ],
)
def test_a_non_finite_answer_to_extreme_rows_names_the_likely_cause_of_that_kind(kind: str, cause: str) -> None:
    caps = FakeShardEngine().capabilities()
    middle = replace(caps, shard_start=1, shard_end=2)
    request = build_request(step_action("prefill", "a", 0, 0, (row_code(3, ROW_KINDS.index(kind)),)), middle)
    nan = np.full((1, middle.hidden_size), np.nan, np.float32)
    answer = StepResult(
        StructuredStatus(StatusCode.OK),
        CacheResult.MISS,
        replace(request.bundle, tensors=(EngineTensor.from_array("residual", nan),)),  # type: ignore[arg-type]
    )
    problems = [problem for problem in output_problems(middle, request, answer) if "non-finite" in problem]
    assert len(problems) == 1
    assert cause in problems[0], problems[0]
