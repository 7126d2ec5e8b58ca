"""Shared fixtures: the planted-bug engines fuzzed once per session, their artefacts on disk."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from tests.planted import PLANTED, PlantedEngine

pytest_plugins = ["pytester"]

PLANTED_SEED = 3

# One BLAS thread per process. This runs in pytest's main process before pytest-xdist starts
# its workers, which inherit it (as do the engine workers they start). OpenBLAS otherwise
# starts a thread per core that spins while it waits: a numpy suite took the same time either
# way but burnt 1.8 times the CPU, and so slowed the other worker on a two-core machine.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


class PlantedRuns(Mapping[type[PlantedEngine], FuzzResult]):
    """Each planted engine fuzzed with ``--seed 3`` (CI-sized) when a test first asks for it,
    once per session: a run of one planted test does not pay for the nineteen."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._runs: dict[type[PlantedEngine], FuzzResult] = {}

    def __getitem__(self, engine: type[PlantedEngine]) -> FuzzResult:
        if engine not in PLANTED:
            raise KeyError(engine)
        if engine not in self._runs:
            out = self._tmp_path_factory.mktemp(engine.__name__)
            target = f"tests.planted:{engine.__name__}"
            self._runs[engine] = fuzz(
                target, seed=PLANTED_SEED, examples=200, steps=50, role=engine.ROLE, faults=engine.FAULTS, out=out
            )
        return self._runs[engine]

    def __iter__(self) -> Iterator[type[PlantedEngine]]:
        return iter(PLANTED)

    def __len__(self) -> int:
        return len(PLANTED)


#: The test files that read the session's ``planted_runs``. Fuzzing the planted engines takes
#: minutes, so under ``pytest -n N --dist loadfile`` these files go to one worker, which fuzzes
#: each engine once (given to two workers, both fuzzed all of them).
PLANTED_RUN_FILES = frozenset({"tests/test_machine.py", "tests/test_planted_minimal.py", "tests/test_reproduction.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the files of ``PLANTED_RUN_FILES`` as one unit; any other
    distribution is left to pytest-xdist."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PlantedRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "planted runs" if scope in PLANTED_RUN_FILES else scope

    return PlantedRunsTogether(config, log)


@pytest.fixture(scope="session")
def planted_runs(tmp_path_factory: pytest.TempPathFactory) -> PlantedRuns:
    """The planted engines' runs, traces under a temporary folder."""
    return PlantedRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
