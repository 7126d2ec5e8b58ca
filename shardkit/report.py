"""Human-readable output of a fuzzing run: the summary, the coverage table, the failure."""

from __future__ import annotations

from typing import TextIO

from .runner import FuzzResult

__all__ = ["coverage_table", "print_summary"]


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


def print_summary(result: FuzzResult, out: TextIO) -> None:
    rate = result.steps / result.elapsed_s if result.elapsed_s > 0 else 0.0
    print(
        f"{result.examples} examples, {result.steps} steps in {result.elapsed_s:.1f}s ({rate:,.0f} steps/s); "
        f"faults: {', '.join(sorted(result.faults)) or 'none'}",
        file=out,
    )
    print("coverage (operation → outcome counts):", file=out)
    print(coverage_table(result), file=out)
    failure = result.failure
    if failure is None:
        print("no failure found", file=out)
        return
    print(f"\nFAILURE ({failure.violation.property}) in {len(failure.records)} steps:", file=out)
    for record in failure.records[:-1]:
        print(f"  step {record.index}: {record.action.describe()}  → {record.observed}", file=out)
    for line in failure.violation.message.splitlines():
        print(f"  {line}", file=out)
    if result.trace_path is not None:
        print(f"trace: {result.trace_path}", file=out)
    print(f"rerun the whole run: shardkit fuzz {result.target} --seed {result.seed}", file=out)
    if result.blob is not None:
        print(f"hypothesis blob: {result.blob}", file=out)
