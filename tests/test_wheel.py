"""``shardkit bench`` from an installed wheel (issue 12 §8): no ``tests.planted`` to lean on,
and no "Exception ignored in LlamaCppShardEngine.__del__" without the ``llama`` extra.

The wheel is built from a copy of the sources (nothing lands in the repository), installed
without dependencies into a fresh virtual environment (no ``grpc``, no ``llama``), which
borrows only ``hypothesis``, ``numpy`` and ``ml_dtypes`` (and what they import) from this environment, and
runs from an empty folder so that neither the repository nor its ``tests`` is importable.
Building the wheel needs setuptools, which pip fetches as CI's own install does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Top-level names of the runtime dependencies (and theirs) the fresh environment borrows.
BORROWED = ("hypothesis", "_hypothesis_", "sortedcontainers", "numpy", "ml_dtypes")


def _run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, f"{command}\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}"
    return completed


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh environment holding shardkit installed from its wheel."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    ignored = shutil.ignore_patterns(
        ".git", ".venv", ".shardkit", "__pycache__", "*.egg-info", "build", "dist", "tests"
    )
    shutil.copytree(REPO_ROOT, source, ignore=ignored)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(work / "dist"), "./source"],
        work,
    )
    (wheel,) = (work / "dist").glob("shardkit-*.whl")
    environment = work / "env"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], work)
    borrowed = work / "borrowed"
    borrowed.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if entry.name.startswith(BORROWED):
            (borrowed / entry.name).symlink_to(entry)
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work).stdout.strip()
    (Path(site) / "borrowed-dependencies.pth").write_text(f"{borrowed}\n")
    return environment / "bin"


def test_bench_runs_from_an_installed_wheel_with_every_planted_engine_and_no_noise(
    installed: Path, tmp_path: Path
) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    arguments = ["bench", "--json", "--examples", "5", "--steps", "5", "--planted-seeds", "1", "--rounds", "1"]
    run = _run([str(installed / "shardkit"), *arguments], tmp_path, env)
    assert "Exception ignored" not in run.stderr, run.stderr
    assert run.stderr == "", run.stderr
    figures = json.loads(run.stdout)
    assert isinstance(figures["planted"], list), figures["planted"]  # not "skipped: cannot import …"
    from shardkit._planted import PLANTED

    assert [row["engine"] for row in figures["planted"]] == [engine.__name__ for engine in PLANTED]
    assert str(figures["engines"]["llama.cpp"]).startswith("skipped")  # no llama extra here
    assert str(figures["out_of_process"]).startswith("skipped")  # no grpc extra here
    where = _run([str(installed / "python"), "-c", "import shardkit; print(shardkit.__file__)"], tmp_path, env)
    assert where.stdout.startswith(str(installed.parent)), where.stdout  # the installed package, not the repository
