"""What a bench run measures with: its sizes, its sections, and ``--quick``'s sizes."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit._machine.profiles import DEFAULT_EXAMPLES, DEFAULT_STEPS

__all__ = [
    "BENCH_PLANTED_SEEDS",
    "BUNDLED_PLANTED",
    "NOT_MEASURED",
    "QUICK",
    "RACY_REPLAY_RUNS",
    "SECTIONS",
    "BenchSettings",
]

#: Seeds at which ``shardkit bench`` fuzzes each planted engine (a found-at-one-seed is luck).
BENCH_PLANTED_SEEDS = 5

BUNDLED_PLANTED = "shardkit._planted"
#: Replays of each racy engine's trace: a race reproduces on some runs only, so the rate is the figure.
RACY_REPLAY_RUNS = 20

#: The sections of a bench run, in the order they are measured (``run_bench``'s ``sections``).
SECTIONS = (
    "throughput",
    "profile",
    "engines",
    "out_of_process",
    "planted",
    "concurrency",
    "memory",
    "scale_out",
    "native_threads",
    "numerics",
)
#: What a section left out by ``run_bench(..., sections=...)`` reports instead of its figures.
NOT_MEASURED = "not measured in this run"


@dataclass(frozen=True)
class BenchSettings:
    examples: int = DEFAULT_EXAMPLES
    steps: int = DEFAULT_STEPS
    seed: int = 1
    #: The planted-bug engines ship with the package (private), so bench runs from an installed wheel.
    planted_module: str | None = BUNDLED_PLANTED
    #: Example counts at which to measure a fuzz run's peak RSS, each in a fresh process of
    #: ``memory_steps`` steps an example (``--memory``: 300 and 3,000 of 100 steps, minutes).
    memory_examples: tuple[int, ...] = (DEFAULT_EXAMPLES, 5 * DEFAULT_EXAMPLES)
    memory_steps: int = DEFAULT_STEPS
    #: How many seeds each planted engine is fuzzed at (``seed``, ``seed + 1``, …): a bug found
    #: at one chosen seed says little about the next run.
    planted_seeds: int = BENCH_PLANTED_SEEDS
    #: Rounds of the throughput and out-of-process sections: each round runs every side of a
    #: comparison once, in an order that turns each round, and the figure is the median round's.
    rounds: int = 3
    #: Replays of each racy engine's trace (a race reproduces on some runs only).
    racy_replays: int = RACY_REPLAY_RUNS
    #: Profile one kit run per role (``--profile``): where a step's time goes, by component.
    profile: bool = False
    #: At most this many planted engines of the module, and of the racy ones (None: all of them).
    planted_engines: int | None = None
    #: Rounds of the scale-out section, each one ``pytest -n 0`` and one ``pytest -n N`` run.
    scale_out_rounds: int = 3
    #: How many of ``SCALE_OUT_SUITES`` the scale-out section runs, the first ones (None: all).
    scale_out_suites: int | None = None
    #: The N of ``pytest -n N`` that the scale-out section sets against one process.
    scale_out_workers: int = 2
    #: The native-threads section's prefill: this many tokens through the numpy engine, with a
    #: BLAS thread per core and with one, ``rounds`` rounds interleaved, idle and with the other cores busy.
    native_prefill_tokens: int = 256
    #: The numerics section: this many histories of ``numerics_tokens`` tokens per model and
    #: format, each prefilled whole and token by token.
    numerics_histories: int = 20
    numerics_tokens: int = 96


#: ``shardkit bench --quick``: every section at sizes that run in well under a minute, to check
#: in CI that the bench runs. Its figures say nothing about speed.
QUICK = BenchSettings(
    examples=10,
    steps=10,
    planted_seeds=1,
    rounds=2,
    racy_replays=2,
    planted_engines=3,
    memory_examples=(10, 50),
    memory_steps=10,
    scale_out_rounds=1,
    scale_out_suites=4,
    native_prefill_tokens=32,
    numerics_histories=1,
    numerics_tokens=8,
)
