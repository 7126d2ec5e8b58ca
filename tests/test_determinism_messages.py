"""What a determinism failure says: where a row differs most and by how much against the
tolerance (the rows whole only on request), and an explanation the evidence supports: a
difference that an engine loaded alone shows too when fed as the session was is the
chunking's, and is called that, never another session's doing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardkit import DelegatingEngine, FakeShardEngine
from shardkit._core.driver import Driver, StepFailed
from shardkit._core.output_checks import LEAKY_RECOMPUTE
from shardkit._core.steps import Action, step_action
from shardkit._run.runner import fuzz
from shardkit._run.trace_reader import read_trace
from shardkit._transport.resolve import resolve_target
from shardkit.contract import BoundaryBundle, DecodeRequest, EngineTensor, LoadRequest, PrefillRequest, StepResult
from shardkit.engines.numpy_llama import NumpyBfloat16ShardEngine

HEAD = LoadRequest("shardkit-fuzz", 0, 1, 4)
#: The value added to the first row of a prefill of two tokens or more: far below any
#: tolerance an engine would declare, so bit-exact comparison (the fake's tolerance 0) sees it.
NUDGE = 2.0**-12
COLUMN = 3


def _nudged(bundle: BoundaryBundle) -> BoundaryBundle:
    tensor = bundle.tensors[0]
    rows = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(tensor.shape).copy()
    rows[0, COLUMN] += NUDGE
    return dataclasses.replace(bundle, tensors=(dataclasses.replace(tensor, data=rows.tobytes()), *bundle.tensors[1:]))


class FirstRowDependsOnChunking(DelegatingEngine[FakeShardEngine]):
    """A head whose first row of a prefill of two tokens or more differs from the row the same
    token gives alone, as a BLAS matmul of many rows rounds otherwise than one of one row: the
    answer depends on how a history is split into steps, and on nothing else."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        several = request.token_ids is not None and len(request.token_ids) > 1
        if result.status.ok and several and isinstance(result.output, BoundaryBundle):
            return StepResult(result.status, result.cache, _nudged(result.output))
        return result


def _failure_of_one_prefill() -> tuple[Driver, StepFailed]:
    driver = Driver(resolve_target(FirstRowDependsOnChunking), HEAD)
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "a", 0, 0, (0, 3)))
    return driver, failed.value


def test_a_row_failure_names_where_it_differs_most_and_the_tolerance_not_whole_rows() -> None:
    _, failed = _failure_of_one_prefill()
    message = failed.violation.message
    assert failed.violation.property == "§3 determinism"
    assert f"output row 0 differs bit-wise: by {NUDGE:.3g} at column {COLUMN} (" in message, message
    assert "tolerance 0 (bit-exact)" in message, message
    # Short: the expected row by its first and last values and its width, no row in full.
    assert "(8 values) after history [0]" in message, message
    assert max(len(line) for line in message.splitlines()) < 400, message
    # The rows whole are kept, for --full-rows, the trace and the report.
    expected, observed = failed.violation.rows.splitlines()
    assert expected.startswith("expected row [")
    assert observed.startswith("observed row [")
    assert expected.count(" ") >= 7
    assert expected != observed.replace("observed", "expected", 1)


def test_a_difference_an_engine_loaded_alone_repeats_is_called_chunking_not_another_sessions_doing() -> None:
    """One session, one step: nothing served before can be to blame. The twins' recompute of
    [0] came from the prefill of [0, 3], which an engine loaded alone repeats: that is
    chunking, and the run must not say a twin was led astray by sessions it served."""
    driver, failed = _failure_of_one_prefill()
    message = failed.violation.message
    assert "gives the same row: the difference comes from how the history is split into steps (chunking)" in message
    assert "not from another session" in message, message
    assert LEAKY_RECOMPUTE not in driver.caveats, driver.caveats
    assert not any("served other sessions" in note for note in driver.notes), driver.notes
    assert any("within the prefill of [0, 3]" in note and "chunked" in note for note in driver.notes), driver.notes


class SecondSessionShifted(DelegatingEngine[FakeShardEngine]):
    """A head whose rows shift once it has served a session before: state from elsewhere."""

    def __init__(self) -> None:
        super().__init__(FakeShardEngine())
        self.served: set[str] = set()

    def prefill(self, request: PrefillRequest) -> StepResult:
        result = self.inner.prefill(request)
        self.served.add(request.session_id)
        if result.status.ok and len(self.served) > 1 and isinstance(result.output, BoundaryBundle):
            return StepResult(result.status, result.cache, _nudged(result.output))
        return result


def test_a_difference_an_engine_loaded_alone_does_not_repeat_is_not_called_chunking() -> None:
    driver = Driver(resolve_target(SecondSessionShifted), HEAD)
    driver.execute(step_action("prefill", "a", 0, 0, (1, 2)))
    driver.execute(Action("release", {"session": "a"}))
    with pytest.raises(StepFailed) as failed:
        driver.execute(step_action("prefill", "b", 0, 0, (0, 3)))
    message = failed.value.violation.message
    assert "(chunking)" not in message, message
    assert "gives another row" in message, message
    assert "depends on more than this session's steps" in message, message


def test_the_rows_travel_in_the_trace_and_print_whole_only_with_full_rows(tmp_path: Path) -> None:
    result = fuzz(FirstRowDependsOnChunking, seed=1, role="head", examples=20, steps=5, faults="none", out=tmp_path)
    assert result.failure is not None
    assert result.trace_path is not None
    rows = result.failure.violation.rows
    assert rows.startswith("expected row [")
    assert read_trace(result.trace_path).failure.rows == rows
    document = json.loads(result.trace_path.read_text())
    # A trace written before the rows were kept (no "rows") still reads, with none.
    del document["failure"]["rows"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(document))
    assert read_trace(older).failure.rows == ""
    command = [sys.executable, "-m", "shardkit", "replay", str(result.trace_path)]
    short = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert short.returncode == 1, short.stderr
    assert "(the rows compared, whole: --full-rows on shardkit fuzz or replay)" in short.stdout, short.stdout
    assert "expected row [" not in short.stdout
    whole = subprocess.run([*command, "--full-rows"], capture_output=True, text=True, timeout=300, check=False)
    assert whole.returncode == 1, whole.stderr
    assert "the rows compared, whole:" in whole.stdout, whole.stdout
    assert "    expected row [" in whole.stdout, whole.stdout


class DecodesShiftColumn3(NumpyBfloat16ShardEngine):
    """A bfloat16 engine whose decodes move column 3 by three times its tolerance: its own
    paths then disagree (one token per decode against a recompute in one prefill)."""

    def decode(self, request: DecodeRequest) -> StepResult:
        result = super().decode(request)
        if not result.status.ok or not isinstance(result.output, BoundaryBundle):
            return result
        rows = result.output.tensors[0].to_array().astype(np.float32)
        rows[:, 3] += 3 * self.TOLERANCE
        shifted = EngineTensor.from_array("residual", rows.astype(result.output.tensors[0].to_array().dtype))
        return dataclasses.replace(result, output=dataclasses.replace(result.output, tensors=(shifted,)))


def test_when_the_engines_own_paths_disagree_the_message_names_where_and_the_tolerance() -> None:
    """The rows shown are cut to their ends; the column where two paths part most, by how
    much and against which tolerance, is named beside them."""
    result = fuzz(DecodesShiftColumn3, seed=1, role="middle")
    assert result.failure is not None
    message = result.failure.violation.message
    assert "the engine's own paths disagree" in message, message
    assert "at column 3 " in message, message
    assert "tolerance 0.25 + 0.016·|reference|" in message, message
