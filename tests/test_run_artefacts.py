"""Nothing found is lost or overwritten, and the pytest route runs what it says.

Trace names per engine, role and seed; a different failure never replaces another; Ctrl-C
keeps the shortest failure; the example database never replays one engine's failure as
another's; a TestCase runs under the documented profile; long runs keep memory flat.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.database import InMemoryExampleDatabase

from shardkit import FakeShardEngine, machine_for
from shardkit._run import artefacts
from shardkit._run.options import Budgets
from shardkit._run.runner import chunk_seeds, fuzz, run_machine

BUGGY_ENGINE = """
from tests.planted import CancelLeaksKvTokens as make_engine
"""
CORRECT_ENGINE = """
from shardkit import FakeShardEngine as make_engine
"""


def _write_engine(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_two_files_with_the_same_factory_name_write_two_traces(tmp_path: Path) -> None:
    """``bug3.py:make_engine`` and ``bug4.py:make_engine`` once wrote one file, the second replacing the first."""
    first = _write_engine(tmp_path / "one", "engine.py", BUGGY_ENGINE)
    second = _write_engine(tmp_path / "two", "engine.py", BUGGY_ENGINE)
    out = tmp_path / "out"
    for path in (first, second):
        result = fuzz(f"{path}:make_engine", seed=3, examples=50, steps=30, role="full", out=out)
        assert result.failure is not None
    assert len(list(out.glob("make-engine-*.json"))) == 2


def test_roles_get_their_own_trace(tmp_path: Path) -> None:
    from tests.planted import ReleaseLeaksKvTokens

    names = set()
    for role in ("head", "tail"):
        result = fuzz(ReleaseLeaksKvTokens, seed=3, examples=100, steps=30, role=role, out=tmp_path)
        assert result.trace_path is not None
        names.add(result.trace_path.name)
    assert len(names) == 2
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_different_failure_under_the_same_name_is_kept_beside_it(tmp_path: Path) -> None:
    from tests.planted import ReleaseLeaksKvTokens

    result = fuzz(ReleaseLeaksKvTokens, seed=3, examples=100, steps=30, role="full", out=tmp_path)
    assert result.trace_path is not None
    original = json.loads(result.trace_path.read_text())
    original["steps"][0]["args"]["session"] = "someone-else"  # another failure under this name
    result.trace_path.write_text(json.dumps(original))
    again = fuzz(ReleaseLeaksKvTokens, seed=3, examples=100, steps=30, role="full", out=tmp_path)
    assert again.trace_path is not None
    assert again.trace_path != result.trace_path
    assert again.trace_path.name == result.trace_path.stem + "-2.json"
    assert json.loads(result.trace_path.read_text()) == original
    # The same failure found a third time is the file it already is, not a third copy.
    third = fuzz(ReleaseLeaksKvTokens, seed=3, examples=100, steps=30, role="full", out=tmp_path)
    assert third.trace_path == again.trace_path


def test_ctrl_c_while_shrinking_keeps_the_shortest_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt once wrote the most recent failing example (49 steps) over the shortest (42)."""
    from tests.planted import CancelLeaksKvTokens

    machine = machine_for(CancelLeaksKvTokens, role="full")
    seen: list[Any] = []
    real_offer = artefacts.Artefacts.offer

    def offer_then_interrupt(self: Any, failure: Any) -> None:
        seen.append(failure)
        real_offer(self, failure)
        if len(failure.records) > min(len(earlier.records) for earlier in seen):
            raise KeyboardInterrupt  # while Hypothesis tries a longer candidate than its best

    monkeypatch.setattr(artefacts.Artefacts, "offer", offer_then_interrupt)
    result = run_machine(machine, settings(max_examples=200, database=None), seed=3, out=tmp_path)
    lengths = [len(failure.records) for failure in seen]
    assert lengths[-1] > min(lengths), "the interrupt must stop a longer attempt for this to test anything"
    assert result.interrupted
    assert result.failure is not None
    assert len(result.failure.records) == min(lengths)
    assert result.trace_path is not None
    written = json.loads(result.trace_path.read_text())
    assert len(written["steps"]) == min(lengths)
    assert not list(tmp_path.glob("*-in-progress.json"))


