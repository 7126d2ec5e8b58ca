"""The planted section: each planted-bug engine fuzzed at several seeds, found or not, how
fast, and how short its failure was shrunk (against the bug's minimum)."""

from __future__ import annotations

import importlib
import time
from typing import Any

from shardkit._bench.settings import BenchSettings
from shardkit._core.conformance import assert_shard_engine_contract
from shardkit._machine.observer import FailureReport
from shardkit._run.runner import fuzz
from shardkit.errors import ContractViolation

__all__ = ["failure_length", "measure_planted", "planted_seeds", "rounded"]


def measure_planted(config: BenchSettings) -> list[dict[str, Any]] | str:
    if config.planted_module is None:
        return "skipped (--planted none)"
    try:
        module = importlib.import_module(config.planted_module)
    except ImportError as error:
        return f"skipped: cannot import {config.planted_module!r} ({error})"
    rows = []
    for engine in module.PLANTED[: config.planted_engines]:
        try:
            assert_shard_engine_contract(getattr(module, engine.__name__))
            caught_by_contract = False
        except ContractViolation:
            caught_by_contract = True
        runs = [_planted_run(config, module, engine, seed) for seed in planted_seeds(config)]
        found = [run for run in runs if run["found"]]
        rows.append(
            {
                "engine": engine.__name__,
                "bug": engine.BUG,
                "minimal_length": len(engine.MINIMAL),
                "late": bool(getattr(engine, "LATE", False)),
                "found_at_seeds": len(found),
                "at_minimum_at_seeds": sum(run["shrunk_length"] == run["minimum"] for run in found),
                "caught_by_contract": caught_by_contract,
                "runs": runs,
            }
        )
    return rows


def planted_seeds(config: BenchSettings) -> range:
    return range(config.seed, config.seed + config.planted_seeds)


def _planted_run(config: BenchSettings, module: Any, engine: Any, seed: int) -> dict[str, Any]:
    """One planted engine fuzzed at one seed: found, how fast, how short."""
    started = time.perf_counter()
    result = fuzz(
        f"{config.planted_module}:{engine.__name__}",
        seed=seed,
        examples=config.examples,
        steps=config.steps,
        role=engine.ROLE,
        # The faults the engine names (as the self-tests fuzz it), else every kind.
        faults=getattr(engine, "FAULTS", "all"),
    )
    total = time.perf_counter() - started
    first_examples, first_seconds, walk_length = result.first_failure or (None, None, None)
    found_property = result.failure.violation.property if result.failure is not None else None
    minimum_for = getattr(engine, "minimum_for", None)  # a planted engine of another module may not have it
    return {
        "seed": seed,
        # The minimum of the property the bug showed through (a few show through two, at two lengths).
        "minimum": minimum_for(found_property) if minimum_for is not None else len(engine.MINIMAL),
        "found": result.failure is not None and module.names_its_property(engine, result.failure.violation.property),
        "property": found_property,
        "examples_to_first_failure": first_examples,
        "seconds_to_first_failure": rounded(first_seconds),
        "random_walk_length": walk_length,
        "shrunk_length": failure_length(result.failure),
        "hypothesis_shrunk_length": failure_length(result.hypothesis_failure),
        "seconds_shrinking": rounded(total - first_seconds) if first_seconds is not None else None,
        # What a user waits for: the run's whole time, to its failure shrunk and minimised.
        "seconds_to_minimal_failure": rounded(total) if first_seconds is not None else None,
    }


def failure_length(failure: FailureReport | None) -> int | None:
    return len(failure.records) if failure is not None else None


def rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None
