"""The ``shardkit`` command: a thin adapter that parses options and calls the library.

Exit codes: 0 no failure, 1 a failure found (or reproduced), 2 a usage or input
error, reported in one line without a traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ._version import __version__
from .contract import FAULT_KINDS
from .errors import ContractViolation, InvalidTarget, ShardkitError
from .machine import ROLES, parse_faults
from .runner import DEFAULT_OUT, parse_seed
from .targets import DEFAULT_TARGET, resolve_target

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C before any failure was found, as shells report SIGINT


class UsageError(Exception):
    """A mistake on the command line: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(name: str) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            message = f"{name} must be a positive integer, got {text!r}"
            raise argparse.ArgumentTypeError(message)
        return value

    parse.__name__ = name
    return parse  # type: ignore[return-value]


def _seed(text: str) -> int:
    try:
        return parse_seed(text, "--seed")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _faults(text: str) -> str:
    try:
        parse_faults(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _parser() -> _Parser:
    parser = _Parser(prog="shardkit", description="Property-based state-machine testing for LLM shard engines.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = commands.add_parser("fuzz", help="fuzz an engine against the reference model")
    fuzz.add_argument("target", nargs="?", default=DEFAULT_TARGET, help=f"engine target (default {DEFAULT_TARGET})")
    fuzz.add_argument("--role", choices=[*ROLES, "any"], default="any", help="shard role to load (default: any)")
    fuzz.add_argument("--examples", type=_positive_int("--examples"), default=200, help="examples to run (200)")
    fuzz.add_argument("--steps", type=_positive_int("--steps"), default=50, help="steps per example (50)")
    fuzz.add_argument(
        "--seed", type=_seed, default=None, help="seed of the whole run, or random (default: chosen and printed)"
    )
    fuzz.add_argument(
        "--faults",
        type=_faults,
        default="all",
        help=f"all, none, or a comma-separated list of {', '.join(FAULT_KINDS)}",
    )
    fuzz.add_argument("--no-twins", action="store_true", help="skip the twin oracle (faster, finds less)")
    fuzz.add_argument(
        "--reference",
        default=None,
        metavar="TARGET",
        help="build the twin oracle from this engine instead: fuzz TARGET differentially against it",
    )
    fuzz.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where failure traces go ({DEFAULT_OUT})")
    fuzz.add_argument("--report", type=Path, default=None, help="write the run report (JSON) here")

    replay = commands.add_parser("replay", help="re-run a trace file without Hypothesis")
    replay.add_argument("trace", type=Path, help="a trace written by shardkit fuzz")
    replay.add_argument("--engine", default=None, help="replay against this engine target instead of the recorded one")

    bench = commands.add_parser("bench", help="measure throughput, time-to-find and shrink quality")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bench.add_argument("--examples", type=_positive_int("--examples"), default=200, help="examples per run (200)")
    bench.add_argument("--steps", type=_positive_int("--steps"), default=50, help="steps per example (50)")
    bench.add_argument("--seed", type=_seed, default=1, help="seed of every run (1)")
    bench.add_argument(
        "--planted", default="tests.planted", help="module of planted-bug engines (tests.planted), or 'none'"
    )

    contract = commands.add_parser("contract", help="run the quick static contract checks")
    contract.add_argument("target", help="engine target, e.g. my_pkg.engine:make_engine")

    serve = commands.add_parser("serve", help="serve an engine target over gRPC (the grpc extra)")
    serve.add_argument("target", help="engine target, e.g. shardkit:FakeShardEngine")
    serve.add_argument(
        "--listen",
        default="127.0.0.1:7000",
        metavar="ADDR",
        help="HOST:PORT (PORT 0 picks a free one) or unix:PATH (default 127.0.0.1:7000)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        handlers = {"fuzz": _fuzz, "replay": _replay, "bench": _bench, "contract": _contract, "serve": _serve}
        handler = handlers[args.command]
        return handler(args)
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    except (InvalidTarget, ShardkitError, OSError) as error:
        print(f"shardkit: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _fuzz(args: argparse.Namespace) -> int:
    from .report import print_summary
    from .runner import fuzz, report_document

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.report is not None and not args.report.parent.exists():
        message = f"shardkit fuzz: --report {args.report}: the folder {args.report.parent} does not exist"
        raise UsageError(message)
    target = resolve_target(args.target)
    print(f"shardkit fuzz {target.name} --seed {seed}", flush=True)
    progress = _Progress(args.examples) if sys.stderr.isatty() else None
    try:
        result = fuzz(
            target,
            seed=seed,
            examples=args.examples,
            steps=args.steps,
            role=args.role,
            faults=args.faults,
            twins=not args.no_twins,
            reference=args.reference,
            out=args.out,
            progress=progress,
        )
    finally:
        if progress is not None:
            progress.clear()
    print_summary(result, sys.stdout)
    if args.report is not None:
        args.report.write_text(json.dumps(report_document(result), indent=2, ensure_ascii=False) + "\n")
        print(f"report: {args.report}")
    return EXIT_FAILURE if result.failure is not None else EXIT_OK


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


def _replay(args: argparse.Namespace) -> int:
    from .replay import replay

    result = replay(args.trace, target=args.engine)
    if result.failure is None:
        print(f"did not reproduce: all {len(result.records)} steps matched the model")
        return EXIT_OK
    if not result.reproduced:
        print(f"a different failure than the trace recorded ({result.trace.failure.property}):")
    print(result.failure.message)
    return EXIT_FAILURE


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchSettings, render, run_bench

    planted = None if args.planted == "none" else args.planted
    figures = run_bench(BenchSettings(args.examples, args.steps, args.seed, planted))
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return EXIT_OK


def _contract(args: argparse.Namespace) -> int:
    from . import assert_shard_engine_contract

    target = resolve_target(args.target)
    try:
        skipped = assert_shard_engine_contract(target)
    except ContractViolation as violation:
        print(violation)
        return EXIT_FAILURE
    print(f"{target.name}: every contract check passed" + (f", {len(skipped)} skipped:" if skipped else ""))
    for reason in skipped:
        print(f"  skipped {reason}")
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    try:
        from .remote.server import parse_listen, serve
    except ImportError as error:
        message = f"shardkit serve: needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise UsageError(message) from None
    try:
        parse_listen(args.listen)
    except ValueError as error:
        raise UsageError(f"shardkit serve: {error}") from None
    target = resolve_target(args.target)
    server = serve(target, args.listen, log=sys.stderr)
    print(f"serving {target.name} on {server.url}", flush=True)
    try:
        server.wait()
    finally:
        server.stop(0)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
