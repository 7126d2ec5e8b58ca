"""Shared fixtures: the planted-bug engines fuzzed once per session, their artefacts on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from tests.planted import PLANTED, PlantedEngine

pytest_plugins = ["pytester"]

PLANTED_SEED = 3


@pytest.fixture(scope="session")
def planted_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[type[PlantedEngine], FuzzResult]:
    """Each planted engine fuzzed with ``--seed 3`` (CI-sized), traces under a temporary folder."""
    runs = {}
    for engine in PLANTED:
        out = tmp_path_factory.mktemp(engine.__name__)
        runs[engine] = fuzz(
            f"tests.planted:{engine.__name__}", seed=PLANTED_SEED, examples=200, steps=50, role=engine.ROLE, out=out
        )
    return runs


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
