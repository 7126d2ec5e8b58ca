"""``shardkit campaign``: worker processes fuzzing one engine from derived seeds, their rounds
merged into one report; the seed derivation, the merging, the progress and the usage errors."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shardkit._campaign.merge import CampaignResult, merge_failures
from shardkit._campaign.progress import LiveBoard, RoundLines, Tally
from shardkit._campaign.rounds import FoundFailure, RoundFinished, RoundOutcome, RoundProgress, WorkerReady
from shardkit._campaign.run import measure_campaign_work
from shardkit._campaign.seeds import round_seed
from shardkit._cli.main import main
from shardkit._run.options import FuzzOptions
from shardkit._run.report import report_document
from shardkit._run.result import FuzzResult

REPO_ROOT = Path(__file__).resolve().parent.parent
PLANTED = "shardkit._planted:StaleEpochAccepted"
#: A planted bug with one minimal sequence (prefill, release), which every round shrinks to: a
#: stale epoch has two (a stale restart at step 0, or a stale step 1), so rounds may differ.
LEAK = "shardkit._planted:ReleaseLeaksKvTokens"
#: Rounds small enough that a planted bug is found and minimised in about a second.
SMALL = ["--examples", "10", "--steps", "20"]


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fuzz_report_keys() -> set[str]:
    """The top-level keys of ``shardkit fuzz --report``, whatever they are today."""
    return set(report_document(FuzzResult("t:t", 1, 0, 0, 0.0, Counter())))


# --- the command end to end --------------------------------------------------------------------


def test_two_workers_find_a_planted_bug_and_merge_it_into_one_report(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the paths the report and the output print are relative
    # 40 examples: enough for each worker's first round to find the leak at these seeds.
    arguments = ["campaign", LEAK, "--workers", "2", "--minutes", "0.05", "--seed", "7", "--examples", "40", "--steps", "20"]
    code, out, err = run(capsys, *arguments, "--out", "found", "--report", "campaign.json", "--html", "campaign.html")
    assert code == 1, (out, err)
    assert out.splitlines()[0] == f"shardkit campaign {LEAK} --workers 2 --minutes 0.05 --seed 7 --examples 40 --steps 20"

    document = json.loads(Path("campaign.json").read_text(encoding="utf-8"))
    assert set(document) == fuzz_report_keys() | {"campaign"}
    campaign = document["campaign"]
    assert (campaign["workers"], campaign["minutes"], campaign["interrupted"], campaign["errors"]) == (2, 0.05, False, [])
    seeds = campaign["seeds"]
    assert {entry["worker"] for entry in seeds} == {1, 2}, "each worker runs at least one round"
    assert campaign["rounds"] == len(seeds)
    for entry in seeds:
        assert entry["seed"] == round_seed(7, entry["worker"], entry["round"])

    # Every round that finds the leak shrinks it to the same two steps: one failure, found by
    # (at least) each worker's first round; a later round, if the minutes allowed one, may not find it.
    [failure] = document["failures"]
    assert failure["property"] == "§2 metrics"
    assert [step["op"] for step in failure["steps"]] == ["prefill", "release"]
    assert failure["found_in_rounds"] == len(failure["found_in"])
    assert {(found["worker"], found["round"]) for found in failure["found_in"]} >= {(1, 1), (2, 1)}
    first = failure["found_in"][0]
    assert failure["rerun_command"] == f"shardkit fuzz {LEAK} --seed {first['seed']} --examples 40 --steps 20"
    assert failure["trace"] == first["trace"]
    assert Path(failure["trace"]).is_file()
    assert not Path(failure["trace"]).is_absolute()
    assert all(Path(found["trace"]).is_file() for found in failure["found_in"])
    assert document["examples"] > 0
    assert document["steps"] > 0
    assert document["coverage"]["prefill"]

    assert f"1 distinct failure, found in {failure['found_in_rounds']} of {len(seeds)} rounds:" in out
    assert f"  this failure:    shardkit replay {failure['trace']}\n" in out
    assert f"  its round:       {failure['rerun_command']}\n" in out
    # Not a terminal: one plain line per round on stderr.
    round_lines = [line for line in err.splitlines() if line.startswith("worker ")]
    assert len(round_lines) == len(seeds), err
    assert "failure (§2 metrics) in 2 steps" in round_lines[0]
    assert "coverage pairs" in round_lines[-1]
    assert "(1 distinct)" in round_lines[-1]

    page = Path("campaign.html").read_text(encoding="utf-8")
    assert "§2 metrics" in page
    assert "Campaign" in page

    # The round's own command reruns it alone, to the same failure.
    command = shlex.split(failure["rerun_command"])
    assert command[:2] == ["shardkit", "fuzz"]
    code, out, err = run(capsys, *command[1:], "--out", "rerun", "--report", "rerun.json")
    assert code == 1, (out, err)
    [rerun] = json.loads(Path("rerun.json").read_text(encoding="utf-8"))["failures"]
    assert rerun["property"] == failure["property"]
    assert [(s["op"], s["args"]) for s in rerun["steps"]] == [(s["op"], s["args"]) for s in failure["steps"]]


def test_a_campaign_that_finds_nothing_exits_0_and_draws_a_live_board_on_a_terminal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    arguments = ["campaign", "--workers", "1", "--minutes", "0.001", "--seed", "3", "--examples", "3", "--steps", "5"]
    code = main([*arguments, "--out", str(tmp_path), "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, (out, terminal.getvalue())
    assert "no failure found in 1 round" in out
    board = terminal.getvalue()
    assert "worker 1  round 1" in board
    assert "total     1 round" in board
    assert board.endswith("\x1b[J"), "the board is cleared before the report is printed"
    document = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert document["failures"] == []
    assert document["campaign"]["rounds"] == 1


def test_ctrl_c_stops_the_workers_and_keeps_what_they_found(tmp_path: Path) -> None:
    """Ctrl-C on a terminal reaches the whole process group: the campaign and its workers."""
    command = [sys.executable, "-m", "shardkit", "campaign", PLANTED, "--workers", "2", "--minutes", "10", "--seed", "7"]
    command += [*SMALL, "--out", "found", "--report", "campaign.json"]
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stderr is not None
        first_round = process.stderr.readline()  # a round's line: a failure has been found
        assert "failure (§2 rule 4)" in first_round, first_round
        os.killpg(process.pid, signal.SIGINT)
        started = time.monotonic()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - started < 30
    assert process.returncode == 1, (out, err)
    assert "Traceback" not in err, err
    assert "interrupted (Ctrl-C)" in out
    document = json.loads((tmp_path / "campaign.json").read_text(encoding="utf-8"))
    assert document["campaign"]["interrupted"] is True
    assert document["failures"]
    assert all(f["property"] == "§2 rule 4" for f in document["failures"])


# --- usage errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--workers", "0"], "--workers must be a number of worker processes from 1 to 256 (rounds at a time on a --cluster: up to 100,000), e.g. --workers 2, got '0'"),
        (["--workers", "257"], "--workers 257 on one machine: at most 256 worker processes (more rounds at a time only with --cluster)"),
        (["--workers", "two"], "got 'two'"),
        (["--workers", "100001"], "got '100001'"),
        (["--minutes", "0"], "--minutes must be a positive number of minutes, e.g. --minutes 10 or --minutes 0.5, got '0'"),
        (["--minutes", "-1"], "got '-1'"),
        (["--minutes", "nan"], "got 'nan'"),
        (["--minutes", "soon"], "got 'soon'"),
        (["--examples", "0"], "--examples must be a positive integer, got '0'"),
        (["--faults", "sometimes"], "'sometimes'"),
        (["--database-read-only"], "--database-read-only"),
        (["--report", "no/such/folder/r.json"], "the folder no/such/folder does not exist"),
        (["--html", "."], "--html . is a folder"),
    ],
)
def test_a_bad_option_is_one_line_naming_the_value_and_no_worker_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: list[str], named: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDKIT_DATABASE", raising=False)
    code, out, err = run(capsys, "campaign", "--minutes", "0.01", *arguments)  # a later --minutes is parsed too
    assert code == 2, (out, err)
    assert out == "", "nothing ran"
    [line] = err.splitlines()
    assert named in line
    assert line.startswith("shardkit campaign: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("target", "named"),
    [("no_such_module_here:Engine", "no_such_module_here"), ("shardkit:NoSuchEngine", "NoSuchEngine")],
)
def test_an_unknown_target_is_one_line_before_any_worker_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, target: str, named: str
) -> None:
    code, out, err = run(capsys, "campaign", target, "--minutes", "0.01", "--out", tmp_path)
    assert code == 2, (out, err)
    assert out == "", "nothing ran"
    [line] = err.splitlines()
    assert named in line
    assert "Traceback" not in err


def test_an_engine_that_cannot_be_built_stops_the_campaign_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    engine = tmp_path / "broken_engine.py"
    engine.write_text('def make():\n    raise RuntimeError("no weights here")\n', encoding="utf-8")
    code, out, err = run(capsys, "campaign", f"{engine}:make", "--workers", "2", "--minutes", "0.01", "--out", tmp_path)
    assert code == 2, (out, err)
    assert "no failure found in 0 rounds" in out
    [line] = err.splitlines()  # both workers fail alike: said once
    assert line.startswith("shardkit campaign: error: worker ")
    assert "RuntimeError when called: no weights here" in line


def test_minutes_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "campaign", "--workers", "2")
    assert code == 2
    assert out == ""
    [line] = err.splitlines()
    assert "--minutes" in line


# --- seeds ---------------------------------------------------------------------------------------


def test_round_seeds_are_distinct_per_worker_and_round_and_stable() -> None:
    grid = {(worker, number): round_seed(7, worker, number) for worker in range(1, 9) for number in range(1, 101)}
    assert len(set(grid.values())) == len(grid), "two rounds of a campaign share a seed"
    assert all(0 <= seed < 2**64 for seed in grid.values())
    # A fixed function of (campaign seed, worker, round): the same on any machine, in any process.
    assert round_seed(7, 1, 1) == 16565768275343057706
    assert round_seed(7, 2, 1) == 8761286933153974977
    assert round_seed(7, 1, 2) != round_seed(7, 2, 1)
    assert {round_seed(seed, 1, 1) for seed in range(100)}.isdisjoint(set(grid.values()) - {grid[1, 1]})
    assert round_seed(8, 1, 1) != round_seed(7, 1, 1)
    with pytest.raises(ValueError, match="counted from 1"):
        round_seed(7, 0, 1)


# --- merging -------------------------------------------------------------------------------------


def outcome(
    worker: int,
    number: int,
    prop: str | None = "§2 rule 4",
    steps: list[tuple[str, dict[str, Any]]] | None = None,
    observed: str = "OK/HIT",
    coverage: tuple[tuple[str, str, int], ...] = (("prefill", "OK", 2),),
) -> RoundOutcome:
    """A finished round, found failure and all, as a worker sends it."""
    steps = steps if steps is not None else [("prefill", {"session": "a", "epoch": 1}), ("prefill", {"session": "a", "epoch": 0})]
    failure = None
    if prop is not None:
        entry = {
            "property": prop,
            "message": f"observed: {observed}",
            "steps": [{"op": op, "args": args, "expected": "ABORTED", "observed": observed} for op, args in steps],
            "trace": f"found/w{worker}-r{number}.json",
        }
        failure = FoundFailure(entry=entry, text=f"FAILURE ({prop})", rerun_command=f"shardkit fuzz t:t --seed {worker}{number}")
    return RoundOutcome(
        worker=worker,
        round=number,
        seed=round_seed(1, worker, number),
        examples=5,
        steps=50,
        work_examples=9,
        work_steps=90,
        elapsed_s=1.0,
        started_at=0.0,
        ended_at=1.0,
        coverage=coverage,
        caveats=(),
        longest_session=((0, 5),),
        faults=("crash",),
        failure=failure,
    )


def test_rounds_with_the_same_property_and_step_sequence_merge_into_one_failure() -> None:
    rounds = [
        outcome(2, 3, observed="OK/MISS"),  # what the engine answered is not compared
        outcome(2, 1),
        outcome(1, 2, steps=[("prefill", {"epoch": 1, "session": "a"}), ("prefill", {"epoch": 0, "session": "a"})]),
        outcome(1, 1, prop=None),
    ]
    [merged] = merge_failures(rounds)
    assert [(found.worker, found.round) for found in merged.rounds] == [(2, 1), (1, 2), (2, 3)]
    assert merged.first.rerun_command == "shardkit fuzz t:t --seed 21", "the first round's (by round, then worker)"
    entry = merged.document()
    assert entry["found_in_rounds"] == 3
    assert entry["trace"] == "found/w2-r1.json"
    assert [found["trace"] for found in entry["found_in"]] == ["found/w2-r1.json", "found/w1-r2.json", "found/w2-r3.json"]
    assert "found in 3 rounds: worker 1 round 2; worker 2 rounds 1, 3" in merged.text()


def test_a_different_property_or_step_sequence_is_another_failure() -> None:
    two_steps = [("prefill", {"session": "a", "epoch": 1}), ("prefill", {"session": "a", "epoch": 0})]
    rounds = [
        outcome(1, 1, steps=two_steps),
        outcome(1, 2, prop="§2 rule 6", steps=two_steps),  # another property
        outcome(1, 3, steps=[("prefill", {"session": "a", "epoch": 2}), ("prefill", {"session": "a", "epoch": 0})]),  # args
        outcome(1, 4, steps=[("decode", {"session": "a", "epoch": 1}), ("prefill", {"session": "a", "epoch": 0})]),  # op
        outcome(1, 5, steps=two_steps[::-1]),  # order
        outcome(1, 6, steps=two_steps[:1]),  # length
        outcome(2, 1, steps=two_steps),  # the first one again
    ]
    merged = merge_failures(rounds)
    assert [len(failure.rounds) for failure in merged] == [2, 1, 1, 1, 1, 1]
    assert [(failure.rounds[0].worker, failure.rounds[0].round) for failure in merged] == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6)]


def test_the_merged_document_sums_the_rounds() -> None:
    rounds = [
        outcome(1, 1, coverage=(("prefill", "OK", 2), ("decode", "OK", 1))),
        outcome(2, 1, prop=None, coverage=(("prefill", "OK", 3), ("cancel", "NOT_FOUND", 1))),
    ]
    result = CampaignResult("t:t", 7, 2, 0.5, None, rounds, elapsed_s=2.0, options=FuzzOptions(), command="shardkit campaign t:t")
    document = result.document()
    assert (document["examples"], document["steps"], document["seed"]) == (10, 100, 7)
    assert document["coverage"] == {"cancel": {"NOT_FOUND": 1}, "decode": {"OK": 1}, "prefill": {"OK": 5}}
    assert document["longest_session"]["decodes_histogram"]["0"] == 10
    assert document["run"]["rerun_command"] == "shardkit campaign t:t"
    assert [failure["found_in_rounds"] for failure in document["failures"]] == [1]
    assert document["campaign"]["seeds"] == [
        {"worker": 1, "round": 1, "seed": round_seed(1, 1, 1)},
        {"worker": 2, "round": 1, "seed": round_seed(1, 2, 1)},
    ]
    assert "3 distinct pairs" in result.text()


# --- progress ------------------------------------------------------------------------------------


def test_the_live_board_shows_each_worker_and_the_total_and_redraws_in_place() -> None:
    stream = io.StringIO()
    tally = Tally(2)
    board = LiveBoard(stream, tally, minutes=1.0)
    events = [
        WorkerReady(1),
        WorkerReady(2),
        RoundProgress(1, 1, 11, examples=4, steps=40, failures=0),
        RoundFinished(outcome(2, 1, coverage=(("prefill", "OK", 2), ("decode", "OK", 1)))),
        RoundFinished(outcome(1, 1, coverage=(("prefill", "OK", 2), ("cancel", "OK", 1)))),
    ]
    for event in events:
        tally.apply(event, time.monotonic() - 1.0)
        board(event)
    lines = board.lines(time.monotonic())
    assert lines[0].startswith("worker 1  round 1  examples 9  steps 90  ")
    assert "coverage pairs 2  failures 1" in lines[0]
    assert lines[1].startswith("worker 2  round 1  examples 9  steps 90  ")
    assert lines[2].startswith("total     2 rounds  examples 18  steps 180  ")
    assert "coverage pairs 3  failures 2 (1 distinct)" in lines[2]
    assert lines[2].endswith(" of 1:00")
    drawn = stream.getvalue()
    assert "\x1b[3F" in drawn, "a redraw moves up over the three lines drawn before"
    board.clear()
    assert stream.getvalue().endswith("\x1b[3F\x1b[J")


def test_round_lines_print_one_line_per_finished_round() -> None:
    stream = io.StringIO()
    tally = Tally(1)
    view = RoundLines(stream, tally)
    for event in (WorkerReady(1), RoundProgress(1, 1, 11, 4, 40, 0), RoundFinished(outcome(1, 1, prop=None))):
        tally.apply(event, time.monotonic())
        view(event)
    [line] = stream.getvalue().splitlines()
    assert line.startswith(f"worker 1 round 1 (seed {round_seed(1, 1, 1)}): 9 examples, 90 steps in 1.0s (90 steps/s), no failure")
    assert line.endswith("coverage pairs 1  failures 0 (0 distinct)")


# --- for shardkit bench ----------------------------------------------------------------------------


def test_campaign_work_is_measured_over_a_fixed_number_of_rounds() -> None:
    options = FuzzOptions(examples=3, steps=10)
    one = measure_campaign_work(options=options, workers=1, rounds_per_worker=1, seed=2)
    two = measure_campaign_work(options=options, workers=2, rounds_per_worker=1, seed=2)
    assert (one.rounds, two.rounds) == (1, 2)
    assert two.steps > one.steps > 0
    assert one.seconds > 0
    assert two.rate == two.steps / two.seconds


def test_the_live_page_is_rewritten_when_the_first_round_ends_then_at_most_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from shardkit._cli import campaign as campaign_command

    class Snapshot:
        def __init__(self, rounds: int) -> None:
            self.rounds = rounds

        def document(self) -> dict[str, Any]:
            return {"campaign": {"rounds": self.rounds}}

    written: list[int] = []
    page = campaign_command._LivePage(lambda document, path: written.append(document["campaign"]["rounds"]), tmp_path / "live.html")
    every = campaign_command.LIVE_REWRITE_S
    for rounds, at in enumerate((100.0, 100.1, 100.0 + every - 0.01, 100.0 + every, 100.0 + every + 1), start=1):
        monkeypatch.setattr(campaign_command.time, "monotonic", lambda at=at: at)
        page(Snapshot(rounds))
    assert written == [1, 4]
