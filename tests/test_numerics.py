"""Boundary dtypes beyond float32 (bfloat16, float16, float8 through ml_dtypes), the allclose
tolerance (absolute + relative·|reference|, a margin tolerance for tokens), extreme values
sized to the declared dtype, and the numpy engine's bfloat16 and float16 modes fuzzed in
every role, alone and against a float32 reference (docs/numerics.md)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from shardkit._core.checks import Tolerance, payload_difference
from shardkit._core.steps import _synthetic_rows, row_code, synthetic_bundle
from shardkit._dtypes import float_info, numpy_dtype
from shardkit._planted.numerics import (
    MASSIVE_CHANNEL,
    AbsoluteToleranceDecodeShipsInt8Residual,
    AbsoluteToleranceMassiveActivationsBfloat16Engine,
    DecodeShipsInt8Residual,
    MassiveActivationsBfloat16Engine,
)
from shardkit._run.runner import fuzz
from shardkit._transport import codec
from shardkit.contract import (
    DEFAULT_RELATIVE_TOLERANCES,
    ROLES,
    BoundaryBundle,
    EngineCapabilities,
    EngineTensor,
    LoadRequest,
    PrefillRequest,
)
from shardkit.engines.base import EngineSpec
from shardkit.engines.numpy_llama import NumpyBfloat16ShardEngine, NumpyFloat16ShardEngine, NumpyShardEngine

NARROW = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
ENGINES = {"bfloat16": NumpyBfloat16ShardEngine, "float16": NumpyFloat16ShardEngine}
FLOAT32_REFERENCE = "shardkit.engines.numpy_llama:NumpyShardEngine"


def _caps(**changes: object) -> EngineCapabilities:
    fields: dict[str, object] = {
        "architecture": "llama",
        "evidence_class": "real",
        "total_layers": 4,
        "shard_start": 0,
        "shard_end": 3,
        "hidden_size": 8,
        "vocab_size": 16,
        "dtype": "bfloat16",
        "max_sessions": 2,
        "max_kv_tokens": 64,
        "supported_faults": frozenset(),
        "tolerance": 0.1,
    }
    fields.update(changes)
    return EngineCapabilities(**fields)  # type: ignore[arg-type]


# --- dtypes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NARROW)
def test_a_narrow_dtype_is_declared_and_its_rows_round_trip_bit_for_bit(dtype: str) -> None:
    EngineSpec("llama", 4, 8, 16, dtype, 2, 64)  # accepted
    values = np.array([[0.5, -1.25, 3.0, 0.0], [-0.0, 2.0, -8.0, 0.125]]).astype(numpy_dtype(dtype))
    tensor = EngineTensor.from_array("residual", values)
    assert tensor.dtype == dtype
    assert len(tensor.data) == values.size * numpy_dtype(dtype).itemsize
    back = tensor.to_array()
    assert back.dtype == numpy_dtype(dtype)
    assert back.tobytes() == values.tobytes()
    wired = codec.tensor_from_pb(codec.tensor_to_pb(tensor))
    assert wired == tensor


def test_an_unknown_dtype_is_refused_naming_the_known_ones() -> None:
    expected = "EngineSpec.dtype must be a dtype name such as 'float32', 'bfloat16' or 'float16', got 'bf16'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        EngineSpec("llama", 4, 8, 16, "bf16", 2, 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_extreme_rows_are_sized_to_the_declared_dtype(dtype: str) -> None:
    info = float_info(dtype)
    assert info is not None
    huge, subnormal, zero = (_synthetic_rows(16, dtype, (row_code(3, kind),))[0] for kind in (1, 2, 3))
    for row in (huge, subnormal, zero):
        assert row.dtype == numpy_dtype(dtype)
        assert np.isfinite(row.astype(np.float64)).all()
    magnitudes = np.abs(huge.astype(np.float64))
    assert (magnitudes >= 0.84 * float(info.max)).all()
    assert (magnitudes <= float(info.max)).all()
    tiny = np.abs(subnormal.astype(np.float64))
    assert (tiny > 0).all()
    assert (tiny < float(info.tiny)).all()
    assert not zero.astype(np.float64).any()


def test_a_reference_in_a_wider_dtype_gets_the_tested_dtypes_rows_cast_exactly() -> None:
    tokens = (3, row_code(4, 1), row_code(5, 4), 7)
    reference = _caps(dtype="float32", hidden_size=16, shard_start=1, shard_end=2)
    bundle = synthetic_bundle(reference, "s", 0, 0, tokens, rows_dtype="bfloat16")
    sent = bundle.tensors[0].to_array()
    assert sent.dtype == np.float32
    made = _synthetic_rows(16, "bfloat16", tokens)
    assert np.array_equal(sent, made.astype(np.float32))
    # Without it, the float32 rows are not bfloat16's: the two engines would compute from different values.
    assert not np.array_equal(synthetic_bundle(reference, "s", 0, 0, tokens).tensors[0].to_array(), sent)


# --- the tolerance --------------------------------------------------------------------------


def test_an_unset_relative_tolerance_is_the_dtypes_default_and_follows_a_replaced_tolerance() -> None:
    caps = _caps()
    assert caps.relative_tolerance is None
    assert caps.margin_tolerance is None
    assert caps.tolerances() == (0.1, DEFAULT_RELATIVE_TOLERANCES["bfloat16"], 0.1)
    exact = dataclasses.replace(caps, tolerance=0.0)
    assert exact.tolerances() == (0.0, 0.0, 0.0)
    assert Tolerance.of(exact).exact
    assert dataclasses.replace(caps, tolerance=0.3).tolerances() == (0.3, 1.6e-2, 0.3)
    assert _caps(dtype="int8").tolerances() == (0.1, 0.0, 0.1)
    assert _caps(relative_tolerance=0.5, margin_tolerance=2.0).tolerances() == (0.1, 0.5, 2.0)


def test_a_relative_tolerance_with_a_bit_exact_tolerance_is_refused_naming_both() -> None:
    with pytest.raises(
        ValueError, match=re.escape("relative_tolerance is 0.01 with tolerance 0.0, which means bit-exact")
    ):
        _caps(tolerance=0.0, relative_tolerance=0.01)
    with pytest.raises(ValueError, match=re.escape("margin_tolerance must be a finite float >= 0, got -1")):
        _caps(margin_tolerance=-1.0)


def test_a_value_may_differ_by_the_absolute_plus_the_relative_part_and_no_more() -> None:
    tolerance = Tolerance(0.01, 0.1)
    expected = np.array([0.0, 1.0, 100.0])
    assert payload_difference(expected, expected + np.array([0.01, 0.1, 10.0]), tolerance) is None
    near_zero = payload_difference(expected, expected + np.array([0.02, 0.0, 0.0]), tolerance)
    assert near_zero == (
        "differs by more than the tolerance 0.01 + 0.1·|reference|: by 0.02 at column 0 "
        "(0.02 where 0 was expected; 0.01 allowed there)"
    )
    # The value named is the one beyond its allowance most, not the largest difference (10.0 at 100 is allowed).
    large = payload_difference(expected, expected + np.array([0.0, 0.2, 10.0]), tolerance)
    assert large is not None
    assert "at column 1" in large
    assert "0.11 allowed there" in large
    # The old single absolute tolerance, sized for the large values, excuses the error near zero.
    assert payload_difference(expected, expected + np.array([0.5, 0.0, 0.0]), Tolerance(10.01)) is None
    assert payload_difference(expected, expected + np.array([0.5, 0.0, 0.0]), tolerance) is not None
    assert payload_difference(expected, np.array([np.nan, 1.0, 100.0]), tolerance) is not None


def test_tolerance_zero_stays_bit_exact_whatever_the_dtype() -> None:
    row = np.array([1.0, 2.0], dtype=numpy_dtype("bfloat16"))
    moved = row.copy()
    moved[1] = np.float32(2.015625)
    message = payload_difference(row, moved, Tolerance.of(_caps(tolerance=0.0)))
    assert message is not None
    assert message.endswith("tolerance 0 (bit-exact)")


def test_a_token_may_flip_only_below_the_margin_tolerance() -> None:
    tolerance = Tolerance(0.01, 0.0, margin=0.5)
    assert payload_difference((3, 0.4), (4, 0.3), tolerance) is None
    assert payload_difference((3, 0.6), (4, 0.7), tolerance) == "token 4, expected 3"


def test_the_tolerances_cross_the_wire_and_an_old_worker_leaving_them_unset_gets_the_defaults() -> None:
    declared = _caps(relative_tolerance=0.02, margin_tolerance=0.3)
    assert codec.capabilities_from_pb(codec.capabilities_to_pb(declared)) == declared
    message = codec.capabilities_to_pb(_caps())
    assert not message.HasField("relative_tolerance")
    assert not message.HasField("margin_tolerance")
    assert codec.capabilities_from_pb(message).tolerances() == (0.1, 1.6e-2, 0.1)


# --- the numpy engine in bfloat16 and float16 -------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(ENGINES))
def test_the_numpy_engine_computes_in_its_format_and_says_so(dtype: str) -> None:
    engine = ENGINES[dtype]()
    assert engine.capabilities().dtype == dtype
    float32 = NumpyShardEngine()
    for each in (engine, float32):
        assert each.load(LoadRequest("tiny-llama", 0, 1, 4)).status.ok
    narrow = engine.prefill(PrefillRequest("s", 0, 0, token_ids=(1, 2, 3)))
    wide = float32.prefill(PrefillRequest("s", 0, 0, token_ids=(1, 2, 3)))
    assert isinstance(narrow.output, BoundaryBundle)
    assert isinstance(wide.output, BoundaryBundle)
    rows = narrow.output.tensors[0].to_array()
    assert rows.dtype == numpy_dtype(dtype)
    reference = wide.output.tensors[0].to_array()
    difference = np.abs(rows.astype(np.float64) - reference)
    # Close to float32's answer within its declared tolerance, and not bit-equal to it.
    assert (difference <= ENGINES[dtype].TOLERANCE + DEFAULT_RELATIVE_TOLERANCES[dtype] * np.abs(reference)).all()
    assert difference.max() > 0


@pytest.mark.parametrize("reference", [None, FLOAT32_REFERENCE], ids=["alone", "float32-reference"])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("dtype", sorted(ENGINES))
def test_the_numpy_engine_in_bfloat16_and_float16_fuzzes_clean_in_every_role(
    dtype: str, role: str, reference: str | None
) -> None:
    target = f"shardkit.engines.numpy_llama:{ENGINES[dtype].__name__}"
    result = fuzz(target, seed=1, role=role, reference=reference)
    assert result.failure is None, result.failure.violation.message
    assert result.coverage[("prefill", "OK")] > 0
    assert result.coverage[("decode", "OK")] > 0


# --- a bfloat16 bug only the relative tolerance sees (shardkit/_planted/numerics.py) ----------

MASSIVE = "shardkit._planted.numerics"
MASSIVE_REFERENCE = f"{MASSIVE}:MassiveActivationsFloat32Engine"


def test_an_absolute_tolerance_below_the_massive_channels_rounding_is_a_false_alarm_against_float32() -> None:
    """Why the absolute-only engine must declare 1.5: at 0.5 a correct bfloat16 engine already
    differs from float32 by more, on the massive channel."""

    class HalfAbsolute(MassiveActivationsBfloat16Engine):
        TOLERANCE = 0.5
        RELATIVE_TOLERANCE = 0.0

    result = fuzz(HalfAbsolute, seed=1, role="head", reference=MASSIVE_REFERENCE)
    assert result.failure is not None
    assert f"column {MASSIVE_CHANNEL} " in result.failure.violation.message


@pytest.mark.parametrize(
    "engine", [MassiveActivationsBfloat16Engine, AbsoluteToleranceMassiveActivationsBfloat16Engine]
)
def test_the_correct_massive_activation_engine_passes_against_float32_under_either_tolerance(engine: type) -> None:
    result = fuzz(engine, seed=1, role="head", reference=MASSIVE_REFERENCE)
    assert result.failure is None, result.failure.violation.message


def test_the_int8_decode_bug_is_missed_by_the_absolute_tolerance_it_stays_within() -> None:
    result = fuzz(AbsoluteToleranceDecodeShipsInt8Residual, seed=1, role="head", reference=MASSIVE_REFERENCE)
    assert result.failure is None, result.failure.violation.message


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_int8_decode_bug_is_found_by_the_allclose_tolerance_and_shrunk_to_a_prefill_and_a_decode(
    seed: int,
) -> None:
    engine = DecodeShipsInt8Residual
    result = fuzz(engine, seed=seed, role=engine.ROLE, reference=MASSIVE_REFERENCE)
    assert result.failure is not None, f"not found at seed {seed}"
    violation = result.failure.violation
    assert violation.property.startswith(engine.PROPERTY)
    assert "differs by more than the tolerance 0.1 + 0.016·|reference|" in violation.message
    assert [record.action.op for record in result.failure.records] == ["prefill", "decode"]
    # The explanation is the reference's, fed the same steps: never a chunking or another session.
    assert "the reference (MassiveActivationsFloat32Engine) loaded alone and fed as session" in violation.message
    assert "the engine under test answers the same steps otherwise than the reference" in violation.message
