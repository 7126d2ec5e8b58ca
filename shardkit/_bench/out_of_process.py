"""The out-of-process section: the fake fuzzed in-process, over gRPC and isolated."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import partial
from typing import Any

from shardkit._bench import timing
from shardkit._bench.settings import BenchSettings
from shardkit._run.runner import fuzz

__all__ = ["OUT_OF_PROCESS_MODES", "measure_out_of_process"]


#: The modes of the out-of-process section, the first the one the others are compared with.
OUT_OF_PROCESS_MODES = ("in-process", "grpc", "isolated")


def measure_out_of_process(config: BenchSettings) -> dict[str, Any] | str:
    """The fake fuzzed in-process, over gRPC to a ``shardkit serve`` process, and isolated
    (``--isolate``): the same seed, so the same steps, at different costs. With faults and
    without, the three modes interleaved over ``config.rounds`` rounds. A mode's row is its
    median round: by steps/s in-process, by how much slower than in-process otherwise (with
    the spread of that over the rounds)."""
    try:
        import shardkit._transport.client  # noqa: F401 - the grpc extra, needed by two of the modes
    except ImportError as error:
        return f"skipped: needs the grpc extra ({error})"
    rows: dict[str, Any] = {}
    for faults in ("all", "none"):
        workers: list[int] = []
        run = partial(_fuzz_out_of_process, config, faults, workers)
        timed = timing.interleaved(
            {mode: partial(timing.timed, partial(run, mode)) for mode in OUT_OF_PROCESS_MODES}, config.rounds
        )
        base = timed[OUT_OF_PROCESS_MODES[0]]
        for mode, runs in timed.items():
            row: dict[str, Any] = {"steps": runs[0].steps, "steps_per_s_by_round": [round(one.rate, 1) for one in runs]}
            if mode == OUT_OF_PROCESS_MODES[0]:
                row["steps_per_s"] = round(runs[timing.median_round(runs, lambda one: one.rate)].rate, 1)
            else:
                slowdowns = [alone.rate / one.rate for alone, one in zip(base, runs, strict=True)]
                # The median round by slowdown: the row's steps/s is that round's, so the two agree.
                middle = timing.median_round(slowdowns, float)
                spread = timing.spread(slowdowns)
                row |= {
                    "steps_per_s": round(runs[middle].rate, 1),
                    "slower": round(slowdowns[middle], 3),
                    "slower_min": spread["min"],
                    "slower_max": spread["max"],
                }
            if mode == "isolated":
                row["workers_started"] = round(statistics.median(workers))
            rows[f"{mode}, faults {faults}"] = row
    return rows


def _fuzz_out_of_process(config: BenchSettings, faults: str, workers: list[int], mode: str) -> int:
    """One run of the fake in ``mode``; an isolated run adds the workers it started to ``workers``."""
    from shardkit._transport.client import close_connection
    from shardkit._transport.isolation import isolated_target

    with contextlib.ExitStack() as stack:
        target: Any = "shardkit:FakeShardEngine"
        if mode == "grpc":
            target = stack.enter_context(_served_fake())
            stack.callback(close_connection, target)
        elif mode == "isolated":
            target = isolated_target(target)
            stack.callback(target.isolation.close)
        result = fuzz(target, seed=config.seed, examples=config.examples, steps=config.steps, faults=faults)
        if mode == "isolated":
            workers.append(target.isolation.workers_started)
        return result.steps


@contextlib.contextmanager
def _served_fake() -> Iterator[str]:
    """A ``shardkit serve`` process for the fake on a Unix socket, stopped afterwards."""
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as folder:
        address = f"unix:{folder}/fake.sock"
        command = [sys.executable, "-m", "shardkit", "serve", "shardkit:FakeShardEngine", "--listen", address]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as server:
            try:
                assert server.stdout is not None
                server.stdout.readline()  # "serving … on …" once it listens
                yield address
            finally:
                server.kill()
