"""The memory section: the peak RSS of a fuzz run at two sizes, each in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardkit._bench.settings import BenchSettings

__all__ = ["measure_memory"]


_MEMORY_PROBE = """
import sys
from shardkit import FakeShardEngine
from shardkit._run.runner import fuzz

fuzz(FakeShardEngine, seed=int(sys.argv[1]), examples=int(sys.argv[2]), steps=int(sys.argv[3]))
with open("/proc/self/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
"""


def measure_memory(config: BenchSettings) -> dict[str, Any] | str:
    """Peak RSS of ``shardkit fuzz`` on the fake at each of ``config.memory_examples`` (of
    ``config.memory_steps`` steps), each in a process of its own: the kit runs long campaigns
    as a series of bounded Hypothesis runs, so the peak must not grow with the examples."""
    if len(config.memory_examples) < 2:
        return f"not measured: two sizes are needed to compare, got {list(config.memory_examples)}"
    if not Path("/proc/self/status").exists():
        return "not measured: needs /proc (Linux)"
    peaks: dict[str, Any] = {}
    for examples in config.memory_examples:
        started = time.perf_counter()
        finished = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, str(config.seed), str(examples), str(config.memory_steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[str(examples)] = {
            "peak_rss_mb": round(int(finished.stdout.split()[-1]) / 1024, 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
    sizes = [peaks[str(examples)]["peak_rss_mb"] for examples in config.memory_examples]
    peaks["steps"] = config.memory_steps
    peaks["ratio_largest_to_smallest"] = round(max(sizes[-1], 1e-9) / max(sizes[0], 1e-9), 2)
    return peaks
