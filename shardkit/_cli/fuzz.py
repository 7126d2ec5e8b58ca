"""``shardkit fuzz``: the run, checked before it starts so that nothing it finds is lost,
its live progress, its summary and report, and what a run that ended early left behind."""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from shardkit._cli.parser import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, check_isolation_options, one_line, run_options
from shardkit._cli.paths import check_out_folder, check_output_file
from shardkit._core.targets import ResolvedTarget, WorkerCommand, parse_target
from shardkit._run.trace import write_atomically
from shardkit._transport.resolve import resolve_target
from shardkit.errors import EngineLost, UsageError

__all__ = ["fuzz_command"]


def fuzz_command(args: argparse.Namespace) -> int:
    from shardkit._html import write_html
    from shardkit._run.report import print_summary, report_document
    from shardkit._run.runner import fuzz

    options = run_options(
        "fuzz",
        args,
        reference=args.reference,
        **({"base": args.machine} if args.machine is not None else {}),
        isolate=args.isolate,
        step_timeout=args.step_timeout,
        worker_memory_mb=args.worker_memory,
        worker_command=args.worker_command,
        shrink_examples=args.shrink_examples,
    )
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    # Where the findings go is checked before the run: a failure found must never be lost.
    check_out_folder("fuzz", args.out)
    if args.report is not None:
        check_output_file("fuzz", "--report", args.report, "report.json")
    if args.html is not None:
        check_output_file("fuzz", "--html", args.html, "report.html")
        if args.report is not None and args.html.resolve() == args.report.resolve():
            message = f"shardkit fuzz: --html {args.html} is the --report file too; name each its own file, e.g. --report report.json --html report.html"
            raise UsageError(message)
    named = parse_target(args.target) if args.target is not None else None
    plan = check_isolation_options("fuzz", args, named)
    assert plan is not None, "only replay leaves the plan to its trace"
    target = plan.target
    assert not isinstance(target, ResolvedTarget), "the command line names its target by text"
    if not isinstance(target, WorkerCommand):
        resolve_target(target)  # an unknown target is a usage error before the run's line is printed
    isolation = plan.isolation
    # The whole command at once, as the summary's rerun line will print it: a run cut short
    # (a killed CI job) can be rerun from this line alone.
    reference = parse_target(args.reference) if args.reference is not None else None
    print(options.command(target, seed, reference, isolation), flush=True)
    in_progress_before = _in_progress_traces(args.out)
    progress = _Progress(args.examples) if sys.stderr.isatty() else None
    try:
        # The typed target names the engine; the options must not name it a second time.
        named_once = replace(options, worker_command=None)
        result = fuzz(target, named_once, seed=seed, out=args.out, progress=progress)
    except EngineLost as lost:
        # Not an Exception, so that it ends a run wherever it happens: the server went away.
        left = _left_behind(args.out, in_progress_before)
        print(f"shardkit: error: {one_line(str(lost))}{left}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if progress is not None:
            progress.clear()
    print_summary(result, sys.stdout, full_rows=args.full_rows)
    found = result.failure is not None
    # A found failure is exit 1 whatever else goes wrong; what could not be written says so.
    unwritten = result.write_error
    if unwritten:
        print(f"shardkit: {one_line(str(unwritten))}", file=sys.stderr)
    html_unwritten = False
    if args.html is not None:
        # Before --report, whose failure ends the command: one file unwritten never costs the other.
        try:
            write_html(report_document(result, options), args.html)
        except OSError as error:
            print(f"shardkit: could not write --html {args.html}: {_reason(error)}", file=sys.stderr)
            html_unwritten = True
        else:
            print(f"html: {args.html}")
    if args.report is not None:
        try:
            write_atomically(args.report, report_document(result, options))
        except OSError as error:
            print(f"shardkit: could not write --report {args.report}: {_reason(error)}", file=sys.stderr)
            return EXIT_FAILURE if found else EXIT_USAGE
        print(f"report: {args.report}")
    if (unwritten or html_unwritten) and not found:
        return EXIT_USAGE
    return EXIT_FAILURE if found else EXIT_OK


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


class _Progress:
    """A one-line live status on an interactive stderr, at most ten updates a second."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.perf_counter()
        self.shown_at = 0.0

    def __call__(self, examples: int, steps: int, failures: int) -> None:
        now = time.perf_counter()
        if now - self.shown_at < 0.1:
            return
        self.shown_at = now
        rate = steps / max(now - self.started, 1e-9)
        line = f"examples {examples}/{self.total}  {rate:,.0f} steps/s  failures {failures}"
        sys.stderr.write(f"\r{line}\x1b[K")
        sys.stderr.flush()

    def clear(self) -> None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def _in_progress_traces(out: Path) -> dict[Path, int]:
    """The in-progress traces in ``out`` and their modification stamps (to tell this run's apart)."""
    try:
        return {path: path.stat().st_mtime_ns for path in out.glob("*in-progress*.json") if path.is_file()}
    except OSError:
        return {}


def _left_behind(out: Path, before: dict[Path, int]) -> str:
    """What a run that ended early left in ``out``: the shortest failure found so far, if any
    (the newest in-progress trace written since ``before``)."""
    written = [path for path, stamp in _in_progress_traces(out).items() if before.get(path) != stamp]
    if not written:
        return f"; it left no in-progress trace in {out}"
    path = sorted(written)[-1]
    return f"; the shortest failure found before is kept in {path} (shardkit replay {shlex.quote(str(path))})"
