"""The shardkit suites under pytest-xdist (docs/scaling.md#xdist): each test's seed is the
same whichever worker runs it, tests of one machine fuzz different examples, no two
processes write one trace file, and each failing test's "shardkit: reproduce" section
names its own seed and test, and reruns its failure."""

from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardkit._planted import ReleaseLeaksKvTokens, StaleEpochAccepted, names_its_property
from shardkit._run.suite import item_seed
from shardkit._run.trace import write_new

pytest.importorskip("xdist", reason="pytest-xdist is not installed (pip install 'shardkit[test]')")

BUGS = """
from hypothesis import settings
from shardkit import machine_for

SIZES = settings(max_examples=100, stateful_step_count=20, database=None)

stale = machine_for("shardkit._planted:StaleEpochAccepted", role="full", faults="none", twins=False)
stale.TestCase.settings = SIZES
TestStaleEpoch = stale.TestCase


class TestStaleEpochAgain(stale.TestCase):
    \"\"\"The same machine a second time: it must fuzz other examples, not repeat the first's.\"\"\"


leak = machine_for("shardkit._planted:ReleaseLeaksKvTokens", role="full", faults="none", twins=False)
leak.TestCase.settings = SIZES
TestReleaseLeak = leak.TestCase
"""

SEED = 7
#: A failing test's report: its header, then (further down) its reproduce section.
FAILURE_HEADER = re.compile(r"^_{3,} (\S+)\.runTest _{3,}$")
WHOLE_RUN = re.compile(r"the whole run:\s+pytest (\S+) --shardkit-seed (\d+)")
THIS_FAILURE = re.compile(r"this failure:\s+shardkit replay (\S+)")


def _pytest(folder: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *arguments],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _reproduce_sections(output: str) -> dict[str, tuple[str, int, str]]:
    """Each failing test class → (the rerun's test id, its seed, the trace) its report printed."""
    sections: dict[str, tuple[str, int, str]] = {}
    current = None
    for line in output.splitlines():
        header = FAILURE_HEADER.match(line)
        if header:
            current = header.group(1)
            continue
        trace = THIS_FAILURE.search(line)
        if trace and current is not None:
            sections[current] = ("", 0, trace.group(1))
        rerun = WHOLE_RUN.search(line)
        if rerun and current is not None:
            sections[current] = (rerun.group(1), int(rerun.group(2)), sections[current][2])
    return sections


