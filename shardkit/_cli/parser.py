"""The ``shardkit`` command line: its parser, the value types of its options, the checks
of option combinations the commands share, and its exit codes."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from shardkit._cli.exit_codes import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUTPUT_CLOSED, EXIT_USAGE
from shardkit._core.targets import DEFAULT_TARGET, Target, WorkerCommand, parse_target, worker_command_argv
from shardkit._run.trace import DEFAULT_OUT
from shardkit._version import __version__
from shardkit.errors import InvalidTarget, UsageError

if TYPE_CHECKING:
    from shardkit._machine.spec import Declared
    from shardkit._run.options import FuzzOptions
    from shardkit._transport.isolation import EnginePlan

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_OUTPUT_CLOSED",
    "EXIT_USAGE",
    "build_parser",
    "check_isolation_options",
    "database_options",
    "declared_option",
    "for_command",
    "one_line",
]

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _bad_value(message: str) -> argparse.ArgumentError:
    """What an option's ``type`` raises for a value it refuses, ``message`` naming the option:
    argparse prints it as it is. (An ``ArgumentTypeError`` would come out as "argument
    --examples: --examples must be …", the option named twice.)"""
    return argparse.ArgumentError(None, message)


def _declared_type(declaration: Declared) -> Callable[[str], Any]:
    """An option's argparse ``type``: its text read (``from_text``) and checked by the check
    declared beside its field; a value it refuses is the command's usage error."""

    from shardkit._machine.spec import OptionValueError

    def parse(text: str) -> Any:
        value = declaration.from_text(text) if declaration.from_text is not None else text
        try:
            return declaration.check(value) if declaration.check is not None else value
        except OptionValueError as error:
            raise _bad_value(f"{declaration.flag} {error}, got {text!r}") from None

    parse.__name__ = declaration.flag
    return parse


def declared_option(command: argparse.ArgumentParser | Any, name: str, help: str | None = None, **changes: Any) -> None:
    """Add the ``FuzzOptions`` option ``name`` to ``command`` (a parser or an argument group) as
    its field declares it: flag, default, help text, choices and check; ``help`` and
    ``changes`` (argparse's keywords) adapt it to a command."""
    from shardkit._machine.spec import declared
    from shardkit._run.options import FuzzOptions

    declaration = declared(FuzzOptions, name)
    default = next(each.default for each in fields(FuzzOptions) if each.name == name)
    if default is True:  # an option on by default, which the command line turns off: --no-twins
        command.add_argument(declaration.flag, action="store_true", help=help or declaration.help)
        return
    arguments: dict[str, Any] = {
        "default": default,
        "help": (help or declaration.help).format(default=default),
        "metavar": declaration.metavar,
    }
    if declaration.choices is not None:
        arguments["choices"] = list(declaration.choices)
        arguments["default"] = "any" if default is None else default
    elif declaration.from_text is not None:
        # A value typed as text is checked where the options are made (the command's usage error).
        arguments["type"] = _declared_type(declaration)
    command.add_argument(declaration.flag, **(arguments | changes))


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
    """A number; which numbers of seconds a run takes is the option's check to say (``shardkit._machine.spec``)."""
    try:
        return float(text)
    except ValueError:
        raise _bad_value(f"--step-timeout must be a number of seconds, got {text!r}") from None


LOCAL_WORKERS, CLUSTER_WORKERS = 256, 100_000  # a campaign's worker processes on one machine (far past any box's cores); rounds at a time on a cluster


def _workers(text: str) -> int:
    """``campaign --workers``: worker processes (at most ``LOCAL_WORKERS``, checked with ``--cluster``), or rounds at a time on a cluster."""
    if not text.isdigit() or not 1 <= int(text) <= CLUSTER_WORKERS:
        raise _bad_value(f"--workers must be a number of worker processes from 1 to {LOCAL_WORKERS} (rounds at a time on a --cluster: up to {CLUSTER_WORKERS:,}), e.g. --workers 2, got {text!r}")
    return int(text)


def _minutes(text: str) -> float:
    """``campaign --minutes``: a positive, finite number of minutes."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise _bad_value(f"--minutes must be a positive number of minutes, e.g. --minutes 10 or --minutes 0.5, got {text!r}")
    return value


@contextlib.contextmanager
def for_command(command: str) -> Iterator[None]:
    """A ``UsageError`` from the library's checks of the options (which names the option) also
    names the command, as the command's own usage errors do."""
    try:
        yield
    except UsageError as error:
        raise UsageError(f"shardkit {command}: {error}") from None


def run_options(command: str, args: argparse.Namespace, **only_fuzz: Any) -> FuzzOptions:
    """The ``FuzzOptions`` of ``shardkit fuzz`` or ``campaign`` from the options both take, and
    ``only_fuzz`` (those ``shardkit fuzz`` alone takes); a bad value names the command."""
    from shardkit._run.database import choose_database
    from shardkit._run.options import FuzzOptions

    with for_command(command):
        return FuzzOptions(
            examples=args.examples,
            steps=args.steps,
            role=args.role,
            faults=args.faults,
            twins=not args.no_twins,
            extreme_values=not args.no_extreme_values,
            concurrency=args.concurrency,
            database=choose_database(args.database, args.database_read_only),
            **only_fuzz,
        )


def _isolation_options(command: argparse.ArgumentParser, *, replaying: bool = False) -> None:
    from shardkit._machine.spec import declared
    from shardkit._run.options import FuzzOptions

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
    worker_command = declared(FuzzOptions, "worker_command")
    replaces = "; replaces the recorded engine" if replaying else ""
    # Checked where it becomes a WorkerCommand (check_isolation_options), as replay's and contract's is.
    group.add_argument(
        worker_command.flag, default=None, metavar=worker_command.metavar, help=worker_command.help.format() + replaces
    )
    # Any number here: which numbers of seconds a run takes is its check's to say.
    declared_option(group, "step_timeout", type=_seconds)
    declared_option(group, "worker_memory_mb")


def database_options(command: argparse.ArgumentParser) -> None:
    """``--database`` and ``--database-read-only``; ``shardkit._run.database.choose_database``
    reads them (with their environment variables) into the run's database."""
    group = command.add_argument_group("example database (docs/scaling.md#database)")
    group.add_argument(
        "--database",
        default=None,
        metavar="DB",
        help="save failing examples to DB and replay its saved ones first: redis://HOST:PORT/N (shared by "
        "every runner naming it; the redis extra), a folder, or none (default: $SHARDKIT_DATABASE, else none)",
    )
    group.add_argument(
        "--database-read-only",
        action="store_true",
        help="replay the database's examples without saving any (also SHARDKIT_DATABASE_READ_ONLY=1)",
    )


def check_isolation_options(command: str, args: argparse.Namespace, target: Target | None) -> EnginePlan | None:
    """Options that cannot apply are a usage error, never silently ignored. ``target`` is
    the engine target the command line named, if any, as ``parse_target`` read it. Returns
    how the engine runs (``engine_plan``), or None for a replay whose trace decides it."""
    worker_command = args.worker_command
    if worker_command is not None:
        if target is not None:
            flag = "--engine " if command == "replay" else ""
            message = f"shardkit {command}: --worker-command names the engine; drop {flag}{target.name!r} or the option"
            raise UsageError(message)
        if args.isolate is False and command == "replay":
            raise UsageError(
                "shardkit replay: --worker-command always runs the engine in worker processes; drop --no-isolate"
            )
        try:
            worker_command_argv(worker_command)
        except InvalidTarget as error:
            raise UsageError(f"shardkit {command}: --worker-command: {error}") from None
    from shardkit._transport.isolation import engine_plan

    if command == "replay" and args.isolate is None:
        return None  # the trace says whether to isolate; replay_command checks what depends on it
    engine = WorkerCommand(worker_command) if worker_command is not None else target or parse_target(DEFAULT_TARGET)
    # replay's deadline is checked by replay_command, against the trace's own isolation.
    step_timeout = args.step_timeout if command != "replay" else None
    try:
        return engine_plan(
            engine, isolate=bool(args.isolate), step_timeout=step_timeout, worker_memory_mb=args.worker_memory
        )
    except UsageError as error:
        raise UsageError(f"shardkit {command}: {error}") from None


def build_parser() -> _Parser:
    from shardkit._bench.settings import BENCH_PLANTED_SEEDS
    from shardkit._run.options import FuzzOptions
    from shardkit._run.replay import DEFAULT_REPLAY_RUNS

    defaults = FuzzOptions()
    parser = _Parser(prog="shardkit", description="Property-based state-machine testing for LLM shard engines.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    full_rows = "print the rows a determinism failure compared whole (its message names the largest difference)"
    fuzz = commands.add_parser("fuzz", help="fuzz an engine against the reference model")
    fuzz.add_argument("target", nargs="?", default=None, help=f"engine target (default {DEFAULT_TARGET}, unless --worker-command)")
    for name in ("role", "examples", "steps", "shrink_examples"):
        declared_option(fuzz, name)
    fuzz.add_argument(
        "--seed", type=_seed, default=None, help="seed of the whole run, or random (default: chosen and printed)"
    )
    for name in ("faults", "twins", "extreme_values", "reference"):
        declared_option(fuzz, name)
    declared_option(fuzz, "base", default=None)  # None: FuzzOptions' own default
    declared_option(fuzz, "concurrency")
    fuzz.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where failure traces go ({DEFAULT_OUT})")
    fuzz.add_argument("--report", type=Path, default=None, help="write the run report (JSON) here")
    fuzz.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the run report as one HTML page here (docs/report.md)")
    fuzz.add_argument("--full-rows", action="store_true", help=full_rows)
    database_options(fuzz)
    _isolation_options(fuzz)

    campaign = commands.add_parser("campaign", help="fuzz with several worker processes for some minutes; one merged report")
    campaign.add_argument("target", nargs="?", default=DEFAULT_TARGET, help=f"engine target (default {DEFAULT_TARGET})")
    campaign.add_argument("--workers", type=_workers, default=None, metavar="N", help="worker processes (default: one per CPU core)")
    campaign.add_argument("--minutes", type=_minutes, required=True, metavar="M", help="start rounds for M minutes; rounds in flight then finish")
    campaign.add_argument("--seed", type=_seed, default=None, help="seed the rounds' seeds derive from, or random (default: chosen and printed)")
    declared_option(campaign, "examples", help="examples per round ({default})")
    for name in ("steps", "role", "faults", "twins", "extreme_values"):
        declared_option(campaign, name)
    declared_option(campaign, "concurrency", help="lanes of calls sent at the same time, as for fuzz")
    campaign.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where failure traces go ({DEFAULT_OUT})")
    campaign.add_argument("--report", type=Path, default=None, help="write the merged report (JSON) here")
    campaign.add_argument("--html", type=Path, default=None, help="write the merged report as an HTML page here")
    campaign.add_argument("--cluster", default=None, metavar="ADDRESS", help="run the rounds as tasks on the Ray cluster at ADDRESS (HOST:PORT, ray://HOST:10001 or auto; the ray extra), --workers at a time")
    database_options(campaign)

    replay = commands.add_parser("replay", help="re-run a trace file without Hypothesis")
    replay.add_argument("trace", type=Path, help="a trace written by shardkit fuzz")
    replay.add_argument("--full-rows", action="store_true", help=full_rows)
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
    replay.add_argument(
        "--runs",
        type=_positive_int("--runs"),
        default=DEFAULT_REPLAY_RUNS,
        help=f"runs of a trace that holds a parallel phase, each on a fresh engine, for the rate it reproduces at ({DEFAULT_REPLAY_RUNS}; other traces run once)",
    )
    _isolation_options(replay, replaying=True)

    bench = commands.add_parser("bench", help="measure throughput, time-to-find and shrink quality")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    # Sizes default to None: --quick picks smaller ones, and a size given beside it still applies.
    declared_option(bench, "examples", default=None, help=f"examples per run ({defaults.examples})")
    declared_option(bench, "steps", default=None, help=f"steps per example ({defaults.steps})")
    bench.add_argument("--seed", type=_seed, default=1, help="seed of every run (1)")
    bench.add_argument(
        "--rounds",
        type=_positive_int("--rounds"),
        default=None,
        help="rounds of each interleaved comparison (kit and bare, in-process and out of process); the median round is reported (3)",
    )
    bench.add_argument("--quick", action="store_true", help="every section at small sizes, in well under a minute: checks that the bench runs; its figures say nothing about speed")
    bench.add_argument(
        "--profile",
        action="store_true",
        help="also profile one kit run per role: the share of its time each component of the kit takes",
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="measure peak RSS at 300 and 3000 examples of 100 steps (takes minutes) instead of --examples and five times as many",
    )
    bench.add_argument("--cluster", action="store_true", help="instead of the sections: a campaign on Ray clusters of 1 and 2 worker nodes started here, next to local workers, and Ray's start-up (the ray extra)")
    bench.add_argument(
        "--planted",
        default="shardkit._planted",
        help="module of planted-bug engines (the bundled shardkit._planted), or 'none'",
    )
    bench.add_argument(
        "--planted-seeds",
        type=_positive_int("--planted-seeds"),
        default=None,
        help=f"fuzz each planted engine at this many seeds, from --seed on ({BENCH_PLANTED_SEEDS})",
    )

    contract = commands.add_parser("contract", help="run the quick static contract checks")
    contract.add_argument("target", nargs="?", default=None, help="engine target, e.g. my_pkg.engine:make_engine (or --worker-command)")
    _isolation_options(contract)

    report = commands.add_parser("report", help="draw a --report JSON as one HTML page (docs/report.md)")
    report.add_argument("report", type=Path, metavar="REPORT.json", help="a report written by shardkit fuzz --report")
    report.add_argument(
        "-o", "--output", type=Path, default=None, metavar="FILE", help="the HTML file to write (default: REPORT with .html)"
    )

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
    declared_option(serve, "worker_memory_mb", help="limit this process's memory (RLIMIT_DATA) to MB MiB")
    serve.add_argument(
        "--max-engines",
        type=_positive_int("--max-engines"),
        default=None,
        metavar="N",
        help="engines kept alive at once; beyond N the least recently used is dropped (default 256)",
    )
    # With --worker: be --isolate's fork server (shardkit/_transport/forkserver.py), forking
    # a worker for each request on this descriptor. The kit passes it; nobody types it.
    serve.add_argument("--fork-server", type=int, default=None, metavar="FD", help=argparse.SUPPRESS)
    return parser


def one_line(text: str) -> str:
    return " / ".join(part.strip() for part in text.splitlines() if part.strip())
