"""``shardkit campaign``: the command around ``shardkit._campaign``. It checks everything
before the first worker starts (a failure found must never be lost to a folder that cannot
be written), shows the campaign while it runs, and prints and writes its one merged report."""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from shardkit._cli.parser import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    LOCAL_WORKERS,
    one_line,
    run_options,
)
from shardkit._core.targets import PythonTarget, Target, parse_target
from shardkit.errors import UsageError

__all__ = ["campaign_command"]


def campaign_command(args: argparse.Namespace) -> int:
    from shardkit._campaign.progress import LiveBoard, RoundLines, Tally
    from shardkit._campaign.run import CampaignPlan, run_campaign
    from shardkit._cli.paths import check_out_folder, check_output_file
    from shardkit._run.trace import write_atomically
    from shardkit._transport.resolve import resolve_target

    options = run_options("campaign", args)
    if args.cluster is not None and args.workers is None:
        raise UsageError("shardkit campaign: --cluster needs --workers N, the rounds to keep running at once on the cluster (its CPUs, say)")
    if args.cluster is None and args.workers is not None and args.workers > LOCAL_WORKERS:
        raise UsageError(f"shardkit campaign: --workers {args.workers} on one machine: at most {LOCAL_WORKERS} worker processes (more rounds at a time only with --cluster)")
    workers = args.workers if args.workers is not None else os.cpu_count() or 1
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    check_out_folder("campaign", args.out)
    for option, path, example in (("--report", args.report, "campaign.json"), ("--html", args.html, "campaign.html")):
        if path is not None:
            check_output_file("campaign", option, path, example)
    write_html = _html_writer() if args.html is not None else None
    # An unknown target is a usage error here, once, not one per worker.
    target = parse_target(args.target)
    resolve_target(target)
    if args.cluster is not None:
        _check_for_cluster(args.cluster, target, options)
    command = _command_line(options, target, workers, args.minutes, seed, args.cluster)
    print(command, flush=True)

    tally = Tally(workers)
    view = LiveBoard(sys.stderr, tally, args.minutes) if sys.stderr.isatty() else RoundLines(sys.stderr, tally)

    def on_event(event: Any) -> None:
        if event is not None:
            tally.apply(event, time.monotonic())
        view(event)

    plan = CampaignPlan(
        args.target, options, workers, seed, args.out, minutes=args.minutes, target_name=target.name, command=command, cluster=args.cluster
    )
    live_page = _LivePage(write_html, args.html) if write_html is not None else None
    try:
        result = run_campaign(plan, on_event, live_page)
    finally:
        view.clear()
    print(result.text())
    found = bool(result.failures)
    for line in _error_lines(result.errors):
        print(line, file=sys.stderr)
    unwritten = False
    document = result.document()
    if args.report is not None:
        try:
            write_atomically(args.report, document)
            print(f"report: {args.report}")
        except OSError as error:
            print(f"shardkit campaign: could not write --report {args.report}: {error.strerror or error}", file=sys.stderr)
            unwritten = True
    if write_html is not None:
        try:
            write_html(document, args.html)
            print(f"html: {args.html}")
        except (OSError, ValueError) as error:
            print(f"shardkit campaign: could not write --html {args.html}: {one_line(str(error))}", file=sys.stderr)
            unwritten = True
    if found:
        return EXIT_FAILURE
    if result.errors or unwritten:
        return EXIT_USAGE
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK


