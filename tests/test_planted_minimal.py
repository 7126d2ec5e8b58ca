"""Each planted engine's MINIMAL really is a minimal failing sequence, checked through the
public path: written as a trace file and run by ``shardkit replay TRACE``, it fails with the
engine's property at its last step; with any one step cut out of the file, replay passes.

The same edit-and-replay check runs on the traces actual ``fuzz`` runs wrote (1-minimal, as
the report claims), never through the minimiser's own helper.

``shardkit replay`` runs in-process (``shardkit._cli.main.main``): one subprocess test shows
the command line does the same, the rest would only pay for starting Python hundreds of times.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from shardkit._cli.main import main
from shardkit._core.targets import IsolationOptions
from shardkit._planted import PLANTED, PlantedEngine
from shardkit._planted.dying import DYING, DyingEngine
from shardkit._planted.minimal import KvTokens, Step, prefill
from shardkit._planted.traces import minimal_trace
from shardkit._run.result import FuzzResult
from tests.test_pipeline_engine import PLANTED as PLANTED_PIPELINES
from tests.test_pipeline_engine import PlantedPipeline, TailGetsTheHeadsBundle

FAILURE_LINE = re.compile(r"^FAILURE \((?P<property>.+)\) in (?P<steps>\d+) steps?:$", re.MULTILINE)



# --- the public path: a trace file, `shardkit replay`, and an edited copy ---------------------------


def write_trace(path: Path, document: Mapping[str, Any]) -> Path:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def without_step(document: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The trace with its ``index``-th step (0-based) cut out, as a person would edit the file:
    the fault steps it lists and the failing step's number follow the steps that remain."""
    steps = [step for position, step in enumerate(document["steps"]) if position != index]
    fault_steps = [
        {"kind": step["args"]["kind"], "value": step["args"]["value"], "step": number}
        for number, step in enumerate(steps, start=1)
        if step["op"] == "fault"
    ]
    failure = {**document["failure"], "step": len(steps)}
    return {**document, "steps": steps, "fault_steps": fault_steps, "failure": failure}


