"""In-spec inputs never crash the kit: a trace at the documented limits replays to a verdict
within bounded memory, a trace cannot ask for more waiting than a documented cap, ``shardkit
report`` refuses what is not a regular report file (a FIFO, a device, a file too large) up
front, and numbers the trace format refuses (an infinite recipe value, a seed of ``2**64``)
are refused in one line.

The CLI runs in a subprocess with a time limit wherever the code before these checks hung."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from shardkit import (
    CacheResult,
    DecodeRequest,
    MetricsResult,
    StatusCode,
    StepResult,
    StructuredStatus,
    TraceFormatError,
)
from shardkit._cli.main import main
from shardkit._cli.report import MAX_REPORT_BYTES
from shardkit._core.model import ReferenceModel
from shardkit._parallel.linearize import TimedStep, linearize
from shardkit._parallel.observed import ObservedCall, counts_no_order_explains
from shardkit._run.trace_reader import (
    MAX_DELAY_SECONDS,
    MAX_LANE_STEPS,
    MAX_LANES,
    MAX_TOTAL_DELAY_SECONDS,
    read_trace,
)

ROOT = Path(__file__).resolve().parent.parent


def _document(steps: list[dict[str, Any]], target: str = "shardkit:FakeShardEngine", **extra: Any) -> dict[str, Any]:
    return {
        "format": "shardkit-trace",
        "version": 1,
        "shardkit_version": "0.1.0",
        "target": target,
        "role": "full",
        "load_request": {"model_id": "m", "shard_start": 0, "shard_end": 3, "total_layers": 4, "recipe": {}},
        "faults_enabled": ["delay"],
        "twins": True,
        "reference": None,
        "isolate": None,
        "fault_steps": [],
        "seed": 1,
        "steps": steps,
        "failure": {"property": "§2 linearizability", "message": "recorded", "step": 1},
        **extra,
    }


def _write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def _shardkit(*argv: str, cwd: Path, timeout: float, memory_bytes: int | None = None) -> tuple[int, str, str, int]:
    """``python -m shardkit ARGV`` in a child with a time limit: its exit code, output, error
    output and peak resident memory in KiB (read by a wrapper process, so it is the child's own)."""
    wrapper = (
        "import resource, subprocess, sys\n"
        "limit = int(sys.argv[1])\n"
        "def cap():\n"
        "    if limit: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
        "done = subprocess.run([sys.executable, '-m', 'shardkit', *sys.argv[2:]], preexec_fn=cap, capture_output=True, text=True)\n"
        "sys.stdout.write(done.stdout)\n"
        "sys.stderr.write(done.stderr)\n"
        "sys.stderr.write(f'\\nPEAK_KIB={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n')\n"
        "sys.exit(done.returncode)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", wrapper, str(memory_bytes or 0), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    err, _, peak = done.stderr.rpartition("\nPEAK_KIB=")
    return done.returncode, done.stdout, err, int(peak)


# --- a parallel phase at the documented limits ---------------------------------------------------


def _decode(session: str, step: int, token: int) -> dict[str, Any]:
    return {"op": "decode", "args": {"session": session, "epoch": 0, "step": step, "tokens": [token], "malformed": None}, "note": ""}


def _open(session: str, token: int) -> dict[str, Any]:
    return {"op": "prefill", "args": {"session": session, "epoch": 0, "step": 0, "tokens": [token, token], "malformed": None}, "note": ""}


def _phase(lanes: int, steps: int) -> dict[str, Any]:
    """Each lane opens a session of its own and decodes it (the fake then runs out of slots and
    KV tokens, so the calls answer OK, RESOURCE_EXHAUSTED and NOT_FOUND)."""
    sessions = "abcdefgh"
    phase = [
        [_open(sessions[lane], lane), *(_decode(sessions[lane], index + 1, (lane + index) % 32) for index in range(steps - 1))]
        for lane in range(lanes)
    ]
    return {"op": "parallel", "args": {"lanes": phase}, "note": ""}


def _lost_updates(lanes: int, steps: int) -> dict[str, Any]:
    """Decodes of a session nobody opened: a planted engine that loses decode counts makes the
    metrics after the lanes match no order, so the search explores as far as it may."""
    phase = [[_decode("a", 0, (lane + index) % 32) for index in range(steps)] for lane in range(lanes)]
    return {"op": "parallel", "args": {"lanes": phase}, "note": ""}


LIMITS = [(1, MAX_LANE_STEPS), (2, MAX_LANE_STEPS // 2), (MAX_LANES, MAX_LANE_STEPS // MAX_LANES), (MAX_LANES, MAX_LANE_STEPS)]
#: Peak resident memory a replay of the largest phase may take (it took 828 MB, then failed).
PEAK_MEMORY_KIB = 300 * 1024


@pytest.mark.parametrize(("lanes", "steps"), LIMITS, ids=[f"{lanes}x{steps}" for lanes, steps in LIMITS])
def test_a_phase_at_the_documented_limits_replays_to_a_verdict(tmp_path: Path, lanes: int, steps: int) -> None:
    trace = _write(tmp_path / "trace.json", _document([_phase(lanes, steps)]))
    read_trace(trace)  # within what the reader accepts
    code, out, err, peak = _shardkit("replay", str(trace), "--runs", "1", cwd=tmp_path, timeout=600)
    assert code in (0, 1), (code, out[-2000:], err[-2000:])
    assert "internal error" not in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert peak < PEAK_MEMORY_KIB, f"peak {peak} KiB"


@pytest.mark.parametrize(("lanes", "steps"), [(2, 500), (MAX_LANES, MAX_LANE_STEPS)], ids=["2x500", "8x1000"])
def test_a_lost_update_at_the_limits_is_found(tmp_path: Path, lanes: int, steps: int) -> None:
    """The costliest search: no order explains the answers. At 8 lanes of 1,000 calls it runs
    out of its states; what every order agrees on (the calls counted) still gives the verdict."""
    target = "shardkit._planted.racy:DecodeCounterLostUpdate"
    trace = _write(tmp_path / "trace.json", _document([_lost_updates(lanes, steps)], target=target))
    code, out, err, peak = _shardkit("replay", str(trace), "--runs", "1", cwd=tmp_path, timeout=600)
    assert code == 1, (code, out[-2000:], err[-2000:])
    assert "FAILURE (§2 linearizability) in 1 step:" in out
    assert "no order of these calls explains their answers" in out
    assert "internal error" not in err, err[-2000:]
    assert peak < PEAK_MEMORY_KIB, f"peak {peak} KiB"


def test_counted_calls_rule_out_every_order_only_for_the_kits_own_model() -> None:
    model = ReferenceModel()
    decode = DecodeRequest("a", 0, 0, token_ids=(1,))
    missing = StepResult(StructuredStatus(StatusCode.NOT_FOUND, "no such session"), CacheResult.MISS)
    calls = [ObservedCall("decode", missing, decode), ObservedCall("decode", missing, decode)]
    lost = counts_no_order_explains(model, calls, MetricsResult(0, 1, 0, 0))
    assert lost is not None
    assert "in every order the model counts prefill_calls=0 decode_calls=2" in lost
    assert "decode_calls=1" in lost
    assert counts_no_order_explains(model, calls, MetricsResult(0, 2, 0, 0)) is None

    class CountsOtherwise(ReferenceModel):
        pass

    assert counts_no_order_explains(CountsOtherwise(), calls, MetricsResult(0, 1, 0, 0)) is None


def _reads(lanes: int, steps: int) -> list[TimedStep[int]]:
    """``lanes`` lanes of ``steps`` reads, each overlapping the other lanes' steps of its index."""
    return [
        TimedStep(lane, index, 2 * lanes * index + lane, 2 * lanes * index + lanes + lane, 0)
        for lane in range(lanes)
        for index in range(steps)
    ]


def test_the_search_is_not_recursive_and_its_memory_grows_with_the_calls_not_their_square() -> None:
    steps = _reads(MAX_LANES, MAX_LANE_STEPS)
    tracemalloc.start()
    try:
        found = linearize(steps, 0, lambda state, step: state, lambda state: state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert found.order is not None
    assert len(found.order) == MAX_LANES * MAX_LANE_STEPS
    assert peak < 64 * 1024 * 1024, f"{peak / 1e6:.0f} MB"


def test_a_long_search_that_fails_names_the_longest_order_it_found() -> None:
    """The iterative search keeps what the recursive one reported: the closest order and why
    the next steps were refused."""
    steps = [*_reads(2, 1500)]
    last = steps[-1]
    steps[-1] = TimedStep(last.lane, last.index, last.started, last.ended, 1)
    found = linearize(steps, 0, lambda state, step: state if step == 0 else "a read of 1", lambda state: state)
    assert not found.linearizable
    assert not found.unknown
    assert len(found.closest) == len(steps) - 1
    assert [rejection.why for rejection in found.breaks] == ["a read of 1"]


# --- the total delay a trace may ask for ---------------------------------------------------------


def _delays(seconds: float, count: int) -> list[dict[str, Any]]:
    steps = []
    for _ in range(count):
        steps.append({"op": "fault", "args": {"kind": "delay", "value": seconds}, "note": ""})
        steps.append({"op": "health", "args": {}, "note": ""})
    return steps


def test_a_trace_whose_delays_add_up_past_the_cap_is_refused_before_anything_runs(tmp_path: Path) -> None:
    count = int(MAX_TOTAL_DELAY_SECONDS // MAX_DELAY_SECONDS) + 1
    trace = _write(tmp_path / "trace.json", _document(_delays(MAX_DELAY_SECONDS, count)))
    code, out, err, _ = _shardkit("replay", str(trace), cwd=tmp_path, timeout=30)
    assert code == 2, (code, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    total = count * MAX_DELAY_SECONDS
    assert f"delay faults that add up to {total:g} seconds" in lines[0]
    assert f"at most {MAX_TOTAL_DELAY_SECONDS:g}" in lines[0]
    assert "delete" in lines[0]
    # Up to the cap, delays are read.
    at_the_cap = read_trace(_write(tmp_path / "cap.json", _document(_delays(MAX_DELAY_SECONDS, count - 1))))
    assert sum(action.args["value"] for action in at_the_cap.actions if action.op == "fault") == MAX_TOTAL_DELAY_SECONDS


def test_many_small_delays_count_too(tmp_path: Path) -> None:
    document = _document(_delays(0.5, int(MAX_TOTAL_DELAY_SECONDS / 0.5) + 2))
    with pytest.raises(TraceFormatError, match="delay faults that add up to"):
        read_trace(_write(tmp_path / "trace.json", document))


# --- shardkit report: only a regular file, of bounded size ----------------------------------------


def _one_line(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardkit report: ")
    return lines[0]


def test_report_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    code, _, err, _ = _shardkit("report", str(fifo), "-o", str(tmp_path / "page.html"), cwd=tmp_path, timeout=30)
    line = _one_line(code, err)
    assert f"{fifo} is a FIFO (named pipe), not a report file" in line
    assert "shardkit fuzz --report FILE" in line


def test_report_refuses_a_device_before_reading_it(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    code, _, err, _ = _shardkit(
        "report", "/dev/zero", "-o", str(tmp_path / "page.html"), cwd=tmp_path, timeout=60, memory_bytes=2 << 30
    )
    line = _one_line(code, err)
    assert "/dev/zero is a character device, not a report file" in line


def test_report_refuses_a_file_too_large_naming_its_size_and_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = tmp_path / "report.json"
    with huge.open("wb") as file:
        file.truncate(MAX_REPORT_BYTES + 1)  # sparse: nothing must be read
    code = main(["report", str(huge), "-o", str(tmp_path / "page.html")])
    line = _one_line(code, capsys.readouterr().err)
    assert f"{MAX_REPORT_BYTES + 1} bytes" in line
    assert f"({MAX_REPORT_BYTES})" in line
    assert not (tmp_path / "page.html").exists()


# --- numbers the trace format refuses ------------------------------------------------------------

STEPS = [{"op": "health", "args": {}, "note": ""}]


def test_an_infinite_recipe_value_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = _document(STEPS)
    document["load_request"]["recipe"] = {"scale": "INFINITY"}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(document).replace('"INFINITY"', "1e999"), encoding="utf-8")
    assert math.isinf(json.loads(trace.read_text())["load_request"]["recipe"]["scale"])  # what json makes of it
    with pytest.raises(TraceFormatError, match=r"load_request\.recipe\.scale must be a finite number, got inf"):
        read_trace(trace)
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "load_request.recipe.scale" in err
    finite = _document(STEPS)
    finite["load_request"]["recipe"] = {"scale": 1e300, "n": 3, "on": True, "name": "x", "none": None}
    assert read_trace(_write(tmp_path / "finite.json", finite)).load_request.recipe["scale"] == 1e300


@pytest.mark.parametrize("value", ["-1e999", "1e400"])
def test_every_spelling_of_an_infinite_recipe_value_is_refused(tmp_path: Path, value: str) -> None:
    document = _document(STEPS)
    document["load_request"]["recipe"] = {"scale": "INFINITY"}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(document).replace('"INFINITY"', value), encoding="utf-8")
    with pytest.raises(TraceFormatError, match="must be a finite number"):
        read_trace(trace)


def test_a_seed_of_two_to_the_64_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write(tmp_path / "trace.json", _document(STEPS, seed=2**64))
    with pytest.raises(TraceFormatError, match=r"seed must be an integer in \[0, 2\*\*64\), got 18446744073709551616"):
        read_trace(trace)
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "seed" in err
    assert read_trace(_write(tmp_path / "largest.json", _document(STEPS, seed=2**64 - 1))).seed == 2**64 - 1
