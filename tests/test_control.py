"""The control suite: the kit never cries wolf on the engines it ships.

Every bundled engine is fuzzed in every role it serves, in two variants, over 10 seeds:

- **native**: as shipped, faults injected through its own ``inject_fault``;
- **boundary**: wrapped so that it advertises no ``supported_faults``, so the kit injects
  ``delay``, ``malformed_output`` and ``crash`` at its boundary (``memory_pressure`` needs
  the engine's own accounting and is not injected at all in this variant); and, for the
  fake, with ``malformed_output`` as the only fault, where most injections reach an output
  (the size at which the kit's old false alarm on a retried corrupted step shows up).

These engines are correct, so any failure is a false alarm of the kit (or a real bug of a
bundled engine): either way it must be fixed, never waived. An injected fault the kit
misses surfaces as ``KitBug``, an error of this test.

The default run is CI-sized (about a minute on two cores). ``SHARDKIT_NIGHTLY=1`` runs
the nightly sweep (about 25 minutes): 30 seeds, each run 4-12 times longer, and the
pipeline differentially against a single engine. llama.cpp is fuzzed where it is
installed; under ``SHARDKIT_REQUIRE_LLAMA=1`` (CI) a missing build fails instead of skipping.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from shardkit import DelegatingEngine, FakeShardEngine, NumpyShardEngine, PipelineEngine
from shardkit._run.runner import fuzz
from shardkit.contract import EngineCapabilities, ShardEngine

NIGHTLY = os.environ.get("SHARDKIT_NIGHTLY") == "1"
REQUIRE_LLAMA = os.environ.get("SHARDKIT_REQUIRE_LLAMA") == "1"
SEEDS = range(30) if NIGHTLY else range(10)
LLAMA = "shardkit.engines.llama_cpp:LlamaCppShardEngine"

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA = True
except ImportError:
    if REQUIRE_LLAMA:
        raise
    HAVE_LLAMA = False


class BoundaryOnly(DelegatingEngine[ShardEngine]):
    """Any engine, advertising no native fault: the kit injects faults at its boundary.

    Deliberately not ``FaultInjectable``: ``DelegatingEngine`` forwards contract v1 only."""

    def capabilities(self) -> EngineCapabilities:
        return replace(self.inner.capabilities(), supported_faults=frozenset())


# Module-level factories, so a failure's rerun line names an importable target.
def fake_at_the_boundary() -> ShardEngine:
    return BoundaryOnly(FakeShardEngine())


def numpy_at_the_boundary() -> ShardEngine:
    return BoundaryOnly(NumpyShardEngine())


numpy_pipeline = PipelineEngine.factory(NumpyShardEngine, cuts=(1, 2))


def llama_at_the_boundary() -> ShardEngine:
    from shardkit.engines.llama_cpp import LlamaCppShardEngine

    return BoundaryOnly(LlamaCppShardEngine())


@dataclass(frozen=True)
class Size:
    """One seed's run: ``examples`` × up to ``steps`` steps."""

    examples: int
    steps: int


#: The fake runs ~1 000 steps/s; the numpy-based engines and llama.cpp are 3-5 times slower.
FAST, SLOW = (Size(50, 60), Size(20, 50)) if NIGHTLY else (Size(8, 30), Size(3, 25))
#: malformed_output alone: at this size the kit, before retries of corrupted steps were fixed, cried wolf at 2 of 10 seeds.
MALFORMED = Size(100, 50) if NIGHTLY else Size(25, 50)


@dataclass(frozen=True)
class Case:
    engine: str
    variant: str  # "native", "boundary", or "malformed" (at the boundary, the only fault)
    role: str
    target: str | Callable[[], ShardEngine]
    size: Size
    reference: str | Callable[[], ShardEngine] | None = None
    faults: str = "all"
    llama: bool = False
    #: Lanes of calls at the same time (``--concurrency``; 1: none).
    concurrency: int = 1

    @property
    def id(self) -> str:
        lanes = f"-{self.concurrency}-lanes" if self.concurrency > 1 else ""
        return f"{self.engine}-{self.variant}-{self.role}{lanes}"


