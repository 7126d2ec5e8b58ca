"""The throughput section (the kit against its bare machine, per role), the profile of a
kit run by component, and the engines compared on throughput and on one decode step."""

from __future__ import annotations

import os
import statistics
import time
from functools import partial
from typing import Any

from shardkit._bench import timing
from shardkit._bench.bare import bare_steps
from shardkit._bench.settings import BenchSettings
from shardkit._core.targets import PythonTarget
from shardkit._machine.build import build_machine
from shardkit._machine.spec import MachineOptions
from shardkit._run.report import long_session_share, session_histogram
from shardkit._run.result import FuzzResult
from shardkit._run.runner import fuzz
from shardkit._transport.resolve import resolve_target
from shardkit.contract import ROLES, DecodeRequest, LoadRequest, PrefillRequest, Role
from shardkit.engines import FakeShardEngine
from shardkit.errors import InvalidTarget

__all__ = ["ENGINE_TARGETS", "PROFILE_COMPONENTS", "measure_engines", "measure_profile", "measure_throughput"]


def measure_throughput(config: BenchSettings) -> dict[str, Any]:
    """Each role: the kit and the bare machine interleaved over ``config.rounds`` rounds; the
    ratio of each round, its median and spread, by wall time and by CPU time (a busy machine
    takes wall time from both sides, but rarely alike; CPU time it takes far less)."""
    return {role: _role_throughput(config, role) for role in ROLES}


def _role_throughput(config: BenchSettings, role: Role) -> dict[str, Any]:
    runs: list[FuzzResult] = []

    def kit() -> int:
        runs.append(fuzz(FakeShardEngine, seed=config.seed, examples=config.examples, steps=config.steps, role=role))
        return runs[-1].steps

    machine = build_machine(PythonTarget(FakeShardEngine), MachineOptions(role=role))
    timed = timing.interleaved(
        {
            "kit": partial(timing.timed, kit),
            "bare": partial(timing.timed, lambda: bare_steps(machine, config.examples, config.steps, config.seed)),
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
    ratio = timing.spread([one["ratio"] for one in rounds])
    middle = rounds[timing.median_round(rounds, lambda one: float(one["ratio"]))]
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


def measure_profile(config: BenchSettings) -> dict[str, Any] | str:
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
    ("transformers", "shardkit.engines.transformers_llama:TransformersShardEngine"),
)
#: The engines measured in every role besides full (llama.cpp serves the whole model only).
ENGINES_IN_EVERY_ROLE = ("numpy", "transformers")


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


def measure_engines(config: BenchSettings) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, target in ENGINE_TARGETS:
        try:
            resolve_target(target)()
        except (ImportError, InvalidTarget) as missing:
            rows[name] = f"skipped: {missing}"
            continue
        run = fuzz(target, seed=config.seed, examples=config.examples, steps=config.steps, role="full")
        other_roles = [role for role in ROLES if role != "full"] if name in ENGINES_IN_EVERY_ROLE else []
        by_role = {}
        for role in other_roles:
            each = fuzz(target, seed=config.seed, examples=config.examples, steps=config.steps, role=role)
            by_role[role] = round(each.steps / each.elapsed_s, 1)
        rows[name] = {
            "kit_steps_per_s": round(run.steps / run.elapsed_s, 1),
            "kit_steps_per_s_by_role": by_role,
            "decode_step_us": _decode_step_microseconds(target),
            "failure": run.failure.violation.property if run.failure is not None else None,
            # Long histories are compared too (each by three twin paths): what that costs shows above.
            "longest_session_decodes": max(run.longest_session, default=0),
            "long_session_share": round(long_session_share(run), 4),
        }
    if isinstance(rows.get("transformers"), dict):
        rows["transformers"]["batching_by_lanes"] = _batching_by_lanes(config)
    return rows


def _batching_by_lanes(config: BenchSettings) -> dict[str, Any]:
    """The batching transformers engine fuzzed with 1, 2 and 3 lanes of calls at once: kit
    steps/s, and how many one-token steps its scheduler ran per batched forward."""
    from shardkit.engines.transformers_batching import BatchingTransformersShardEngine

    by_lanes: dict[str, Any] = {}
    for lanes in (1, 2, 3):
        engines: list[BatchingTransformersShardEngine] = []
        built = partial(_kept, engines, BatchingTransformersShardEngine)
        run = fuzz(built, seed=config.seed, examples=config.examples, steps=config.steps, concurrency=lanes)
        sizes = [size for engine in engines for size in engine.batch_sizes()]
        for engine in engines:
            engine.close()
        by_lanes[str(lanes)] = {
            "kit_steps_per_s": round(run.steps / run.elapsed_s, 1),
            "batches": len(sizes),
            "steps_per_batch": round(sum(sizes) / len(sizes), 2) if sizes else None,
            "largest_batch": max(sizes, default=0),
            "failure": run.failure.violation.property if run.failure is not None else None,
        }
    return by_lanes


def _kept(engines: list[Any], build: Any) -> Any:
    """A fresh engine from ``build``, kept in ``engines`` to be read after the run."""
    engines.append(build())
    return engines[-1]
