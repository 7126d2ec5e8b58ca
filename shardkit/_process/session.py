"""A pytest session that runs shardkit suites, under a supervising parent (the plugin's
``pytest_runtestloop``): an engine that ends pytest's process never passes.

pytest runs an engine in its own process, where a native ``exit(0)`` ends the session with
exit 0 and no output. So a top-level session (not a pytest-xdist worker, whose end the
controller already reports as a crashed test; not a ``pytester`` run inside another session)
that collected a shardkit suite forks as its tests start: the child runs them, and the parent
waits for its verdict and exits with it. A child that ends before its verdict fails the
session (exit 1), naming the test it was running. ``SHARDKIT_IN_PROCESS=1`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from typing import NoReturn

import pytest

from shardkit._process.supervisor import (
    ForkedChild,
    Supervisor,
    become_subreaper,
    describe_status,
    die_with_parent,
    send_line,
    send_verdict,
    stop_leftover_processes,
    threads_left_running,
)

__all__ = ["begin_session", "end_session", "on_test_start", "supervise_session"]

#: The pid of the process whose top-level pytest session is running (a ``pytester`` session
#: inside it is not top-level: it finds its own pid here).
_SESSION_PROCESS_VARIABLE = "SHARDKIT_PYTEST_PROCESS"
_IN_PROCESS_VARIABLE = "SHARDKIT_IN_PROCESS"
#: pytest's exit code for failed tests: a session whose process ended early failed.
_TESTS_FAILED = int(pytest.ExitCode.TESTS_FAILED)
#: Whether a session is the top-level one of its process.
_TOP_LEVEL_KEY: pytest.StashKey[bool] = pytest.StashKey()
#: Whether this session (a pytest-xdist worker's) names the threads its tests left, at its end.
_WORKER_NAMES_THREADS_KEY: pytest.StashKey[bool] = pytest.StashKey()
#: In a pytest-xdist worker: the mark its tests' processes carry in their environment.
_WORKER_MARK_KEY: pytest.StashKey[str] = pytest.StashKey()
#: In a pytest-xdist worker: whether it ran an item of a shardkit suite.
_WORKER_RAN_A_SUITE_KEY: pytest.StashKey[bool] = pytest.StashKey()
#: The environment entry that marks the processes a pytest-xdist worker's tests start.
_WORKER_MARK_VARIABLE = "SHARDKIT_PYTEST_WORKER_MARK"
#: In a supervised child: where its verdict goes.
_VERDICT_FD_KEY: pytest.StashKey[int] = pytest.StashKey()


def begin_session(config: pytest.Config) -> None:
    """At configure: note whether this session is the top-level one of its process."""
    top_level = os.environ.get(_SESSION_PROCESS_VARIABLE) != str(os.getpid())
    config.stash[_TOP_LEVEL_KEY] = top_level
    if top_level:
        os.environ[_SESSION_PROCESS_VARIABLE] = str(os.getpid())
    # A pytest-xdist worker is watched by its controller, which reports its end; it names the
    # threads its tests left, and stops the processes they left. It is no subreaper (orphans
    # would wait as zombies until its end, where a test may wait for one to go): the processes
    # its tests start carry a mark in their environment instead, which orphans keep.
    worker = top_level and hasattr(config, "workerinput")
    config.stash[_WORKER_NAMES_THREADS_KEY] = worker
    if worker:
        mark = f"{os.getpid()}-{uuid.uuid4().hex}"
        os.environ[_WORKER_MARK_VARIABLE] = mark
        config.stash[_WORKER_MARK_KEY] = f"{_WORKER_MARK_VARIABLE}={mark}"


def _is_suite_item(item: pytest.Item) -> bool:
    """An item of a suite ``machine_for`` built (its class is a shardkit machine's TestCase)."""
    return getattr(getattr(item, "cls", None), "shardkit_machine", None) is not None


def supervise_session(session: pytest.Session) -> None:
    """At the start of the test loop: fork if this session needs a supervisor. Returns in
    the child (which runs the tests) and where none is needed; the parent never returns."""
    config = session.config
    suites = any(_is_suite_item(item) for item in session.items)
    if (
        not suites
        or not config.stash.get(_TOP_LEVEL_KEY, False)
        or hasattr(config, "workerinput")  # a pytest-xdist worker
        or config.pluginmanager.has_plugin("dsession")  # the pytest-xdist controller runs no test
        or config.option.collectonly
        or os.environ.get(_IN_PROCESS_VARIABLE) == "1"
        or not hasattr(os, "fork")
    ):
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.environ[_SESSION_PROCESS_VARIABLE] = str(os.getpid())
        if not die_with_parent(parent):
            os._exit(_TESTS_FAILED)
        config.stash[_VERDICT_FD_KEY] = write_fd
        return
    os.close(write_fd)
    _wait_as_parent(ForkedChild(pid), read_fd)


def on_test_start(item: pytest.Item) -> None:
    config = item.config
    fd = config.stash.get(_VERDICT_FD_KEY, None)
    if fd is not None:
        send_line(fd, {"running": item.nodeid})
    if _WORKER_MARK_KEY in config.stash and _is_suite_item(item):
        config.stash[_WORKER_RAN_A_SUITE_KEY] = True


def end_session(config: pytest.Config, exit_status: int) -> None:
    """At unconfigure, in a supervised child: send the verdict, pytest's exit status. In a
    pytest-xdist worker: name the threads left running; and if it ran a shardkit suite, stop
    and name the processes left: its children, and those that carry its mark (which other
    suites' workers leave alone: their processes are their own business)."""
    fd = config.stash.get(_VERDICT_FD_KEY, None)
    if fd is not None:
        send_verdict(fd, exit_status)
        del config.stash[_VERDICT_FD_KEY]
    if config.stash.get(_WORKER_NAMES_THREADS_KEY, False):
        threads = threads_left_running()
        if threads:
            named = ", ".join(sorted(f"{name!r}" for name in set(threads)))
            print(
                f"shardkit: the session's tests left non-daemon threads running: {named}", file=sys.stderr, flush=True
            )
    if config.stash.get(_WORKER_RAN_A_SUITE_KEY, False):
        stop_leftover_processes("the session", marked=config.stash[_WORKER_MARK_KEY])


def _wait_as_parent(child: ForkedChild, read_fd: int) -> NoReturn:
    # The child shares this terminal's process group, so that --pdb can read from it: a Ctrl-C
    # reaches it directly. Signals sent to this process alone are passed on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, lambda number, frame: _forward(child, number))
    subreaper = become_subreaper()
    supervisor = Supervisor(child, read_fd, "the pytest process", left_by="the session")
    verdict = supervisor.wait_for_verdict()
    if verdict.code is not None:
        status = supervisor.wait_for_end()
        if subreaper:
            supervisor.stop_what_was_left()
        supervisor.note_a_changed_status(status)
        os._exit(verdict.code)
    status = child.wait()
    if subreaper:
        supervisor.stop_what_was_left()
    where = f"while running {verdict.running}" if verdict.running else "before its first test"
    message = (
        f"shardkit: FAILED: the pytest process ended ({describe_status(status)}) {where}, before pytest reported: "
        "the engine under test, or a library it loaded, ended it, and nothing after that was checked; "
        "isolate=True in machine_for runs the engine in a worker process, whose end is a failure the kit "
        "shrinks and reproduces"
    )
    print(message, file=sys.stderr, flush=True)
    os._exit(_TESTS_FAILED)


def _forward(child: ForkedChild, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(number)