ROLES = ("full", "head", "middle", "tail")
CASES = [
    *(Case("fake", "native", role, FakeShardEngine, FAST) for role in ROLES),
    *(Case("fake", "boundary", role, fake_at_the_boundary, FAST) for role in ROLES),
    # With malformed_output the only fault, ~3 times as many injections reach an OK output.
    Case("fake", "malformed", "full", fake_at_the_boundary, MALFORMED, faults="malformed_output"),
    *(Case("numpy", "native", role, NumpyShardEngine, SLOW) for role in ROLES),
    *(Case("numpy", "boundary", role, numpy_at_the_boundary, SLOW) for role in ROLES),
    # The pipeline lists no native fault: as shipped, every fault is already injected at its boundary.
    Case("pipeline", "boundary", "full", numpy_pipeline, SLOW),
    Case("llama", "native", "full", LLAMA, SLOW, llama=True),
    Case("llama", "boundary", "full", llama_at_the_boundary, SLOW, llama=True),
    # Every bundled engine declares concurrent_calls: lanes of calls at once must not flag one.
    Case("fake", "native", "full", FakeShardEngine, FAST, concurrency=2),
    Case("fake", "native", "middle", FakeShardEngine, FAST, concurrency=3),
    Case("numpy", "native", "full", NumpyShardEngine, SLOW, concurrency=2),
    Case("numpy", "native", "tail", NumpyShardEngine, SLOW, concurrency=3),
    # A phase that passes runs three times, each on a fresh pipeline (two engines) replaying the example.
    Case("pipeline", "boundary", "full", numpy_pipeline, Size(2, SLOW.steps), concurrency=2),
    Case("llama", "native", "full", LLAMA, SLOW, llama=True, concurrency=2),
]
if NIGHTLY:
    CASES.append(Case("pipeline-vs-numpy", "boundary", "full", numpy_pipeline, SLOW, reference=NumpyShardEngine))


def sweep(case: Case, seeds: range, out: Path, *, stop_at_first: bool = False) -> list[str]:
    """Fuzz ``case`` at every seed; one line per failure (empty: no false alarm)."""
    failures = []
    for seed in seeds:
        result = fuzz(
            case.target,
            seed=seed,
            examples=case.size.examples,
            steps=case.size.steps,
            role=case.role,
            reference=case.reference,
            faults=case.faults,
            concurrency=case.concurrency,
            out=out,
            minimize=not stop_at_first,
        )
        assert result.examples >= 1
        if result.failure is not None:
            failures.append(
                f"{case.id} seed {seed}: {result.failure.violation.property}\n{result.failure.violation.message}"
            )
            if stop_at_first:
                break
    return failures


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_no_false_alarm_on_a_bundled_engine(case: Case, tmp_path: Path) -> None:
    if case.llama and not HAVE_LLAMA:
        pytest.skip("llama.cpp is not installed: pip install 'shardkit[llama]'")
    failures = sweep(case, SEEDS, tmp_path)
    sizes = f"{len(SEEDS)} seeds × {case.size.examples} examples × {case.size.steps} steps"
    assert not failures, f"false alarm(s) on a correct engine ({sizes}):\n" + "\n\n".join(failures)


def test_the_sweep_reports_a_bug_of_an_engine(tmp_path: Path) -> None:
    """The control suite can fail: the same sweep, at the same size, on a planted bug."""
    from tests.planted import ReleaseLeaksKvTokens

    case = Case("planted", "boundary", "full", lambda: BoundaryOnly(ReleaseLeaksKvTokens()), FAST)
    failures = sweep(case, SEEDS, tmp_path, stop_at_first=True)
    assert failures
    assert "§2 metrics" in failures[0]
