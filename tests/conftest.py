"""Shared fixtures: the planted-bug engines fuzzed once per session, their artefacts on disk."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from tests.planted import PLANTED, PlantedEngine

pytest_plugins = ["pytester"]

PLANTED_SEED = 3


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


@pytest.fixture(scope="session")
def planted_runs(tmp_path_factory: pytest.TempPathFactory) -> PlantedRuns:
    """The planted engines' runs, traces under a temporary folder."""
    return PlantedRuns(tmp_path_factory)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
