"""``shardkit campaign --cluster``: a campaign's rounds as tasks on a real Ray cluster.

The tests run against the cluster ``SHARDKIT_TEST_RAY_ADDRESS`` names: ``.ci/run`` starts a
head and a worker node on 127.0.0.1, each its own ``ray start`` process with one CPU, from a
virtual environment of their own. Without it (or without Ray here) they skip, unless
``SHARDKIT_REQUIRE_RAY=1`` makes that a failure. Each campaign runs as its own process, as a
user runs it, from a project folder outside the package that holds the engine's file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardkit._campaign.seeds import round_seed
from shardkit._cli.main import main
from tests.test_database import shardkit_process

RAY_ADDRESS = os.environ.get("SHARDKIT_TEST_RAY_ADDRESS")
RAY_REQUIRED = os.environ.get("SHARDKIT_REQUIRE_RAY") == "1"
#: Seconds a campaign of these tests may take, joining the cluster included.
CAMPAIGN_TIMEOUT_S = 300
#: A planted bug every round finds and shrinks to one sequence (prefill, release).
ENGINE_FILE = """\
# A project's engine, as a user's file: the planted KV-token leak after release.
from shardkit._planted import ReleaseLeaksKvTokens as Engine
"""
SMALL = ["--examples", "40", "--steps", "20"]


def _missing() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as error:
        return f"Ray cannot be imported ({error}); pip install 'shardkit[ray]'"
    if not RAY_ADDRESS:
        return "no Ray cluster: SHARDKIT_TEST_RAY_ADDRESS is not set (.ci/run starts one)"
    return None


@pytest.fixture
def cluster() -> str:
    """The cluster's address; skipped without one, failed under ``SHARDKIT_REQUIRE_RAY=1``."""
    problem = _missing()
    if problem is not None:
        if RAY_REQUIRED:
            pytest.fail(f"SHARDKIT_REQUIRE_RAY=1, but {problem}", pytrace=False)
        pytest.skip(problem)
    assert RAY_ADDRESS is not None
    return RAY_ADDRESS


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "engine.py").write_text(ENGINE_FILE, encoding="utf-8")
    return folder


