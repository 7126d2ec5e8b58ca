"""The fork server of ``--isolate``: worker processes forked in milliseconds from one
interpreter that imported the target once.

A worker started as a fresh interpreter (``python -m shardkit serve TARGET --worker``)
spends 0.3-0.5 s importing shardkit, gRPC and the target, and a run with crash faults
on starts one per injected crash. The kit instead starts one fresh interpreter per
``WorkerPool``, the *zygote* (``shardkit serve TARGET --worker --fork-server FD``): it
imports what a worker imports (shardkit, the server and gRPC, the target), then forks a
worker each time the kit asks. The zygote never builds an engine, never starts a gRPC
server or channel and runs no Python thread, so every worker starts from exactly the module
state importing the target made, and gRPC's core first starts in the worker, after the
fork (gRPC must not have started its threads in a process that forks: the zygote refuses
to fork, and the kit falls back to fresh interpreters, if a Python thread or one of gRPC's
is running).

Who waits for whom. Only a process's parent can read how it ended, and the kit is not a
forked worker's parent. So the zygote forks a *waiter*, which forks the worker, tells the
kit its pid, waits for it and tells the kit how it ended: the exit code, or minus the
signal that killed it, as ``subprocess.Popen.returncode`` says for a fresh worker. Since
the waiter is not the zygote, a worker's end is still reported if the zygote dies. The
kit (``ForkedProcess``) signals a worker through a pidfd, which never reaches another
process that reused the pid.

The worker then serves as ``shardkit serve TARGET --worker`` does in a fresh interpreter,
through the same code (the command passes it in as ``run_worker``): in its own session
(a Ctrl-C meant for the kit does not reach it), its output in its own log, the memory
limit (``--worker-memory``) set in the worker itself, faulthandler's stack dump on
SIGUSR1, exits 70 and 71 when an engine raises, and the watch of stdin: every worker
shares the zygote's stdin, whose other end the kit holds, so all end when the kit dies.

What differs from a fresh interpreter, none of which a result depends on: a worker's
``/proc/PID/cmdline`` is the zygote's, it holds the other file descriptors the target's
import opened, and all workers share the zygote's string-hash seed where fresh
interpreters would each draw one (``random`` is reseeded at every fork).

Messages (one ``SOCK_SEQPACKET`` datagram each, fields separated by NUL bytes):
kit to zygote ``fork NUMBER URL LOG_PATH``; zygote to kit ``ready``, ``refused NUMBER
REASON``; waiter to kit ``forked NUMBER PID``, ``refused NUMBER REASON``, ``exited PID
CODE``. The kit's end closing (the pool closed, or the kit died) ends the zygote.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["ForkServer", "ForkUnavailable", "ForkedProcess", "serve_forks"]

#: How long a fork request may wait for its answer before the kit stops using the zygote.
FORK_ANSWER_SECONDS = 30.0
#: How long the zygote gets to end once the kit closed its end, before it is killed.
_CLOSE_SECONDS = 5.0
_MESSAGE_BYTES = 65_536
_TAIL_BYTES = 4096
#: The names gRPC's core gives its threads (``/proc/PID/task/*/comm``, cut at 15 bytes):
#: one of them in the zygote means gRPC started, and a fork would copy its locks mid-use.
_GRPC_THREAD_NAMES = ("grpc_global_tim", "event_engine", "lifeguard", "default-executo", "resolver-execut", "timer_manager")


class ForkUnavailable(Exception):
    """The zygote cannot give a worker; the message says why (the pool starts fresh interpreters instead)."""


# --- the kit's end --------------------------------------------------------------------------------------


class ForkServer:
    """The kit's end of one zygote: starts it, asks it for workers, hears how each ended.

    ``command`` starts the zygote (``… serve TARGET --worker``, to which ``--fork-server FD``
    is added); its output goes to ``log_path``."""

    def __init__(self, command: list[str], log_path: Path, environment: Mapping[str, str]) -> None:
        self.log_path = log_path
        kit_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = kit_end
        self._changed = threading.Condition()
        self._ready = False
        #: The connection ended: the zygote and every waiter are gone, nothing more will be heard.
        self._lost = False
        #: What each fork request got: the worker's pid, or the reason there is none.
        self._forked: dict[int, int | str] = {}
        #: How each reported worker ended (``Popen.returncode``: minus the signal that killed it).
        self._exit_codes: dict[int, int] = {}
        self._send_lock = threading.Lock()
        with zygote_end, log_path.open("wb") as log:
            # Its own session, as a worker's: a Ctrl-C meant for the kit must not reach it.
            self.process = subprocess.Popen(
                [*command, "--fork-server", str(zygote_end.fileno())],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(environment),
                start_new_session=True,
                pass_fds=(zygote_end.fileno(),),
            )
        self._reader = threading.Thread(target=self._read, name="shardkit-fork-server-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, seconds: float) -> None:
        """Wait until the zygote has imported everything; ``ForkUnavailable`` if it cannot."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while not self._ready:
                code = self.process.poll()
                if code is not None or self._lost:
                    raise ForkUnavailable(f"the fork server {_ended(self._end_code(code))} before it was ready{self._tail()}")
                if time.monotonic() > deadline:
                    message = f"the fork server was not ready within {seconds:g} s (importing the target takes longer?)"
                    raise ForkUnavailable(message)
                self._changed.wait(0.05)

    def _end_code(self, polled: int | None) -> int | None:
        """The zygote's exit code, once it ended or its connection closed: a zygote whose
        connection closed is ending, and a poll right then often still finds it running
        (which named a zygote killed by a signal as one that closed its connection)."""
        if polled is not None:
            return polled
        try:
            return self.process.wait(_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            return None

    def fork(self, number: int, url: str, log_path: Path) -> ForkedProcess:
        """A worker forked from the zygote, to serve on ``url`` with its output in ``log_path``."""
        request = b"\0".join([b"fork", str(number).encode(), os.fsencode(url), os.fsencode(log_path)])
        try:
            with self._send_lock:
                self._control.send(request)
        except OSError as error:
            # Nobody holds its end any more: the zygote (and every waiter) has ended, or is ending.
            try:
                code: int | None = self.process.wait(_CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                code = None
            reason = f"the fork server {_ended(code)}" if code is not None else f"the fork server cannot be reached ({error})"
            raise ForkUnavailable(reason + self._tail()) from None
        deadline = time.monotonic() + FORK_ANSWER_SECONDS
        with self._changed:
            while number not in self._forked:
                code = self.process.poll()
                if code is not None or self._lost:
                    raise ForkUnavailable(f"the fork server {_ended(self._end_code(code))}{self._tail()}")
                if time.monotonic() > deadline:
                    raise ForkUnavailable(f"the fork server did not answer a fork request within {FORK_ANSWER_SECONDS:g} s")
                self._changed.wait(0.05)
            answer = self._forked.pop(number)
        if isinstance(answer, str):
            raise ForkUnavailable(answer)
        return ForkedProcess(self, answer)

    def exit_code(self, pid: int) -> int | None:
        """How the worker ``pid`` ended, once its waiter has said; None until then."""
        with self._changed:
            return self._exit_codes.get(pid)

    def wait_exit(self, pid: int, seconds: float | None) -> int | None:
        """How the worker ``pid`` ended, waiting up to ``seconds`` (None: as long as someone may still say)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._changed:
            while pid not in self._exit_codes and not self._lost:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._changed.wait(left)
            return self._exit_codes.get(pid)

    def stop_forking(self) -> None:
        """End the zygote, keeping what its workers need: their stdin (their lifeline) and the
        connection their waiters report on. For a zygote the pool no longer forks from."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """End the zygote and, through stdin, every worker still running; the pool kills its
        workers first, so only one that never reached the pool is ended that way."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        try:
            # It waits for its waiters, which end with their workers.
            self.process.wait(_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(_CLOSE_SECONDS)
        self._control.close()

    def _read(self) -> None:
        while True:
            try:
                message = self._control.recv(_MESSAGE_BYTES)
            except OSError:
                message = b""
            with self._changed:
                if not message:
                    self._lost = True
                    self._changed.notify_all()
                    return
                kind, *fields = message.split(b"\0")
                if kind == b"ready":
                    self._ready = True
                elif kind == b"forked":
                    self._forked[int(fields[0])] = int(fields[1])
                elif kind == b"refused":
                    self._forked[int(fields[0])] = fields[1].decode("utf-8", "replace")
                elif kind == b"exited":
                    self._exit_codes[int(fields[0])] = int(fields[1])
                self._changed.notify_all()

    def _tail(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _TAIL_BYTES))
                lines = [line.strip() for line in log.read().decode("utf-8", "replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return f": {'; '.join(lines[-3:])}" if lines else ""


class ForkedProcess:
    """A forked worker as the kit sees it, answering what ``subprocess.Popen`` answers for a
    fresh one (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self._server = server
        self._pidfd: int | None
        try:
            # Held from now on: a signal through it never reaches a process that reuses the pid.
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # it already ended (its end is reported anyway), or the kernel predates pidfds
            self._pidfd = None

    def poll(self) -> int | None:
        return self._server.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, number: int) -> None:
        if self.poll() is not None:
            return
        if self._pidfd is not None:
            signal.pidfd_send_signal(self._pidfd, number)
        else:
            os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def release(self) -> None:
        """Close the pidfd once the worker is dead (or no longer the pool's)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _ended(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# --- the zygote ------------------------------------------------------------------------------------------


def serve_forks(control_fd: int, run_worker: Callable[[str], int]) -> int:
    """Be the zygote: fork a worker for each request read on ``control_fd`` until the kit closes it.

    Returns in the zygote (0, once its waiters have ended) and in each forked worker, with
    what ``run_worker(URL)`` returned there: the caller unwinds as the serving command would.
    The caller has imported everything a worker needs before calling."""
    control = socket.socket(fileno=control_fd)
    # Waiters are reaped by the kernel: the zygote never waits for one while it forks.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    control.send(b"ready")
    while True:
        message = control.recv(_MESSAGE_BYTES)
        if not message:
            break
        kind, *fields = message.split(b"\0")
        if kind != b"fork" or len(fields) != 3:
            continue  # not from this kit's ForkServer
        number, url, log_path = fields[0], os.fsdecode(fields[1]), os.fsdecode(fields[2])
        refusal = _fork_refusal()
        if refusal is not None:
            control.send(b"\0".join([b"refused", number, refusal.encode()]))
            continue
        if _fork_waiter(control, number, log_path):
            return run_worker(url)
    control.close()
    # With SIGCHLD ignored, this returns once every waiter has ended (ECHILD).
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)
    return 0


def _fork_refusal() -> str | None:
    """Why forking now would not give a faithful worker, or None."""
    threads = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    if threads:
        return f"importing the target started Python threads ({', '.join(threads)}), which a forked worker would lack"
    with contextlib.suppress(OSError):
        tasks = Path("/proc/self/task")
        for task in tasks.iterdir():
            name = (task / "comm").read_text().strip()
            if name.startswith(_GRPC_THREAD_NAMES):
                return f"gRPC's core was started before the fork (its thread {name!r} runs), which a fork cannot copy safely"
    return None


def _fork_waiter(control: socket.socket, number: bytes, log_path: str) -> bool:
    """Fork the waiter, which forks the worker: True in the worker, False in the zygote."""
    _flush_output()
    try:
        waiter = os.fork()
    except OSError as error:
        control.send(b"\0".join([b"refused", number, f"the fork server cannot fork: {error}".encode()]))
        return False
    if waiter:
        return False
    try:
        _fork_the_worker_and_wait(control, number)  # returns in the worker only
        _become_worker(control, log_path)
    except BaseException:
        # Neither the waiter nor a worker that could not set itself up may return into the zygote's loop.
        with contextlib.suppress(Exception):
            traceback.print_exc()
            _flush_output()
        os._exit(1)
    return True


def _fork_the_worker_and_wait(control: socket.socket, number: bytes) -> None:
    """In the waiter: fork the worker (and return there); report its pid and its end, then exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote's SIG_IGN would reap the worker unseen
    try:
        worker = os.fork()
    except OSError as error:
        _report(control, b"refused", number, f"the fork server cannot fork: {error}".encode())
        os._exit(0)
    if worker == 0:
        return
    _report(control, b"forked", number, str(worker).encode())
    _, status = os.waitpid(worker, 0)
    _report(control, b"exited", str(worker).encode(), str(os.waitstatus_to_exitcode(status)).encode())
    os._exit(0)


def _become_worker(control: socket.socket, log_path: str) -> None:
    """In the forked worker: what a fresh one gets from ``Popen(start_new_session=True, stdout=log)``."""
    control.close()
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _report(control: socket.socket, *fields: bytes) -> None:
    # The kit may be gone (then so is everyone who would read this): nothing to do about it.
    with contextlib.suppress(OSError):
        control.send(b"\0".join(fields))


def _flush_output() -> None:
    # Whatever is buffered would be written again by every forked child.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
