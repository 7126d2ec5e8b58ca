"""The ``shardkit`` command (SPEC §6): its output, its exit codes and its ``--report`` schema."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit import __version__
from shardkit._bench.render import render
from shardkit._bench.run import run_bench
from shardkit._bench.settings import NOT_MEASURED, QUICK, SECTIONS, BenchSettings
from shardkit._bench.throughput import PROFILE_COMPONENTS
from shardkit._cli.bench import bench_settings
from shardkit._cli.main import main
from shardkit._cli.parser import build_parser
from shardkit._planted import PLANTED

REPO_ROOT = Path(__file__).resolve().parent.parent
PLANTED_FILE = REPO_ROOT / "tests" / "planted" / "__init__.py"
SMALL = ["--examples", "20", "--steps", "20"]
REPORT_KEYS = {
    "shardkit_version",
    "target",
    "seed",
    "examples",
    "steps",
    "elapsed_s",
    "coverage",
    "not_checked",
    "longest_session",
    "failures",
    "run",
}
FAILURE_KEYS = {"message", "steps", "trace", "faults", "notes"}
STEP_KEYS = {"op", "args", "expected", "observed"}


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    """Call ``shardkit`` in-process; return its exit code, stdout and stderr."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_usage_error(code: int, out: str, err: str) -> str:
    """Exit 2 with exactly one line on stderr and no traceback; return that line."""
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].strip()
    return lines[0]


def read_json(path: Path) -> dict[str, object]:
    return json.loads(path.read_text(encoding="utf-8"))


def write_target(folder: Path, source: str) -> str:
    """Write ``source`` to a module file in ``folder``; return the target ``file.py:make``."""
    path = folder / "target_engine.py"
    path.write_text(source, encoding="utf-8")
    return f"{path}:make"


# --- fuzz: success ----------------------------------------------------------


def test_fuzz_of_the_default_target_prints_seed_coverage_and_no_failure(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path)
    assert code == 0, err
    assert "shardkit fuzz shardkit:FakeShardEngine --seed 1" in out
    assert "no failure found" in out
    assert "coverage (operation → outcome counts):" in out
    for op in ("prefill", "decode", "cancel", "release", "health"):
        assert f"  {op} " in out
    assert "steps/s" in out
    assert "FAILURE" not in out
    assert err == ""


def test_fuzz_report_has_exactly_the_spec_keys_and_no_failures(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    code, out, _ = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path, "--report", report)
    assert code == 0
    assert f"report: {report}" in out
    document = read_json(report)
    assert set(document) == REPORT_KEYS
    assert document["shardkit_version"] == __version__
    assert document["target"] == "shardkit:FakeShardEngine"
    assert document["seed"] == 1
    for key in ("examples", "steps"):
        value = document[key]
        assert type(value) is int, (key, value)
        assert value > 0, (key, value)
    assert isinstance(document["elapsed_s"], float | int)
    assert document["elapsed_s"] >= 0
    coverage = document["coverage"]
    assert isinstance(coverage, dict)
    assert coverage
    for op, outcomes in coverage.items():
        assert isinstance(op, str)
        assert isinstance(outcomes, dict)
        assert outcomes
        for outcome, count in outcomes.items():
            assert isinstance(outcome, str)
            assert type(count) is int
            assert count > 0
    assert document["failures"] == []


def test_fuzz_with_the_same_seed_twice_gives_the_same_report_apart_from_elapsed_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    documents = []
    for name in ("first.json", "second.json"):
        report = tmp_path / name
        code, _, _ = run(capsys, "fuzz", "--seed", "7", *SMALL, "--out", tmp_path, "--report", report)
        assert code == 0
        document = read_json(report)
        del document["elapsed_s"]
        documents.append(document)
    assert documents[0] == documents[1]


