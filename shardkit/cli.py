"""The ``shardkit`` command: a thin adapter that parses options and calls the library.

Exit codes: 0 no failure, 1 a failure found (or reproduced), 2 a usage or input
error, reported in one line without a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import resource
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

# Imports stay light here: `shardkit serve --worker` starts through this module, once per
# worker process, and should not pay for Hypothesis; each command imports what it runs.
from ._version import __version__
from .contract import FAULT_KINDS, ROLES
from .errors import ContractViolation, InvalidTarget, ShardkitError
from .targets import DEFAULT_TARGET, ResolvedTarget, resolve_target
from .trace import DEFAULT_OUT

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
    from .runner import parse_seed

    try:
        return parse_seed(text, "--seed")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        message = f"--step-timeout must be a number of seconds in (0, 3600], got {text!r}"
        raise argparse.ArgumentTypeError(message)
    return value


def _isolation_options(command: argparse.ArgumentParser, *, replaying: bool = False) -> None:
    group = command.add_argument_group("isolation (the grpc extra)")
    if replaying:
        group.add_argument(
            "--isolate",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="run the engine in a worker process, or not (default: as the trace records)",
        )
    else:
        group.add_argument(
            "--isolate",
            action="store_true",
            help="run the engine in a worker process: a crash, hang or memory blow-up becomes a reported failure",
        )
    group.add_argument(
        "--step-timeout",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds each engine call may take (isolated or grpc:// engines; default 5)",
    )
    group.add_argument(
        "--worker-memory",
        type=_positive_int("--worker-memory"),
        default=None,
        metavar="MB",
        help="limit the worker's memory (RLIMIT_DATA) to MB MiB; needs --isolate",
    )


def _check_isolation_options(command: str, args: argparse.Namespace, target: str | None) -> None:
    """Options that cannot apply are a usage error, never silently ignored."""
    # replay's --isolate is None when the trace decides; the trace then says whether to isolate.
    isolation_refused = args.isolate is False if command == "replay" else not args.isolate
    if args.worker_memory is not None and isolation_refused:
        raise UsageError(f"shardkit {command}: --worker-memory limits a worker process; it needs --isolate")
    remote = target is not None and target.startswith(("grpc://", "unix:"))
    if args.isolate and remote:
        message = f"shardkit {command}: --isolate runs a Python engine target in a worker process; {target} is already out of process"
        raise UsageError(message)
    if args.step_timeout is not None and not args.isolate and not remote and command == "fuzz":
        message = f"shardkit {command}: --step-timeout is the deadline of calls to another process; it needs --isolate or a grpc:// or unix: target"
        raise UsageError(message)


def _faults(text: str) -> str:
    from .machine import parse_faults

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
    _isolation_options(fuzz)

    replay = commands.add_parser("replay", help="re-run a trace file without Hypothesis")
    replay.add_argument("trace", type=Path, help="a trace written by shardkit fuzz")
    replay.add_argument("--engine", default=None, help="replay against this engine target instead of the recorded one")
    _isolation_options(replay, replaying=True)

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
    serve.add_argument(
        "--worker",
        action="store_true",
        help="serve as --isolate's worker: an engine exception ends the process (exit 70, 71 for MemoryError) "
        "as a native crash would, and the process ends when its stdin closes",
    )
    serve.add_argument(
        "--worker-memory",
        type=_positive_int("--worker-memory"),
        default=None,
        metavar="MB",
        help="limit this process's memory (RLIMIT_DATA) to MB MiB",
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
    _check_isolation_options("fuzz", args, args.target)
    target = resolve_target(args.target)
    isolation = " --isolate" if args.isolate else ""
    print(f"shardkit fuzz {target.name} --seed {seed}{isolation}", flush=True)
    progress = _Progress(args.examples) if sys.stderr.isatty() else None
    try:
        result = fuzz(
            args.target,
            seed=seed,
            examples=args.examples,
            steps=args.steps,
            role=args.role,
            faults=args.faults,
            twins=not args.no_twins,
            reference=args.reference,
            out=args.out,
            progress=progress,
            isolate=args.isolate,
            step_timeout=args.step_timeout,
            worker_memory_mb=args.worker_memory,
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
    from .isolation import IsolationOptions, target_with_options
    from .replay import load_trace, replay

    _check_isolation_options("replay", args, args.engine)
    engine: str | ResolvedTarget | None = args.engine
    isolate: bool | IsolationOptions | None = args.isolate
    if args.engine is not None and args.engine.startswith(("grpc://", "unix:")):
        if args.step_timeout is not None:
            engine = target_with_options(args.engine, step_timeout=args.step_timeout)
    elif args.step_timeout is not None or args.worker_memory is not None:
        recorded = load_trace(args.trace).isolation
        if args.isolate is False or (args.isolate is None and recorded is None):
            message = "shardkit replay: --step-timeout and --worker-memory set up a worker process; add --isolate (the trace ran in-process)"
            raise UsageError(message)
        defaults = recorded or IsolationOptions()
        isolate = IsolationOptions(
            args.step_timeout if args.step_timeout is not None else defaults.step_timeout,
            args.worker_memory if args.worker_memory is not None else defaults.worker_memory_mb,
        )
    result = replay(args.trace, target=engine, isolate=isolate)
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
    if args.worker:
        from .remote.worker import watch_parent

        # A native crash in the engine still leaves its Python stack in the worker's log.
        faulthandler.enable(sys.stderr, all_threads=False)
        # The kit asks a worker that missed a deadline where its threads hang before killing it.
        faulthandler.register(signal.SIGUSR1, sys.stderr, all_threads=True)
        watch_parent(sys.stdin.fileno())
    target = resolve_target(args.target)
    server = serve(target, args.listen, log=sys.stderr, fatal_exceptions=args.worker)
    try:
        if args.worker_memory is not None:
            # After the server's own threads exist, before any engine: the limit is for the engines.
            _limit_memory(args.worker_memory)
        print(f"serving {target.name} on {server.url}", flush=True)
        server.wait()
    finally:
        server.stop(0)
    return EXIT_OK


#: Room left under --worker-memory for the threads gRPC starts as calls arrive (8 MiB of stack each).
_THREAD_HEADROOM_MIB = 64


def _limit_memory(mebibytes: int) -> None:
    """Cap this process's data (heap, private mappings, thread stacks) with RLIMIT_DATA."""
    status = Path("/proc/self/status")
    used = 0
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmData:"):
                used = int(line.split()[1]) // 1024
    needed = used + _THREAD_HEADROOM_MIB
    if mebibytes < needed:
        message = (
            f"shardkit serve: --worker-memory {mebibytes} MiB is below what this worker needs before any engine "
            f"({used} MiB of data plus {_THREAD_HEADROOM_MIB} MiB for its threads); give it at least {needed}"
        )
        raise UsageError(message)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = mebibytes * 2**20
    if hard != resource.RLIM_INFINITY and limit > hard:
        message = (
            f"shardkit serve: --worker-memory {mebibytes} MiB is above this system's hard limit of {hard // 2**20} MiB"
        )
        raise UsageError(message)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


if __name__ == "__main__":
    raise SystemExit(main())
