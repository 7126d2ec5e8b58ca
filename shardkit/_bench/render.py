"""``render``: a bench run's figures as the tables ``shardkit bench`` prints, one helper per
section; a section not measured prints the one line it reports instead of its figures."""

from __future__ import annotations

import statistics
from typing import Any

from shardkit._run.report import LONG_SESSION_DECODES

__all__ = ["render"]


def render(bench: dict[str, Any]) -> str:
    run_size = f"{bench['examples']} examples × {bench['steps']} steps, seed {bench['seed']}"
    lines = [
        *_render_throughput(bench["per_role"], run_size),
        *_render_profile(bench["profile"]),
        *_render_engines(bench["engines"]),
        *_render_out_of_process(bench["out_of_process"]),
        *_render_planted(bench["planted"]),
        *_render_concurrency(bench["concurrency"]),
        *_render_memory(bench["memory"]),
        *_render_scale_out(bench["scale_out"]),
        *_render_native_threads(bench["native_threads"]),
        *_render_numerics(bench["numerics"]),
    ]
    sections = ", ".join(f"{name} {seconds:g} s" for name, seconds in bench["section_seconds"].items())
    lines.append(f"peak RSS {bench['peak_rss_mb']} MB; bench took {bench['elapsed_s']} s ({sections})")
    return "\n".join(lines)


def _render_throughput(per_role: dict[str, Any] | str, run_size: str) -> list[str]:
    if isinstance(per_role, str):
        return [f"throughput, {run_size}: {per_role}"]
    lines = []
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
    return lines


def _render_profile(profile: dict[str, Any] | str) -> list[str]:
    if isinstance(profile, str):
        return [f"profile: {profile}"]
    lines = []
    lines.append("profile (share of a kit run's time by component, one run per role under cProfile):")
    roles = list(profile)
    components = list(profile[roles[0]])
    lines.append(f"  {'component':<90}" + "".join(f" {role:>7}" for role in roles))
    for component in components:
        cells = "".join(f" {profile[role].get(component, 0.0):>7.1%}" for role in roles)
        lines.append(f"  {component:<90}{cells}")
    return lines


def _render_engines(engines: dict[str, Any] | str) -> list[str]:
    if isinstance(engines, str):
        return [f"engines: {engines}"]
    lines = []
    lines.append("engines (full role, and the others where it serves them; faults on):")
    for name, row in engines.items():
        if isinstance(row, str):
            lines.append(f"  {name:<10} {row}")
        else:
            found = f"; FAILURE {row['failure']}" if row["failure"] else ""
            roles = "".join(f", {role} {rate:,.0f}" for role, rate in row.get("kit_steps_per_s_by_role", {}).items())
            lines.append(
                f"  {name:<12} {row['kit_steps_per_s']:>8,.0f} kit steps/s{roles}, one decode step {row['decode_step_us']} µs; "
                f"longest session {row['longest_session_decodes']} decodes, "
                f"{row['long_session_share']:.0%} of examples with {LONG_SESSION_DECODES}+{found}"
            )
            for lanes, batching in row.get("batching_by_lanes", {}).items():
                failed = f"; FAILURE {batching['failure']}" if batching["failure"] else ""
                lines.append(
                    f"    batching, {lanes} lane(s): {batching['kit_steps_per_s']:>8,.0f} kit steps/s, "
                    f"{batching['batches']} batches of {batching['steps_per_batch']} steps on average "
                    f"(largest {batching['largest_batch']}){failed}"
                )
    return lines


def _render_out_of_process(out_of_process: dict[str, Any] | str) -> list[str]:
    if isinstance(out_of_process, str):
        return [f"out of process: {out_of_process}"]
    lines = []
    rounds = len(next(iter(out_of_process.values()))["steps_per_s_by_round"])
    lines.append(f"out of process (fake, same seed: the same steps; modes interleaved, medians of {rounds} rounds):")
    for name, row in out_of_process.items():
        started = row.get("workers_started")
        workers = "" if started is None else f", {started} worker process{'es' if started != 1 else ''} started"
        slower = (
            f"  x{row['slower']:.1f} slower (x{row['slower_min']:.1f}-x{row['slower_max']:.1f})"
            if "slower" in row
            else ""
        )
        calls = (
            f"{row['engine_calls_per_step']:.2f} engine calls a step, no round trip"
            if "engine_calls_per_step" in row
            else f"{row['round_trips_per_step']:.2f} round trips a step ({row['calls_per_step']:.2f} calls)"
        )
        lines.append(
            f"  {name:<26} {row['steps_per_s']:>8,.0f} steps/s{slower}  {calls}  ({row['steps']} steps{workers})"
        )
    return lines


