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
from shardkit.contract import (
    DecodeRequest,
    EngineCapabilities,
    Fault,
    HealthResult,
    LoadRequest,
    LoadResult,
    MetricsResult,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)
from shardkit.engines.fake import FakeShardEngine

__all__ = ["OUT_OF_PROCESS_MODES", "measure_out_of_process"]


#: The modes of the out-of-process section, the first the one the others are compared with.
#: "grpc, unary" is a server without the ``Calls`` stream (an older one): one RPC a call.
OUT_OF_PROCESS_MODES = ("in-process", "grpc", "grpc, unary", "isolated")


def measure_out_of_process(config: BenchSettings) -> dict[str, Any] | str:
    """The fake fuzzed in-process, over gRPC to a ``shardkit serve`` process (over its ``Calls``
    stream, and RPC by RPC as to an older server), and isolated (``--isolate``): the same seed,
    so the same steps, at different costs. With faults and
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
        trips: dict[str, list[int]] = {mode: [] for mode in OUT_OF_PROCESS_MODES}
        calls: dict[str, list[int]] = {mode: [] for mode in OUT_OF_PROCESS_MODES}
        run = partial(_fuzz_out_of_process, config, faults, workers, trips, calls)
        timed = timing.interleaved(
            {mode: partial(timing.timed, partial(run, mode)) for mode in OUT_OF_PROCESS_MODES}, config.rounds
        )
        # In process there is no round trip: the calls the engines answered (the engine under
        # test's and the twins'), which a run out of process would send, are counted in a run
        # of their own, outside the timed rounds.
        in_process_calls, counted_steps = _engine_calls(config, faults)
        base = timed[OUT_OF_PROCESS_MODES[0]]
        for mode, runs in timed.items():
            row: dict[str, Any] = {"steps": runs[0].steps, "steps_per_s_by_round": [round(one.rate, 1) for one in runs]}
            if mode == OUT_OF_PROCESS_MODES[0]:
                row["steps_per_s"] = round(runs[timing.median_round(runs, lambda one: one.rate)].rate, 1)
                # The same seed: the counted run took the timed runs' steps (``engine_calls_steps``).
                row["engine_calls_per_step"] = _per_step(in_process_calls, counted_steps)
                row["engine_calls_steps"] = counted_steps
                row["round_trips_per_step"] = 0.0
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
                    # Every round runs the same steps; the median round's calls.
                    "round_trips_per_step": _per_step(trips[mode][middle], runs[middle].steps),
                    "calls_per_step": _per_step(calls[mode][middle], runs[middle].steps),
                    "round_trips_per_step_by_round": [
                        _per_step(count, one.steps) for count, one in zip(trips[mode], runs, strict=True)
                    ],
                }
            if mode == "isolated":
                row["workers_started"] = round(statistics.median(workers))
            rows[f"{mode}, faults {faults}"] = row
    return rows


def _fuzz_out_of_process(
    config: BenchSettings,
    faults: str,
    workers: list[int],
    trips: dict[str, list[int]],
    calls: dict[str, list[int]],
    mode: str,
) -> int:
    """One run of the fake in ``mode``; it adds its round trips to ``trips[mode]``, the calls it
    sent to ``calls[mode]``, and an isolated run the workers it started to ``workers``."""
    from shardkit._transport.client import calls_sent, close_connection, round_trips
    from shardkit._transport.isolation import isolated_target

    with contextlib.ExitStack() as stack:
        target: Any = "shardkit:FakeShardEngine"
        if mode.startswith("grpc"):
            target = stack.enter_context(_served_fake(streamed=mode == "grpc"))
            stack.callback(close_connection, target)
        elif mode == "isolated":
            target = isolated_target(target)
            stack.callback(target.isolation.close)
        before, sent_before = round_trips(), calls_sent()
        result = fuzz(target, seed=config.seed, examples=config.examples, steps=config.steps, faults=faults)
        trips[mode].append(round_trips() - before)
        calls[mode].append(calls_sent() - sent_before)
        if mode == "isolated":
            workers.append(target.isolation.workers_started)
        return result.steps


def _per_step(calls: int, steps: int) -> float:
    return round(calls / steps, 2) if steps else 0.0


def _engine_calls(config: BenchSettings, faults: str) -> tuple[int, int]:
    """The calls the engines of an in-process run of the fake answered, every engine the run
    built (the engine under test, its restarts and the twins), and the run's steps: what a
    run out of process sends as round trips, less what the server answers ahead."""
    counter = _CallCounter()
    counted = partial(_CountedEngine, counter)
    result = fuzz(counted, seed=config.seed, examples=config.examples, steps=config.steps, faults=faults)
    return counter.calls, result.steps


class _CallCounter:
    def __init__(self) -> None:
        self.calls = 0


class _CountedEngine(ShardEngine):
    """The fake, its calls counted: in process, each is what a round trip is out of process."""

    def __init__(self, counter: _CallCounter) -> None:
        self._inner = FakeShardEngine()
        self._counter = counter

    def __getattr__(self, name: str) -> Any:  # what the kit asks the fake beyond the contract
        return getattr(self._inner, name)

    def load(self, request: LoadRequest) -> LoadResult:
        self._counter.calls += 1
        return self._inner.load(request)

    def capabilities(self) -> EngineCapabilities:
        self._counter.calls += 1
        return self._inner.capabilities()

    def prefill(self, request: PrefillRequest) -> StepResult:
        self._counter.calls += 1
        return self._inner.prefill(request)

    def decode(self, request: DecodeRequest) -> StepResult:
        self._counter.calls += 1
        return self._inner.decode(request)

    def cancel(self, session_id: str, epoch: int) -> StructuredStatus:
        self._counter.calls += 1
        return self._inner.cancel(session_id, epoch)

    def release(self, session_id: str) -> StructuredStatus:
        self._counter.calls += 1
        return self._inner.release(session_id)

    def health(self) -> HealthResult:
        self._counter.calls += 1
        return self._inner.health()

    def metrics(self) -> MetricsResult:
        self._counter.calls += 1
        return self._inner.metrics()

    def inject_fault(self, fault: Fault) -> StructuredStatus:
        self._counter.calls += 1
        return self._inner.inject_fault(fault)


#: A server for the fake without the optional ``Calls`` stream, as an older one.
_SERVE_UNARY = """
import sys
from shardkit._transport.server import serve
server = serve("shardkit:FakeShardEngine", sys.argv[1], optional_calls=())
print("serving", flush=True)
server.wait()
"""


@contextlib.contextmanager
def _served_fake(*, streamed: bool = True) -> Iterator[str]:
    """A ``shardkit serve`` process for the fake on a Unix socket, stopped afterwards;
    ``streamed=False``: a server without the ``Calls`` stream."""
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-") as folder:
        address = f"unix:{folder}/fake.sock"
        command = [sys.executable, "-m", "shardkit", "serve", "shardkit:FakeShardEngine", "--listen", address]
        if not streamed:
            command = [sys.executable, "-c", _SERVE_UNARY, address]
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as server:
            try:
                assert server.stdout is not None
                server.stdout.readline()  # "serving … on …" once it listens
                yield address
            finally:
                server.kill()
