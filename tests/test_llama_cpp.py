"""LlamaCppShardEngine: llama.cpp behind contract v1, and parity with the numpy engine on one file.

Needs the ``llama`` extra; without it these tests skip with a message naming the extra,
except under SHARDKIT_REQUIRE_LLAMA=1 (CI), where a missing build is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit import (
    DecodeRequest,
    EngineError,
    LoadRequest,
    NumpyShardEngine,
    PrefillRequest,
    StatusCode,
    assert_shard_engine_contract,
)
from shardkit.engines.gguf_io import read_llama_gguf, write_tiny_llama_gguf

if os.environ.get("SHARDKIT_REQUIRE_LLAMA") != "1":
    pytest.importorskip("llama_cpp", reason="llama.cpp is not installed: pip install 'shardkit[llama]'")

from shardkit.engines import llama_cpp
from shardkit.engines.llama_cpp import LlamaCppShardEngine, tiny_gguf_path

HISTORIES = st.lists(st.integers(0, 255), min_size=1, max_size=48)


def _loaded(engine: object) -> object:
    engine.load(LoadRequest("parity", 0, 3, 4))  # type: ignore[attr-defined]
    return engine


def _logits_llama(engine: LlamaCppShardEngine, history: list[int], cuts: list[int]) -> np.ndarray:
    """Feed ``history`` in chunks ending at ``cuts`` and return the last chunk's logits."""
    start, step = 0, 0
    for end in [*cuts, len(history)]:
        if end <= start:
            continue
        chunk = tuple(history[start:end])
        request = PrefillRequest("s", 0, step, token_ids=chunk)
        result = engine.prefill(request)
        assert result.status.code is StatusCode.OK, result.status
        start, step = end, step + 1
    # The engine returns only the token: read the logits of the last row llama.cpp decoded.
    llama = llama_cpp._llama()
    pointer = llama.llama_get_logits_ith(engine._context, -1)
    return np.ctypeslib.as_array(pointer, shape=(engine.capabilities().vocab_size,)).copy()


def _numpy_logits(weights: object, history: list[int]) -> np.ndarray:
    engine = NumpyShardEngine(weights)  # type: ignore[arg-type]
    _loaded(engine)
    _, logits = engine.forward(engine.fresh_cache(), _step(history))
    return np.asarray(logits)


def _step(history: list[int]) -> object:
    from shardkit.engines.base import StepInput

    return StepInput(tuple(history), None)


@pytest.fixture(scope="module")
def tiny_weights() -> object:
    return read_llama_gguf(tiny_gguf_path())


def test_the_class_itself_is_a_target_that_writes_the_tiny_model_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDKIT_CACHE", str(tmp_path))
    engine = LlamaCppShardEngine()
    written = tmp_path / "tiny-llama-f32-seed0.gguf"
    assert written.is_file()
    assert written.read_bytes() == write_tiny_llama_gguf(tmp_path / "again.gguf").read_bytes()
    caps = engine.capabilities()
    assert (caps.total_layers, caps.hidden_size, caps.vocab_size, caps.evidence_class) == (4, 64, 256, "real")


def test_the_static_contract_passes_and_skips_the_partial_roles() -> None:
    skipped = assert_shard_engine_contract(LlamaCppShardEngine)
    assert len(skipped) == 3
    assert all("serves the whole model only" in reason for reason in skipped)


def test_its_answer_depends_on_the_whole_history_the_cache_holds() -> None:
    """The contract's history sensitivity, on the margin a real model reports: not flagged."""
    from shardkit._core.sensitivity import history_sensitivity

    measured = history_sensitivity(LlamaCppShardEngine)
    assert measured.compared == "the token or its margin"
    assert measured.changed == measured.trials > 0
    assert measured.warning() is None


def test_a_partial_range_and_a_missing_file_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="serves the whole model only"):
        LlamaCppShardEngine().load(LoadRequest("m", 0, 1, 4))
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        LlamaCppShardEngine(tmp_path / "absent.gguf")


def test_sessions_map_to_sequences_that_cancel_release_and_restart_free() -> None:
    engine = _loaded(LlamaCppShardEngine(max_sessions=2))
    assert isinstance(engine, LlamaCppShardEngine)
    first = engine.prefill(PrefillRequest("a", 0, 0, token_ids=(1, 2, 3)))
    for _ in range(10):  # restarts and releases must give their sequences back
        assert engine.prefill(PrefillRequest("b", 0, 0, token_ids=(1, 2, 3))).output == first.output
        assert engine.release("b").code is StatusCode.OK
        assert engine.prefill(PrefillRequest("a", _ + 1, 0, token_ids=(1, 2, 3))).output == first.output
    assert engine.cancel("a", 10).code is StatusCode.OK
    assert engine.metrics().kv_tokens == 0
    decoded = engine.decode(DecodeRequest("a", 10, 1, token_ids=(4,)))
    assert decoded.status.code is StatusCode.CANCELLED


@settings(max_examples=60, deadline=None)
@given(history=HISTORIES, cut_seed=st.integers(0, 2**16))
def test_greedy_tokens_match_the_numpy_engine_on_the_same_file(
    tiny_weights: object, history: list[int], cut_seed: int
) -> None:
    """Parity: same file, same history (chunked at random for llama.cpp): the same greedy token,
    unless the two top logits are within the tolerance (a near-tie may flip)."""
    cuts = sorted(np.random.default_rng(cut_seed).choice(len(history) + 1, size=min(3, len(history)), replace=False))
    engine = _loaded(LlamaCppShardEngine())
    assert isinstance(engine, LlamaCppShardEngine)
    ours = _logits_llama(engine, history, [int(cut) for cut in cuts])
    theirs = _numpy_logits(tiny_weights, history)
    difference = float(np.max(np.abs(ours - theirs)))
    assert difference < LlamaCppShardEngine.TOLERANCE, difference
    top_two = np.sort(theirs)[-2:]
    if top_two[1] - top_two[0] >= LlamaCppShardEngine.TOLERANCE:
        assert int(np.argmax(ours)) == int(np.argmax(theirs))
