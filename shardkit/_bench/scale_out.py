"""The scale-out section: the same suites run by pytest in one process and by pytest-xdist
on several workers, and ``shardkit campaign`` with one worker and with several."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from shardkit._bench import timing
from shardkit._bench.campaign_scaling import measure_campaign_scaling
from shardkit._bench.settings import BenchSettings
from shardkit._run.runner import fuzz
from shardkit.contract import ROLES
from shardkit.engines import FakeShardEngine

__all__ = ["SCALE_OUT_SUITES", "measure_scale_out"]


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


class _NotMeasured(Exception):
    """A section's run failed; the message is what the section reports instead of figures."""


def measure_scale_out(config: BenchSettings) -> dict[str, Any] | str:
    """The same suites run by pytest in one process (``-n 0``) and by pytest-xdist on
    ``scale_out_workers`` workers, interleaved over ``scale_out_rounds`` rounds (``timing.interleaved``:
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
            timed = timing.interleaved(
                {
                    "serial": partial(timing.timed, partial(pytest_run, 0)),
                    "parallel": partial(timing.timed, partial(pytest_run, config.scale_out_workers)),
                },
                config.scale_out_rounds,
            )
        except _NotMeasured as failed:
            return str(failed)
    serial, parallel = timed["serial"], timed["parallel"]
    speedup = timing.spread([many.rate / one.rate for one, many in zip(serial, parallel, strict=True)])
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
        "campaign": measure_campaign_scaling(config),
    }
