"""One fuzzing run end to end: build the machine, run Hypothesis, collect the result.

The CLI and the benchmark call ``fuzz``; it prints nothing itself.
"""

from __future__ import annotations

import io
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from ._version import __version__
from .contract import Role
from .machine import FailureReport, ShardMachine, machine_for
from .minimize import MinimizedFailure, minimize_failure
from .model import ReferenceModel
from .targets import EngineFactory, ResolvedTarget, resolve_target
from .trace import trace_document, write_atomically

__all__ = ["FuzzResult", "fuzz", "report_document"]


@dataclass
class FuzzResult:
    target: str
    seed: int
    examples: int
    steps: int
    elapsed_s: float
    coverage: Counter[tuple[str, str]]
    failure: FailureReport | None = None
    trace_path: Path | None = None
    hypothesis_output: str = ""
    faults: frozenset[str] = field(default_factory=frozenset)
    #: The failure as Hypothesis's shrinker left it, before the second stage.
    hypothesis_failure: FailureReport | None = None
    minimized: MinimizedFailure | None = None

    @property
    def blob(self) -> str | None:
        """Hypothesis's ``@reproduce_failure`` line, if it printed one."""
        found = re.search(r"@reproduce_failure\([^)]*\)", self.hypothesis_output)
        return found.group(0) if found else None


def fuzz(
    target: str | EngineFactory | ResolvedTarget,
    *,
    seed: int,
    examples: int = 200,
    steps: int = 50,
    role: Role | str | None = None,
    faults: bool | str | Iterable[str] = True,
    twins: bool = True,
    out: Path | None = None,
    model: Callable[[], ReferenceModel] = ReferenceModel,
    base: type[ShardMachine] = ShardMachine,
    minimize: bool = True,
) -> FuzzResult:
    """Fuzz ``target``; on a failure, minimise it further by replay (unless
    ``minimize`` is False) and write its trace under ``out`` (if given)."""
    resolved = resolve_target(target)
    machine = machine_for(resolved, role=role, faults=faults, twins=twins, model=model, base=base)
    run_settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        print_blob=True,
        report_multiple_bugs=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    captured = io.StringIO()
    started = time.perf_counter()
    try:
        with with_reporter(lambda text: print(text, file=captured)):
            run_state_machine_as_test(hypothesis_seed(seed)(machine), settings=run_settings)
    except BaseException as error:
        if machine.stats.failure is None or isinstance(error, KeyboardInterrupt):
            raise
        captured.write("".join(getattr(error, "__notes__", [])))
    stats = machine.stats
    minimized = None
    if stats.failure is not None and minimize:
        minimized = minimize_failure(machine, stats.failure)
    elapsed = time.perf_counter() - started
    result = FuzzResult(
        target=resolved.name,
        seed=seed,
        examples=stats.examples,
        steps=stats.steps,
        elapsed_s=elapsed,
        coverage=stats.coverage,
        failure=minimized.report if minimized is not None else stats.failure,
        hypothesis_output=captured.getvalue(),
        faults=machine.fault_kinds,
        hypothesis_failure=stats.failure,
        minimized=minimized,
    )
    if stats.failure is not None and out is not None:
        result.trace_path = _write_trace(result, stats.failure, out)
    return result


def _write_trace(result: FuzzResult, failure: FailureReport, out: Path) -> Path:
    document = trace_document(
        target=result.target,
        load_request=failure.load_request,
        faults=failure.faults,
        records=failure.records,
        violation=failure.violation,
        seed=result.seed,
    )
    slug = re.sub(r"[^A-Za-z0-9]+", "-", failure.violation.property).strip("-").lower()
    return write_atomically(out / f"seed-{result.seed}-{slug}.json", document)


def report_document(result: FuzzResult) -> dict[str, Any]:
    """The ``--report`` JSON (SPEC §6); its keys are a stable schema."""
    coverage: dict[str, dict[str, int]] = {}
    for (op, outcome), count in sorted(result.coverage.items()):
        coverage.setdefault(op, {})[outcome] = count
    failures = []
    if result.failure is not None:
        records = result.failure.records
        failures.append(
            {
                "message": result.failure.violation.message,
                "property": result.failure.violation.property,
                "steps": [
                    {
                        "op": r.action.op,
                        "args": r.action.to_json()["args"],
                        "expected": r.expected,
                        "observed": r.observed,
                    }
                    for r in records
                ],
                "trace": str(result.trace_path) if result.trace_path is not None else None,
                "faults": [
                    {"kind": r.action.args["kind"], "value": r.action.args["value"], "step": r.index}
                    for r in records
                    if r.action.op == "fault"
                ],
            }
        )
    return {
        "shardkit_version": __version__,
        "target": result.target,
        "seed": result.seed,
        "examples": result.examples,
        "steps": result.steps,
        "elapsed_s": round(result.elapsed_s, 3),
        "coverage": coverage,
        "failures": failures,
    }