def test_a_saved_example_of_one_engine_is_never_replayed_against_another(tmp_path: Path) -> None:
    """Two engines whose factories share a name, one example database: the correct engine's run
    must not report the buggy engine's saved failure."""
    buggy = _write_engine(tmp_path / "one", "engine.py", BUGGY_ENGINE)
    correct = _write_engine(tmp_path / "two", "engine.py", CORRECT_ENGINE)
    database = InMemoryExampleDatabase()
    shared = settings(max_examples=60, stateful_step_count=30, database=database)
    found = run_machine(machine_for(f"{buggy}:make_engine", role="full"), shared, seed=3, out=None)
    assert found.failure is not None
    assert database.data, "the failure was saved"
    clean = run_machine(machine_for(f"{correct}:make_engine", role="full"), shared, seed=3, out=None)
    assert clean.failure is None
    replayed = run_machine(machine_for(f"{buggy}:make_engine", role="full"), shared, seed=4, out=None)
    assert replayed.failure is not None
    assert replayed.examples == 1, "the buggy engine's own saved example replays first"


def test_a_long_run_is_a_series_of_bounded_runs_from_one_seed() -> None:
    plan = list(chunk_seeds(7, 250, 100, 200))
    assert [count for _, count in plan] == [100, 100, 50]
    assert plan[0][0] == 7
    assert len({seed for seed, _ in plan}) == 3
    assert plan == list(chunk_seeds(7, 250, 100, 200))
    # A run no longer than single_run is one plain Hypothesis run from the seed itself.
    assert list(chunk_seeds(7, 200, 100, 200)) == [(7, 200)]
    defaults = Budgets()
    assert list(chunk_seeds(7, 200, defaults.chunk_examples, defaults.single_run_examples)) == [(7, 200)]
    assert len(list(chunk_seeds(7, 3000, defaults.chunk_examples, defaults.single_run_examples))) == 30


def test_chunked_runs_repeat_from_their_seed() -> None:
    small = Budgets(chunk_examples=20, single_run_examples=20)
    first = fuzz(FakeShardEngine, seed=5, examples=70, steps=10, budgets=small)
    second = fuzz(FakeShardEngine, seed=5, examples=70, steps=10, budgets=small)
    assert first.failure is None
    assert (first.examples, first.steps, first.coverage) == (second.examples, second.steps, second.coverage)
    assert first.examples >= 70


SUITE_WITHOUT_SETTINGS = """
from shardkit import FakeShardEngine, ShardMachine, machine_for

EXAMPLES = []


class Counting(ShardMachine):
    def teardown(self):
        EXAMPLES.append(1)


TestFake = machine_for(FakeShardEngine, role="full", faults="none", base=Counting).TestCase


def test_the_suite_ran_the_profile_s_examples():
    assert len(EXAMPLES) >= {examples}, len(EXAMPLES)
"""


