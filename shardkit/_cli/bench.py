"""``shardkit bench``: the command's options turned into ``BenchSettings``, the bench run
(``shardkit._bench``), and its figures printed as tables or as one JSON object."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
from typing import TYPE_CHECKING

from shardkit._cli.parser import EXIT_OK
from shardkit.errors import UsageError

if TYPE_CHECKING:
    from shardkit._bench.settings import BenchSettings

__all__ = ["bench_command", "bench_settings"]


def bench_command(args: argparse.Namespace) -> int:
    from shardkit._bench.render import render
    from shardkit._bench.run import run_bench

    if args.cluster:
        from shardkit._bench.cluster_scaling import measure_cluster_scaling, render_cluster_scaling

        ignored = [flag for flag, given in (("--profile", args.profile), ("--memory", args.memory), ("--planted", args.planted != "shardkit._planted"), ("--planted-seeds", args.planted_seeds is not None)) if given]
        if ignored:
            raise UsageError(f"shardkit bench: --cluster measures only campaigns on Ray, and {ignored[0]} has no part in it; drop one of the two")
        if importlib.util.find_spec("ray") is None:
            raise UsageError("shardkit bench: --cluster needs Ray, which is not installed here; install it with pip install 'shardkit[ray]'")
        cluster_figures = measure_cluster_scaling(bench_settings(args, None))
        print(json.dumps(cluster_figures, indent=2) if args.json else render_cluster_scaling(cluster_figures))
        return EXIT_OK
    planted = None if args.planted == "none" else args.planted
    if planted is not None:
        # Checked before minutes of measuring: a mistyped module is a usage error, not a skipped row.
        try:
            module = importlib.import_module(planted)
        except ImportError as error:
            message = f"shardkit bench: --planted {planted!r} cannot be imported ({error}); name a module with PLANTED, or 'none'"
            raise UsageError(message) from None
        if not isinstance(getattr(module, "PLANTED", None), tuple):
            message = (
                f"shardkit bench: --planted {planted!r} has no PLANTED tuple of planted-bug engines; or pass 'none'"
            )
            raise UsageError(message)
    figures = run_bench(bench_settings(args, planted))
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return EXIT_OK


def bench_settings(args: argparse.Namespace, planted: str | None) -> BenchSettings:
    """The settings ``shardkit bench`` measures with: ``--quick``'s sizes or the full ones, then
    each size given on the command line, which ``--quick`` never overrides."""
    from shardkit._bench.settings import QUICK, BenchSettings

    base = QUICK if args.quick else BenchSettings()
    given = {
        "examples": args.examples,
        "steps": args.steps,
        "rounds": args.rounds,
        "planted_seeds": args.planted_seeds,
    }
    settings = dataclasses.replace(base, seed=args.seed, planted_module=planted, profile=args.profile)
    settings = dataclasses.replace(settings, **{name: value for name, value in given.items() if value is not None})
    if args.memory:
        return dataclasses.replace(settings, memory_examples=(300, 3000), memory_steps=100)
    # The peak at the run's own size and five times it: flat is the aim.
    return dataclasses.replace(
        settings, memory_examples=(settings.examples, 5 * settings.examples), memory_steps=settings.steps
    )