def test_fuzz_with_faults_none_injects_no_fault(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, out, _ = run(capsys, "fuzz", "--seed", "1", *SMALL, "--faults", "none", "--out", tmp_path, "--report", report)
    assert code == 0
    assert "faults: none" in out
    coverage = read_json(report)["coverage"]
    assert isinstance(coverage, dict)
    assert coverage
    assert "fault" not in coverage


def test_fuzz_with_a_list_of_faults_runs_only_those_kinds(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    code, out, _ = run(
        capsys, "fuzz", "--seed", "1", *SMALL, "--faults", "delay,crash", "--out", tmp_path, "--report", report
    )
    assert code == 0
    assert "faults: crash, delay\n" in out
    assert "no failure found" in out
    assert read_json(report)["failures"] == []


# --- fuzz: a planted bug ----------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [f"{PLANTED_FILE}:ReleaseLeaksKvTokens", "tests.planted:ReleaseLeaksKvTokens"],
    ids=["file-path target", "module target"],
)
def test_fuzz_finds_a_planted_bug_exits_1_and_reports_its_minimal_steps(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str
) -> None:
    out_dir = tmp_path / "failures"
    report = tmp_path / "report.json"
    argv = ["fuzz", target, "--seed", "3", "--examples", "200", "--steps", "50"]
    code, out, err = run(capsys, *argv, "--out", out_dir, "--report", report)
    assert code == 1, err
    assert "Traceback" not in out + err

    # The human-readable summary.
    assert f"shardkit fuzz {target} --seed 3" in out
    assert "FAILURE (§2 metrics) in 2 steps:" in out
    assert "  step 1: prefill(session='a', epoch=0, step=0, tokens=[0])" in out
    assert "  step 2: release(session='a')" in out
    assert "expected: metrics prefill_calls=1 decode_calls=0 active_sessions=0 kv_tokens=0" in out
    assert "observed: metrics prefill_calls=1 decode_calls=0 active_sessions=0 kv_tokens=1" in out
    assert f"  the whole run:   shardkit fuzz {target} --seed 3" in out
    assert "no failure found" not in out

    # The trace file and the regression test, each with the command that reruns it.
    trace_lines = [line for line in out.splitlines() if line.startswith("  this failure:    shardkit replay ")]
    assert len(trace_lines) == 1
    trace = Path(trace_lines[0].removeprefix("  this failure:    shardkit replay "))
    assert trace.is_file()
    test_lines = [line for line in out.splitlines() if line.startswith("  as a test:       pytest ")]
    assert len(test_lines) == 1
    assert Path(test_lines[0].removeprefix("  as a test:       pytest ")).is_file()
    assert trace.parent == out_dir
    trace_document = read_json(trace)
    assert trace_document["format"] == "shardkit-trace"
    assert trace_document["version"] == 1

    # The report.
    document = read_json(report)
    assert set(document) == REPORT_KEYS
    assert document["target"] == target
    assert document["seed"] == 3
    failures = document["failures"]
    assert isinstance(failures, list)
    assert len(failures) == 1
    failure = failures[0]
    assert set(failure) >= FAILURE_KEYS
    assert "kv_tokens=1" in failure["message"]
    assert failure["trace"] == str(trace)
    assert failure["faults"] == []
    steps = failure["steps"]
    assert len(steps) == 2
    for step in steps:
        assert set(step) >= STEP_KEYS
    assert [step["op"] for step in steps] == ["prefill", "release"]
    assert steps[1]["args"] == {"session": "a"}
    assert "kv_tokens=0" in steps[1]["expected"]
    assert "kv_tokens=1" in steps[1]["observed"]


# --- contract ---------------------------------------------------------------


def test_contract_of_the_fake_engine_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "contract", "shardkit:FakeShardEngine")
    assert code == 0, out + err
    assert "every contract check passed" in out
    assert err == ""


def test_contract_of_a_planted_bug_exits_1_and_names_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "contract", "tests.planted:StaleEpochAccepted")
    assert code == 1, out + err
    assert "a stale epoch is ABORTED" in out
    assert "Traceback" not in out + err


def test_contract_of_a_missing_module_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = assert_usage_error(*run(capsys, "contract", "nope:thing"))
    assert "cannot import" in line


# --- usage errors -----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["fuzz", "--steps", "0"], "--steps must be a positive integer, got '0'"),
        (["fuzz", "--examples", "abc"], "--examples must be a positive integer, got 'abc'"),
        (["fuzz", "--seed", "-1"], "--seed must be an integer in [0, 2**64) or 'random', got '-1'"),
        (["fuzz", "--shrink-examples", "-1"], "--shrink-examples must be an integer >= 0 (0: report the failure as first found), got '-1'"),
        (["fuzz", "--faults", "flood"], "'flood'"),
        (["fuzz", "--role", "edge"], "'edge'"),
        (["frobnicate"], "'frobnicate'"),
        ([], "command"),
    ],
    ids=["--steps 0", "--examples abc", "--seed -1", "--shrink-examples -1", "--faults flood", "--role edge", "unknown command", "no command"],
)
def test_a_bad_command_line_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    line = assert_usage_error(*run(capsys, *argv))
    assert expected in line


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("nocolon", "must look like"),
        ("shardkit_no_such_module:make", "cannot import"),
        ("shardkit:no_such_factory", "has no attribute"),
        ("shardkit:__version__", "not callable"),
        ("tests/planted/no_such_file.py:make", "no file at"),
    ],
    ids=["no colon", "missing module", "missing attribute", "not callable", "missing file"],
)
def test_a_bad_target_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, expected: str
) -> None:
    line = assert_usage_error(*run(capsys, "fuzz", target, *SMALL, "--out", tmp_path))
    assert expected in line


def test_a_target_returning_something_else_than_an_engine_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = write_target(tmp_path, "def make():\n    return 42\n")
    line = assert_usage_error(*run(capsys, "fuzz", target, *SMALL, "--out", tmp_path))
    assert "returned int, not a ShardEngine" in line


def test_a_target_that_raises_when_called_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = write_target(tmp_path, "def make():\n    raise RuntimeError('no GPU here')\n")
    line = assert_usage_error(*run(capsys, "fuzz", target, *SMALL, "--out", tmp_path))
    assert "raised RuntimeError when called: no GPU here" in line


def test_a_target_file_that_raises_on_import_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = write_target(tmp_path, "raise RuntimeError('broken at import')\n")
    line = assert_usage_error(*run(capsys, "fuzz", target, *SMALL, "--out", tmp_path))
    assert "RuntimeError: broken at import" in line


