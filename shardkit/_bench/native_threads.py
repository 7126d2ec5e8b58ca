"""The native-threads section: a long prefill of the numpy engine with its BLAS pool at a
thread per core and pinned to one, on the machine as found and with the other cores busy."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from typing import Any

import numpy as np

from shardkit._bench import timing
from shardkit._bench.settings import BenchSettings
from shardkit._core.checks import max_abs_difference
from shardkit.contract import LoadRequest, PrefillRequest, TokenOutput

__all__ = ["NATIVE_CONDITIONS", "NATIVE_PREFILLS_PER_RUN", "measure_native_threads"]


#: Prefills in one run of a side of the native-threads comparison (a run is timed whole).
NATIVE_PREFILLS_PER_RUN = 2
#: The native-threads section's conditions: the machine as the bench found it, then with a
#: spinning process on every core but one (as a two-core CI host runs the other pytest-xdist worker).
NATIVE_CONDITIONS = ("machine as found", "other cores busy")
_SPIN = "while True: pass"


def measure_native_threads(config: BenchSettings) -> dict[str, Any] | str:
    """A long prefill of the numpy engine (a head shard: every row's residual is its answer)
    with its BLAS pool at a thread per core, as OpenBLAS starts when no variable says
    otherwise, and pinned to one (``shardkit/_core/native_threads.py``), the two interleaved
    over ``config.rounds`` rounds; once on the machine as it is and once with the bench's own
    spinning processes on every core but one. A condition's row is its median round by how
    much slower the unpinned side was, with the spread; CPU time counts every thread. Both
    sides' outputs are compared: a BLAS may sum in another order with another number of
    threads (OpenBLAS does on some processors), so the last bits may move, but never by more
    than the engine's declared tolerance."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError as error:
        return f"not measured: needs threadpoolctl ({error})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2:
        return "not measured: one core, so a native pool has one thread pinned or not"
    from shardkit.engines import NumpyShardEngine

    engine = NumpyShardEngine()
    total = engine.capabilities().total_layers
    engine.load(LoadRequest("bench", 0, total - 2, total))
    tokens = tuple((7 * index) % 256 for index in range(config.native_prefill_tokens))
    epochs = iter(range(1_000_000))
    outputs: dict[int, list[np.ndarray[Any, Any]]] = {cores: [], 1: []}

    def prefills(threads: int) -> int:
        with threadpool_limits(limits=threads):
            for _ in range(NATIVE_PREFILLS_PER_RUN):
                result = engine.prefill(PrefillRequest("s", next(epochs), 0, token_ids=tokens))
                if not result.status.ok or result.output is None or isinstance(result.output, TokenOutput):
                    message = f"the numpy engine refused a benchmark prefill: {result.status.code.name} {result.status.message}"
                    raise RuntimeError(message)
                outputs[threads].append(np.concatenate([tensor.to_array().ravel() for tensor in result.output.tensors]))
        return NATIVE_PREFILLS_PER_RUN

    prefills(cores)  # warm up: the pool's threads started, the weights in cache
    pools = threadpool_info()
    conditions: dict[str, Any] = {}
    for condition in NATIVE_CONDITIONS:
        # The load before the bench's own spinners start: "as found" may be busy already.
        load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        spinners = [] if condition == NATIVE_CONDITIONS[0] else [_spinner() for _ in range(cores - 1)]
        try:
            timed = timing.interleaved(
                {
                    "default": partial(timing.timed, partial(prefills, cores)),
                    "pinned": partial(timing.timed, partial(prefills, 1)),
                },
                config.rounds,
            )
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        default, pinned = timed["default"], timed["pinned"]
        slower = [alone.wall_s / one.wall_s for alone, one in zip(default, pinned, strict=True)]
        middle = timing.median_round(slower, float)
        spread = timing.spread(slower)
        conditions[condition] = {
            "busy_processes": len(spinners),
            "load_average_before": load,
            "default_ms": round(default[middle].wall_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2),
            "pinned_ms": round(pinned[middle].wall_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2),
            "default_cpu_ms": round(default[middle].cpu_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2),
            "pinned_cpu_ms": round(pinned[middle].cpu_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2),
            "slower": round(slower[middle], 3),
            "slower_min": spread["min"],
            "slower_max": spread["max"],
            "default_ms_by_round": [round(one.wall_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2) for one in default],
            "pinned_ms_by_round": [round(one.wall_s / NATIVE_PREFILLS_PER_RUN * 1e3, 2) for one in pinned],
        }
    reference = outputs[1][0]
    max_difference = max(max_abs_difference(reference, answer) for answer in outputs[cores] + outputs[1])
    return {
        "target": "shardkit:NumpyShardEngine",
        "layers": f"0-{total - 2} of {total} (head)",
        "prefill_tokens": len(tokens),
        "prefills_per_run": NATIVE_PREFILLS_PER_RUN,
        "rounds": config.rounds,
        "cores": cores,
        "default_threads": cores,
        "pools": [
            f"{pool['internal_api']} {pool.get('version') or ''} ({pool.get('threading_layer', '?')})" for pool in pools
        ],
        # How far any answer, unpinned or pinned, lies from the first pinned one: 0.0 where the
        # BLAS sums in the same order at any thread count, a few ulps where it does not.
        "max_difference": max_difference,
        "tolerance": engine.TOLERANCE,
        "within_tolerance": max_difference <= engine.TOLERANCE,
        "conditions": conditions,
    }


def _spinner() -> subprocess.Popen[bytes]:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
