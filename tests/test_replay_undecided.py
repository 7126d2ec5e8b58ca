"""A replay that could not make every check is undecided, never a pass: the command exits 2
naming each check not made, the API says ``undecided``, and a generated regression test fails.

The check not made here is the one a replay of a race most often loses: the search for an
order that explains a parallel phase runs out of its states (given a budget of one state, so
that it does so on a correct engine, with the calls counted ruling out no order)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardkit import prepare_replay
from shardkit._cli.main import main
from shardkit._core.driver import Violation
from shardkit._parallel import linearize, phase
from shardkit._run.regression import regression_test_source

ROOT = Path(__file__).resolve().parent.parent
LINEARIZABILITY = "§2 linearizability"


def _step(op: str, session: str, step: int, token: int) -> dict[str, Any]:
    tokens = [token, token] if op == "prefill" else [token]
    args = {"session": session, "epoch": 0, "step": step, "tokens": tokens, "malformed": None}
    return {"op": op, "args": args, "note": ""}


def _trace(path: Path) -> Path:
    """Two lanes, each opening a session of its own and decoding it: a correct engine answers
    them in any order."""
    lanes = [[_step("prefill", name, 0, 1), _step("decode", name, 1, 2)] for name in ("a", "b")]
    document = {
        "format": "shardkit-trace",
        "version": 1,
        "shardkit_version": "0.1.0",
        "target": "shardkit:FakeShardEngine",
        "role": "full",
        "load_request": {"model_id": "m", "shard_start": 0, "shard_end": 3, "total_layers": 4, "recipe": {}},
        "faults_enabled": [],
        "twins": True,
        "reference": None,
        "isolate": None,
        "fault_steps": [],
        "seed": 1,
        "steps": [{"op": "parallel", "args": {"lanes": lanes}, "note": ""}],
        "failure": {"property": LINEARIZABILITY, "message": "recorded", "step": 1},
    }
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


#: Put in place of the phase's search: the real one, with a budget of one state.
STARVED_SEARCH = "functools.partial(linearize.linearize, max_states=1)"


@pytest.fixture
def starved_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phase, "linearize", functools.partial(linearize.linearize, max_states=1))


def test_a_correct_engine_replays_to_did_not_reproduce_when_the_search_decides(tmp_path: Path) -> None:
    """The baseline the other tests change one thing of: with its states, the search decides."""
    with prepare_replay(_trace(tmp_path / "t.json")) as prepared:
        result = prepared.run(runs=3)
    assert result.failure is None
    assert result.not_checked == ()
    assert not result.undecided


@pytest.mark.usefixtures("starved_search")
def test_the_api_says_undecided_and_names_the_check_not_made(tmp_path: Path) -> None:
    with prepare_replay(_trace(tmp_path / "t.json")) as prepared:
        result = prepared.run(runs=3)
    assert result.failure is None
    assert result.undecided
    [caveat] = result.undecided_checks
    assert result.not_checked == (caveat,)
    assert "the search for an order that explains it" in caveat
    assert "without a verdict" in caveat


@pytest.mark.usefixtures("starved_search")
def test_the_command_exits_2_naming_each_check_not_made(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["replay", str(_trace(tmp_path / "t.json")), "--runs", "3"])
    out = capsys.readouterr().out
    assert code == 2, out
    assert "did not reproduce" not in out
    assert "undecided: no run failed, but 1 check reached no verdict:" in out
    assert "  not checked: a parallel phase: the search for an order that explains it" in out
    assert "nothing is claimed about the trace" in out


def test_a_generated_regression_test_fails_when_undecided(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json")
    violation = Violation(LINEARIZABILITY, "recorded")
    source = regression_test_source(trace.name, violation, 1, {"target": "shardkit:FakeShardEngine"})
    (tmp_path / "test_regression.py").write_text(source, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "test_regression.py",
    ]
    decided = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert decided.returncode == 0, decided.stdout + decided.stderr
    # The same test, with the phase's search starved (a conftest puts the starved search in place).
    conftest = (
        f"import functools\nfrom shardkit._parallel import linearize, phase\nphase.linearize = {STARVED_SEARCH}\n"
    )
    (tmp_path / "conftest.py").write_text(conftest, encoding="utf-8")
    starved = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert starved.returncode == 1, starved.stdout + starved.stderr
    assert "undecided: no run failed, but some checks reached no verdict:" in starved.stdout
    assert "not checked: a parallel phase: the search for an order" in starved.stdout
