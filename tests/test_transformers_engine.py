"""TransformersShardEngine: a Hugging Face transformers Llama on PyTorch behind contract v1,
in every role, with a DynamicCache per session that holds only its shard's layers.

Needs the ``transformers`` extra; without it these tests skip with a message naming the
extra, except under SHARDKIT_REQUIRE_TRANSFORMERS=1 (CI), where a missing install fails.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from shardkit import (
    BoundaryBundle,
    DecodeRequest,
    LoadRequest,
    NumpyShardEngine,
    PrefillRequest,
    TokenOutput,
    assert_shard_engine_contract,
)
from shardkit._core.checks import Tolerance, payload_difference
from shardkit._dtypes import numpy_dtype
from shardkit._run.runner import fuzz
from shardkit.contract import ROLES

if os.environ.get("SHARDKIT_REQUIRE_TRANSFORMERS") != "1":
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'shardkit[transformers]'")

from shardkit.engines.transformers_llama import TransformersShardEngine, numpy_weights, tiny_llama

TARGET = "shardkit.engines.transformers_llama:TransformersShardEngine"
LAYERS = 4


def _loaded(start: int, end: int, dtype: str = "float32") -> TransformersShardEngine:
    engine = TransformersShardEngine(dtype=dtype)
    assert engine.load(LoadRequest("tiny-llama", start, end, LAYERS)).status.ok
    return engine


def test_capabilities_describe_the_model_and_its_format() -> None:
    engine = _loaded(1, 2, "bfloat16")
    caps = engine.capabilities()
    config = tiny_llama().config
    assert (caps.total_layers, caps.hidden_size, caps.vocab_size) == (LAYERS, config.hidden_size, config.vocab_size)
    assert caps.role == "middle"
    assert caps.dtype == "bfloat16"
    assert caps.tolerance == TransformersShardEngine.TOLERANCES["bfloat16"]
    assert caps.evidence_class == "real"


def test_a_head_a_middle_and_a_tail_chained_give_the_full_models_answer() -> None:
    tokens = (5, 17, 3, 99, 42, 7)
    full = _loaded(0, 3).prefill(PrefillRequest("s", 0, 0, token_ids=tokens)).output
    bundle = _loaded(0, 0).prefill(PrefillRequest("s", 0, 0, token_ids=tokens)).output
    for start, end in ((1, 2), (3, 3)):
        assert isinstance(bundle, BoundaryBundle)
        bundle = _loaded(start, end).prefill(PrefillRequest("s", 0, 0, bundle=bundle)).output
    assert isinstance(full, TokenOutput)
    assert isinstance(bundle, TokenOutput)
    assert bundle.token_id == full.token_id
    assert full.margin is not None
    assert bundle.margin == pytest.approx(full.margin, abs=TransformersShardEngine.TOLERANCE)


def test_a_sessions_cache_holds_its_shards_layers_only_and_its_length_is_counted_by_the_engine() -> None:
    """A middle's DynamicCache has nothing at layer 0, so get_seq_length() says 0: the engine
    counts the positions itself, and a decode after a prefill continues the history."""
    middle = _loaded(1, 2)
    head = _loaded(0, 0)
    first = head.prefill(PrefillRequest("s", 0, 0, token_ids=(1, 2, 3))).output
    second = head.decode(DecodeRequest("s", 0, 1, token_ids=(4,))).output
    assert isinstance(first, BoundaryBundle)
    assert isinstance(second, BoundaryBundle)
    assert middle.prefill(PrefillRequest("s", 0, 0, bundle=first)).status.ok
    stepwise = middle.decode(DecodeRequest("s", 0, 1, bundle=second)).output
    session = middle._sessions["s"].cache
    assert session.positions == 4
    assert session.kv.get_seq_length() == 0  # layer 0 is not this shard's
    assert session.kv.get_seq_length(layer_idx=1) == 4
    whole_input = np.concatenate([first.tensors[0].to_array(), second.tensors[0].to_array()])
    assert whole_input.shape == (4, tiny_llama().config.hidden_size)
    whole_bundle = BoundaryBundle(
        "w",
        0,
        0,
        first.boundary_point,
        first.architecture,
        (first.tensors[0].from_array("residual", whole_input),),
        (1, 2, 3, 4),
    )
    whole = _loaded(1, 2).prefill(PrefillRequest("w", 0, 0, bundle=whole_bundle)).output
    assert isinstance(stepwise, BoundaryBundle)
    assert isinstance(whole, BoundaryBundle)
    tolerance = Tolerance.of(middle.capabilities())
    assert payload_difference(whole.tensors[0].to_array()[-1], stepwise.tensors[0].to_array()[0], tolerance) is None


def test_bfloat16_rows_cross_the_boundary_bit_for_bit() -> None:
    head = _loaded(0, 1, "bfloat16")
    output = head.prefill(PrefillRequest("s", 0, 0, token_ids=(1, 2))).output
    assert isinstance(output, BoundaryBundle)
    rows = output.tensors[0].to_array()
    assert rows.dtype == numpy_dtype("bfloat16")
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        hidden = head.model.model.embed_tokens(torch.tensor([[1, 2]]))
    assert hidden.dtype == torch.bfloat16


def test_the_static_contract_passes() -> None:
    assert_shard_engine_contract(TransformersShardEngine)


@pytest.mark.parametrize("role", ROLES)
def test_fuzzing_finds_no_failure_in_any_role(role: str) -> None:
    result = fuzz(TARGET, seed=1, role=role)
    assert result.failure is None, result.failure.violation.message
    assert result.coverage[("prefill", "OK")] > 0
    assert result.coverage[("decode", "OK")] > 0


# --- three-way parity: the numpy engine's weights (the tiny GGUF's) in transformers ---------

NUMPY = "shardkit.engines.numpy_llama:NumpyShardEngine"
NUMPY_WEIGHTS = "shardkit.engines.transformers_llama:numpy_weights"


@pytest.mark.parametrize(("start", "end"), [(0, 1), (0, 3)])
def test_the_numpy_engines_weights_give_the_numpy_engines_answers(start: int, end: int) -> None:
    tokens = (5, 17, 3, 99, 42, 7, 1, 2)
    answers = []
    for engine in (numpy_weights(), NumpyShardEngine()):
        assert engine.load(LoadRequest("tiny-llama", start, end, LAYERS)).status.ok
        answers.append(engine.prefill(PrefillRequest("s", 0, 0, token_ids=tokens)).output)
    ours, theirs = answers
    if isinstance(ours, BoundaryBundle):
        assert isinstance(theirs, BoundaryBundle)
        assert np.abs(ours.tensors[0].to_array() - theirs.tensors[0].to_array()).max() < NumpyShardEngine.TOLERANCE
    else:
        assert isinstance(ours, TokenOutput)
        assert isinstance(theirs, TokenOutput)
        assert ours.token_id == theirs.token_id
        assert ours.margin == pytest.approx(theirs.margin, abs=NumpyShardEngine.TOLERANCE)


def test_the_tiny_gguf_file_is_read_into_the_same_model() -> None:
    from shardkit.engines.gguf_io import write_tiny_llama_gguf

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tiny.gguf"
        write_tiny_llama_gguf(path)
        from_file = TransformersShardEngine.from_gguf(path)
    ours = numpy_weights()
    for engine in (from_file, ours):
        assert engine.load(LoadRequest("tiny-llama", 0, 3, LAYERS)).status.ok
    request = PrefillRequest("s", 0, 0, token_ids=(3, 1, 4, 1, 5))
    assert from_file.prefill(request).output == ours.prefill(request).output


@pytest.mark.parametrize("role", ROLES)
def test_it_fuzzes_clean_against_the_numpy_engine_on_the_same_weights(role: str) -> None:
    """Differentially, in every role. A middle's and a tail's extreme rows are left out:
    transformers' RMSNorm squares in float32, as the next test shows."""
    result = fuzz(NUMPY_WEIGHTS, seed=1, role=role, reference=NUMPY, extreme_values=False)
    assert result.failure is None, result.failure.violation.message


def test_against_numpy_the_kit_finds_transformers_rmsnorm_overflowing_on_huge_rows() -> None:
    """LlamaRMSNorm squares a row in float32: a row of values near 3e38 overflows to inf, its
    scale to 0, and the layer answers as if the row were zeros, where the numpy engine (which
    squares in float64) keeps it. Found in one prefill of extreme rows."""
    result = fuzz(NUMPY_WEIGHTS, seed=1, role="middle", reference=NUMPY)
    assert result.failure is not None
    assert result.failure.violation.property == "§3 determinism"
    assert len(result.failure.records) == 1
    assert "rows=" in result.failure.records[0].action.describe()
