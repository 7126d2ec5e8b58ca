"""The contract v1 value types: structure is checked on construction, ranges are not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shardkit import (
    BoundaryBundle,
    CacheResult,
    DecodeRequest,
    EngineCapabilities,
    EngineError,
    EngineTensor,
    Fault,
    FaultInjectable,
    LoadRequest,
    MetricsResult,
    PrefillRequest,
    StatusCode,
    StepResult,
    StructuredStatus,
    TokenOutput,
)


def _caps(**overrides: object) -> EngineCapabilities:
    fields: dict[str, object] = {
        "architecture": "arch",
        "evidence_class": "fixture",
        "total_layers": 4,
        "shard_start": 0,
        "shard_end": 3,
        "hidden_size": 8,
        "vocab_size": 32,
        "dtype": "float32",
        "max_sessions": 4,
        "max_kv_tokens": 64,
        "supported_faults": frozenset(),
        "tolerance": 0.0,
    }
    fields.update(overrides)
    return EngineCapabilities(**fields)  # type: ignore[arg-type]


# No deadline: a busy CI machine once took 980 ms over the first example (strategy set-up),
# and Hypothesis's 200 ms deadline failed the test; the clock must decide no result here.
@settings(deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from(["<f4", ">f4", "<f2", ">f8", "<i4", ">i8", "u1", "?"]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    )
)
def test_tensor_round_trips_dtype_shape_and_bytes_exactly(array: np.ndarray) -> None:
    tensor = EngineTensor.from_array("x", array)
    back = tensor.to_array()
    assert back.dtype == array.dtype.newbyteorder("=")
    assert back.shape == array.shape
    assert back.astype(back.dtype.newbyteorder("<")).tobytes() == tensor.data
    np.testing.assert_array_equal(back, array)


def test_tensor_data_is_little_endian_c_order() -> None:
    array = np.array([[1, 2], [3, 4]], dtype=">i2").T  # big-endian and Fortran-ordered
    tensor = EngineTensor.from_array("x", array)
    assert tensor.data == np.array([[1, 3], [2, 4]], dtype="<i2").tobytes()
    assert tensor.dtype == "int16"


def test_tensor_to_array_names_a_length_mismatch() -> None:
    tensor = EngineTensor("residual", "float32", (2, 8), b"\0" * 12)
    with pytest.raises(ValueError, match=r"'residual' holds 12 bytes, but shape \(2, 8\) of float32 needs 64"):
        tensor.to_array()


def test_tensor_to_array_names_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="dtype 'float7'"):
        EngineTensor("residual", "float7", (1,), b"\0").to_array()


def test_a_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValueError, match="exactly one of token_ids and bundle, got neither"):
        PrefillRequest("s", 0, 0)
    bundle = BoundaryBundle("s", 0, 0, "post_head_residual", "a", ())
    with pytest.raises(ValueError, match="got both"):
        DecodeRequest("s", 0, 0, token_ids=(1,), bundle=bundle)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PrefillRequest(3, 0, 0, token_ids=(1,)), r"PrefillRequest.session_id must be a str, got 3"),  # type: ignore[arg-type]
        (lambda: PrefillRequest("s", True, 0, token_ids=(1,)), r"PrefillRequest.epoch must be an int, got True"),
        (lambda: DecodeRequest("s", 0, 1.0, token_ids=(1,)), r"DecodeRequest.step must be an int, got 1.0"),  # type: ignore[arg-type]
        (lambda: PrefillRequest("s", 0, 0, token_ids=(1, "2")), r"PrefillRequest.token_ids\[1\] must be an int"),  # type: ignore[arg-type]
        (lambda: PrefillRequest("s", 0, 0, token_ids="12"), r"token_ids must be a tuple of ints"),  # type: ignore[arg-type]
        (lambda: PrefillRequest("s", 0, 0, bundle=(1,)), r"PrefillRequest.bundle must be a BoundaryBundle"),  # type: ignore[arg-type]
        (lambda: StructuredStatus("OK"), r"StructuredStatus.code must be a StatusCode, got 'OK'"),  # type: ignore[arg-type]
        (lambda: StepResult(StructuredStatus(StatusCode.OK), "HIT"), r"StepResult.cache must be a CacheResult"),  # type: ignore[arg-type]
        (lambda: TokenOutput(1.5), r"TokenOutput.token_id must be an int, got 1.5"),  # type: ignore[arg-type]
        (lambda: EngineTensor("r", "float32", (2, -1), b""), r"negative extents"),
        (lambda: BoundaryBundle("s", 0, 0, "p", "a", ("t",)), r"tensors\[0\] must be an EngineTensor"),  # type: ignore[arg-type]
        (lambda: MetricsResult(0, 0, 0, None), r"MetricsResult.kv_tokens must be an int, got None"),  # type: ignore[arg-type]
        (lambda: Fault("meltdown"), r"Fault.kind must be one of .* got 'meltdown'"),  # type: ignore[arg-type]
        (lambda: Fault("delay", float("nan")), r"Fault.value must be finite, got nan"),
        (lambda: LoadRequest("m", 2, 1, 4), r"0 <= shard_start <= shard_end < total_layers, got shard_start=2"),
        (lambda: LoadRequest("m", 0, 4, 4), r"shard_end=4, total_layers=4"),
        (lambda: _caps(evidence_class="guess"), r"evidence_class must be 'fixture' or 'real', got 'guess'"),
        (lambda: _caps(supported_faults=frozenset({"flood"})), r"unknown kinds \['flood'\]"),
        (lambda: _caps(tolerance=-1.0), r"tolerance must be a finite float >= 0, got -1.0"),
    ],
)
def test_bad_values_raise_errors_naming_the_field_and_value(build: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        build()  # type: ignore[operator]


def test_ranges_are_left_to_the_engine_so_malformed_requests_can_be_built() -> None:
    """Out-of-range epochs, empty ids and out-of-vocab tokens are the engine's to refuse."""
    request = DecodeRequest("", -1, 2**63, token_ids=(-5, 10**9))
    assert request.epoch == -1
    assert PrefillRequest("s", 0, 0, token_ids=()).token_ids == ()


