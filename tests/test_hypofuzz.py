"""Every shardkit machine is a HypoFuzz target: ``hypothesis fuzz`` collects a suite's
``TestCase``, fuzzes its machine, and a bug it finds is left as a shardkit trace that
``shardkit replay`` reproduces (docs/scaling.md#hypofuzz).

The campaign is bounded: it stops as soon as the planted bug's trace is on disk, and is
given up (a failure, with HypoFuzz's output) after ``CAMPAIGN_LIMIT_S``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hypofuzz", reason="HypoFuzz is not installed (pip install 'shardkit[hypofuzz]')")


#: Found in a few seconds on an idle machine; generous for a shared CI runner.
CAMPAIGN_LIMIT_S = 45

SUITE = """
from shardkit import machine_for

TestStaleEpoch = machine_for(
    "shardkit._planted:StaleEpochAccepted", role="full", faults="none", twins=False
).TestCase
"""

#: ``hypothesis fuzz``, from the Python running the tests (its script may not be on PATH).
HYPOTHESIS_CLI = (sys.executable, "-c", "from hypothesis.extra.cli import main; main()")


def _fuzz_command(*pytest_arguments: str) -> list[str]:
    return [*HYPOTHESIS_CLI, "fuzz", "--no-dashboard", "-n", "1", "--", *pytest_arguments]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "test_stale_epoch.py").write_text(SUITE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDKIT_OUT", str(tmp_path / "found"))
    return tmp_path


def _planted_traces(out: Path) -> list[Path]:
    """Finished traces (not a run's in-progress file) of the planted bug: the engine has no
    other, so any property it breaks is its bug showing (HypoFuzz's generation once met it
    through §2 cancel before §2 rule 4, and then its own shrinker died, with Hypothesis
    6.170, before it reached another)."""
    found = []
    for path in sorted(out.glob("*.json")) if out.is_dir() else ():
        if "in-progress" in path.name:
            continue
        try:
            trace = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced as we read it
        if isinstance(trace.get("failure"), dict) and str(trace["failure"].get("property", "")).startswith("§2"):
            found.append(path)
    return found


def _stop(campaign: subprocess.Popen[str]) -> str:
    """End the campaign and the fuzzing processes it started (one process group), and return its output."""
    if campaign.poll() is None:
        os.killpg(campaign.pid, signal.SIGTERM)
    try:
        output, _ = campaign.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(campaign.pid, signal.SIGKILL)
        output, _ = campaign.communicate()
    return output


def test_a_bug_hypofuzz_finds_is_left_as_a_trace_that_replays(project: Path) -> None:
    """Run as the docs' CI command: with CI set, Hypothesis loads its own "ci" profile at
    import, which has no database; shardkit-dev must still have one, or HypoFuzz cannot start."""
    out = project / "found"
    campaign = subprocess.Popen(
        _fuzz_command("test_stale_epoch.py", "-p", "no:cacheprovider", "--hypothesis-profile", "shardkit-dev"),
        env={**os.environ, "CI": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so stopping it stops HypoFuzz's workers too
    )
    given_up_at = time.monotonic() + CAMPAIGN_LIMIT_S
    try:
        while not _planted_traces(out) and campaign.poll() is None and time.monotonic() < given_up_at:
            time.sleep(0.5)
    finally:
        output = _stop(campaign)
    traces = _planted_traces(out)
    assert traces, f"no trace of a §2 rule in {sorted(p.name for p in out.glob('*'))}; HypoFuzz said:\n{output}"
    assert "using 1 process to fuzz 1 test" in output, output
    trace = traces[0]
    recorded = json.loads(trace.read_text())["failure"]["property"]
    assert (trace.parent / f"test_{trace.stem.replace('-', '_')}.py").is_file(), "its regression test is beside it"

    replayed = subprocess.run(
        [sys.executable, "-m", "shardkit", "replay", str(trace)], capture_output=True, text=True, timeout=60
    )
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert f"FAILURE ({recorded})" in replayed.stdout, replayed.stdout


def test_under_a_derandomized_profile_hypofuzz_skips_the_suite_and_says_why(project: Path) -> None:
    """The shardkit-ci profile (and Hypothesis's own "ci") is derandomized, which HypoFuzz refuses to fuzz."""
    collected = subprocess.run(
        _fuzz_command("test_stale_epoch.py", "-p", "no:cacheprovider", "--hypothesis-profile", "shardkit-ci"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert collected.returncode != 0
    assert "test_stale_epoch.py::TestStaleEpoch::runTest (because: {'status_reason': 'sets_derandomize'}" in (
        collected.stdout
    ), collected.stdout + collected.stderr


def test_a_fuzzing_process_keeps_one_trace_its_shortest_failure(tmp_path: Path) -> None:
    """HypoFuzz shrinks through many failures, some of other properties: one file stays, the shortest."""
    from dataclasses import replace

    from shardkit import machine_for
    from shardkit._run.artefacts import Artefacts
    from shardkit._run.runner import fuzz

    target = "shardkit._planted:StaleEpochAccepted"
    found = fuzz(target, seed=3, examples=100, steps=20, role="full", faults="none", twins=False).failure
    assert found is not None
    longer = replace(
        found,
        records=[found.records[0], *found.records],
        violation=replace(found.violation, property="§3 determinism"),
    )
    assert found.violation.property != "§3 determinism"
    keeper = Artefacts(machine_for(target, role="full", faults="none", twins=False), tmp_path, seed=None)

    first = keeper.keep_shortest(longer)
    assert first is not None
    assert first.name.endswith("-full-3-determinism.json")
    shortest = keeper.keep_shortest(found)
    assert shortest is not None
    assert shortest != first
    assert keeper.keep_shortest(longer) == shortest, "a longer failure replaces nothing"
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [shortest.name, f"test_{shortest.stem.replace('-', '_')}.py"]
    )
    assert len(json.loads(shortest.read_text())["steps"]) == len(found.records)