def test_a_target_module_that_raises_on_import_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only ImportError: any exception while importing a module target is an input error."""
    (tmp_path / "shardkit_broken_target_module.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = assert_usage_error(
        *run(capsys, "fuzz", "shardkit_broken_target_module:make", *SMALL, "--out", tmp_path / "out")
    )
    assert "RuntimeError: broken at import" in line


def test_a_report_into_a_missing_folder_exits_2_before_fuzzing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "missing" / "report.json"
    code, out, err = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path, "--report", report)
    line = assert_usage_error(code, out, err)
    assert "does not exist" in line
    assert "steps/s" not in out
    assert not report.parent.exists()


def test_role_middle_for_an_engine_with_too_few_layers_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "from shardkit import FakeShardEngine, FakeShardEngineConfig\n\n\n"
        "def make():\n    return FakeShardEngine(FakeShardEngineConfig(total_layers=2))\n",
    )
    line = assert_usage_error(*run(capsys, "fuzz", target, "--role", "middle", *SMALL, "--out", tmp_path))
    assert "middle" in line


def test_a_fault_the_engine_cannot_take_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    target = write_target(
        tmp_path,
        "import dataclasses\n\nfrom shardkit import FakeShardEngine\n\n\n"
        "class make(FakeShardEngine):\n"
        "    def capabilities(self):\n"
        "        return dataclasses.replace(super().capabilities(), supported_faults=frozenset())\n",
    )
    line = assert_usage_error(*run(capsys, "fuzz", target, "--faults", "memory_pressure", *SMALL, "--out", tmp_path))
    assert "memory_pressure" in line
    # Every kind (the default): the ones the engine cannot take are left out, and the summary says so.
    code, out, _ = run(capsys, "fuzz", target, "--seed", "1", *SMALL, "--out", tmp_path)
    assert code == 0
    assert "faults: crash, delay, malformed_output\n" in out
    assert re.search(
        r"not checked in (\d+) of \1 examples: the memory_pressure fault \(docs/contract.md#fault-memory-pressure\): "
        r"not in the engine's supported_faults and not injectable at its boundary\n",
        out,
    ), out


# --- python -m shardkit -----------------------------------------------------


def test_python_dash_m_shardkit_prints_the_version() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "shardkit", "--version"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == f"shardkit {__version__}"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_fuzz_shows_live_progress_on_a_terminal_and_clears_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["fuzz", "--seed", "1", "--examples", "20", "--steps", "20", "--no-twins"]) == 0
    shown = terminal.getvalue()
    assert "examples 1/20" in shown
    assert "steps/s  failures 0" in shown
    assert shown.endswith("\r\x1b[K")  # the status line is erased before the summary
    assert "no failure found" in capsys.readouterr().out


def test_fuzz_prints_nothing_on_stderr_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--seed", "1", "--examples", "20", "--steps", "20"]) == 0
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def bench_json_quick() -> str:
    """What ``shardkit bench --quick --json`` prints (CI's check that the bench runs): every
    section measured at ``--quick``'s sizes, once for the tests that read it."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["bench", "--quick", "--json"]) == 0
    return printed.getvalue()


def test_bench_json_prints_one_object_with_the_throughput_figures(bench_json_quick: str) -> None:
    figures = json.loads(bench_json_quick)
    assert {"kit_steps_per_s", "bare_steps_per_s", "throughput_ratio", "per_role", "planted", "peak_rss_mb"} <= set(
        figures
    )
    assert set(figures["per_role"]) == {"full", "head", "middle", "tail"}
    for row in figures["per_role"].values():
        assert row["kit_steps_per_s"] > 0
        # Kit and bare interleaved, one ratio a round; the figure is the median round's.
        assert len(row["rounds"]) == QUICK.rounds == 2
        for one in row["rounds"]:
            assert one["ratio"] == pytest.approx(one["kit_steps_per_s"] / one["bare_steps_per_s"], rel=0.01)
        # The median round (the lower middle one of two): the row's rates and ratio are its own.
        middle = sorted(row["rounds"], key=lambda one: one["ratio"])[0]
        assert (row["kit_steps_per_s"], row["bare_steps_per_s"]) == (
            middle["kit_steps_per_s"],
            middle["bare_steps_per_s"],
        )
        assert row["throughput_ratio"] == middle["ratio"]
        assert row["throughput_ratio"] == pytest.approx(row["kit_steps_per_s"] / row["bare_steps_per_s"], rel=0.01)
        ratios = sorted(one["ratio"] for one in row["rounds"])
        assert (row["throughput_ratio_min"], row["throughput_ratio_max"]) == (ratios[0], ratios[-1])
        assert row["cpu_ratio"] > 0
    assert [row["engine"] for row in figures["planted"]] == [engine.__name__ for engine in PLANTED[:3]]
    assert all(len(row["runs"]) == 1 for row in figures["planted"])
    # Every section was measured, each timed.
    assert set(figures["section_seconds"]) == set(SECTIONS)
    for row in figures["out_of_process"].values():
        assert len(row["steps_per_s_by_round"]) == 2
    assert (
        figures["out_of_process"]["grpc, faults all"]["slower_min"]
        <= figures["out_of_process"]["grpc, faults all"]["slower"]
    )
    for faults in ("all", "none"):
        # A step is at least one call of the engine under test, in process and out of it.
        in_process = figures["out_of_process"][f"in-process, faults {faults}"]
        assert (in_process["round_trips_per_step"], in_process["engine_calls_per_step"] >= 1) == (0.0, True)
        assert in_process["engine_calls_steps"] == in_process["steps"]  # the engines counted ran the same steps
        for mode in ("grpc", "grpc, unary", "isolated"):
            out = figures["out_of_process"][f"{mode}, faults {faults}"]
            assert out["round_trips_per_step"] >= 1, (mode, faults, out)
            assert len(out["round_trips_per_step_by_round"]) == 2
        # The stream changes what a call costs and how many wait for each other, never which calls are made.
        unary = figures["out_of_process"][f"grpc, unary, faults {faults}"]
        streamed = figures["out_of_process"][f"grpc, faults {faults}"]
        assert unary["calls_per_step"] == streamed["calls_per_step"] == unary["round_trips_per_step"]
        assert streamed["round_trips_per_step"] < streamed["calls_per_step"]
    memory = figures["memory"]
    assert set(memory) >= {"10", "50"}, memory
    assert memory["steps"] == 10


def test_bench_tables_show_every_section_the_bench_measured(bench_json_quick: str) -> None:
    """The tables ``shardkit bench`` prints without ``--json`` are ``render`` of these figures:
    each measured section comes out as its table, none as "not measured" (the planted table's
    own test, below, measures the planted section alone)."""
    table = render(json.loads(bench_json_quick))
    assert (
        "throughput, 10 examples × 10 steps, seed 1 (fake engine, faults on; kit and bare interleaved, the median of 2 rounds):"
        in table
    )
    for role in ("full", "head", "middle", "tail"):
        assert re.search(
            rf"^  {role} +[\d,]+ +[\d,]+ +\d+\.\d\d +\d+\.\d\d-\d+\.\d\d +\d+\.\d\d +\d+%$", table, re.MULTILINE
        ), table
    assert "engines (full role, and the others where it serves them; faults on):" in table
    assert re.search(r"^  fake +[\d,]+ kit steps/s, one decode step ", table, re.MULTILINE), table
    role_rates = r"[\d,]+ kit steps/s, head [\d,]+, tail [\d,]+, middle [\d,]+, one decode step "
    assert re.search(rf"^  numpy +{role_rates}", table, re.MULTILINE), table
    assert "out of process (fake, same seed: the same steps; modes interleaved, medians of 2 rounds):" in table
    assert re.search(
        r"^  isolated, faults all +[\d,]+ steps/s  x\d+\.\d slower \(x\d+\.\d-x\d+\.\d\)  \d+\.\d\d round trips a step "
        r"\(\d+\.\d\d calls\)  \(\d+ steps, \d+ worker",
        table,
        re.MULTILINE,
    ), table
    assert re.search(
        r"^  in-process, faults all +[\d,]+ steps/s  \d+\.\d\d engine calls a step, no round trip  \(\d+ steps\)$",
        table,
        re.MULTILINE,
    ), table
    assert "planted bugs at 1 seed (shrunk length at each seed" in table
    assert "concurrency (fake, faults on): steps/s by lanes: " in table
    assert re.search(
        r"^memory \(fake, 10 steps an example, a fresh process each\): peak RSS [\d.]+ MB at 10 examples, [\d.]+ MB at 50 examples; ratio [\d.]+$",
        table,
        re.MULTILINE,
    ), table
    assert re.search(
        r"^peak RSS [\d.]+ MB; bench took [\d.]+ s \(throughput [\d.]+ s, profile [\d.]+ s, engines ",
        table,
        re.MULTILINE,
    ), table
    assert "numerics (1 histories of 8 tokens per model and format, prefilled whole and token by token;" in table
    for fmt in ("float32", "tf32-like", "bfloat16", "float16"):
        assert re.search(rf"^    {fmt} +chunking [\d.e+-]+ \([\d.e+-]+ beside\)  vs float32 ", table, re.MULTILINE), table
    assert NOT_MEASURED not in table


def test_the_numerics_section_sees_each_format_differ_as_its_precision_says() -> None:
    """float32 answers move far less with the chunking than float16 or TF32-like ones, and
    those far less than bfloat16's; float32 is its own reference (0)."""
    figures = run_bench(BenchSettings(numerics_histories=2, numerics_tokens=24), sections=("numerics",))
    for formats in figures["numerics"]["models"].values():
        assert formats["float32"]["float32"] == 0.0
        assert formats["float32"]["chunking"] < 1e-3
        assert formats["float32"]["chunking"] < formats["float16"]["chunking"] < formats["bfloat16"]["chunking"]
        assert formats["float16"]["float32"] < formats["bfloat16"]["float32"]


def test_bench_planted_none_skips_the_planted_engines() -> None:
    figures = run_bench(BenchSettings(planted_module=None), sections=("planted",))
    assert figures["planted"] == "skipped (--planted none)"
    assert "planted bugs: skipped (--planted none)" in render(figures)


def test_bench_profile_splits_a_kit_run_into_the_kits_components() -> None:
    """``--profile``: each role's shares sum to one, and the components a run always passes
    through (Hypothesis, the engine, the driver, the twin oracle) each have a share."""
    figures = run_bench(BenchSettings(examples=5, steps=10, profile=True), sections=("profile",))
    profile = figures["profile"]
    assert set(profile) == {"full", "head", "middle", "tail"}
    components = {name for _, name in PROFILE_COMPONENTS}
    for shares in profile.values():
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
        assert set(shares) <= components | {"Python's built-ins and standard library"}
        for part in ("hypothesis/", "shardkit/engines/", "shardkit/_core/driver.py", "shardkit/_core/twins.py"):
            assert shares[dict(PROFILE_COMPONENTS)[part]] > 0, (part, shares)
    table = render(figures)
    assert re.search(
        r"^  Hypothesis \(drawing steps.* +\d+\.\d% +\d+\.\d% +\d+\.\d% +\d+\.\d%$", table, re.MULTILINE
    ), table
    assert (
        run_bench(BenchSettings(), sections=("profile",))["profile"]
        == "not measured (shardkit bench --profile)"
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            [],
            {
                "examples": 200,
                "steps": 50,
                "rounds": 3,
                "planted_seeds": 5,
                "memory_examples": (200, 1000),
                "profile": False,
            },
        ),
        (["--quick", "--profile"], {"examples": 10, "profile": True}),
        (["--quick"], {"examples": 10, "steps": 10, "rounds": 2, "planted_seeds": 1, "memory_examples": (10, 50)}),
        (
            ["--quick", "--examples", "30", "--rounds", "5"],
            {"examples": 30, "steps": 10, "rounds": 5, "memory_examples": (30, 150)},
        ),
        (["--quick", "--memory"], {"examples": 10, "memory_examples": (300, 3000), "memory_steps": 100}),
    ],
)
def test_bench_quick_picks_small_sizes_and_a_size_given_beside_it_still_applies(
    options: list[str], expected: dict[str, object]
) -> None:
    """``--quick`` never silently overrides what the command line says."""
    settings = bench_settings(build_parser().parse_args(["bench", *options]), "shardkit._planted")
    assert {name: getattr(settings, name) for name in expected} == expected


