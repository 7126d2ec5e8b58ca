"""The history sensitivity ``shardkit contract`` measures: how often one changed token before
the last changes an engine's answer, which is what the twin oracle can see of a corrupted
cache. The bundled engines are sensitive; the blind engines of ``tests/planted/blind.py``
(correct, answers from the last token or from the high bits of a linear hash) are flagged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardkit import FakeShardEngine, FakeShardEngineConfig, StatusCode, StructuredStatus
from shardkit._cli.main import main
from shardkit._core.checks import Tolerance
from shardkit._core.sensitivity import HISTORIES, POSITIONS, HistorySensitivity, _differs, history_sensitivity
from shardkit.engines.numpy_llama import NumpyShardEngine
from shardkit.engines.pipeline import PipelineEngine
from tests.planted.blind import LastTokenOnly, LinearHashEngine

TRIALS = HISTORIES * POSITIONS


def test_the_bundled_engines_change_their_answer_with_every_earlier_token() -> None:
    for engine in (FakeShardEngine, NumpyShardEngine):
        measured = history_sensitivity(engine)
        assert (measured.trials, measured.changed, measured.role) == (TRIALS, TRIALS, "full"), measured
        assert not measured.blind
        assert measured.warning() is None


def test_an_engine_answering_from_its_last_token_is_flagged() -> None:
    measured = history_sensitivity(LastTokenOnly)
    assert (measured.trials, measured.changed) == (TRIALS, 0)
    assert measured.blind
    warning = measured.warning()
    assert warning is not None
    assert "only 0 of 15 changes of one earlier token changed the answer" in warning
    assert "report TokenOutput.margin" in warning  # it reports no margin: the fix is named


def test_a_linear_hash_engine_is_flagged() -> None:
    measured = history_sensitivity(LinearHashEngine)
    assert measured.blind, measured.summary()
    assert 0 < measured.changed < TRIALS / 2


def test_the_figure_is_the_same_on_every_run() -> None:
    assert history_sensitivity(LinearHashEngine) == history_sensitivity(LinearHashEngine)


def test_a_head_shard_is_measured_on_the_residual_of_the_last_row() -> None:
    """An engine that will not load its whole range is measured on the first role it loads."""

    class HeadOnly(FakeShardEngine):
        def load(self, request):  # type: ignore[no-untyped-def]
            if request.shard_end == request.total_layers - 1:
                result = super().load(request)
                return dataclasses.replace(
                    result, status=StructuredStatus(StatusCode.INVALID_ARGUMENT, "this engine serves no tail")
                )
            return super().load(request)

    measured = history_sensitivity(HeadOnly)
    assert measured.role in ("head", "middle")
    assert measured.compared == "the residual row of the last token"
    assert (measured.trials, measured.changed) == (TRIALS, TRIALS)


def test_too_small_a_cache_is_said_and_not_measured() -> None:
    measured = history_sensitivity(lambda: FakeShardEngine(FakeShardEngineConfig(max_kv_tokens=1)))
    assert measured.trials == 0
    assert not measured.blind
    assert measured.summary().startswith("history sensitivity not measured: a history needs 2 tokens")


def test_a_token_answer_changes_with_its_margin_and_a_row_beyond_the_tolerance() -> None:
    assert _differs((3, 1.0), (3, 1.5), tolerance=Tolerance(0.1, margin=0.1))
    assert not _differs((3, 1.0), (3, 1.05), tolerance=Tolerance(0.1, margin=0.1))
    assert not _differs((3, None), (3, 2.0), tolerance=Tolerance(0.0))
    assert _differs((3, None), (4, None), tolerance=Tolerance(0.0))
    row = np.zeros(4, dtype=np.float32)
    assert not _differs(row, row + 1e-4, tolerance=Tolerance(1e-3))
    assert _differs(row, row + 1e-2, tolerance=Tolerance(1e-3))
    assert _differs(row, row + np.float32(1e-7), tolerance=Tolerance(0.0))


def test_a_blind_measure_needs_a_trial() -> None:
    assert not HistorySensitivity("full", 16, 0, 0, "the token").blind
    assert HistorySensitivity("full", 16, 15, 7, "the token").blind
    assert not HistorySensitivity("full", 16, 15, 8, "the token").blind


def test_shardkit_contract_prints_the_figure_and_warns_of_a_blind_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contract", "tests.planted.blind:LastTokenOnly"]) == 0
    out = capsys.readouterr().out
    assert "history sensitivity: 0 of 15 one-token changes before the last token of a 16-token history" in out
    assert "warning: only 0 of 15" in out
    assert main(["contract", "shardkit:FakeShardEngine"]) == 0
    out = capsys.readouterr().out
    assert "history sensitivity: 15 of 15" in out
    assert "warning" not in out


def test_a_pipeline_of_sensitive_shards_is_sensitive() -> None:
    measured = history_sensitivity(lambda: PipelineEngine(FakeShardEngine, (1,)))
    assert (measured.trials, measured.changed) == (TRIALS, TRIALS)


def test_a_fuzz_run_of_a_blind_engine_says_what_it_could_not_check() -> None:
    from shardkit import fuzz

    blind = fuzz(LastTokenOnly, seed=1, examples=10, steps=20)
    assert blind.failure is None  # it keeps the contract: nothing to report but the blind spot
    (caveat,) = [caveat for caveat in blind.caveats if "KV cache" in caveat]
    assert caveat.startswith("most corruption of the engine's KV cache: only 0 of 15 changes")
    assert blind.caveats[caveat] == blind.examples
    sighted = fuzz(FakeShardEngine, seed=1, examples=10, steps=20)
    assert not [caveat for caveat in sighted.caveats if "KV cache" in caveat]
