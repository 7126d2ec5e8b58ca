"""The concurrency section: the fake's throughput by lanes of calls at once, and how soon
and how short each racy planted engine is found with two lanes, and how often it replays."""

from __future__ import annotations

import tempfile
import time
from typing import Any

from shardkit._bench.planted import failure_length, planted_seeds, rounded
from shardkit._bench.settings import BUNDLED_PLANTED, BenchSettings
from shardkit._core.steps import PARALLEL_OP
from shardkit._machine.parallel_rules import MAX_CONCURRENCY
from shardkit._planted.racy import RACY
from shardkit._run.replay import replay
from shardkit._run.runner import fuzz
from shardkit.engines import FakeShardEngine

__all__ = ["measure_concurrency"]


def measure_concurrency(config: BenchSettings) -> dict[str, Any]:
    """Throughput of the fake with lanes of calls at once (faults on), and (with the bundled
    planted engines) how soon each racy planted engine is found with two lanes, how short
    its failure came out, how many lane steps the failing phase kept (against the race's
    ``MINIMUM``) and in how many of ``config.racy_replays`` replays its trace reproduced."""
    throughput = {}
    for lanes in range(1, MAX_CONCURRENCY + 1):
        result = fuzz(
            FakeShardEngine, seed=config.seed, examples=config.examples, steps=config.steps, concurrency=lanes
        )
        throughput[str(lanes)] = {"steps_per_s": round(result.steps / result.elapsed_s, 1), "steps": result.steps}
    racy: list[dict[str, Any]] = []
    # The racy engines are the bundled planted module's: another module (--planted) or
    # none leaves them out, as it leaves out the bundled sequential ones.
    for engine in RACY[: config.planted_engines] if config.planted_module == BUNDLED_PLANTED else ():
        runs = []
        for seed in planted_seeds(config):
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="shardkit-bench-racy-") as folder:
                result = fuzz(
                    f"shardkit._planted.racy:{engine.__name__}",
                    seed=seed,
                    examples=config.examples,
                    steps=config.steps,
                    faults="none",
                    concurrency=2,
                    out=folder,
                )
                seconds = round(time.perf_counter() - started, 1)
                replayed = (
                    replay(result.trace_path, runs=config.racy_replays) if result.trace_path is not None else None
                )
            failure = result.failure
            first_examples, first_seconds, _ = result.first_failure or (None, None, None)
            last = failure.records[-1].action if failure is not None else None
            lane_steps = (
                sum(len(lane) for lane in last.args["lanes"]) if last is not None and last.op == PARALLEL_OP else None
            )
            shrunk = failure_length(failure)
            runs.append(
                {
                    "seed": seed,
                    "found": failure is not None and failure.violation.property in engine.PROPERTIES,
                    "property": failure.violation.property if failure is not None else None,
                    "examples_to_first_failure": first_examples,
                    "seconds_to_first_failure": rounded(first_seconds),
                    "shrunk_length": shrunk,
                    "lane_steps": lane_steps,
                    "at_minimum": (shrunk, lane_steps) == engine.MINIMUM,
                    "replay_reproductions": replayed.reproductions if replayed is not None else None,
                    "replay_runs": replayed.runs if replayed is not None else None,
                    "seconds": seconds,
                }
            )
        racy.append({"engine": engine.__name__, "race": engine.RACE, "runs": runs})
    return {"steps_per_s_by_lanes": throughput, "racy": racy, "racy_replays": config.racy_replays}
