"""``shardkit bench``: throughput, time-to-find and shrink quality, measured side by side.

Ratios are taken within one process and one run, so a noisy shared machine
shifts both sides alike. Nothing here asserts a speed: it prints figures.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from shardkit._cli.parser import BENCH_PLANTED_SEEDS
from shardkit._core.checks import max_abs_difference
from shardkit._core.conformance import assert_shard_engine_contract
from shardkit._core.steps import PARALLEL_OP
from shardkit._machine.build import build_machine
from shardkit._machine.parallel_rules import MAX_CONCURRENCY
from shardkit._machine.profiles import DEFAULT_EXAMPLES, DEFAULT_STEPS
from shardkit._machine.state_machine import FailureReport, ShardMachine
from shardkit._planted.racy import RACY
from shardkit._run.replay import replay
from shardkit._run.report import LONG_SESSION_DECODES, long_session_share, session_histogram
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit._transport.resolve import resolve_target
from shardkit.contract import ROLES, DecodeRequest, LoadRequest, PrefillRequest, TokenOutput
from shardkit.engines import FakeShardEngine
from shardkit.errors import ContractViolation, InvalidTarget

__all__ = [
    "NOT_MEASURED",
    "SECTIONS",
    "BenchSettings",
    "bare_machine_like",
    "bare_steps",
    "render",
    "run_bench",
]


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
)


@dataclass(frozen=True)
class _Timed:
    """One run of a comparison: the steps it took, its wall time and its CPU time."""

    steps: int
    wall_s: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.steps / self.wall_s


_Run = TypeVar("_Run")


def _timed(run: Callable[[], int]) -> _Timed:
    wall, cpu = time.perf_counter(), time.process_time()
    steps = run()
    return _Timed(steps, time.perf_counter() - wall, time.process_time() - cpu)


def _interleaved(runs: dict[str, Callable[[], _Run]], rounds: int) -> dict[str, list[_Run]]:
    """Every one of ``runs`` once a round, the order turned by one each round (A B C, B C A,
    C A B, …): a machine that grows busier or quieter during the bench shifts every side of a
    comparison alike, and no side always runs first. Each run returns its measure."""
    names = list(runs)
    measured: dict[str, list[_Run]] = {name: [] for name in names}
    for round_number in range(rounds):
        turn = round_number % len(names)
        for name in names[turn:] + names[:turn]:
            measured[name].append(runs[name]())
    return measured


def _median_round(rounds: Sequence[_Run], key: Callable[[_Run], float]) -> int:
    """The index of the median round by ``key`` (with an even number, the lower of the two
    middle ones): a row shows that one round's figures, so its rates and ratio agree."""
    order = sorted(range(len(rounds)), key=lambda index: key(rounds[index]))
    return order[(len(order) - 1) // 2]


def _spread(values: list[float]) -> dict[str, float]:
    """The median of ``values``, with the lowest and highest: how far one round may be from it."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def bare_machine_like(machine: type[ShardMachine]) -> type[RuleBasedStateMachine]:
    """A machine of the same shape as ``machine`` — the same rules drawing the same
    strategies — whose rules do nothing but count: what Hypothesis alone costs."""
    shape = machine.setup_state()
    namespace: dict[str, Any] = {"steps": 0}

    def counting(name: str) -> Callable[..., None]:
        def step(self: RuleBasedStateMachine, **arguments: int) -> None:
            type(self).steps += 1  # type: ignore[attr-defined]

        step.__name__ = name
        return step

    for initializer in shape.initializers:
        namespace[initializer.function.__name__] = initialize(**initializer.arguments)(counting("init"))  # type: ignore[no-untyped-call]
    for each in shape.rules:
        namespace[each.function.__name__] = rule(**each.arguments)(counting(each.function.__name__))  # type: ignore[no-untyped-call]
    return type(f"Bare{machine.__name__}", (RuleBasedStateMachine,), namespace)


def bare_steps(machine: type[ShardMachine], examples: int, steps: int, seed: int) -> int:
    """Run the bare machine of ``machine`` (``bare_machine_like``) and return the rules it ran.

    It draws exactly what the kit's machine draws at the same seed and sizes, but a rule is
    not a kit step: a kit step is one engine call or one fault, and one rule may make
    several (a run of decodes). So the kit and the bare machine are compared by time."""
    bare = bare_machine_like(machine)
    run_settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    run_state_machine_as_test(hypothesis_seed(seed)(bare), settings=run_settings)
    counted: int = bare.steps  # type: ignore[attr-defined]
    return counted


def _throughput(config: BenchSettings) -> dict[str, Any]:
    """Each role: the kit and the bare machine interleaved over ``config.rounds`` rounds; the
    ratio of each round, its median and spread, by wall time and by CPU time (a busy machine
    takes wall time from both sides, but rarely alike; CPU time it takes far less)."""
    return {role: _role_throughput(config, role) for role in ROLES}


def _role_throughput(config: BenchSettings, role: str) -> dict[str, Any]:
    runs: list[FuzzResult] = []

    def kit() -> int:
        runs.append(fuzz(FakeShardEngine, seed=config.seed, examples=config.examples, steps=config.steps, role=role))
        return runs[-1].steps

    machine = build_machine(FakeShardEngine, role=role)
    timed = _interleaved(
        {
            "kit": partial(_timed, kit),
            "bare": partial(_timed, lambda: bare_steps(machine, config.examples, config.steps, config.seed)),
        },
        config.rounds,
    )
    # Both draw the same examples: the bare machine's speed in the kit's steps is the kit's
    # steps over the bare machine's time, and the ratio is the bare machine's time over the kit's.
    rounds = [
        {
            "kit_steps_per_s": round(kit_run.rate, 1),
            "bare_steps_per_s": round(kit_run.steps / bare_run.wall_s, 1),
            "ratio": round(bare_run.wall_s / kit_run.wall_s, 3),
            "cpu_ratio": round(bare_run.cpu_s / kit_run.cpu_s, 3),
        }
        for kit_run, bare_run in zip(timed["kit"], timed["bare"], strict=True)
    ]
    ratio = _spread([one["ratio"] for one in rounds])
    middle = rounds[_median_round(rounds, lambda one: float(one["ratio"]))]
    return {
        "kit_steps_per_s": middle["kit_steps_per_s"],
        "bare_steps_per_s": middle["bare_steps_per_s"],
        "throughput_ratio": middle["ratio"],
        "kit_steps": timed["kit"][0].steps,
        "bare_rules": timed["bare"][0].steps,
        "throughput_ratio_min": ratio["min"],
        "throughput_ratio_max": ratio["max"],
        "cpu_ratio": middle["cpu_ratio"],
        "rounds": rounds,
        # How long the sessions got: throughput bought with short sessions only is no gain.
        "long_session_share": round(long_session_share(runs[0]), 4),
        "longest_session_histogram": session_histogram(runs[0]),
    }


#: The kit's components, by where their code lives: a profile's time is summed per component.
PROFILE_COMPONENTS = (
    ("hypothesis/", "Hypothesis (drawing steps, its engine, its bookkeeping)"),
    ("shardkit/engines/", "the engine: the fake's numerics and the lifecycle base (engine under test and twins)"),
    ("shardkit/_core/twins.py", "the twin oracle: feeding twins, composition"),
    ("shardkit/_core/output_checks.py", "the twin oracle: comparing outputs with the twins'"),
    ("shardkit/_core/model.py", "the reference model"),
    ("shardkit/_core/driver.py", "the driver: calls, metrics checks, records"),
    ("shardkit/_core/fault", "faults"),
    ("shardkit/_core/steps.py", "building requests"),
    ("shardkit/_core/checks.py", "output shape checks and the memo"),
    ("shardkit/contract.py", "contract types: building and checking values"),
    ("shardkit/_machine/", "the state machine: rules, coverage, events"),
    ("shardkit/", "the rest of the kit"),
)


def _profile(config: BenchSettings) -> dict[str, Any] | str:
    """One kit run per role under cProfile: the share of its time each component took. Time
    in Python's built-ins and standard library goes to the component that called them. The
    profiler slows code of many small calls more than the rest, so shares are approximate."""
    if not config.profile:
        return "not measured (shardkit bench --profile)"
    import cProfile
    import pstats

    roles: dict[str, Any] = {}
    for role in ROLES:
        profiler = cProfile.Profile()
        profiler.enable()
        fuzz(FakeShardEngine, seed=config.seed, examples=config.examples, steps=config.steps, role=role)
        profiler.disable()
        shares = _component_seconds(pstats.Stats(profiler))
        total = sum(shares.values())
        roles[role] = {
            name: round(seconds / total, 4) for name, seconds in sorted(shares.items(), key=lambda item: -item[1])
        }
    return roles


def _component_seconds(stats: Any) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for (file, _, _), (_, _, own, _, callers) in stats.stats.items():
        component = _component(file)
        if component is not None:
            seconds[component] = seconds.get(component, 0.0) + own
            continue
        # A built-in or the standard library: its time goes to whoever called it.
        for (caller_file, _, _), caller_timing in callers.items():
            owner = _component(caller_file) or "Python's built-ins and standard library"
            seconds[owner] = seconds.get(owner, 0.0) + caller_timing[2]
    return seconds


def _component(file: str) -> str | None:
    path = file.replace(os.sep, "/")
    return next((name for part, name in PROFILE_COMPONENTS if part in path), None)


#: Engines compared on kit throughput and on the cost of one decode step (full role).
ENGINE_TARGETS = (
    ("fake", "shardkit:FakeShardEngine"),
    ("numpy", "shardkit:NumpyShardEngine"),
    ("llama.cpp", "shardkit.engines.llama_cpp:LlamaCppShardEngine"),
)


def _decode_step_microseconds(target: str, decodes: int = 200) -> float:
    """Median wall time of one accepted decode on a loaded engine, after a 16-token prefill."""
    engine = resolve_target(target)()
    total = engine.capabilities().total_layers
    engine.load(LoadRequest("bench", 0, total - 1, total))
    timings: list[float] = []
    epoch = 0
    while len(timings) < decodes:
        engine.prefill(PrefillRequest("s", epoch, 0, token_ids=tuple(range(16))))
        for step in range(1, 33):  # a restart every 32 decodes keeps the session inside max_kv_tokens
            request = DecodeRequest("s", epoch, step, token_ids=(step % 8,))
            started = time.perf_counter()
            result = engine.decode(request)
            timings.append(time.perf_counter() - started)
            if not result.status.ok:
                message = f"{target} refused a benchmark decode: {result.status.code.name} {result.status.message}"
                raise RuntimeError(message)
        epoch += 1
    return round(statistics.median(timings) * 1e6, 1)


def _engines(config: BenchSettings) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, target in ENGINE_TARGETS:
        try:
            resolve_target(target)()
        except (ImportError, InvalidTarget) as missing:
            rows[name] = f"skipped: {missing}"
            continue
        run = fuzz(target, seed=config.seed, examples=config.examples, steps=config.steps, role="full")
        rows[name] = {
            "kit_steps_per_s": round(run.steps / run.elapsed_s, 1),
            "decode_step_us": _decode_step_microseconds(target),
            "failure": run.failure.violation.property if run.failure is not None else None,
            # Long histories are compared too (each by three twin paths): what that costs shows above.
            "longest_session_decodes": max(run.longest_session, default=0),
            "long_session_share": round(long_session_share(run), 4),
        }
    return rows


#: The modes of the out-of-process section, the first the one the others are compared with.
OUT_OF_PROCESS_MODES = ("in-process", "grpc", "isolated")


def _out_of_process(config: BenchSettings) -> dict[str, Any] | str:
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
        timed = _interleaved(
            {mode: partial(_timed, partial(run, mode)) for mode in OUT_OF_PROCESS_MODES}, config.rounds
        )
        base = timed[OUT_OF_PROCESS_MODES[0]]
        for mode, runs in timed.items():
            row: dict[str, Any] = {"steps": runs[0].steps, "steps_per_s_by_round": [round(one.rate, 1) for one in runs]}
            if mode == OUT_OF_PROCESS_MODES[0]:
                row["steps_per_s"] = round(runs[_median_round(runs, lambda one: one.rate)].rate, 1)
            else:
                slowdowns = [alone.rate / one.rate for alone, one in zip(base, runs, strict=True)]
                # The median round by slowdown: the row's steps/s is that round's, so the two agree.
                middle = _median_round(slowdowns, float)
                spread = _spread(slowdowns)
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


def _planted(config: BenchSettings) -> list[dict[str, Any]] | str:
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
        runs = [_planted_run(config, module, engine, seed) for seed in _planted_seeds(config)]
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


def _planted_seeds(config: BenchSettings) -> range:
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
        "seconds_to_first_failure": _rounded(first_seconds),
        "random_walk_length": walk_length,
        "shrunk_length": _length(result.failure),
        "hypothesis_shrunk_length": _length(result.hypothesis_failure),
        "seconds_shrinking": _rounded(total - first_seconds) if first_seconds is not None else None,
    }


def _concurrency(config: BenchSettings) -> dict[str, Any]:
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
        for seed in _planted_seeds(config):
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
            shrunk = _length(failure)
            runs.append(
                {
                    "seed": seed,
                    "found": failure is not None and failure.violation.property in engine.PROPERTIES,
                    "property": failure.violation.property if failure is not None else None,
                    "examples_to_first_failure": first_examples,
                    "seconds_to_first_failure": _rounded(first_seconds),
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


def _length(failure: FailureReport | None) -> int | None:
    return len(failure.records) if failure is not None else None


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


_MEMORY_PROBE = """
import sys
from shardkit import FakeShardEngine
from shardkit._run.runner import fuzz

fuzz(FakeShardEngine, seed=int(sys.argv[1]), examples=int(sys.argv[2]), steps=int(sys.argv[3]))
with open("/proc/self/status") as status:
    print(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
"""


def _memory(config: BenchSettings) -> dict[str, Any] | str:
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


#: The scale-out workload: the fake under each role, with faults and without, with the twin
#: oracle and without, each suite its own machine; every suite runs ``--examples`` ×
#: ``--steps`` from the bench's seed. Sixteen suites, not fewer: starting pytest-xdist's
#: workers costs seconds whatever they run, and a few long suites leave one worker idle at the end.
SCALE_OUT_SUITES = tuple(
    (role, faults, twins) for role in ROLES for faults in ("all", "none") for twins in (True, False)
)

_SCALE_OUT_HEADER = """from hypothesis import settings
from shardkit import FakeShardEngine, machine_for

SIZES = settings(max_examples={examples}, stateful_step_count={steps}, database=None)
"""
_SCALE_OUT_SUITE = """
machine = machine_for(FakeShardEngine, role={role!r}, faults={faults!r}, twins={twins!r})
machine.TestCase.settings = SIZES
Test_{role}_faults_{faults}_twins_{twins} = machine.TestCase
"""


def _scale_out(config: BenchSettings) -> dict[str, Any] | str:
    """The same suites run by pytest in one process (``-n 0``) and by pytest-xdist on
    ``scale_out_workers`` workers, interleaved over ``scale_out_rounds`` rounds (``_interleaved``:
    a machine growing busier or quieter shifts both alike): steps per
    second of each, and the speed-up of each round. ``--shardkit-seed`` makes every run do
    the same work, the steps the same suites take under ``fuzz`` at that seed."""
    missing = [name for name in ("pytest", "xdist") if importlib.util.find_spec(name) is None]
    if missing:
        return f"not measured: needs {' and '.join(missing)} (pip install pytest pytest-xdist)"
    suites = SCALE_OUT_SUITES[: config.scale_out_suites]
    steps = sum(
        fuzz(
            FakeShardEngine,
            seed=config.seed,
            examples=config.examples,
            steps=config.steps,
            role=role,
            faults=faults,
            twins=twins,
        ).steps
        for role, faults, twins in suites
    )
    source = _SCALE_OUT_HEADER.format(examples=config.examples, steps=config.steps) + "".join(
        _SCALE_OUT_SUITE.format(role=role, faults=faults, twins=twins) for role, faults, twins in suites
    )
    # A database named in the environment would add its saved examples to some runs' work.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("SHARDKIT_")}
    with tempfile.TemporaryDirectory(prefix="shardkit-bench-scale-out-") as folder:
        Path(folder, "test_scale_out.py").write_text(source)
        Path(folder, "pytest.ini").write_text("[pytest]\n")  # no configuration from the folders above

        def pytest_run(workers: int) -> int:
            command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", str(workers)]
            command += ["--shardkit-seed", str(config.seed), "--shardkit-out", "failures", "test_scale_out.py"]
            finished = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True)
            if finished.returncode != 0:
                tail = " | ".join(finished.stdout.strip().splitlines()[-3:])
                raise _NotMeasured(f"not measured: pytest -n {workers} exited {finished.returncode}: {tail}")
            return steps

        try:
            timed = _interleaved(
                {
                    "serial": partial(_timed, partial(pytest_run, 0)),
                    "parallel": partial(_timed, partial(pytest_run, config.scale_out_workers)),
                },
                config.scale_out_rounds,
            )
        except _NotMeasured as failed:
            return str(failed)
    serial, parallel = timed["serial"], timed["parallel"]
    speedup = _spread([many.rate / one.rate for one, many in zip(serial, parallel, strict=True)])
    return {
        "suites": len(suites),
        "steps": steps,
        "workers": config.scale_out_workers,
        "cpus": os.cpu_count(),
        "rounds": config.scale_out_rounds,
        "serial_steps_per_s": [round(one.rate, 1) for one in serial],
        "parallel_steps_per_s": [round(many.rate, 1) for many in parallel],
        "speedup_median": speedup["median"],
        "speedup_min": speedup["min"],
        "speedup_max": speedup["max"],
        "campaign": _campaign_scaling(config),
    }


#: Prefills in one run of a side of the native-threads comparison (a run is timed whole).
NATIVE_PREFILLS_PER_RUN = 2
#: The native-threads section's conditions: the machine as the bench found it, then with a
#: spinning process on every core but one (as a two-core CI host runs the other pytest-xdist worker).
NATIVE_CONDITIONS = ("machine as found", "other cores busy")
_SPIN = "while True: pass"


def _native_threads(config: BenchSettings) -> dict[str, Any] | str:
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
            timed = _interleaved(
                {"default": partial(_timed, partial(prefills, cores)), "pinned": partial(_timed, partial(prefills, 1))},
                config.rounds,
            )
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        default, pinned = timed["default"], timed["pinned"]
        slower = [alone.wall_s / one.wall_s for alone, one in zip(default, pinned, strict=True)]
        middle = _median_round(slower, float)
        spread = _spread(slower)
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


def _render_native_threads(native: dict[str, Any] | str) -> list[str]:
    if isinstance(native, str):
        return [f"native threads: {native}"]
    if native["max_difference"] == 0.0:
        outputs = "identical"
    elif native["within_tolerance"]:
        outputs = f"at most {native['max_difference']:.2g} apart, within the engine's tolerance {native['tolerance']:g}"
    else:
        outputs = (
            f"{native['max_difference']:.2g} apart, BEYOND the engine's tolerance {native['tolerance']:g} "
            "(its answers at one thread count would fail a comparison with its answers at another)"
        )
    lines = [
        f"native threads (numpy engine, {native['prefill_tokens']}-token prefill, layers {native['layers']}; "
        f"{', '.join(native['pools']) or 'no native pool found'}; a thread per core ({native['default_threads']}) "
        f"against 1, interleaved, the median of {native['rounds']} rounds; outputs {outputs}):"
    ]
    for condition, row in native["conditions"].items():
        lines.append(
            f"  {condition:<18} default {row['default_ms']:>8.1f} ms (CPU {row['default_cpu_ms']:.1f} ms)  "
            f"pinned {row['pinned_ms']:>7.1f} ms (CPU {row['pinned_cpu_ms']:.1f} ms)  "
            f"x{row['slower']:.1f} slower unpinned (x{row['slower_min']:.1f}-x{row['slower_max']:.1f})"
            + (f"; load {row['load_average_before']:g} before" if row["load_average_before"] is not None else "")
        )
    return lines


class _NotMeasured(Exception):
    """A section's run failed; the message is what the section reports instead of figures."""


def _campaign_scaling(config: BenchSettings) -> dict[str, Any]:
    """``shardkit campaign`` on the fake with 1 worker and with ``scale_out_workers``, each
    worker running the same 3 rounds of ``--examples`` × ``--steps`` (no clock involved), the
    two interleaved over ``scale_out_rounds`` rounds. The speed-up is the median round's, with
    the spread over the rounds; the figures by workers are that round's."""
    from shardkit._campaign.run import measure_campaign_work
    from shardkit._run.options import FuzzOptions

    options = FuzzOptions(examples=config.examples, steps=config.steps)
    counts = (1, config.scale_out_workers)
    rounds_per_worker = 3
    measured = _interleaved(
        {
            str(count): partial(
                measure_campaign_work,
                options=options,
                workers=count,
                rounds_per_worker=rounds_per_worker,
                seed=config.seed,
            )
            for count in counts
        },
        config.scale_out_rounds,
    )
    one, many = measured[str(counts[0])], measured[str(counts[-1])]
    speedups = [more.rate / alone.rate if alone.rate else 0.0 for alone, more in zip(one, many, strict=True)]
    middle = _median_round(speedups, float)
    spread = _spread(speedups)
    return {
        "target": "shardkit:FakeShardEngine",
        "rounds_per_worker": rounds_per_worker,
        "examples_per_round": options.examples,
        "steps_per_example": options.steps,
        "cpu_count": os.cpu_count(),
        "interleaved_rounds": config.scale_out_rounds,
        "by_workers": {
            count: {
                "rounds": works[middle].rounds,
                "steps": works[middle].steps,
                "seconds": round(works[middle].seconds, 3),
                "steps_per_s": round(works[middle].rate, 1),
                "steps_per_s_by_round": [round(work.rate, 1) for work in works],
            }
            for count, works in measured.items()
        },
        "speedup": round(speedups[middle], 3),
        "speedup_min": spread["min"],
        "speedup_max": spread["max"],
    }


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

    throughput = measured("throughput", _throughput)
    profile = measured("profile", _profile)
    engines = measured("engines", _engines)
    out_of_process = measured("out_of_process", _out_of_process)
    planted = measured("planted", _planted)
    concurrency = measured("concurrency", _concurrency)
    memory = measured("memory", _memory)
    scale_out = measured("scale_out", _scale_out)
    native_threads = measured("native_threads", _native_threads)
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
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "section_seconds": section_seconds,
    }


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def render(bench: dict[str, Any]) -> str:
    run_size = f"{bench['examples']} examples × {bench['steps']} steps, seed {bench['seed']}"
    lines = []
    per_role = bench["per_role"]
    if isinstance(per_role, str):
        lines.append(f"throughput, {run_size}: {per_role}")
    else:
        rounds = len(next(iter(per_role.values()))["rounds"]) if per_role else 0
        lines.append(
            f"throughput, {run_size} (fake engine, faults on; kit and bare interleaved, the median of {rounds} rounds):"
        )
        lines.append(
            f"  {'role':<8} {'kit steps/s':>12} {'bare steps/s':>13} {'ratio':>7} {'spread':>11} {'CPU ratio':>10}"
            f" {f'examples with a {LONG_SESSION_DECODES}+ decode session':>36}"
        )
        for role, row in per_role.items():
            spread = f"{row['throughput_ratio_min']:.2f}-{row['throughput_ratio_max']:.2f}"
            lines.append(
                f"  {role:<8} {row['kit_steps_per_s']:>12,.0f} {row['bare_steps_per_s']:>13,.0f} {row['throughput_ratio']:>7.2f}"
                f" {spread:>11} {row['cpu_ratio']:>10.2f} {row['long_session_share']:>36.0%}"
            )
    profile = bench["profile"]
    if isinstance(profile, str):
        lines.append(f"profile: {profile}")
    else:
        lines.append("profile (share of a kit run's time by component, one run per role under cProfile):")
        roles = list(profile)
        components = list(profile[roles[0]])
        lines.append(f"  {'component':<90}" + "".join(f" {role:>7}" for role in roles))
        for component in components:
            cells = "".join(f" {profile[role].get(component, 0.0):>7.1%}" for role in roles)
            lines.append(f"  {component:<90}{cells}")
    engines = bench["engines"]
    if isinstance(engines, str):
        lines.append(f"engines: {engines}")
    else:
        lines.append("engines (full role, faults on):")
        for name, row in engines.items():
            if isinstance(row, str):
                lines.append(f"  {name:<10} {row}")
            else:
                found = f"; FAILURE {row['failure']}" if row["failure"] else ""
                lines.append(
                    f"  {name:<10} {row['kit_steps_per_s']:>8,.0f} kit steps/s, one decode step {row['decode_step_us']} µs; "
                    f"longest session {row['longest_session_decodes']} decodes, "
                    f"{row['long_session_share']:.0%} of examples with {LONG_SESSION_DECODES}+{found}"
                )
    out_of_process = bench["out_of_process"]
    if isinstance(out_of_process, str):
        lines.append(f"out of process: {out_of_process}")
    else:
        rounds = len(next(iter(out_of_process.values()))["steps_per_s_by_round"])
        lines.append(
            f"out of process (fake, same seed: the same steps; modes interleaved, medians of {rounds} rounds):"
        )
        for name, row in out_of_process.items():
            started = row.get("workers_started")
            workers = "" if started is None else f", {started} worker process{'es' if started != 1 else ''} started"
            slower = (
                f"  x{row['slower']:.1f} slower (x{row['slower_min']:.1f}-x{row['slower_max']:.1f})"
                if "slower" in row
                else ""
            )
            lines.append(f"  {name:<22} {row['steps_per_s']:>8,.0f} steps/s{slower}  ({row['steps']} steps{workers})")
    planted = bench["planted"]
    if isinstance(planted, str):
        lines.append(f"planted bugs: {planted}")
    else:
        seeds = len(planted[0]["runs"]) if planted else 0
        lines.append(
            f"planted bugs at {seeds} seed{'s' if seeds != 1 else ''} (shrunk length at each seed, min: the minimum; "
            "secs: median seconds to the first failure):"
        )
        lines.append(
            f"  {'engine':<30} {'found':>5} {'min':>4}  {'shrunk at each seed':<24} {'secs':>6} {'contract':>8}"
        )
        for row in planted:
            runs = row["runs"]
            lengths = " ".join(_cell(run["shrunk_length"]) if run["found"] else "NO" for run in runs)
            seconds = _median([run["seconds_to_first_failure"] for run in runs if run["found"]])
            caught = "caught" if row["caught_by_contract"] else "-"
            lines.append(
                f"  {row['engine']:<30} {row['found_at_seeds']:>3}/{len(runs)} {row['minimal_length']:>4}  "
                f"{lengths:<24} {_cell(seconds):>6} {caught:>8}"
            )
        lines.append("  " + _planted_summary(planted))
    concurrency = bench["concurrency"]
    if isinstance(concurrency, str):
        lines.append(f"concurrency: {concurrency}")
    else:
        rates = concurrency["steps_per_s_by_lanes"]
        cells = ", ".join(f"{row['steps_per_s']:,.0f} with {lanes}" for lanes, row in rates.items())
        lines.append(f"concurrency (fake, faults on): steps/s by lanes: {cells} (1: no lanes)")
        if not concurrency["racy"]:
            lines.append("  racy engines: measured with the bundled planted engines only (--planted shardkit._planted)")
        else:
            lines.append(
                "  racy engines, --concurrency 2 --faults none, per seed: examples to the first failure, "
                f"shrunk steps/lane steps (* its minimum), replays that reproduced of {concurrency['racy_replays']}:"
            )
        for row in concurrency["racy"]:
            runs = row["runs"]
            cells = "  ".join(
                f"{run['examples_to_first_failure']}:{run['shrunk_length']}/{run['lane_steps']}"
                f"{'*' if run['at_minimum'] else ''} {run['replay_reproductions']}"
                if run["found"]
                else "NO"
                for run in runs
            )
            found = sum(run["found"] for run in runs)
            minimal = sum(run["found"] and run["at_minimum"] for run in runs)
            lines.append(f"  {row['engine']:<30} {found}/{len(runs)} found, {minimal} at minimum  {cells}")
    memory = bench["memory"]
    if isinstance(memory, str):
        lines.append(f"memory: {memory}")
    else:
        sizes = [key for key in memory if key.isdigit()]
        cells = ", ".join(f"{memory[key]['peak_rss_mb']} MB at {int(key):,} examples" for key in sizes)
        lines.append(
            f"memory (fake, {memory['steps']} steps an example, a fresh process each): peak RSS {cells}; "
            f"ratio {memory['ratio_largest_to_smallest']}"
        )
    scale_out = bench["scale_out"]
    if isinstance(scale_out, str):
        lines.append(f"scale-out: {scale_out}")
    else:
        serial = statistics.median(scale_out["serial_steps_per_s"])
        parallel = statistics.median(scale_out["parallel_steps_per_s"])
        lines.append(
            f"scale-out ({scale_out['suites']} fake suites, {scale_out['steps']:,} steps a run, "
            f"{scale_out['rounds']} round{'s' if scale_out['rounds'] != 1 else ''} interleaved, "
            f"{scale_out['cpus']} CPUs): pytest -n 0 {serial:,.0f} steps/s, "
            f"-n {scale_out['workers']} {parallel:,.0f} steps/s (medians); speed-up x{scale_out['speedup_median']:.2f} "
            f"median (x{scale_out['speedup_min']:.2f} to x{scale_out['speedup_max']:.2f})"
        )
        campaign = scale_out["campaign"]
        rates = ", ".join(f"{count} {figures['steps_per_s']:,.0f}" for count, figures in campaign["by_workers"].items())
        rounds = campaign["interleaved_rounds"]
        lines.append(
            f"scale-out (shardkit campaign, {campaign['rounds_per_worker']} rounds a worker, start-up not counted, "
            f"{rounds} round{'s' if rounds != 1 else ''} interleaved): steps/s by workers: {rates} (median round); "
            f"speed-up x{campaign['speedup']:.2f} (x{campaign['speedup_min']:.2f} to x{campaign['speedup_max']:.2f})"
        )
    lines.extend(_render_native_threads(bench["native_threads"]))
    sections = ", ".join(f"{name} {seconds:g} s" for name, seconds in bench["section_seconds"].items())
    lines.append(f"peak RSS {bench['peak_rss_mb']} MB; bench took {bench['elapsed_s']} s ({sections})")
    return "\n".join(lines)


def _planted_summary(planted: list[dict[str, Any]]) -> str:
    runs = [run for row in planted for run in row["runs"]]
    found = [run for run in runs if run["found"]]
    at_minimum = [run for run in found if run["shrunk_length"] == run["minimum"]]
    within_one = [run for run in found if run["shrunk_length"] <= run["minimum"] + 1]
    everywhere = sum(row["found_at_seeds"] == len(row["runs"]) for row in planted)
    contract = sum(row["caught_by_contract"] for row in planted)
    return (
        f"found at every seed {everywhere}/{len(planted)} engines; of {len(runs)} runs found {len(found)}, "
        f"at the minimum {len(at_minimum)} ({_percent(len(at_minimum), len(runs))}), within one step "
        f"{len(within_one)}; median time to first failure "
        f"{_cell(_median([run['seconds_to_first_failure'] for run in found]))} s; median random-walk length "
        f"{_cell(_median([run['random_walk_length'] for run in found]))} steps vs shrunk "
        f"{_cell(_median([run['shrunk_length'] for run in found]))}; the static contract alone catches "
        f"{contract}/{len(planted)}"
    )


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f} %" if whole else "-"


def _median(values: list[Any]) -> Any:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