def _render_planted(planted: list[dict[str, Any]] | str) -> list[str]:
    if isinstance(planted, str):
        return [f"planted bugs: {planted}"]
    lines = []
    seeds = len(planted[0]["runs"]) if planted else 0
    lines.append(
        f"planted bugs at {seeds} seed{'s' if seeds != 1 else ''} (shrunk length at each seed, min: the minimum; "
        "secs: median seconds to the first failure, and to the minimised one):"
    )
    lines.append(
        f"  {'engine':<30} {'found':>5} {'min':>4}  {'shrunk at each seed':<24} {'secs':>6} {'to min':>7} "
        f"{'contract':>8}"
    )
    for row in planted:
        runs = row["runs"]
        found = [run for run in runs if run["found"]]
        lengths = " ".join(_cell(run["shrunk_length"]) if run["found"] else "NO" for run in runs)
        seconds = _median([run["seconds_to_first_failure"] for run in found])
        to_minimal = _median([run["seconds_to_minimal_failure"] for run in found])
        caught = "caught" if row["caught_by_contract"] else "-"
        lines.append(
            f"  {row['engine']:<30} {row['found_at_seeds']:>3}/{len(runs)} {row['minimal_length']:>4}  "
            f"{lengths:<24} {_cell(seconds):>6} {_cell(to_minimal):>7} {caught:>8}"
        )
    lines.append("  " + _planted_summary(planted))
    return lines


def _render_concurrency(concurrency: dict[str, Any] | str) -> list[str]:
    if isinstance(concurrency, str):
        return [f"concurrency: {concurrency}"]
    lines = []
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
    return lines


def _render_memory(memory: dict[str, Any] | str) -> list[str]:
    if isinstance(memory, str):
        return [f"memory: {memory}"]
    sizes = [key for key in memory if key.isdigit()]
    cells = ", ".join(f"{memory[key]['peak_rss_mb']} MB at {int(key):,} examples" for key in sizes)
    return [
        f"memory (fake, {memory['steps']} steps an example, a fresh process each): peak RSS {cells}; "
        f"ratio {memory['ratio_largest_to_smallest']}"
    ]


def _render_scale_out(scale_out: dict[str, Any] | str) -> list[str]:
    if isinstance(scale_out, str):
        return [f"scale-out: {scale_out}"]
    lines = []
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
    return lines


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


def _render_numerics(numerics: dict[str, Any] | str) -> list[str]:
    if isinstance(numerics, str):
        return [f"numerics: {numerics}"]
    lines = [
        f"numerics ({numerics['histories']} histories of {numerics['tokens']} tokens per model and format, "
        "prefilled whole and token by token; the largest difference of a residual value, and beside the "
        "format's default relative tolerance):"
    ]
    for model, formats in numerics["models"].items():
        lines.append(f"  {model}:")
        for fmt, row in formats.items():
            flips = f"{row['flips']} argmax flips (margin <= {row['flip_margin']:.2g})" if row["flips"] else "no argmax flip"
            lines.append(
                f"    {fmt:<9} chunking {row['chunking']:.2g} ({row['chunking_beside_relative']:.2g} beside)  "
                f"vs float32 {row['float32']:.2g} ({row['float32_beside_relative']:.2g} beside)  "
                f"values up to {row['largest_value']:.3g}; logits {row['logits']:.2g} apart, {flips}"
            )
    return lines


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
        f"{_cell(_median([run['seconds_to_first_failure'] for run in found]))} s, to the minimised one "
        f"{_cell(_median([run['seconds_to_minimal_failure'] for run in found]))} s; median random-walk length "
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