@pytest.mark.parametrize(
    ("arguments", "examples"),
    [
        ((), 200),  # shardkit-ci, as the header says
        (("--hypothesis-profile", "shardkit-dev"), 50),  # a profile the user chose
        (("--hypothesis-profile", "shardkit-ci"), 200),  # registered by the plugin: no conftest needed
    ],
)
def test_a_testcase_runs_the_documented_profile_or_the_one_chosen(
    pytester: pytest.Pytester,
    repo_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    arguments: tuple[str, ...],
    examples: int,
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    pytester.makepyfile(test_suite=SUITE_WITHOUT_SETTINGS.format(examples=examples))
    result = pytester.runpytest_subprocess(*arguments)
    result.assert_outcomes(passed=2)
    if "shardkit-dev" in arguments:
        result.stdout.fnmatch_lines(["shardkit: a fresh seed each run*profile shardkit-dev (50 examples × 30 steps)*"])
    else:
        result.stdout.fnmatch_lines(["shardkit: derandomized*profile shardkit-ci (200 examples × 50 steps)*"])


def test_the_bench_measures_peak_memory_at_two_sizes_in_fresh_processes() -> None:
    from shardkit._bench.memory import measure_memory
    from shardkit._bench.settings import BenchSettings

    figures = measure_memory(BenchSettings(seed=1, memory_examples=(10, 30), memory_steps=20))
    assert isinstance(figures, dict), figures
    assert figures["10"]["peak_rss_mb"] > 10
    assert figures["30"]["peak_rss_mb"] > 10
    assert figures["steps"] == 20
    assert figures["ratio_largest_to_smallest"] == round(figures["30"]["peak_rss_mb"] / figures["10"]["peak_rss_mb"], 2)
    assert measure_memory(BenchSettings(memory_examples=(10,))) == "not measured: two sizes are needed to compare, got [10]"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_users_umask(tmp_path: Path, umask: int) -> None:
    """Traces were written 0600 whatever the umask (the temporary file's mode)."""
    import os

    from shardkit._run.trace import write_atomically

    previous = os.umask(umask)
    try:
        written = write_atomically(tmp_path / "trace.json", {"a": 1})
    finally:
        os.umask(previous)
    assert written.stat().st_mode & 0o777 == 0o666 & ~umask


def test_step_notes_describe_each_step_as_it_runs_not_as_it_was_drawn() -> None:
    """'# out of order' was seen on a valid step-0 prefill and '# epoch ahead' on a fresh session,
    notes drawn for steps that shrinking had since moved."""
    from shardkit import LoadRequest
    from shardkit._core.driver import Driver
    from shardkit._core.steps import Action, step_action
    from shardkit._transport.resolve import resolve_target

    driver = Driver(
        resolve_target(FakeShardEngine), LoadRequest("m", 0, 3, 4), faults=frozenset({"delay"}), twins=False
    )

    def note(action: Action) -> str:
        return driver.execute(action).action.note

    assert note(step_action("prefill", "a", 0, 0, (0,), note="out of order")) == ""
    assert note(step_action("prefill", "b", 1, 0, (0,), note="epoch ahead")) == "opens at a higher epoch"
    assert note(step_action("prefill", "a", 0, 0, (0,))) == "resent"
    assert note(step_action("prefill", "a", 0, 0, (1,))) == "out of order"
    assert note(step_action("decode", "a", 0, 3, (0,))) == "out of order"
    assert note(step_action("decode", "zz", 0, 0, (0,), note="resent")) == "unknown session"
    assert note(step_action("prefill", "b", 0, 1, (0,))) == "stale epoch"
    assert note(step_action("decode", "b", 2, 1, (0,))) == "epoch ahead"
    assert note(step_action("prefill", "b", 2, 0, (0,))) == "epoch bump"
    assert note(Action("cancel", {"session": "b", "epoch": 1})) == "stale epoch"
    assert note(Action("cancel", {"session": "b", "epoch": 2})) == ""
    assert note(step_action("decode", "b", 2, 1, (0,))) == "cancelled session"
    assert note(Action("cancel", {"session": "", "epoch": 0})) == "empty session id"
    assert note(Action("fault", {"kind": "delay", "value": 0.0}, note="kept")) == "kept"


def test_out_may_be_given_as_a_string(tmp_path: Path) -> None:
    """``fuzz(..., out="folder")`` as a newcomer writes it, not only a ``Path``."""
    from tests.planted import CancelLeaksKvTokens

    result = fuzz(CancelLeaksKvTokens, seed=3, examples=50, steps=30, role="full", out=str(tmp_path / "out"))
    assert result.trace_path is not None
    assert result.trace_path.parent == tmp_path / "out"
    assert result.trace_path.is_file()


def test_the_printed_test_command_says_when_pytest_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's first command installs no pytest: the printed command must not fail unexplained."""
    from shardkit._run import report
    from tests.planted import CancelLeaksKvTokens

    result = fuzz(CancelLeaksKvTokens, seed=3, examples=50, steps=30, role="full", out=tmp_path)
    (line,) = [line for line in report.render_failure(result).splitlines() if "as a test:" in line]
    assert not line.endswith("(pytest is not installed here: pip install pytest)")
    monkeypatch.setattr(report, "_has_pytest", lambda: False)
    (line,) = [line for line in report.render_failure(result).splitlines() if "as a test:" in line]
    assert line.endswith("(pytest is not installed here: pip install pytest)")


def test_two_checkouts_of_one_project_share_an_identity_and_another_file_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file target is known by its path from the folder the run starts in: a CI runner's
    checkout and a laptop's name the same engine (trace digests, database keys, suite seeds)."""
    engine = "from shardkit import FakeShardEngine as Engine\n"
    for checkout in ("ci-runner", "laptop"):
        (tmp_path / checkout / "engines").mkdir(parents=True)
        (tmp_path / checkout / "engines" / "mine.py").write_text(engine)
    (tmp_path / "elsewhere.py").write_text(engine)

    def identity_from(folder: str, target: str) -> str:
        monkeypatch.chdir(tmp_path / folder)
        return artefacts.machine_identity(machine_for(target, role="full", faults="none"))

    runner = identity_from("ci-runner", "engines/mine.py:Engine")
    assert runner == identity_from("laptop", "engines/mine.py:Engine")
    assert runner.startswith("engines/mine.py:Engine")
    (tmp_path / "laptop" / "engines" / "other.py").write_text(engine)
    assert identity_from("laptop", "engines/other.py:Engine") != runner, "another file is another engine"
    outside = identity_from("laptop", f"{tmp_path / 'elsewhere.py'}:Engine")
    assert outside.startswith(f"{(tmp_path / 'elsewhere.py').resolve()}:Engine"), (
        "outside the project: its absolute path"
    )


def test_a_full_disk_at_the_end_names_the_in_progress_trace_it_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final trace cannot be written (the disk is full); the in-progress one, small and
    written while shrinking, is still there and replays: the message says so, and how."""
    import errno

    from shardkit._run.trace_reader import read_trace
    from tests.planted import CancelLeaksKvTokens

    def disk_full(self: Any, stem: str, document: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / f"{stem}.json"))

    monkeypatch.setattr(artefacts.Artefacts, "_claim", disk_full)
    machine = machine_for(CancelLeaksKvTokens, role="full")
    result = run_machine(machine, settings(max_examples=200, database=None), seed=3, out=tmp_path)
    assert result.failure is not None
    assert result.trace_path is None
    [left] = tmp_path.glob("*-in-progress.json")
    assert result.write_error is not None
    assert result.write_error.startswith(f"could not write the trace under {tmp_path}")
    assert "No space left on device" in result.write_error
    steps = len(result.failure.records)
    assert (
        f"; the in-progress trace {left} holds the failure in {steps} steps: shardkit replay {left}"
        in result.write_error
    )
    assert len(read_trace(left).actions) == steps


def test_a_full_disk_while_shrinking_is_forgotten_once_the_final_trace_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_offer = artefacts.Artefacts.offer
    calls: list[int] = []

    def offer_on_a_full_disk(self: Any, failure: Any) -> None:
        calls.append(len(failure.records))
        if len(calls) == 2:  # one in-progress write fails, later ones succeed
            self.write_error = f"could not write {self.in_progress()}: No space left on device"
            return
        real_offer(self, failure)

    monkeypatch.setattr(artefacts.Artefacts, "offer", offer_on_a_full_disk)
    from tests.planted import CancelLeaksKvTokens

    result = run_machine(
        machine_for(CancelLeaksKvTokens, role="full"), settings(max_examples=200, database=None), seed=3, out=tmp_path
    )
    assert len(calls) >= 2
    assert result.trace_path is not None
    assert result.write_error is None


MACHINE_IDENTITY = """
import sys
from shardkit import FakeShardEngine, machine_for
from shardkit._core.importing import import_named
from shardkit._run.artefacts import machine_identity

base = import_named("machines/mine.py:Mine", "--machine", "FILE.py:CLASS")
print(machine_identity(machine_for(FakeShardEngine, role="full", faults="none", base=base)).splitlines()[-2])
"""


def test_a_machine_from_a_file_has_one_identity_in_every_process_and_checkout(tmp_path: Path) -> None:
    """Its module is named for its file: by a digest, not by ``hash()``, which changes with
    each process (so did the trace names of a ``--machine FILE.py:Class`` run), and the
    identity names it by its path from the run's folder, as it does a file target."""
    import os
    import subprocess
    import sys

    identities = set()
    for checkout, hash_seed in (("ci-runner", "1"), ("ci-runner", "2"), ("laptop", "3")):
        (tmp_path / checkout / "machines").mkdir(parents=True, exist_ok=True)
        (tmp_path / checkout / "machines" / "mine.py").write_text(
            "from shardkit import ShardMachine\n\n\nclass Mine(ShardMachine):\n    pass\n"
        )
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", MACHINE_IDENTITY],
            cwd=tmp_path / checkout,
            env=environment,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        identities.add(done.stdout.strip())
    assert identities == {"machine=machines/mine.py:Mine"}