def _check_for_cluster(address: str, target: Target, options: Any) -> None:
    """What cannot work on a cluster, said before it is joined: a file target outside the
    folder shipped to the nodes, a database folder, which each node would keep apart, no Ray
    here, no cluster at ``address``."""
    from shardkit._campaign.cluster import check_cluster

    if isinstance(target, PythonTarget) and isinstance(target.code, str):
        file = target.code.rpartition(":")[0]
        if file.endswith(".py"):
            here = Path.cwd().resolve()
            if not Path(file).resolve().is_relative_to(here):
                message = f"shardkit campaign: --cluster ships this folder ({here.name}) to the nodes, and {file} lies outside it; start the campaign from a folder that holds the engine's file"
                raise UsageError(message)
            if Path(file).is_absolute():
                relative = Path(file).resolve().relative_to(here).as_posix()
                attribute = target.code.rpartition(":")[2]
                message = f"shardkit campaign: --cluster: each node runs its own copy of this folder, where {file} does not exist; name the engine's file from this folder: {relative}:{attribute}"
                raise UsageError(message)
    database = options.database_choice
    if database.kind == "directory":
        message = f"shardkit campaign: --cluster: the database folder {database.value} would be a separate folder on each node; name one every node reaches, --database redis://HOST:PORT/N"
        raise UsageError(message)
    check_cluster(address)


def _command_line(options: Any, target: Target, workers: int, minutes: float, seed: int, cluster: str | None) -> str:
    """The campaign's own command, with the seed: what it ran can be run again (the rounds a
    time limit allows vary with the machine; each round's seed does not)."""
    fuzz_line = options.command(target, seed, None, None)
    fuzz_start = f"shardkit fuzz {shlex.quote(target.name)} --seed {seed}"
    assert fuzz_line.startswith(fuzz_start)
    fuzz_options = fuzz_line[len(fuzz_start) :]
    on_cluster = f" --cluster {shlex.quote(cluster)}" if cluster is not None else ""
    return f"shardkit campaign {shlex.quote(target.name)} --workers {workers} --minutes {minutes:g} --seed {seed}{fuzz_options}{on_cluster}"


#: Seconds between two rewrites of a campaign's live page: each merges every round so far, and
#: a cluster's rounds may end many a second (the page itself reloads every 10 s).
LIVE_REWRITE_S = 5.0


class _LivePage:
    """``--html`` rewritten as rounds end (the first at once, then at most every
    ``LIVE_REWRITE_S``), so that a person can watch a long campaign in a browser (the page
    reloads itself while the campaign runs). A rewrite that fails is said once; the final
    page is written, or its failure reported, as ever."""

    def __init__(self, write_html: Any, path: Path) -> None:
        self.write_html = write_html
        self.path = path
        self.warned = False
        self.written_at: float | None = None

    def __call__(self, result: Any) -> None:
        now = time.monotonic()
        if self.written_at is not None and now - self.written_at < LIVE_REWRITE_S:
            return
        self.written_at = now
        try:
            self.write_html(result.document(), self.path)
        except (OSError, ValueError) as error:
            if not self.warned:
                self.warned = True
                print(f"shardkit campaign: warning: could not rewrite --html {self.path} while running: {one_line(str(error))}", file=sys.stderr)


def _html_writer() -> Any:
    """``shardkit._html.write_html``, imported before the run: a missing renderer is said at
    once, not after the minutes of the campaign."""
    try:
        from shardkit._html import write_html
    except ImportError as error:
        message = f"shardkit campaign: --html needs the HTML renderer shardkit._html, which cannot be imported here ({error}); leave out --html, or reinstall shardkit"
        raise UsageError(message) from None
    return write_html


def _error_lines(errors: list[Any]) -> list[str]:
    """One line per distinct error (an engine that cannot be built fails in every worker
    alike), and the traceback of a bug of the kit."""
    lines: list[str] = []
    seen: set[str] = set()
    for error in errors:
        if error.error in seen:
            continue
        seen.add(error.error)
        where = f"worker {error.worker} round {error.round} (seed {error.seed}): " if error.round else ""
        if error.details:
            lines.append(error.details.rstrip())
            lines.append(f"shardkit: internal error: {where}{one_line(error.error)}; this is a bug in shardkit: please report it with the command that ran")
        else:
            lines.append(f"shardkit campaign: error: {where}{one_line(error.error)}")
    return lines
