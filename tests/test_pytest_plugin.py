"""The pytest plugin: --shardkit-engine and --shardkit-seed, the seed in the header, the replay command on failure."""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE = """
from hypothesis import settings
from shardkit import FakeShardEngine, machine_for

machine = machine_for(FakeShardEngine, role="full", faults="none")
machine.TestCase.settings = settings(max_examples=40, stateful_step_count=20, database=None, deadline=None)
TestFakeSuite = machine.TestCase
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_the_header_shows_the_seed_in_use(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("--shardkit-seed", "5")
    result.stdout.fnmatch_lines(
        [
            "shardkit: seed 5 (--shardkit-seed); profile shardkit-ci (200 examples × 50 steps) unless a suite sets its own; engine each suite's own"
        ]
    )
    result.assert_outcomes(passed=1)


def test_without_a_seed_the_header_says_the_profile_decides(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        ["shardkit: derandomized: each suite's seed derives from its engine; profile shardkit-ci*"]
    )
    result.assert_outcomes(passed=1)


def test_shardkit_engine_points_the_suites_at_another_engine_and_the_report_shows_how_to_replay(
    suite: pytest.Pytester,
) -> None:
    result = suite.runpytest_subprocess(
        "--shardkit-engine", "tests.planted:ReleaseLeaksKvTokens", "--shardkit-seed", "3", "--shardkit-out", "failures"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*FAILURE (§2 metrics) in 2 steps:*",
            "*shardkit: reproduce*",
            "*this failure:    shardkit replay failures/releaseleakskvtokens-full-seed-3-*-full-2-metrics.json*",
            "*as a test:       pytest failures/test_releaseleakskvtokens_full_seed_3_*_full_2_metrics.py*",
            # The failing suite alone, not every test the project's testpaths collect.
            "*the whole run:   pytest test_suite.py::TestFakeSuite::runTest --shardkit-seed 3 --shardkit-engine tests.planted:ReleaseLeaksKvTokens*",
        ]
    )
    assert len(list((suite.path / "failures").glob("releaseleakskvtokens-full-seed-3-*-full-2-metrics.json"))) == 1


def test_the_same_seed_finds_the_same_failure_twice(suite: pytest.Pytester) -> None:
    arguments = ("--shardkit-engine", "tests.planted:SessionStateBleeds", "--shardkit-seed", "9")
    first = suite.runpytest_subprocess(*arguments)
    second = suite.runpytest_subprocess(*arguments)
    failure = [line for line in first.outlines if "FAILURE" in line or "step " in line]
    assert failure
    assert failure == [line for line in second.outlines if "FAILURE" in line or "step " in line]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--shardkit-engine", "nope:thing", "*--shardkit-engine: engine target 'nope:thing': cannot import*"),
        ("--shardkit-seed", "abc", "*--shardkit-seed must be an integer in [[]0, 2**64) or 'random', got 'abc'*"),
    ],
)
def test_bad_plugin_options_are_usage_errors(suite: pytest.Pytester, option: str, value: str, message: str) -> None:
    result = suite.runpytest_subprocess(option, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


UNDECLARED = """
from dataclasses import replace

from shardkit import DelegatingEngine, FakeShardEngine, machine_for


class OneThreadOnly(DelegatingEngine):
    def __init__(self):
        super().__init__(FakeShardEngine())

    def capabilities(self):
        return replace(super().capabilities(), concurrent_calls=False)


TestInParallel = machine_for(OneThreadOnly, concurrency=2).TestCase
"""


def test_a_suite_set_up_wrong_says_what_to_fix_without_the_kits_frames(
    pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    pytester.makepyfile(test_undeclared=UNDECLARED)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E * does not declare concurrent_calls in its capabilities*"])
    output = result.stdout.str()
    assert "shardkit/_machine" not in output, output
    assert "shardkit/_run" not in output, output


@pytest.mark.parametrize("named_by", ["option", "variable"])
def test_a_trace_folder_that_is_a_file_is_refused_before_any_suite_runs(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, named_by: str
) -> None:
    """Found only after a suite failed, the failure's trace would be lost."""
    (suite.path / "notes.txt").write_text("not a folder\n")
    if named_by == "option":
        result = suite.runpytest_subprocess("--shardkit-out", "notes.txt")
        expected = "*--shardkit-out notes.txt is a file, not a folder; name a folder for the failure traces*"
    else:
        monkeypatch.setenv("SHARDKIT_OUT", "notes.txt")
        result = suite.runpytest_subprocess()
        expected = "*$SHARDKIT_OUT notes.txt is a file, not a folder; name a folder for the failure traces*"
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([expected])


def test_a_failure_whose_trace_cannot_be_written_says_so(
    pytester: pytest.Pytester, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up while the suite runs: the failure is reported, and so is the trace it could not keep."""
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    pytester.makeconftest(
        """
import errno, os

def disk_full(path, document):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

def pytest_configure(config):
    import shardkit._run.artefacts as artefacts
    artefacts.write_new = disk_full
    artefacts.write_atomically = disk_full
"""
    )
    pytester.makepyfile(
        test_leak="""
from shardkit import machine_for

TestLeak = machine_for("shardkit._planted:ReleaseLeaksKvTokens", role="full", faults="none").TestCase
"""
    )
    result = pytester.runpytest_subprocess("--shardkit-seed", "1", "--shardkit-out", "traces")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAILURE (§2 metrics)*", "*(no trace was kept: could not write*No space left on device*"])
