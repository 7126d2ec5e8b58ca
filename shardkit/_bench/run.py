"""``run_bench``: the sections of a bench run measured in order, each timed, into one report."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from shardkit._bench.concurrency import measure_concurrency
from shardkit._bench.memory import measure_memory
from shardkit._bench.native_threads import measure_native_threads
from shardkit._bench.numerics import measure_numerics
from shardkit._bench.out_of_process import measure_out_of_process
from shardkit._bench.planted import measure_planted
from shardkit._bench.scale_out import measure_scale_out
from shardkit._bench.settings import NOT_MEASURED, SECTIONS, BenchSettings
from shardkit._bench.throughput import measure_engines, measure_profile, measure_throughput

__all__ = ["run_bench"]


def run_bench(config: BenchSettings, *, sections: Collection[str] = SECTIONS) -> dict[str, Any]:
    """Measure each of ``sections`` (all of them by default, as ``shardkit bench`` always does).

    A section left out reports ``NOT_MEASURED`` in place of its figures (the throughput
    section's top-level figures are then ``None``), and ``render`` prints it so. This is for
    callers that need one section's figures without minutes of the others, such as the CLI
    tests of the planted table; the command itself has no option for it.
    """
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; the sections are {', '.join(SECTIONS)}")
    started = time.perf_counter()

    section_seconds: dict[str, float] = {}

    def measured(name: str, measure: Callable[[BenchSettings], Any]) -> Any:
        if name not in sections:
            return NOT_MEASURED
        section_started = time.perf_counter()
        figures = measure(config)
        section_seconds[name] = round(time.perf_counter() - section_started, 1)
        return figures

    throughput = measured("throughput", measure_throughput)
    profile = measured("profile", measure_profile)
    engines = measured("engines", measure_engines)
    out_of_process = measured("out_of_process", measure_out_of_process)
    planted = measured("planted", measure_planted)
    concurrency = measured("concurrency", measure_concurrency)
    memory = measured("memory", measure_memory)
    scale_out = measured("scale_out", measure_scale_out)
    native_threads = measured("native_threads", measure_native_threads)
    numerics = measured("numerics", measure_numerics)
    headline = ("kit_steps_per_s", "bare_steps_per_s", "throughput_ratio", "long_session_share")
    full = throughput["full"] if isinstance(throughput, dict) else dict.fromkeys(headline)
    return {
        "examples": config.examples,
        "steps": config.steps,
        "seed": config.seed,
        "kit_steps_per_s": full["kit_steps_per_s"],
        "bare_steps_per_s": full["bare_steps_per_s"],
        "throughput_ratio": full["throughput_ratio"],
        "long_session_share": full["long_session_share"],
        "per_role": throughput,
        "profile": profile,
        "engines": engines,
        "out_of_process": out_of_process,
        "planted": planted,
        "concurrency": concurrency,
        "memory": memory,
        "scale_out": scale_out,
        "native_threads": native_threads,
        "numerics": numerics,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "section_seconds": section_seconds,
    }


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere
