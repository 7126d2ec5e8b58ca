"""The ``shardkit`` command under its supervising parent: a run's verdict is reported by a
process the engine under test cannot end (``shardkit._process.supervisor``).

An engine runs inside the process that fuzzes it (unless ``--isolate``), and a native library
may end that process at any point: ``exit(0)`` from C, an ``atexit`` handler, a thread that
never ends and so holds the interpreter's exit forever. So each command that runs an engine
(``SUPERVISED_COMMANDS``) runs in a child process, in a process group of its own, and the
parent exits with the child's verdict; a child that ended without one exits 2, saying so.

``SHARDKIT_IN_PROCESS=1`` runs the command in this process instead (a debugger's choice),
with none of these guarantees. See docs/process.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

from shardkit._cli.exit_codes import EXIT_USAGE
from shardkit._process.supervisor import (
    Supervisor,
    become_subreaper,
    describe_status,
    die_with_parent,
    send_verdict,
)

__all__ = ["IN_PROCESS_VARIABLE", "SUPERVISED_COMMANDS", "command_line"]

#: The commands that run an engine, and so run under the supervising parent.
SUPERVISED_COMMANDS = frozenset({"fuzz", "campaign", "replay", "contract", "bench"})
#: Set to 1, the command runs in this process, unsupervised (a debugger's way in).
IN_PROCESS_VARIABLE = "SHARDKIT_IN_PROCESS"
#: How the parent tells the child where to send its verdict (removed from the child's environment).
_SUPERVISOR_VARIABLE = "SHARDKIT_SUPERVISOR"
#: The signals the parent passes on to the child, which runs in its own process group.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def command_line(argv: Sequence[str] | None = None) -> int:
    """The ``shardkit`` console script: a command that runs an engine runs supervised."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    supervisor = os.environ.pop(_SUPERVISOR_VARIABLE, None)
    if supervisor is not None:
        return _run_as_child(arguments, supervisor)
    supervised = bool(arguments) and arguments[0] in SUPERVISED_COMMANDS
    if not supervised or os.environ.get(IN_PROCESS_VARIABLE) == "1":
        from shardkit._cli.main import main

        return main(arguments)
    return _supervise(arguments)


def _run_as_child(arguments: list[str], supervisor: str) -> int:
    handover = json.loads(supervisor)
    verdict_fd: int = handover["fd"]
    os.set_inheritable(verdict_fd, False)  # the engine's own children never hold the verdict's pipe
    sys.path[:] = handover["path"]  # the parent's, whether a console script or ``python -m``
    if not die_with_parent(handover["parent"]):
        return EXIT_USAGE
    from shardkit._cli.main import main

    try:
        code = main(arguments)
    except SystemExit as exiting:
        # Only the parser's --help gets here: main turns a SystemExit raised anywhere in a
        # command, an engine's included, into exit 2 (``main``'s last handler).
        code = exiting.code if isinstance(exiting.code, int) else 0 if exiting.code is None else EXIT_USAGE
    send_verdict(verdict_fd, code)
    return code


def _supervise(arguments: list[str]) -> int:
    subreaper = become_subreaper()
    read_fd, write_fd = os.pipe()
    handover = {"fd": write_fd, "parent": os.getpid(), "path": sys.path}
    command = [
        sys.executable,
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        "import sys; from shardkit._cli.supervise import command_line; sys.exit(command_line())",
        *arguments,
    ]
    forwarded: list[int] = []
    started: list[subprocess.Popen[bytes]] = []

    def forward(number: int, frame: FrameType | None) -> None:
        forwarded.append(number)
        for child in started:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(number)

    previous = {number: signal.signal(number, forward) for number in _FORWARDED}
    try:
        # Its own process group: a Ctrl-C at the terminal reaches the parent only, which passes
        # it on once (twice would cut short the child saving what it found).
        environment = {**os.environ, _SUPERVISOR_VARIABLE: json.dumps(handover)}
        child = subprocess.Popen(command, pass_fds=(write_fd,), env=environment, process_group=0)
        started.append(child)
        os.close(write_fd)
        supervisor = Supervisor(child, read_fd, "the run's process")
        verdict = supervisor.wait_for_verdict()
        status = child.wait() if verdict.code is None else supervisor.wait_for_end()
    finally:
        os.close(read_fd)
        for number, handler in previous.items():
            signal.signal(number, handler)
    if subreaper:
        supervisor.stop_what_was_left()
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # what is left of its group at least, unnamed
    if verdict.code is not None:
        supervisor.note_a_changed_status(status)
        return verdict.code
    if forwarded and status == -forwarded[-1]:
        # Stopped by the signal this process was sent: end the same way, as shells expect.
        signal.signal(forwarded[-1], signal.SIG_DFL)
        os.kill(os.getpid(), forwarded[-1])
        return EXIT_USAGE
    assert status is not None
    message = (
        f"shardkit: error: the run's process ended ({describe_status(status)}) before the run reached a verdict: "
        "the engine under test, or a library it loaded, ended it, and nothing after that was checked; "
        "with --isolate the engine runs in a worker process, whose end is a failure the kit shrinks and reproduces"
    )
    print(message, file=sys.stderr, flush=True)
    return EXIT_USAGE
