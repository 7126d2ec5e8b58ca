"""The ``shardkit`` command: a thin adapter that parses options and calls the library.

Exit codes: 0 no failure, 1 a failure found (or reproduced), 2 a usage or input
error, reported in one line without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import random
import resource
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from shardkit._core.targets import (
    DEFAULT_TARGET,
    IsolationOptions,
    ResolvedTarget,
    check_step_timeout,
    describe_exception,
    is_loopback,
    is_remote_address,
)
from shardkit._run.trace import DEFAULT_OUT, write_atomically
from shardkit._transport.resolve import resolve_target

# Imports stay light here: `shardkit serve --worker` starts through this module, once per
# worker process, and should not pay for Hypothesis; each command imports what it runs.
from shardkit._version import __version__
from shardkit.contract import FAULT_KINDS, ROLES, EngineError
from shardkit.errors import ContractViolation, EngineLost, KitBug, ShardkitError, UsageError

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C before any failure was found, as shells report SIGINT


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _bad_value(message: str) -> argparse.ArgumentError:
    """What an option's ``type`` raises for a value it refuses, ``message`` naming the option:
    argparse prints it as it is. (An ``ArgumentTypeError`` would come out as "argument
    --examples: --examples must be …", the option named twice.)"""
    return argparse.ArgumentError(None, message)


def _positive_int(name: str) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise _bad_value(f"{name} must be a positive integer, got {text!r}")
        return value

    parse.__name__ = name
    return parse  # type: ignore[return-value]


def _seed(text: str) -> int:
    from shardkit._run.runner import parse_seed

    try:
        return parse_seed(text, "--seed")
    except ValueError as error:
        raise _bad_value(str(error)) from None


def _seconds(text: str) -> float:
    """A number; which numbers of seconds a run takes is ``check_step_timeout``'s to say."""
    try:
        return float(text)
    except ValueError:
        raise _bad_value(f"--step-timeout must be a number of seconds, got {text!r}") from None


@contextlib.contextmanager
def _command(command: str) -> Iterator[None]:
    """A ``UsageError`` from the library's checks of the options (which names the option) also
    names the command, as the command's own usage errors do."""
    try:
        yield
    except UsageError as error:
        raise UsageError(f"shardkit {command}: {error}") from None


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
    remote = target is not None and is_remote_address(target)
    if args.isolate and remote:
        message = f"shardkit {command}: --isolate runs a Python engine target in a worker process; {target} is already out of process"
        raise UsageError(message)
    if args.step_timeout is not None and not args.isolate and not remote and command == "fuzz":
        message = f"shardkit {command}: --step-timeout is the deadline of calls to another process; it needs --isolate or a grpc:// or unix: target"
        raise UsageError(message)


def _parser() -> _Parser:
    from shardkit._run.options import FuzzOptions

    defaults = FuzzOptions()
    parser = _Parser(prog="shardkit", description="Property-based state-machine testing for LLM shard engines.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = commands.add_parser("fuzz", help="fuzz an engine against the reference model")
    fuzz.add_argument("target", nargs="?", default=DEFAULT_TARGET, help=f"engine target (default {DEFAULT_TARGET})")
    fuzz.add_argument("--role", choices=[*ROLES, "any"], default="any", help="shard role to load (default: any)")
    fuzz.add_argument("--examples", type=_positive_int("--examples"), default=defaults.examples, help=f"examples to run ({defaults.examples})")
    fuzz.add_argument("--steps", type=_positive_int("--steps"), default=defaults.steps, help=f"steps per example ({defaults.steps})")
    fuzz.add_argument(
        "--seed", type=_seed, default=None, help="seed of the whole run, or random (default: chosen and printed)"
    )
    fuzz.add_argument(
        "--faults",
        default=defaults.faults,
        help=f"all, none, or a comma-separated list of {', '.join(FAULT_KINDS)}",
    )
    fuzz.add_argument("--no-twins", action="store_true", help="skip the twin oracle (faster, finds less)")
    fuzz.add_argument(
        "--reference",
        default=None,
        metavar="TARGET",
        help="build the twin oracle from this engine instead: fuzz TARGET differentially against it",
    )
    fuzz.add_argument(
        "--machine",
        default=None,
        metavar="MODULE:CLASS",
        help="fuzz with this ShardMachine subclass: the rules and model extended for a backend (docs/extending.md)",
    )
    fuzz.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where failure traces go ({DEFAULT_OUT})")
    fuzz.add_argument("--report", type=Path, default=None, help="write the run report (JSON) here")
    _isolation_options(fuzz)

    replay = commands.add_parser("replay", help="re-run a trace file without Hypothesis")
    replay.add_argument("trace", type=Path, help="a trace written by shardkit fuzz")
    replay.add_argument(
        "--engine",
        default=None,
        metavar="TARGET",
        help="replay against this engine target instead of the recorded one; its twins too (the recorded reference is not built)",
    )
    replay.add_argument(
        "--trust",
        action="store_true",
        help="build the code the trace names even where it is not inside the current folder "
        "(by default only shardkit's engines and code inside the project are built: a trace is data)",
    )
    _isolation_options(replay, replaying=True)

    bench = commands.add_parser("bench", help="measure throughput, time-to-find and shrink quality")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    bench.add_argument("--examples", type=_positive_int("--examples"), default=defaults.examples, help=f"examples per run ({defaults.examples})")
    bench.add_argument("--steps", type=_positive_int("--steps"), default=defaults.steps, help=f"steps per example ({defaults.steps})")
    bench.add_argument("--seed", type=_seed, default=1, help="seed of every run (1)")
    bench.add_argument(
        "--memory",
        action="store_true",
        help="also measure a fuzz run's peak RSS at 300 and 3000 examples (takes minutes)",
    )
    bench.add_argument(
        "--planted",
        default="shardkit._planted",
        help="module of planted-bug engines (the bundled shardkit._planted), or 'none'",
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
    serve.add_argument(
        "--max-engines",
        type=_positive_int("--max-engines"),
        default=None,
        metavar="N",
        help="engines kept alive at once; beyond N the least recently used is dropped (default 256)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code. Whatever escapes the library is reported
    here, so no exit code lies: only a found (or reproduced) failure is 1, and only a run
    that checked everything it was asked to is 0."""
    try:
        # --help and --version end here with argparse's SystemExit(0), as they should.
        args = _parser().parse_args(argv)
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    handlers = {"fuzz": _fuzz, "replay": _replay, "bench": _bench, "contract": _contract, "serve": _serve}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except EngineLost as lost:
        # Not an Exception, so that it ends a run wherever it happens: the server went away.
        print(f"shardkit: error: {_one_line(str(lost))}{_left_behind(args, lost)}", file=sys.stderr)
        return EXIT_USAGE
    except (ShardkitError, EngineError, OSError) as error:
        print(_error_line(error), file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:
        # Nothing should get here: the library turns what an engine raises into a finding or an
        # input error. Keep the traceback for the bug report; the exit code still says "error".
        traceback.print_exc(file=sys.stderr)
        print(_kit_bug_line(f"unexpected {describe_exception(error)}"), file=sys.stderr)
        return EXIT_USAGE
    except BaseException as error:
        # A SystemExit (or another BaseException) raised by the engine under test: never the kit's
        # own exit, and never a pass, since nothing after it was checked.
        message = (
            f"shardkit: error: the engine under test raised {describe_exception(error)}, which ended the run "
            "before anything more was checked (a SystemExit from an engine is never the kit's own exit)"
        )
        print(message, file=sys.stderr)
        return EXIT_USAGE


def _error_line(error: ShardkitError | EngineError | OSError) -> str:
    """The line an input error (or a bug of the kit) that ended a command prints."""
    if isinstance(error, UsageError):
        return str(error)  # it names the command and the option already
    if isinstance(error, KitBug):
        return _kit_bug_line(str(error))
    if isinstance(error, EngineError):
        # The driver lets an engine's refusal of load or capabilities pass (as the contract
        # allows, and replay and the choice of roles rely on); one that ends a run lands here.
        status = error.status
        return f"shardkit: error: the engine refused with EngineError {status.code.name}: {status.message}"
    return f"shardkit: error: {error}"


def _kit_bug_line(what: str) -> str:
    line = f"shardkit: internal error: {_one_line(what)}"
    if "bug in shardkit" not in what:
        line += "; this is a bug in shardkit: please report it with the command that ran"
    return line


def _one_line(text: str) -> str:
    return " / ".join(part.strip() for part in text.splitlines() if part.strip())


def _left_behind(args: argparse.Namespace, error: BaseException) -> str:
    """What a run that ended early left on disk: the shortest failure found so far, if any."""
    if args.command != "fuzz":
        return ""
    path = getattr(error, "in_progress_trace", None)
    if path is None:
        before: dict[Path, int] = getattr(args, "in_progress_before", {})
        written = [path for path, stamp in _in_progress_traces(args.out).items() if before.get(path) != stamp]
        path = sorted(written)[-1] if written else None
    if path is None:
        return f"; it left no in-progress trace in {args.out}"
    return f"; the shortest failure found before is kept in {path} (shardkit replay {shlex.quote(str(path))})"


def _in_progress_traces(out: Path) -> dict[Path, int]:
    """The in-progress traces in ``out`` and their modification stamps (to tell this run's apart)."""
    try:
        return {path: path.stat().st_mtime_ns for path in out.glob("*in-progress*.json") if path.is_file()}
    except OSError:
        return {}


def _fuzz(args: argparse.Namespace) -> int:
    from shardkit._run.options import FuzzOptions
    from shardkit._run.report import print_summary, report_document
    from shardkit._run.runner import fuzz

    with _command("fuzz"):
        options = FuzzOptions(
            examples=args.examples,
            steps=args.steps,
            role=args.role,
            faults=args.faults,
            twins=not args.no_twins,
            reference=args.reference,
            **({"base": args.machine} if args.machine is not None else {}),
            isolate=args.isolate,
            step_timeout=args.step_timeout,
            worker_memory_mb=args.worker_memory,
        )
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    # Where the findings go is checked before the run: a failure found must never be lost.
    _check_out_folder(args.out)
    if args.report is not None:
        _check_report_file(args.report)
    _check_isolation_options("fuzz", args, args.target)
    target = resolve_target(args.target)
    isolation = None
    if args.isolate:
        timeout = IsolationOptions().step_timeout if args.step_timeout is None else args.step_timeout
        isolation = IsolationOptions(timeout, args.worker_memory)
    # The whole command at once, as the summary's rerun line will print it: a run cut short
    # (a killed CI job) can be rerun from this line alone.
    print(options.command(target.name, seed, args.reference, isolation), flush=True)
    args.in_progress_before = _in_progress_traces(args.out)
    progress = _Progress(args.examples) if sys.stderr.isatty() else None
    try:
        result = fuzz(args.target, options, seed=seed, out=args.out, progress=progress)
    finally:
        if progress is not None:
            progress.clear()
    print_summary(result, sys.stdout)
    found = result.failure is not None
    # A found failure is exit 1 whatever else goes wrong; what could not be written says so.
    unwritten = getattr(result, "write_error", None)
    if unwritten:
        print(f"shardkit: {_one_line(str(unwritten))}", file=sys.stderr)
    if args.report is not None:
        try:
            write_atomically(args.report, report_document(result))
        except OSError as error:
            print(f"shardkit: could not write --report {args.report}: {_reason(error)}", file=sys.stderr)
            return EXIT_FAILURE if found else EXIT_USAGE
        print(f"report: {args.report}")
    if unwritten and not found:
        return EXIT_USAGE
    return EXIT_FAILURE if found else EXIT_OK


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def _check_out_folder(out: Path) -> None:
    """``--out`` must be a folder this process can write in, or one it can create."""
    if out.exists():
        if not out.is_dir():
            message = f"shardkit fuzz: --out {out} is a file, not a folder; name a folder for the failure traces"
            raise UsageError(message)
        _check_writable(out, f"--out {out}: cannot write in it")
        return
    existing = next((parent for parent in out.parents if parent.exists()), Path("."))
    if not existing.is_dir():
        message = f"shardkit fuzz: --out {out} cannot be created: {existing} is a file, not a folder"
        raise UsageError(message)
    _check_writable(existing, f"--out {out}: cannot create it in {existing}")


def _check_report_file(report: Path) -> None:
    """``--report`` must name a file in an existing folder this process can write in."""
    folder = report.parent
    if report.is_dir():
        message = f"shardkit fuzz: --report {report} is a folder; name a file, e.g. {report / 'report.json'}"
        raise UsageError(message)
    if not folder.exists():
        message = f"shardkit fuzz: --report {report}: the folder {folder} does not exist"
        raise UsageError(message)
    if not folder.is_dir():
        message = f"shardkit fuzz: --report {report}: {folder} is a file, not a folder"
        raise UsageError(message)
    _check_writable(folder, f"--report {report}: cannot write in {folder}")


def _check_writable(folder: Path, problem: str) -> None:
    """Create (and remove) a file in ``folder``: the only test permissions, mounts and root agree on."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".shardkit-write-check-"):
            pass
    except OSError as error:
        message = f"shardkit fuzz: {problem} ({_reason(error)}); choose a folder you can write in"
        raise UsageError(message) from None


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
    from shardkit._run.replay import replay
    from shardkit._run.report import failure_lines
    from shardkit._run.trace_reader import read_trace
    from shardkit._transport.isolation import target_with_options

    with _command("replay"):
        check_step_timeout(args.step_timeout)
    _check_isolation_options("replay", args, args.engine)
    engine: str | ResolvedTarget | None = args.engine
    isolate: bool | IsolationOptions | None = args.isolate
    if args.engine is not None and is_remote_address(args.engine):
        if args.step_timeout is not None:
            engine = target_with_options(args.engine, step_timeout=args.step_timeout)
    elif args.step_timeout is not None or args.worker_memory is not None:
        recorded = read_trace(args.trace).isolation
        if args.isolate is False or (args.isolate is None and recorded is None):
            message = "shardkit replay: --step-timeout and --worker-memory set up a worker process; add --isolate (the trace ran in-process)"
            raise UsageError(message)
        defaults = recorded or IsolationOptions()
        isolate = IsolationOptions(
            args.step_timeout if args.step_timeout is not None else defaults.step_timeout,
            args.worker_memory if args.worker_memory is not None else defaults.worker_memory_mb,
        )
    result = replay(
        args.trace, target=engine, isolate=isolate, trust=args.trust, announce=lambda line: print(line, flush=True)
    )
    if result.failure is None:
        print(f"did not reproduce: all {len(result.records)} steps matched the model")
        return EXIT_OK
    if not result.reproduced:
        print(f"a different failure than the trace recorded ({result.trace.failure.property}):")
    # The whole sequence, as fuzz printed it: the last step alone does not say how it was reached.
    for line in failure_lines(result.failure.property, result.records, result.failure.message):
        print(line)
    return EXIT_FAILURE


def _bench(args: argparse.Namespace) -> int:
    from shardkit._cli.bench import BenchSettings, render, run_bench

    planted = None if args.planted == "none" else args.planted
    if planted is not None:
        # Checked before minutes of measuring: a mistyped module is a usage error, not a skipped row.
        try:
            module = importlib.import_module(planted)
        except ImportError as error:
            message = f"shardkit bench: --planted {planted!r} cannot be imported ({error}); name a module with PLANTED, or 'none'"
            raise UsageError(message) from None
        if not isinstance(getattr(module, "PLANTED", None), tuple):
            message = f"shardkit bench: --planted {planted!r} has no PLANTED tuple of planted-bug engines; or pass 'none'"
            raise UsageError(message)
    memory = (300, 3000) if args.memory else ()
    figures = run_bench(BenchSettings(args.examples, args.steps, args.seed, planted, memory))
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return EXIT_OK


def _contract(args: argparse.Namespace) -> int:
    from shardkit import assert_shard_engine_contract

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
        from shardkit._transport.server import parse_listen, serve
    except ImportError as error:
        message = f"shardkit serve: needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise UsageError(message) from None
    try:
        _, host = parse_listen(args.listen)
    except ValueError as error:
        raise UsageError(f"shardkit serve: {error}") from None
    if args.worker:
        from shardkit._transport.worker import watch_parent

        # A native crash in the engine still leaves its Python stack in the worker's log.
        faulthandler.enable(sys.stderr, all_threads=False)
        # The kit asks a worker that missed a deadline where its threads hang before killing it.
        faulthandler.register(signal.SIGUSR1, sys.stderr, all_threads=True)
        watch_parent(sys.stdin.fileno())
    target = resolve_target(args.target)
    options = {} if args.max_engines is None else {"max_engines": args.max_engines}
    server = serve(target, args.listen, log=sys.stderr, fatal_exceptions=args.worker, **options)
    if host is not None and not is_loopback(host):
        warning = (
            f"shardkit serve: warning: {args.listen} is reachable from other machines and the service has no "
            "authentication: anyone who can reach the port can run this engine; listen on 127.0.0.1 or a unix: socket"
        )
        print(warning, file=sys.stderr, flush=True)
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