def shardkit(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``shardkit ARGV`` run in ``folder``, as a user types it there (no database from the environment)."""
    return shardkit_process(*argv, cwd=folder, timeout=CAMPAIGN_TIMEOUT_S)


def test_a_campaign_on_the_cluster_runs_its_rounds_on_both_nodes_and_merges_them(cluster: str, project: Path) -> None:
    ran = shardkit(project, "campaign", "engine.py:Engine", "--cluster", cluster, "--workers", "2", "--minutes", "0.05",
                   "--seed", "7", *SMALL, "--report", "campaign.json", "--html", "campaign.html")  # fmt: skip
    assert ran.returncode == 1, (ran.stdout, ran.stderr)
    lines = ran.stdout.splitlines()
    assert lines[0] == f"shardkit campaign engine.py:Engine --workers 2 --minutes 0.05 --seed 7 --examples 40 --steps 20 --cluster {cluster}"
    assert lines[1].startswith(f"campaign: 2 workers on the Ray cluster at {cluster} for 0.05 minutes: ")

    document = json.loads((project / "campaign.json").read_text(encoding="utf-8"))
    campaign = document["campaign"]
    assert (campaign["cluster"], campaign["workers"], campaign["errors"], campaign["interrupted"]) == (cluster, 2, [], False)
    # Each node has one CPU and a round asks for one: the two first rounds ran at once, one on each.
    assert len(campaign["rounds_per_node"]) == 2, campaign["rounds_per_node"]
    assert sum(campaign["rounds_per_node"].values()) == campaign["rounds"] == len(campaign["seeds"])
    for entry in campaign["seeds"]:
        assert entry["seed"] == round_seed(7, entry["worker"], entry["round"]), "the same seeds as on one machine"
        assert entry["node"] in campaign["rounds_per_node"]

    [failure] = document["failures"]
    assert failure["property"] == "§2 metrics"
    assert [step["op"] for step in failure["steps"]] == ["prefill", "release"]
    assert {(found["worker"], found["round"]) for found in failure["found_in"]} >= {(1, 1), (2, 1)}
    # The page: each round's node, and the rounds per node.
    page = (project / "campaign.html").read_text(encoding="utf-8")
    nodes_table = page.partition('<table class="nodes">')[2].partition("</table>")[0]
    assert nodes_table.count("<tr>") == 1 + 2, "a header and a row per node"
    assert page.partition('<table class="seeds">')[2].partition("</tr>")[0].endswith("<th>node</th>")

    # The trace and regression test came home, under --out here, and name the engine's file here.
    trace = project / failure["trace"]
    assert trace.parent == project / ".shardkit" / "failures"
    for written in (trace, project / failure["regression_test"]):
        text = written.read_text(encoding="utf-8")
        assert "_ray_pkg_" not in text, f"{written.name} names the node's copy of the folder"
    assert json.loads(trace.read_text(encoding="utf-8"))["target_file"] == str(project / "engine.py")
    assert f"this failure:    {failure['replay_command']}" in ran.stdout
    replayed = shardkit(project, *shlex.split(failure["replay_command"])[1:])
    assert replayed.returncode == 1, (replayed.stdout, replayed.stderr)
    assert "§2 metrics" in replayed.stdout


def test_a_round_found_on_the_cluster_reruns_alone_on_this_machine(cluster: str, project: Path) -> None:
    ran = shardkit(project, "campaign", "engine.py:Engine", "--cluster", cluster, "--workers", "1", "--minutes", "0.01",
                   "--seed", "3", *SMALL, "--report", "campaign.json")  # fmt: skip
    assert ran.returncode == 1, (ran.stdout, ran.stderr)
    [failure] = json.loads((project / "campaign.json").read_text(encoding="utf-8"))["failures"]
    rerun = shlex.split(failure["rerun_command"])
    assert rerun[:5] == ["shardkit", "fuzz", "engine.py:Engine", "--seed", str(round_seed(3, 1, 1))]
    alone = shardkit(project, *rerun[1:], "--report", "alone.json", "--out", "alone")
    assert alone.returncode == 1, (alone.stdout, alone.stderr)
    [again] = json.loads((project / "alone.json").read_text(encoding="utf-8"))["failures"]
    assert (again["property"], again["steps"]) == (failure["property"], failure["steps"])


def test_an_engine_that_cannot_be_imported_on_a_node_is_one_line_naming_the_node(cluster: str, project: Path) -> None:
    # Importable here; on a node, where it runs in the copy Ray made of this folder, it is not.
    (project / "engine.py").write_text(
        "from pathlib import Path\n"
        "if Path.cwd().name.startswith('_ray_pkg_'):\n"
        "    import a_package_the_nodes_lack  # noqa: F401\n" + ENGINE_FILE,
        encoding="utf-8",
    )
    ran = shardkit(project, "campaign", "engine.py:Engine", "--cluster", cluster, "--workers", "1", "--minutes", "0.01", "--seed", "1")
    assert ran.returncode == 2, (ran.stdout, ran.stderr)
    [line] = ran.stderr.splitlines()
    assert line.startswith("shardkit campaign: error: worker 1 round 1 (seed ")
    assert re.search(r"\): on node \S+ \(node [0-9a-f]{8}\): engine target 'engine.py:Engine': importing", line), line
    assert line.endswith("No module named 'a_package_the_nodes_lack'")
    assert "Traceback" not in ran.stdout + ran.stderr


def test_a_failure_saved_by_one_node_is_replayed_first_by_rounds_on_every_node(cluster: str, project: Path) -> None:
    redis_url = os.environ.get("SHARDKIT_TEST_REDIS_URL")
    if not redis_url:
        message = "SHARDKIT_TEST_REDIS_URL is unset: start redis-server and export redis://127.0.0.1:PORT/0 (.ci/run does)"
        if os.environ.get("SHARDKIT_REQUIRE_REDIS") == "1":
            pytest.fail(f"SHARDKIT_REQUIRE_REDIS=1, but {message}", pytrace=False)
        pytest.skip(message)
    # An engine file of its own: a name no other run has saved examples under.
    engine = f"engine_{uuid.uuid4().hex[:12]}.py"
    (project / "engine.py").rename(project / engine)
    finding = ["campaign", f"{engine}:Engine", "--cluster", cluster, "--workers", "1", "--minutes", "0.01", "--seed", "5"]
    found = shardkit(project, *finding, *SMALL, "--database", redis_url, "--report", "found.json")
    assert found.returncode == 1, (found.stdout, found.stderr)
    [finder] = json.loads((project / "found.json").read_text(encoding="utf-8"))["campaign"]["rounds_per_node"]

    # Rounds of one example each, on both nodes: only a failure replayed from the database can be found.
    one_example = ["campaign", f"{engine}:Engine", "--cluster", cluster, "--workers", "2", "--minutes", "0.01",
                   "--seed", "6", "--examples", "1", "--steps", "20"]  # fmt: skip
    control = shardkit(project, *one_example, "--report", "control.json")
    assert control.returncode == 0, (control.stdout, control.stderr)
    replayed = shardkit(project, *one_example, "--database", redis_url, "--report", "replayed.json")
    assert replayed.returncode == 1, (replayed.stdout, replayed.stderr)
    document = json.loads((project / "replayed.json").read_text(encoding="utf-8"))
    nodes = document["campaign"]["rounds_per_node"]
    assert len(nodes) == 2, nodes
    assert set(nodes) - {finder}, "no round ran on a node other than the one that found the failure"
    [failure] = document["failures"]
    assert failure["found_in_rounds"] == document["campaign"]["rounds"], "a round did not replay the saved failure"
    assert [step["op"] for step in failure["steps"]] == ["prefill", "release"]
    assert document["examples"] == document["campaign"]["rounds"], "each round found it in its first example"


def test_a_node_killed_mid_campaign_loses_no_round(cluster: str, project: Path, tmp_path: Path) -> None:
    """A third node joins, runs a round, and is killed in the middle of it: Ray reruns that
    round on a node that is left, from the same seed, and the report has every round."""
    markers = tmp_path / "markers"
    markers.mkdir()
    # A correct engine whose every construction says on which node it ran (the nodes share this disk).
    (project / "engine.py").write_text(
        "from pathlib import Path\n"
        "import ray\n"
        "from shardkit import FakeShardEngine\n"
        "class Engine(FakeShardEngine):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__()\n"
        f"        Path({str(markers)!r}, ray.get_runtime_context().get_node_id()).touch()\n",
        encoding="utf-8",
    )
    before = set(alive_nodes(cluster))
    victim = start_node(cluster)
    try:
        [victim_id] = wait_for(lambda: set(alive_nodes(cluster)) - before, "the third node to join")
        arguments = ["campaign", "engine.py:Engine", "--cluster", cluster, "--workers", "3", "--minutes", "0.01",
                     "--seed", "11", "--examples", "400", "--steps", "50", "--report", "campaign.json"]  # fmt: skip
        running = subprocess.Popen([sys.executable, "-m", "shardkit", *arguments], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: (markers / victim_id).exists(), "a round to start on the third node")
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(timeout=60)
            out, err = running.communicate(timeout=CAMPAIGN_TIMEOUT_S)
        finally:
            running.kill()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)
    assert running.returncode == 0, (out, err)
    campaign = json.loads((project / "campaign.json").read_text(encoding="utf-8"))["campaign"]
    assert campaign["errors"] == []
    assert [(entry["worker"], entry["round"]) for entry in campaign["seeds"]] == [(1, 1), (2, 1), (3, 1)]
    assert not any(victim_id[:8] in node for node in campaign["rounds_per_node"]), "a round on the killed node was kept"
    assert "no failure found in 3 rounds" in out


def alive_nodes(cluster: str) -> list[str]:
    """The ids of the cluster's live nodes, asked by a process of its own."""
    script = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print(' '.join(n['NodeID'] for n in ray.nodes() if n['Alive']))"
    asked = subprocess.run([sys.executable, "-c", script, cluster], capture_output=True, text=True, timeout=120, check=True)
    return asked.stdout.split()


def start_node(cluster: str) -> subprocess.Popen[str]:
    """A worker node with one CPU, as its own ``ray start --block`` in a process group of its own."""
    ray = os.environ.get("SHARDKIT_TEST_RAY_BIN") or str(Path(sys.executable).with_name("ray"))
    command = [ray, "start", "--address", cluster, "--num-cpus", "1", "--object-store-memory", "100000000", "--disable-usage-stats", "--block"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def wait_for(found: Callable[[], Any], what: str, seconds: float = 120) -> Any:
    """``found()`` once it is true (pytest-timeout bounds the test as a whole)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        value = found()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"waited {seconds:g} s for {what}")


# --- what is refused before any cluster is joined (no cluster needed) ----------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--minutes", "1"], "--cluster needs --workers N"),
        (["--workers", "2", "--minutes", "1", "--database", "examples"], "would be a separate folder on each node"),
        (["--workers", "2", "--minutes", "1", "--cluster", "nowhere"], "is no Ray address"),
        (["--workers", "2", "--minutes", "1", "--cluster", "127.0.0.1:1"], "nothing answers there"),
    ],
)
def test_what_cannot_work_on_a_cluster_is_one_line_and_exit_2(
    arguments: list[str], expected: str, project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(project)
    if "--cluster" not in arguments:
        arguments = [*arguments, "--cluster", "127.0.0.1:1"]
    code = main(["campaign", "engine.py:Engine", *arguments])
    err = capsys.readouterr().err
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith("shardkit campaign: "), line
    assert expected in line


def test_an_engine_file_outside_the_shipped_folder_is_refused(
    tmp_path: Path, project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code = main(["campaign", "../project/engine.py:Engine", "--workers", "1", "--minutes", "1", "--cluster", "127.0.0.1:1"])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2
    assert "ships this folder (elsewhere) to the nodes, and ../project/engine.py lies outside it" in line


def test_bench_cluster_refuses_an_option_it_has_no_part_for(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--cluster", "--profile"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == "shardkit bench: --cluster measures only campaigns on Ray, and --profile has no part in it; drop one of the two"


def test_a_node_without_the_redis_client_says_so_before_a_round_with_a_redis_database(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from shardkit import __version__
    from shardkit._campaign.cluster import missing_on_node
    from shardkit._run.options import FuzzOptions

    with_redis = FuzzOptions(database="redis://127.0.0.1:6379/0")
    assert missing_on_node(with_redis, "0.0.0") == f"shardkit {__version__} is installed, but the campaign was started with shardkit 0.0.0; install the same version on every node"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "redis" else real_find_spec(name, *rest))
    assert missing_on_node(with_redis, __version__) == "--database redis://127.0.0.1:6379/0 needs the redis package on every node: pip install 'shardkit[ray,redis]' there"
    assert missing_on_node(FuzzOptions(), __version__) is None


def test_an_engine_file_named_by_its_absolute_path_is_refused_naming_the_relative_one(
    project: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(project)
    code = main(["campaign", f"{project / 'engine.py'}:Engine", "--workers", "1", "--minutes", "1", "--cluster", "127.0.0.1:1"])
    [line] = capsys.readouterr().err.splitlines()
    assert code == 2
    assert line.endswith("does not exist; name the engine's file from this folder: engine.py:Engine"), line
