"""A supervising parent and its child, which runs the engine: the child sends its verdict down
a pipe, and the parent alone decides the exit code.

- A child that ends without sending a verdict never passes: the parent says how it ended.
- A verdict sent stands, whatever exit status the child's end then gives (an ``atexit``
  handler's ``os._exit(0)``).
- A child that does not end within ``EXIT_GRACE_SECONDS`` of its verdict is killed, and the
  non-daemon threads it still ran at the verdict are named.
- Every process the child started and left behind is killed and named: the parent is the
  "child subreaper" of its descendants (Linux), so orphans come to it however deep they were.

The grace is the only clock here, and it decides no verdict: only when to stop waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

__all__ = [
    "EXIT_GRACE_SECONDS",
    "ForkedChild",
    "Supervisor",
    "Verdict",
    "become_subreaper",
    "describe_status",
    "die_with_parent",
    "send_line",
    "send_verdict",
    "stop_leftover_processes",
    "threads_left_running",
]

#: Seconds a child may take to end once it has sent its verdict (its threads and atexit
#: handlers run then). Past it the child is killed, and that is said; the verdict stands.
EXIT_GRACE_SECONDS = 10.0
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
#: Processes named in the line about what a child left behind; more are counted.
_NAMED_PROCESSES = 5
_POLL_SECONDS = 0.05


class Child(Protocol):
    """What the parent needs of its child: ``subprocess.Popen``'s answers."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class ForkedChild:
    """A child made by ``os.fork``, answering as ``subprocess.Popen`` does (returncode: minus
    the signal that ended it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
            time.sleep(_POLL_SECONDS)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)


class Verdict:
    """What the child sent: its exit code (None: it sent none), the non-daemon threads it
    still ran then, and the last thing it said it was running."""

    def __init__(self) -> None:
        self.code: int | None = None
        self.threads: list[str] = []
        self.running: str | None = None

    def take(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if isinstance(message.get("running"), str):
            self.running = message["running"]
        if isinstance(message.get("exit"), int):
            self.code = message["exit"]
            threads = message.get("threads")
            self.threads = [str(name) for name in threads] if isinstance(threads, list) else []


def send_line(fd: int, message: dict[str, object]) -> None:
    """One message to the parent (``{"running": …}`` as the child moves on)."""
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps(message).encode() + b"\n")


def send_verdict(fd: int, code: int) -> None:
    """The child's last word: its exit code, sent once everything it prints is out."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    send_line(fd, {"exit": code, "threads": threads_left_running()})
    with contextlib.suppress(OSError):
        os.close(fd)


def threads_left_running() -> list[str]:
    """The names of the threads, other than the main one, that hold the interpreter's exit."""
    return [
        thread.name
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and thread.is_alive() and not thread.daemon
    ]


class Supervisor:
    """The parent's side. ``process`` names the child in what is printed ("the run's
    process"), and ``left_by`` what left processes behind ("the run")."""

    def __init__(self, child: Child, read_fd: int, process: str, left_by: str = "the run") -> None:
        self.child = child
        self.read_fd = read_fd
        self.process = process
        self.left_by = left_by
        self.verdict = Verdict()

    def wait_for_verdict(self) -> Verdict:
        """Read what the child says until its verdict, or until it ends without one."""
        pending = b""
        while self.verdict.code is None:
            ready, _, _ = select.select([self.read_fd], [], [], 0.1)
            if ready:
                chunk = os.read(self.read_fd, 65536)
                if not chunk:
                    break  # every writer closed the pipe: the child is gone
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.verdict.take(line)
            elif self.child.poll() is not None:
                # Ended; the pipe may still be held open by a process it forked.
                ready, _, _ = select.select([self.read_fd], [], [], 0)
                if not ready:
                    break
        return self.verdict

    def wait_for_end(self) -> int | None:
        """The child's exit status once it ends after its verdict; None if it had to be
        killed (then said, with the threads it still ran)."""
        try:
            return self.child.wait(EXIT_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            self.child.send_signal(signal.SIGKILL)
        self.child.wait()
        counted = Counter(self.verdict.threads)
        named = ", ".join(f"{name!r}" + (f" ×{count}" if count > 1 else "") for name, count in sorted(counted.items()))
        message = (
            f"shardkit: {self.process} did not end within {EXIT_GRACE_SECONDS:g} s of the verdict and was killed; "
            f"non-daemon threads still running at the verdict: {named or 'none named (a native thread, or an atexit handler)'}. "
            "An engine should end the threads it starts (or make them daemon threads); the verdict stands"
        )
        print(message, file=sys.stderr, flush=True)
        return None

    def note_a_changed_status(self, status: int | None) -> None:
        code = self.verdict.code
        if status is not None and code is not None and status != code:
            message = (
                f"shardkit: note: after its verdict (exit {code}) {self.process} ended with {describe_status(status)} "
                "(an atexit handler or a thread of the engine); the verdict stands"
            )
            print(message, file=sys.stderr, flush=True)

    def stop_what_was_left(self) -> None:
        """Kill, and name, every process the child started that outlived it (its orphans
        come to this process, the subreaper)."""
        stop_leftover_processes(self.left_by)


def stop_leftover_processes(left_by: str, *, marked: str | None = None) -> None:
    """Kill, and name, every child of this process, generation after generation (in a
    subreaper, orphans of its descendants are its children). With ``marked`` (an environment
    entry ``NAME=VALUE``), also every process started with that entry in its environment,
    wherever it now is: an orphan of a process that is no subreaper goes to another parent,
    but keeps the environment it was started with."""
    left: list[str] = []
    killed: set[int] = set()
    for _ in range(100):  # each round kills a generation: its children come to their subreaper
        # A process killed but not this one's to reap may still show as running for a moment.
        found = [process for process in _processes_left(os.getpid(), marked) if process[0] not in killed or process[3]]
        if not found:
            break
        for pid, running, name, ours in found:
            if running and pid not in killed:
                left.append(f"{pid} ({name})")
                killed.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if ours:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
    if left:
        more = len(left) - _NAMED_PROCESSES
        shown = ", ".join(left[:_NAMED_PROCESSES]) + (f" and {more} more" if more > 0 else "")
        processes = "process" if len(left) == 1 else "processes"
        message = (
            f"shardkit: {left_by} left {len(left)} {processes} running, now killed: {shown}. "
            "An engine should end the processes it starts when it is closed"
        )
        print(message, file=sys.stderr, flush=True)


def _processes_left(parent: int, marked: str | None) -> list[tuple[int, bool, str, bool]]:
    """The children of ``parent``, and the running processes whose environment holds
    ``marked``: pid, whether it still runs, its command, whether it is ``parent``'s child (to
    reap). A zombie that is not ``parent``'s is its own parent's to reap: not listed."""
    wanted = None if marked is None else b"\0" + marked.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == parent:
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ours, running = int(fields[1]) == parent, fields[0] != "Z"
            if not ours and not (
                running and wanted is not None and wanted in b"\0" + (entry / "environ").read_bytes() + b"\0"
            ):
                continue
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable: not ours
        name = command.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        name = name or stat[stat.index("(") + 1 : stat.rindex(")")]
        found.append((int(entry.name), running, name[:80], ours))
    return found


def describe_status(status: int) -> str:
    """``Popen.returncode`` in words."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children; False where that cannot be
    (another system than Linux), and then only the child's process group is killed."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(parent: int) -> bool:
    """In the child: be killed when the parent dies (a killed parent takes the run with it);
    False if the parent is already gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
