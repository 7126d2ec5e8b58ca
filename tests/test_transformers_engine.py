"""TransformersShardEngine: a Hugging Face transformers Llama on PyTorch behind contract v1,
in every role, with a DynamicCache per session that holds only its shard's layers.

Needs the ``transformers`` extra; without it these tests skip with a message naming the
extra, except under SHARDKIT_REQUIRE_TRANSFORMERS=1 (CI), where a missing install fails.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardkit import (
    BoundaryBundle,
    DecodeRequest,
    LoadRequest,
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

from shardkit.engines.transformers_llama import TransformersShardEngine, tiny_llama

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
