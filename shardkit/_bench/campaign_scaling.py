"""How ``shardkit campaign`` scales: its work with one worker and with several (part of
the scale-out section)."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from shardkit._bench import timing
from shardkit._bench.settings import BenchSettings

__all__ = ["measure_campaign_scaling"]


def measure_campaign_scaling(config: BenchSettings) -> dict[str, Any]:
    """``shardkit campaign`` on the fake with 1 worker and with ``scale_out_workers``, each
    worker running the same 3 rounds of ``--examples`` × ``--steps`` (no clock involved), the
    two interleaved over ``scale_out_rounds`` rounds. The speed-up is the median round's, with
    the spread over the rounds; the figures by workers are that round's."""
    from shardkit._campaign.run import measure_campaign_work
    from shardkit._run.options import FuzzOptions

    options = FuzzOptions(examples=config.examples, steps=config.steps)
    counts = (1, config.scale_out_workers)
    rounds_per_worker = 3
    measured = timing.interleaved(
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
    middle = timing.median_round(speedups, float)
    spread = timing.spread(speedups)
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
