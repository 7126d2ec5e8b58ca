"""``shardkit replay``, ``contract`` and ``serve``: each parses nothing itself and hands its
checked options to the library (``shardkit bench`` is ``shardkit._cli.bench``)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import resource
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from shardkit._cli.parser import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, check_isolation_options, for_command
from shardkit._core.targets import (
    IsolationOptions,
    RemoteAddress,
    ResolvedTarget,
    Target,
    WorkerCommand,
    parse_target,
)
from shardkit._transport.resolve import resolve_target
from shardkit.errors import ContractViolation, UsageError

__all__ = ["contract_command", "replay_command", "serve_command"]


def replay_command(args: argparse.Namespace) -> int:
    from shardkit._machine.spec import check_option
    from shardkit._run.replay import replay
    from shardkit._run.report import failure_lines
    from shardkit._run.trace_reader import read_trace
    from shardkit._transport.isolation import target_with_options

    with for_command("replay"):
        check_option("step_timeout", args.step_timeout)
    named = parse_target(args.engine) if args.engine is not None else None
    check_isolation_options("replay", args, named)
    engine: Target | ResolvedTarget | None = named
    if args.worker_command is not None:
        engine = WorkerCommand(args.worker_command)
    isolate: bool | IsolationOptions | None = args.isolate
    if isinstance(named, RemoteAddress):
        if args.step_timeout is not None:
            engine = target_with_options(named, step_timeout=args.step_timeout)
    elif args.step_timeout is not None or args.worker_memory is not None:
        recorded = read_trace(args.trace).isolation
        if args.worker_command is None and (args.isolate is False or (args.isolate is None and recorded is None)):
            message = "shardkit replay: --step-timeout and --worker-memory set up a worker process; add --isolate (the trace ran in-process)"
            raise UsageError(message)
        defaults = recorded or IsolationOptions()
        isolate = IsolationOptions(
            args.step_timeout if args.step_timeout is not None else defaults.step_timeout,
            args.worker_memory if args.worker_memory is not None else defaults.worker_memory_mb,
        )
    result = replay(
        args.trace,
        target=engine,
        isolate=isolate,
        trust=args.trust,
        announce=lambda line: print(line, flush=True),
        runs=args.runs,
    )
    if result.runs > 1:
        # A race shows on some runs only: the rate says how far to trust one clean run.
        print(
            f"the trace holds a parallel phase: {result.trace.failure.property} reproduced in "
            f"{result.reproductions} of {result.runs} runs, each on a fresh engine"
        )
    if result.undecided:
        # "Did not reproduce" would be a pass; with a check that reached no verdict, it is none.
        checks = result.undecided_checks
        print(f"undecided: no run failed, but {len(checks)} check{'' if len(checks) == 1 else 's'} reached no verdict:")
        for caveat in checks:
            print(f"  not checked: {caveat}")
        print("nothing is claimed about the trace: replay it again (--runs N for a parallel phase), or shorten what it holds")
        return EXIT_USAGE
    if result.failure is None:
        for caveat in result.not_checked:
            # What the engine's capabilities rule out, as a fuzz run lists it: the verdict stands.
            print(f"not checked: {caveat}")
        runs = f" in any of {result.runs} runs" if result.runs > 1 else ""
        steps = len(result.trace.actions)
        # A phase is one step of the trace and several calls: count both, as the failure did.
        calls = f" ({len(result.records)} calls)" if len(result.records) != steps else ""
        print(f"did not reproduce{runs}: all {steps} step{'' if steps == 1 else 's'}{calls} matched the model")
        return EXIT_OK
    if not result.reproduced:
        print(f"a different failure than the trace recorded ({result.trace.failure.property}):")
    # The whole sequence, as fuzz printed it: the last step alone does not say how it was reached.
    failure = result.failure
    for line in failure_lines(failure.property, result.records, failure.message, failure.rows, full_rows=args.full_rows):
        print(line)
    return EXIT_FAILURE


def contract_command(args: argparse.Namespace) -> int:
    from shardkit import assert_shard_engine_contract
    from shardkit._core.sensitivity import history_sensitivity
    from shardkit._machine.spec import check_option

    with for_command("contract"):
        check_option("step_timeout", args.step_timeout)
    given = parse_target(args.target) if args.target is not None else None
    if args.worker_command is None and given is None:
        raise UsageError(
            "shardkit contract: name the engine: a target (my_pkg.engine:make_engine) or --worker-command CMD"
        )
    plan = check_isolation_options("contract", args, given)
    assert plan is not None, "only replay leaves the plan to its trace"
    # In worker processes (--isolate, --worker-command), a crash is a failed check, not the end of the run.
    target = plan.start()
    try:
        skipped = assert_shard_engine_contract(target)
        sensitivity = history_sensitivity(target)
    except ContractViolation as violation:
        print(violation)
        return EXIT_FAILURE
    finally:
        if target.isolation is not None:
            target.isolation.close()
    print(
        f"{target.target.shown}: every contract check passed" + (f", {len(skipped)} skipped:" if skipped else "")
    )
    for reason in skipped:
        print(f"  skipped {reason}")
    print(sensitivity.summary())
    warning = sensitivity.warning()
    if warning is not None:
        print(warning)
    return EXIT_OK


def serve_command(args: argparse.Namespace) -> int:
    try:
        from shardkit._transport.calls_socket import calls_socket_path
        from shardkit._transport.server import binds_loopback_only, parse_listen, serve
    except ImportError as error:
        message = f"shardkit serve: needs the grpc extra ({error}); pip install 'shardkit[grpc]'"
        raise UsageError(message) from None
    try:
        _, host = parse_listen(args.listen)
    except ValueError as error:
        raise UsageError(f"shardkit serve: {error}") from None
    if args.fork_server is not None:
        return _fork_workers(args)
    if args.worker:
        from shardkit._transport.worker import watch_parent

        # A native crash in the engine still leaves its Python stack in the worker's log.
        faulthandler.enable(sys.stderr, all_threads=False)
        # The kit asks a worker that missed a deadline where its threads hang before killing it.
        faulthandler.register(signal.SIGUSR1, sys.stderr, all_threads=True)
        watch_parent(sys.stdin.fileno())
    target = resolve_target(args.target)
    options: dict[str, Any] = {} if args.max_engines is None else {"max_engines": args.max_engines}
    if args.worker:
        # The kit's own calls go over a plain socket beside the gRPC one (calls_socket.py).
        options["calls_socket"] = calls_socket_path(args.listen)
    server = serve(target, args.listen, log=sys.stderr, fatal_exceptions=args.worker, **options)
    if host is not None and not binds_loopback_only(host):
        warning = (
            f"shardkit serve: warning: {args.listen} is reachable from other machines and the service has no "
            "authentication: anyone who can reach the port can run this engine; listen on 127.0.0.1 or a unix: socket"
        )
        print(warning, file=sys.stderr, flush=True)
    # SIGTERM ends a server as Ctrl-C does, through the finally below, so that a unix: socket's
    # file goes with it; then the process still ends by SIGTERM, as whoever sent it expects. A
    # worker (--worker) is ended by the kit, which removes its socket itself.
    terminated: list[int] = []

    def stop_serving(signum: int, _frame: object) -> None:
        terminated.append(signum)
        server.server.stop(0)

    previous = None
    main_thread = threading.current_thread() is threading.main_thread()
    if not args.worker and main_thread and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, stop_serving)
    try:
        if args.worker_memory is not None:
            # After the server's own threads exist, before any engine: the limit is for the engines.
            _limit_memory(args.worker_memory)
        print(f"serving {target.name} on {server.url}", flush=True)
        server.wait()
    finally:
        server.stop(0)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGTERM)  # the handler it had before, SIG_DFL: the process ends
    return EXIT_OK


def _fork_workers(args: argparse.Namespace) -> int:
    """``serve TARGET --worker --fork-server FD``: the zygote of ``--isolate``
    (``shardkit._transport.forkserver``). It imports what a worker needs, once; each worker
    forked from it returns here and serves as ``serve TARGET --worker --listen URL`` would."""
    from shardkit._transport.forkserver import serve_forks
    from shardkit._transport.worker import watch_parent  # noqa: F401 - imported once here, not in each worker

    if not args.worker:
        raise UsageError("shardkit serve: --fork-server forks --worker processes; add --worker")
    resolve_target(args.target)

    def run_worker(url: str) -> int:
        return serve_command(argparse.Namespace(**{**vars(args), "listen": url, "fork_server": None}))

    return serve_forks(args.fork_server, run_worker)


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