def test_sequences_are_frozen_to_tuples_so_equality_is_by_value() -> None:
    from_list = PrefillRequest("s", 0, 0, token_ids=[1, 2])
    assert from_list == PrefillRequest("s", 0, 0, token_ids=(1, 2))
    assert from_list.token_ids == (1, 2)
    assert hash(from_list) == hash(PrefillRequest("s", 0, 0, token_ids=(1, 2)))


def test_prefill_and_decode_with_equal_fields_are_not_equal() -> None:
    assert PrefillRequest("s", 0, 1, token_ids=(1,)) != DecodeRequest("s", 0, 1, token_ids=(1,))


def test_load_request_recipe_is_a_read_only_copy() -> None:
    recipe = {"architecture": "x"}
    request = LoadRequest("m", 0, 3, 4, recipe)
    recipe["architecture"] = "changed"
    assert request.recipe["architecture"] == "x"
    with pytest.raises(TypeError):
        request.recipe["architecture"] = "y"  # type: ignore[index]


@pytest.mark.parametrize(
    ("start", "end", "role"),
    [(0, 3, "full"), (0, 0, "head"), (0, 2, "head"), (3, 3, "tail"), (1, 3, "tail"), (1, 2, "middle")],
)
def test_role_follows_the_loaded_range(start: int, end: int, role: str) -> None:
    assert _caps(shard_start=start, shard_end=end).role == role
    assert LoadRequest("m", start, end, 4).role == role


def test_engine_error_carries_its_status() -> None:
    status = StructuredStatus(StatusCode.FAILED_PRECONDITION, "already loaded")
    error = EngineError(status)
    assert error.status is status
    assert "FAILED_PRECONDITION: already loaded" in str(error)


def test_fault_value_is_a_float_and_fault_injectable_is_a_runtime_protocol() -> None:
    assert Fault("crash", 2).value == 2.0

    class Injectable:
        def inject_fault(self, fault: Fault) -> StructuredStatus:
            return StructuredStatus(StatusCode.OK)

    assert isinstance(Injectable(), FaultInjectable)
    assert not isinstance(object(), FaultInjectable)


def test_step_result_defaults_to_no_output() -> None:
    result = StepResult(StructuredStatus(StatusCode.NOT_FOUND), CacheResult.MISS)
    assert result.output is None
    assert not result.status.ok
