"""Human-readable output of a fuzzing run: the summary, the coverage table, the failure."""

from __future__ import annotations

from typing import TextIO

from .runner import FuzzResult

__all__ = ["coverage_table", "print_summary", "render_failure"]


def coverage_table(result: FuzzResult) -> str:
    """(operation, outcome) counts, one operation per line."""
    by_op: dict[str, dict[str, int]] = {}
    for (op, outcome), count in sorted(result.coverage.items()):
        by_op.setdefault(op, {})[outcome] = count
    width = max((len(op) for op in by_op), default=0)
    lines = []
    for op, outcomes in by_op.items():
        cells = "  ".join(f"{outcome}={count}" for outcome, count in outcomes.items())
        lines.append(f"  {op:<{width}}  {cells}")
    return "\n".join(lines)


def render_failure(result: FuzzResult) -> str:
    """The minimal steps, expected vs observed, and every way to rerun the failure."""
    failure = result.failure
    assert failure is not None
    lines = [f"FAILURE ({failure.violation.property}) in {len(failure.records)} steps:"]
    lines += [f"  step {r.index}: {r.action.describe()}  → {r.observed}" for r in failure.records[:-1]]
    lines += [f"  {line}" for line in failure.violation.message.splitlines()]
    if result.interrupted:
        lines.append("(interrupted: the sequence above is the best found so far, not minimised)")
    elif result.minimized is not None and result.hypothesis_failure is not None:
        before = len(result.hypothesis_failure.records)
        state = "1-minimal" if result.minimized.one_minimal else "not proven 1-minimal (replay budget ran out)"
        lines.append(f"(Hypothesis shrank it to {before} steps, replay to {len(failure.records)}; {state})")
    lines.append("reproduce:")
    if result.trace_path is not None:
        lines.append(f"  this failure:    shardkit replay {result.trace_path}")
    if result.regression_path is not None:
        lines.append(f"  as a test:       pytest {result.regression_path}")
    if result.rerun_command:
        lines.append(f"  the whole run:   {result.rerun_command}")
    if result.blob is not None:
        lines.append(f"  hypothesis blob: {result.blob}")
    return "\n".join(lines)


def print_summary(result: FuzzResult, out: TextIO) -> None:
    rate = result.steps / result.elapsed_s if result.elapsed_s > 0 else 0.0
    print(
        f"{result.examples} examples, {result.steps} steps in {result.elapsed_s:.1f}s ({rate:,.0f} steps/s); "
        f"faults: {', '.join(sorted(result.faults)) or 'none'}",
        file=out,
    )
    print("coverage (operation → outcome counts):", file=out)
    print(coverage_table(result), file=out)
    if result.failure is None:
        print("no failure found", file=out)
        return
    print(file=out)
    print(render_failure(result), file=out)