@pytest.fixture
def bugs(tmp_path: Path) -> Path:
    (tmp_path / "test_bugs.py").write_text(BUGS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the folder is the rootdir: test ids are as printed
    return tmp_path


def test_each_failing_worker_reports_its_own_seed_and_test_and_each_rerun_reproduces_it(bugs: Path) -> None:
    run = _pytest(bugs, "-n", "2", "--shardkit-seed", str(SEED), "--shardkit-out", "failures", "test_bugs.py")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "3 failed" in run.stdout, run.stdout
    sections = _reproduce_sections(run.stdout)
    assert set(sections) == {"TestStaleEpoch", "TestStaleEpochAgain", "TestReleaseLeak"}, run.stdout

    # Each section names the test it is printed under, with that test's seed.
    for test, (rerun_id, _, _) in sections.items():
        assert rerun_id == f"test_bugs.py::{test}::runTest", run.stdout
    # A suite that is its machine's only test keeps the run's seed, exactly as without xdist;
    # the two tests of one machine each get their own, derived from the run's seed and their id.
    assert sections["TestReleaseLeak"][1] == SEED
    for test in ("TestStaleEpoch", "TestStaleEpochAgain"):
        assert sections[test][1] == item_seed(SEED, f"test_bugs.py::{test}::runTest")
    assert sections["TestStaleEpoch"][1] != sections["TestStaleEpochAgain"][1]
    assert "(this test's own seed, derived from the run's seed 7 and its id)" in run.stdout

    # Three failures, three trace files, each holding its own test's failure.
    traces = {test: bugs / trace for test, (_, _, trace) in sections.items()}
    assert len(set(traces.values())) == 3
    on_disk = sorted(path.name for path in (bugs / "failures").glob("*.json"))
    assert on_disk == sorted(path.name for path in traces.values()), "no other trace, no in-progress file left"
    for test, trace in traces.items():
        recorded = json.loads(trace.read_text())
        engine = ReleaseLeaksKvTokens if test == "TestReleaseLeak" else StaleEpochAccepted
        assert names_its_property(engine, recorded["failure"]["property"])
        assert recorded["seed"] == sections[test][1]

    # Each printed rerun, run alone and without xdist, fails the same way into the same trace.
    for test, (rerun_id, seed, trace) in sections.items():
        again = _pytest(bugs, rerun_id, "--shardkit-seed", str(seed), "--shardkit-out", "failures")
        assert again.returncode == 1, again.stdout
        assert _reproduce_sections(again.stdout)[test] == (rerun_id, seed, trace), again.stdout
        replayed = subprocess.run(
            [sys.executable, "-m", "shardkit", "replay", trace], cwd=bugs, capture_output=True, text=True, timeout=60
        )
        assert replayed.returncode == 1, replayed.stdout + replayed.stderr
        assert f"FAILURE ({json.loads((bugs / trace).read_text())['failure']['property']})" in replayed.stdout


SEED_PROBE = """
import os
from shardkit.pytest_plugin import OVERRIDES_KEY


def test_one(request):
    write_seed(request)


def test_two(request):
    write_seed(request)


def write_seed(request):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"seed-{worker}.txt", "w") as file:
        file.write(str(request.config.stash[OVERRIDES_KEY].seed))
"""


def test_a_random_seed_is_drawn_once_and_every_worker_runs_it(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(SEED_PROBE)
    run = _pytest(tmp_path, "-n", "2", "--dist", "each", "--shardkit-seed", "random", "test_probe.py")
    assert run.returncode == 0, run.stdout + run.stderr
    printed = re.search(r"shardkit: seed (\d+) \(--shardkit-seed\)", run.stdout)
    assert printed, run.stdout
    seen = {path.name: path.read_text() for path in tmp_path.glob("seed-gw*.txt")}
    assert seen == {"seed-gw0.txt": printed.group(1), "seed-gw1.txt": printed.group(1)}


def test_a_plain_item_keeps_the_runs_seed_and_only_shared_machines_derive_one() -> None:
    assert item_seed(7, "a.py::TestX::runTest") == item_seed(7, "a.py::TestX::runTest")
    assert item_seed(7, "a.py::TestX::runTest") != item_seed(7, "a.py::TestY::runTest")
    assert item_seed(7, "a.py::TestX::runTest") != item_seed(8, "a.py::TestX::runTest")


def _claim(folder: str, index: int, start: Any, claimed: Any) -> None:
    start.wait()  # all at once, so the claims race
    claimed[index] = write_new(Path(folder) / "trace.json", {"writer": index})


def test_of_processes_claiming_one_trace_name_exactly_one_gets_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    writers = 4
    start = context.Barrier(writers)
    claimed = context.Array("b", writers)
    processes = [context.Process(target=_claim, args=(str(tmp_path), index, start, claimed)) for index in range(writers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0] * writers
    assert sum(claimed) == 1
    winner = list(claimed).index(1)
    assert json.loads((tmp_path / "trace.json").read_text()) == {"writer": winner}
    assert [path.name for path in tmp_path.iterdir()] == ["trace.json"], "no temporary file left behind"


IN_PROGRESS_NAME = """
import sys
from pathlib import Path
from shardkit import machine_for
from shardkit._run.artefacts import Artefacts

machine = machine_for("shardkit._planted:StaleEpochAccepted", role="full")
print(Artefacts(machine, Path(sys.argv[1]), seed=7).in_progress().name)
"""


def test_two_processes_on_one_machine_and_seed_keep_separate_in_progress_files(tmp_path: Path) -> None:
    names = [
        subprocess.run(
            [sys.executable, "-c", IN_PROGRESS_NAME, str(tmp_path)], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert all(name.endswith("-in-progress.json") for name in names), names
    assert names[0] != names[1]


def test_the_bench_measures_scale_out_and_reports_it_in_json() -> None:
    """Tiny sizes: this checks the section runs and reports, not the speed-up (measured by
    ``shardkit bench``, never asserted)."""
    from shardkit._bench.render import render
    from shardkit._bench.run import run_bench
    from shardkit._bench.scale_out import SCALE_OUT_SUITES
    from shardkit._bench.settings import BenchSettings

    bench = json.loads(json.dumps(run_bench(BenchSettings(examples=2, steps=3, scale_out_rounds=1), sections=("scale_out",))))
    scale_out = bench["scale_out"]
    assert isinstance(scale_out, dict), scale_out
    assert scale_out["suites"] == len(SCALE_OUT_SUITES)
    assert scale_out["steps"] > 0
    assert len(scale_out["serial_steps_per_s"]) == len(scale_out["parallel_steps_per_s"]) == 1
    assert min(scale_out["serial_steps_per_s"] + scale_out["parallel_steps_per_s"]) > 0
    assert scale_out["speedup_min"] <= scale_out["speedup_median"] <= scale_out["speedup_max"]
    assert f"scale-out ({len(SCALE_OUT_SUITES)} fake suites" in render(bench)
    campaign = scale_out["campaign"]
    assert set(campaign["by_workers"]) == {"1", "2"}
    assert all(figures["steps_per_s"] > 0 for figures in campaign["by_workers"].values())
    assert all(len(figures["steps_per_s_by_round"]) == 1 for figures in campaign["by_workers"].values())
    assert campaign["speedup_min"] <= campaign["speedup"] <= campaign["speedup_max"]
    assert "scale-out (shardkit campaign" in render(bench)