def replay_file(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[str | None, int]:
    """``shardkit replay PATH``: the property of the failure it printed (None: it passed) and
    the number of steps of that failure. An input error (exit 2) fails the test."""
    code = main(["replay", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 1), f"shardkit replay {path.name} exited {code}: {err}"
    if code == 0:
        assert "did not reproduce" in out, out
        return None, 0
    found = FAILURE_LINE.search(out)
    assert found is not None, out
    return found["property"], int(found["steps"])


def assert_one_minimal(
    capsys: pytest.CaptureFixture[str], document: Mapping[str, Any], folder: Path, name: str
) -> None:
    """Cut each step out of the trace in turn: no replay of what is left may fail. (A trace of
    one step has nothing left once it is cut, and nothing fails with no step.)"""
    still_failing = []
    steps = document["steps"]
    for index in range(len(steps) if len(steps) > 1 else 0):
        path = write_trace(folder / f"{name}-without-step-{index + 1}.json", without_step(document, index))
        failed, _ = replay_file(capsys, path)
        if failed is not None:
            still_failing.append(f"without step {index + 1} ({steps[index]['op']}): {failed}")
    assert not still_failing, f"{name} is not 1-minimal: " + "; ".join(still_failing)


def names_property(engine: type, property_name: str) -> bool:
    expected = (getattr(engine, "PROPERTY"), *getattr(engine, "ALSO", ()))  # noqa: B009
    return any(property_name.startswith(name) for name in expected)


def check_minimal(
    capsys: pytest.CaptureFixture[str],
    folder: Path,
    engine: type,
    target: str,
    *,
    steps: Sequence[Step] | None = None,
    reference: str | None = None,
    isolation: IsolationOptions | None = None,
) -> None:
    """``steps`` (default: the engine's MINIMAL) fail under ``shardkit replay`` with the
    engine's property, at their last step, and no sequence with one step fewer does."""
    chosen: Sequence[Step] = steps if steps is not None else getattr(engine, "MINIMAL")  # noqa: B009
    document = minimal_trace(engine, target, steps=chosen, reference=reference, isolation=isolation)
    path = write_trace(folder / f"{engine.__name__}.json", document)
    failed, length = replay_file(capsys, path)
    shown = "\n  ".join(map(str, chosen))
    assert failed is not None, f"{engine.__name__} ({getattr(engine, 'BUG')}) passed the replay of:\n  {shown}"  # noqa: B009
    assert names_property(engine, failed), f"{engine.__name__}: replay failed with {failed}"
    assert length == len(chosen), f"{engine.__name__} failed at step {length} of:\n  {shown}"
    assert_one_minimal(capsys, document, folder, engine.__name__)


# --- the planted engines' MINIMALs ---------------------------------------------------------------


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_each_planted_minimal_fails_on_replay_and_no_step_can_go(
    engine: type[PlantedEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check_minimal(capsys, tmp_path, engine, f"shardkit._planted:{engine.__name__}")


@pytest.mark.parametrize("engine", [*PLANTED_PIPELINES, TailGetsTheHeadsBundle], ids=lambda engine: engine.__name__)
def test_each_planted_pipeline_minimal_fails_on_replay_and_no_step_can_go(
    engine: type[PlantedPipeline],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    repo_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(repo_root)  # replay builds a recorded target from inside the current project only
    # As in its fuzz test: only twins from a single full fake see the fanned-out bundle is wrong.
    reference = "shardkit:FakeShardEngine" if engine is TailGetsTheHeadsBundle else None
    check_minimal(capsys, tmp_path, engine, f"tests.test_pipeline_engine:{engine.__name__}", reference=reference)


@pytest.mark.parametrize("engine", DYING, ids=lambda engine: engine.__name__)
def test_each_dying_minimal_kills_its_worker_on_replay_and_no_step_can_go(
    engine: type[DyingEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replayed in a worker process, as the trace of an isolated run is (each replay starts one)."""
    isolation = IsolationOptions(engine.STEP_TIMEOUT or 5.0, engine.WORKER_MEMORY)
    check_minimal(capsys, tmp_path, engine, f"shardkit._planted.dying:{engine.__name__}", isolation=isolation)


def test_a_budget_sized_chunk_follows_the_engine_it_is_replayed_against() -> None:
    """A "fill the KV budget" chunk is the loaded engine's budget, whatever it is: the same
    MINIMAL is 64 tokens long for the fake and 10 for an engine with a budget of 10."""
    from dataclasses import replace

    from shardkit import FakeShardEngine

    caps = FakeShardEngine().capabilities()
    chunk = prefill("b", tokens=KvTokens(), note="a is evicted")
    assert str(chunk) == "prefill(b, epoch=0, step=0, tokens=[max_kv_tokens of 0])  # a is evicted"
    assert len(chunk.action(caps).args["tokens"]) == caps.max_kv_tokens
    assert len(chunk.action(replace(caps, max_kv_tokens=10)).args["tokens"]) == 10
    half = prefill("a", tokens=KvTokens(1, 2, extra=1))
    assert str(half) == "prefill(a, epoch=0, step=0, tokens=[max_kv_tokens//2 + 1 of 0])"
    assert len(half.action(replace(caps, max_kv_tokens=10)).args["tokens"]) == 6
    with pytest.raises(ValueError, match="outside this engine's vocab_size 3"):
        prefill("a", tokens=(0, 3)).action(replace(caps, vocab_size=3))


def test_the_check_refuses_a_sequence_with_a_step_too_many_or_one_that_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check itself can fail: a step that changes nothing, or a sequence that misses the bug."""
    from shardkit._planted import StaleEpochAccepted as engine

    target = f"shardkit._planted:{engine.__name__}"
    padded = (prefill("z", note="unrelated"), *engine.MINIMAL)
    with pytest.raises(AssertionError, match=r"not 1-minimal: without step 1 \(prefill\): §2 rule 4"):
        check_minimal(capsys, tmp_path, engine, target, steps=padded)
    with pytest.raises(AssertionError, match="passed the replay"):
        check_minimal(capsys, tmp_path, engine, target, steps=engine.MINIMAL[:1])


# --- the command line ---------------------------------------------------------------------------


def test_shardkit_replay_on_the_command_line_fails_a_minimal_and_passes_it_cut(tmp_path: Path, repo_root: Path) -> None:
    """The same check through ``python -m shardkit replay`` in a subprocess, for one engine."""
    from shardkit._planted import CancelledSessionStillServes as engine

    document = minimal_trace(engine, f"shardkit._planted:{engine.__name__}")
    env = {**os.environ, "PYTHONPATH": str(repo_root)}

    def replay(path: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "shardkit", "replay", str(path)]
        return subprocess.run(command, capture_output=True, text=True, cwd=repo_root, env=env, check=False)

    whole = replay(write_trace(tmp_path / "whole.json", document))
    assert whole.returncode == 1, whole.stderr
    assert f"FAILURE ({engine.PROPERTY}) in {len(engine.MINIMAL)} steps:" in whole.stdout
    for index in range(len(engine.MINIMAL)):
        cut = replay(write_trace(tmp_path / f"cut-{index}.json", without_step(document, index)))
        assert cut.returncode == 0, cut.stdout + cut.stderr
        left = len(engine.MINIMAL) - 1
        assert f"did not reproduce: all {left} step{'' if left == 1 else 's'} matched the model" in cut.stdout


# --- traces written by fuzz runs ----------------------------------------------------------------


@pytest.mark.parametrize("engine", PLANTED, ids=lambda engine: engine.__name__)
def test_each_fuzz_trace_of_a_planted_engine_is_one_minimal_when_edited_and_replayed(
    engine: type[PlantedEngine],
    planted_runs: Mapping[type[PlantedEngine], FuzzResult],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The trace the run left (``--out``) replays to its failure; cut one step, and it passes."""
    result = planted_runs[engine]
    assert result.trace_path is not None, f"{engine.__name__}: the run left no trace"
    document = json.loads(result.trace_path.read_text(encoding="utf-8"))
    failed, length = replay_file(capsys, result.trace_path)
    assert failed == document["failure"]["property"], failed
    assert length == len(document["steps"])
    assert_one_minimal(capsys, document, tmp_path, engine.__name__)