@pytest.fixture
def planted_section_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shardkit bench`` as the command runs it (its parser, its checks of ``--planted``, the
    settings it builds from the options, its printing), measuring the planted section alone
    (``run_bench``'s ``sections``): the others take a minute or more even at 20 examples, and
    the tests of the planted figures read none of them (the two tests above do)."""
    monkeypatch.setattr("shardkit._bench.run.run_bench", functools.partial(run_bench, sections=("planted",)))


def test_bench_refuses_a_section_it_does_not_have_before_measuring() -> None:
    """A misspelt section is an error, not a bench that silently measures less than it was asked to."""
    with pytest.raises(ValueError, match=r"unknown bench sections \['plants'\]; the sections are throughput, "):
        run_bench(BenchSettings(), sections=("planted", "plants"))


@pytest.mark.usefixtures("planted_section_only")
def test_bench_reports_each_planted_engine_of_a_module_at_each_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """The full planted suite is the self-test's (test_machine.py); two engines show the bench's columns."""
    arguments = ["bench", "--json", "--examples", "30", "--steps", "30", "--planted", "tests.planted_sample"]
    assert main([*arguments, "--seed", "4", "--planted-seeds", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["planted"]
    assert [row["engine"] for row in rows] == ["FailedCallsNotCounted", "OutputDependsOnChunking"]
    for row in rows:
        assert row["minimal_length"] == 1
        assert [run["seed"] for run in row["runs"]] == [4, 5]
        assert row["found_at_seeds"] == row["at_minimum_at_seeds"] == 2, row
        for run in row["runs"]:
            assert run["shrunk_length"] == 1, run
            assert run["random_walk_length"] >= run["shrunk_length"]
            assert run["examples_to_first_failure"] >= 1
            # The time to the minimised failure is the run's: to the first failure, then shrinking.
            assert run["seconds_to_minimal_failure"] >= run["seconds_to_first_failure"] > 0
            assert run["seconds_to_minimal_failure"] == pytest.approx(
                run["seconds_to_first_failure"] + run["seconds_shrinking"], abs=0.002
            )
    assert [row["caught_by_contract"] for row in rows] == [False, False]


@pytest.mark.usefixtures("planted_section_only")
def test_bench_prints_the_planted_table_with_one_length_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["bench", "--examples", "20", "--steps", "20", "--planted", "tests.planted_sample"]
    assert main([*arguments, "--planted-seeds", "3"]) == 0
    table = capsys.readouterr().out
    assert "planted bugs at 3 seeds" in table
    assert re.search(r"FailedCallsNotCounted +3/3 +1  1 1 1 +\d+\.\d+ +\d+\.\d+ +- *$", table, re.MULTILINE), table
    assert "found at every seed 2/2 engines; of 6 runs found 6, at the minimum 6 (100 %)" in table


# --- nothing found is lost: --out and --report are checked before the run -----------------


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("file", "is a file, not a folder"),
        ("under a file", "cannot be created: {file} is a file, not a folder"),
        ("/proc", "cannot create it in /proc"),
    ],
)
def test_an_out_folder_that_cannot_hold_traces_exits_2_before_fuzzing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str, expected: str
) -> None:
    """Tests run as root here, where chmod stops nothing: a regular file and /proc are what refuse."""
    file = tmp_path / "somefile"
    file.write_text("not a folder\n")
    out = {"file": file, "under a file": file / "sub", "/proc": Path("/proc/shardkit-failures")}[where]
    code, stdout, err = run(capsys, "fuzz", "tests.planted:ReleaseLeaksKvTokens", "--seed", "3", "--out", out)
    line = assert_usage_error(code, stdout, err)
    assert f"--out {out}" in line
    assert expected.format(file=file) in line
    assert stdout == ""  # refused before the run: nothing was fuzzed


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("a folder", "is a folder; name a file"),
        ("in a file", "is a file, not a folder"),
        ("in /proc", "cannot write in /proc"),
    ],
)
def test_a_report_path_that_cannot_be_written_exits_2_before_fuzzing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str, expected: str
) -> None:
    file = tmp_path / "somefile"
    file.write_text("not a folder\n")
    report = {"a folder": tmp_path, "in a file": file / "report.json", "in /proc": Path("/proc/report.json")}[where]
    code, out, err = run(capsys, "fuzz", "--seed", "1", *SMALL, "--out", tmp_path / "out", "--report", report)
    line = assert_usage_error(code, out, err)
    assert f"--report {report}" in line
    assert expected in line
    assert out == ""


def test_a_trace_that_cannot_be_written_after_a_failure_prints_the_failure_and_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--out passed the check, then the disk filled up: the failure and its steps still reach the terminal."""
    import errno
    import os

    def disk_full(path: Path, document: object) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def disk_full_on_claim(path: Path, document: object) -> bool:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    # Both ways a trace reaches the disk: replacing a file, and claiming a new name.
    monkeypatch.setattr("shardkit._run.artefacts.write_atomically", disk_full)
    monkeypatch.setattr("shardkit._run.artefacts.write_new", disk_full_on_claim)
    out_dir = tmp_path / "failures"
    code, out, err = run(capsys, "fuzz", "tests.planted:ReleaseLeaksKvTokens", "--seed", "3", "--out", out_dir)
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    assert "FAILURE (§2 metrics) in 2 steps:" in out
    assert "  step 1: prefill(session='a', epoch=0, step=0, tokens=[0])" in out
    assert "  step 2: release(session='a')" in out
    assert "observed: metrics prefill_calls=1 decode_calls=0 active_sessions=0 kv_tokens=1" in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shardkit: could not write ")
    assert "No space left on device" in lines[0]
    assert not out_dir.exists() or not any(out_dir.iterdir())


# --- the console script resolves module targets from the current folder, as python -m does ----------

CONSOLE_SCRIPT = Path(sys.executable).parent / "shardkit"


def console(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the installed ``shardkit`` console script in ``cwd``, without PYTHONPATH (as from a fresh clone)."""
    if not CONSOLE_SCRIPT.is_file():
        pytest.skip(f"no console script at {CONSOLE_SCRIPT} (shardkit is not installed in this environment)")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_console_script_finds_a_module_target_in_the_current_folder() -> None:
    """`shardkit contract tests.planted:…` from the repository root needed PYTHONPATH=. before."""
    run = console("contract", "tests.planted:StaleEpochAccepted", cwd=REPO_ROOT)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "a stale epoch is ABORTED" in run.stdout


def test_a_module_target_found_nowhere_is_still_a_one_line_usage_error(tmp_path: Path) -> None:
    run = console("contract", "tests.planted:StaleEpochAccepted", cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert len(run.stderr.splitlines()) == 1
    assert "cannot import 'tests.planted'" in run.stderr


def test_an_isolated_run_and_its_printed_rerun_line_work_from_the_current_folder(tmp_path: Path) -> None:
    """The worker process imports the target by name too: it must see the current folder.
    (FailedCallsNotCounted: its one-step failure shrinks in a few seconds over the worker's
    socket, where ReleaseLeaksKvTokens' took ten; any ``tests.planted`` target shows the import.)"""
    pytest.importorskip("grpc")
    argv = ["fuzz", "tests.planted:FailedCallsNotCounted", "--isolate", "--faults", "none", "--seed", "3"]
    first = console(*argv, "--out", str(tmp_path / "first"), cwd=REPO_ROOT)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "FAILURE (§2 metrics) in 1 step:" in first.stdout
    rerun = next(line for line in first.stdout.splitlines() if line.startswith("  the whole run:"))
    command = shlex.split(rerun.partition(":")[2])
    assert command[:2] == ["shardkit", "fuzz"], rerun
    again = console(*command[1:], "--out", str(tmp_path / "again"), cwd=REPO_ROOT)
    assert again.returncode == 1, again.stdout + again.stderr
    assert "FAILURE (§2 metrics) in 1 step:" in again.stdout


@pytest.mark.parametrize(
    ("module", "expected"),
    [("shardkit_no_such_planted", "cannot be imported"), ("shardkit.errors", "has no PLANTED tuple")],
)
def test_bench_with_a_planted_module_that_cannot_serve_exits_2_before_measuring(
    capsys: pytest.CaptureFixture[str], module: str, expected: str
) -> None:
    code, out, err = run(capsys, "bench", "--examples", "5", "--steps", "5", "--planted", module)
    line = assert_usage_error(code, out, err)
    assert f"--planted '{module}'" in line
    assert expected in line
    assert out == ""


def test_a_target_file_imports_its_neighbours_as_a_script_would(tmp_path: Path) -> None:
    """``my_buggy.py`` doing ``from my_engine import …`` once failed with "No module named
    'my_engine'" unless run from its folder: a file target's folder is on the path, as for
    ``python file.py``."""
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "my_engine_for_the_neighbour_test.py").write_text(
        "from shardkit import FakeShardEngine\n\nclass Mine(FakeShardEngine):\n    pass\n"
    )
    (engines / "my_child.py").write_text(
        "from my_engine_for_the_neighbour_test import Mine\n\nclass Child(Mine):\n    pass\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = [sys.executable, "-m", "shardkit", "fuzz", str(engines / "my_child.py") + ":Child", *SMALL]
    completed = subprocess.run(command, cwd=elsewhere, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "no failure found" in completed.stdout


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path) -> None:
    """``shardkit fuzz | head -1``: the run's first line is read, then the pipe closes; the
    rest cannot be written, and that is said by the exit code alone (141, as for SIGPIPE),
    not by a traceback."""
    command = [sys.executable, "-m", "shardkit", "fuzz", "--seed", "1", "--examples", "100", "--out", str(tmp_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("shardkit fuzz")
    process.stdout.close()  # the summary comes seconds later, into a closed pipe
    _, err = process.communicate(timeout=300)
    assert process.returncode == 141, err
    assert "Traceback" not in err, err
    assert "BrokenPipe" not in err, err
