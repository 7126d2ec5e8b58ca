"""Worker processes for isolated engines (``shardkit fuzz --isolate``).

A ``WorkerPool`` keeps one child process serving the engines of one target over a Unix
socket, as ``shardkit serve TARGET --worker`` does; every engine the kit builds from the
target (the engine under test, its twins, restarts) is a ``RemoteShardEngine`` on that
child. In worker mode the child ends itself when an engine raises (exit 70, 71 for
``MemoryError``), as a native engine's process would die, and ends when its stdin closes,
so a kit killed outright leaves no worker behind.

Where workers come from. Each pool starts one fresh interpreter, the fork server's
*zygote* (``forkserver.py``), that imports shardkit, gRPC and the target once and forks
a worker in milliseconds whenever the pool needs one: after an injected crash, a native
death, a missed deadline. A forked worker starts from the module state importing the
target made (the zygote never builds an engine nor starts gRPC), serves through the same
code as a fresh ``shardkit serve --worker`` process and dies the same ways. If the zygote
cannot fork (it died, or importing the target started threads a fork would not copy),
the pool starts each worker as a fresh interpreter instead, as it always did, and says
why in ``fork_note``.

A *foreign* worker (``--worker-command``: an engine in C++, Rust, Go…) is the user's
command, started for each worker with ``{address}`` replaced by the worker's own Unix
socket, in its own process group, its output kept like a Python worker's. It is ready
once its socket accepts a connection; ``--worker-memory`` caps it with RLIMIT_DATA set
by a small exec shim before the command runs (the same process, so the same pid and
exit status). Nothing is forked for it, and the exit codes a Python worker gives an
engine's exception (70, 71) mean nothing special from it.

When a call fails, ``death`` finds out how the child ended: a signal or an exit
code, read from the process itself (for a forked worker, as its waiter reports it), or a
missed deadline or a garbage answer, after which the child is killed since it can no
longer be trusted. The next engine comes from a new worker; after the first death a
spare one is kept ready, so shrinking (where most runs end in a death) does not wait.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from shardkit._core.native_threads import worker_environment
from shardkit._core.targets import (
    WORKER_ADDRESS_FIELD,
    IsolationOptions,
    ProcessDeath,
    PythonTarget,
    WorkerCommand,
)
from shardkit._transport.calls_socket import calls_socket_path
from shardkit._transport.client import RemoteShardEngine, close_connection
from shardkit._transport.codec import EXIT_ENGINE_RAISED, EXIT_OUT_OF_MEMORY
from shardkit._transport.forkserver import ForkedProcess, ForkServer, ForkUnavailable
from shardkit.contract import ShardEngine
from shardkit.errors import (
    InvalidTarget,
    RemoteDeadlineExceeded,
    RemoteEngineCrashed,
    RemoteEngineError,
    RemoteUnavailable,
)

__all__ = ["WorkerPool", "live_worker_pids", "watch_parent"]

#: How long a worker may take to import its target and start serving.
START_SECONDS = 60.0
#: How long a worker whose connection broke gets to finish dying before it is killed.
EXIT_GRACE_SECONDS = 3.0
#: How long a killed worker's end may take to be seen (SIGKILL cannot be refused: it is quick).
_KILLED_SECONDS = 10.0
TAIL_LINES = 8
#: How long a hung worker gets to print its threads' stacks before it is killed.
_DUMP_SECONDS = 1.0
_TAIL_BYTES = 16_384
#: What a native allocator prints when a memory limit refuses it.
_MEMORY_SIGNS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "out of memory", "pthread_create failed")
#: Runs a foreign worker command under --worker-memory: sets RLIMIT_DATA, then becomes the command.
_LIMIT_THEN_EXEC = (
    "import os, resource, sys\n"
    "limit = int(sys.argv[1]) * 2**20\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_DATA)\n"
    "resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class _Worker:
    """One child process serving on ``url``, its output kept in ``log_path``: forked from the
    pool's zygote (``ForkedProcess``) or a fresh interpreter (``Popen``)."""

    def __init__(
        self, url: str, log_path: Path, process: subprocess.Popen[bytes] | ForkedProcess, *, foreign: bool = False
    ) -> None:
        self.url = url
        self.log_path = log_path
        self.process = process
        #: Started from a --worker-command: not shardkit's own server, so it is told ready by its socket.
        self.foreign = foreign
        self.death: ProcessDeath | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, target: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self._serving():
                return
            code = self.process.poll()
            if code is not None:
                tail = "; ".join(self.tail()) or "it printed nothing"
                message = f"the worker process for {target} {_exit_text(code)} before serving: {tail}"
                raise InvalidTarget(message)
            if time.monotonic() > deadline:
                self.kill()
                message = f"the worker process for {target} did not start serving within {START_SECONDS:g} s"
                if self.foreign:
                    message += f": a worker command must serve contract v1 on the address given in {WORKER_ADDRESS_FIELD} ({self.url})"
                printed = "; ".join(self.tail())
                message += f"; it printed: {printed}" if printed else "; it printed nothing"
                raise InvalidTarget(message)
            time.sleep(0.005)

    def _serving(self) -> bool:
        if not self.foreign:
            # `shardkit serve` prints "serving TARGET on URL" once it listens.
            return b"serving " in self.log_path.read_bytes()[:_TAIL_BYTES]
        # Any other server: listening once its socket takes a connection.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.url.removeprefix("unix:"))
            except OSError:
                return False
            return True

    def exit_code(self, grace: float) -> int | None:
        """The exit code (negative: the signal) once the process ends, None if it lives on."""
        try:
            code = self.process.wait(grace)
        except subprocess.TimeoutExpired:
            return None
        self._release()
        return code

    def _release(self) -> None:
        """Drop what the kit holds of the ended process: a fresh one's stdin, a forked one's pidfd."""
        if isinstance(self.process, ForkedProcess):
            self.process.release()
        elif self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    def dump_stacks(self) -> None:
        """Have the worker print where each of its threads is (faulthandler, on SIGUSR1)."""
        if self.foreign:
            return  # SIGUSR1 means nothing agreed to another program; by default it ends it
        size = self.log_path.stat().st_size
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + _DUMP_SECONDS
        while time.monotonic() < deadline and self.log_path.stat().st_size == size:
            time.sleep(0.01)
        time.sleep(0.05)  # the dump is written thread by thread

    def kill(self) -> None:
        # Its whole process group (the worker leads its own session), even once the worker has
        # ended: what the engine or a foreign command (a shell, a launcher) started goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(_KILLED_SECONDS)
        self._release()
        close_connection(self.url)

    def tail(self) -> tuple[str, ...]:
        """The last lines the process printed; from a fatal error's header when there is one."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - _TAIL_BYTES))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ()
        # Not the line saying where it listens: shardkit's "serving … on URL", or a foreign
        # worker's own wording; either names its socket.
        address = self.url.removeprefix("unix:")
        lines = [line.rstrip() for line in text.splitlines() if line.strip() and address not in line]
        for index in range(max(0, len(lines) - 40), len(lines)):
            if lines[index].startswith("Fatal Python error"):
                # faulthandler: the header, then the crashing thread's innermost frames.
                return tuple(lines[index : index + TAIL_LINES])
        engine_thread = _engine_thread(lines)
        return engine_thread if engine_thread else tuple(lines[-TAIL_LINES:])


class WorkerPool:
    """The ``Isolation`` of one target: builds engines in a child process, explains its deaths."""

    def __init__(self, target: PythonTarget | WorkerCommand, options: IsolationOptions) -> None:
        if isinstance(target, PythonTarget) and not isinstance(target.code, str):
            message = f"a worker process imports its engine target by name; {target.name} is a factory object"
            raise TypeError(message)
        self.target = target
        self.options = options
        #: A foreign worker's command (--worker-command), its address still a field; None for a Python target.
        self._foreign = target.argv if isinstance(target, WorkerCommand) else None
        self._folder = Path(tempfile.mkdtemp(prefix="shardkit-worker-"))
        self._numbers = itertools.count(1)
        self._current: _Worker | None = None
        self._spare: _Worker | None = None
        self._by_url: dict[str, _Worker] = {}
        #: Deaths so far; after the first a spare worker is kept starting.
        self._deaths = 0
        self._lock = threading.RLock()
        self._closed = False
        #: Forks this pool's workers; started with the first worker.
        self._fork_server: ForkServer | None = None
        #: Why this pool's workers start as fresh interpreters rather than forked (None: forked).
        self.fork_note: str | None = None
        self._forked = 0
        _OPEN_POOLS.add(self)

    def __repr__(self) -> str:
        note = f"; {self.fork_note}" if self.fork_note is not None else ""
        return f"WorkerPool({self.target.name!r}, {self.options}{note})"

    @property
    def workers_started(self) -> int:
        return len(self._by_url)

    @property
    def workers_forked(self) -> int:
        """Of ``workers_started``, those forked from the zygote (the others are fresh interpreters)."""
        return self._forked

    @property
    def fork_server_pid(self) -> int | None:
        """The zygote's process while it runs, else None."""
        with self._lock:
            server = self._fork_server
            return server.pid if server is not None and server.process.poll() is None else None

    @property
    def pids(self) -> list[int]:
        """The processes of this pool that still run (the serving one and the spare)."""
        with self._lock:
            return [worker.pid for worker in (self._current, self._spare) if worker is not None and worker.alive()]

    def new_engine(self) -> ShardEngine:
        """A fresh engine in the serving worker, started (or replaced) as needed."""
        worker = self._serving_worker()
        try:
            # A shardkit worker takes the kit's calls over a plain socket too; a foreign one, gRPC only.
            calls_socket = None if worker.foreign else calls_socket_path(worker.url)
            return RemoteShardEngine(worker.url, timeout_seconds=self.options.step_timeout, calls_socket=calls_socket)
        except RemoteEngineError as error:
            death = self.death(error)
            if death is None:
                raise
            message = f"the worker process for {self.target.shown} {death.summary} while building an engine"
            message += death.quoted_tail()
            raise InvalidTarget(message) from error

    def _serving_worker(self) -> _Worker:
        with self._lock:
            if self._closed:
                message = f"the isolation of {self.target.name} was closed; isolate the target again"
                raise InvalidTarget(message)
            current = self._current
            if current is not None and current.alive() and current.death is None:
                return current
            if current is not None:
                current.kill()
                self._forget_files(current)
            worker, self._spare = self._spare or self._start(), None
            self._current = worker
            try:
                worker.wait_ready(self.target.shown)
            except InvalidTarget:
                # No worker of this target serves (a --worker-memory too low, say): leave no process behind.
                self._stop_every_process()
                raise
            if self._deaths:
                # Workers die often from here on (shrinking ends most runs in a death).
                self._spare = self._start()
            return worker

    def _start(self) -> _Worker:
        number = next(self._numbers)
        url = f"unix:{self._folder / f'worker-{number}.sock'}"
        log_path = self._folder / f"worker-{number}.log"
        log_path.write_bytes(b"")  # read (wait_ready, tail) before the worker writes a line
        if self._foreign is not None:
            worker = _Worker(url, log_path, self._spawn_foreign(url, log_path), foreign=True)
        else:
            worker = _Worker(url, log_path, self._fork(number, url, log_path) or self._spawn(url, log_path))
        self._by_url[url] = worker
        return worker

    def _command(self) -> list[str]:
        command = [sys.executable, "-m", "shardkit", "serve", self.target.name, "--worker"]
        if self.options.worker_memory_mb is not None:
            command += ["--worker-memory", str(self.options.worker_memory_mb)]
        return command

    def _environment(self) -> dict[str, str]:
        # The child imports the target by name: let it see what this process sees.
        paths = [path or os.getcwd() for path in sys.path if isinstance(path, str)]
        # Its native thread pools (BLAS, OpenMP) one thread each unless the user chose: native_threads.py.
        return {**worker_environment(os.environ), "PYTHONPATH": os.pathsep.join(paths)}

    def _fork(self, number: int, url: str, log_path: Path) -> ForkedProcess | None:
        """A worker forked from the zygote (started first if need be), or None when it cannot give one."""
        if self.fork_note is not None:
            return None
        try:
            if self._fork_server is None:
                log = self._folder / "fork-server.log"
                self._fork_server = ForkServer(self._command(), log, self._environment())
                self._fork_server.wait_ready(START_SECONDS)
            process = self._fork_server.fork(number, url, log_path)
        except (ForkUnavailable, OSError) as error:  # OSError: the zygote's process could not start
            # Its workers still running keep their stdin and their waiters: only the forking ends.
            if self._fork_server is not None:
                self._fork_server.stop_forking()
            self.fork_note = f"workers start as fresh interpreters: {error}"
            return None
        self._forked += 1
        return process

    def _spawn(self, url: str, log_path: Path) -> subprocess.Popen[bytes]:
        """A worker in a fresh interpreter (``shardkit serve TARGET --worker --listen URL``)."""
        return self._popen([*self._command(), "--listen", url], log_path)

    def _spawn_foreign(self, url: str, log_path: Path) -> subprocess.Popen[bytes]:
        """A foreign worker: the user's command with ``{address}`` made this worker's socket."""
        assert self._foreign is not None
        command = [word.replace(WORKER_ADDRESS_FIELD, url) for word in self._foreign]
        if self.options.worker_memory_mb is not None:
            command = [sys.executable, "-S", "-c", _LIMIT_THEN_EXEC, str(self.options.worker_memory_mb), *command]
        try:
            return self._popen(command, log_path)
        except OSError as error:
            message = f"{self.target.shown} could not be started: {error}"
            raise InvalidTarget(message) from error

    def _popen(self, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        """``command`` as a worker: its output to ``log_path``; its stdin a pipe the kit holds
        while it runs (a worker that exits at its end leaves nothing behind a killed kit); its
        own session, so a Ctrl-C meant for the kit does not kill it mid-step."""
        with log_path.open("wb") as log:
            return subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,
            )

    def _stop_every_process(self) -> None:
        """Kill every worker and end the zygote; a later engine starts them again."""
        for worker in self._by_url.values():
            worker.kill()  # a dead worker is only reaped and released
        self._current = self._spare = None
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None

    def _forget_files(self, worker: _Worker) -> None:
        # The log is kept until the pool closes: a death's tail may still be read.
        Path(worker.url.removeprefix("unix:")).unlink(missing_ok=True)
        calls_socket = calls_socket_path(worker.url)
        if calls_socket is not None:
            Path(calls_socket).unlink(missing_ok=True)

    def death(self, error: BaseException) -> ProcessDeath | None:
        if not isinstance(error, RemoteEngineError):
            return None
        with self._lock:
            worker = self._by_url.get(error.address)
            if worker is None:
                return None
            if worker.death is None:
                worker.death = self._diagnose(worker, error)
                self._deaths += 1
            return worker.death

    def _diagnose(self, worker: _Worker, error: RemoteEngineError) -> ProcessDeath:
        if worker.foreign and isinstance(error, RemoteEngineCrashed):
            return self._foreign_raised(worker, error)
        if isinstance(error, RemoteDeadlineExceeded):
            worker.dump_stacks()
            worker.kill()
            summary = f"missed its {error.timeout_seconds:g} s step deadline (the kit killed it)"
            return ProcessDeath("step deadline", summary, worker.tail())
        code = (
            worker.exit_code(EXIT_GRACE_SECONDS)
            if isinstance(error, (RemoteUnavailable, RemoteEngineCrashed))
            else None
        )
        if code is None:
            worker.kill()
            if isinstance(error, RemoteUnavailable):
                summary = f"stopped answering but did not exit ({error.details}); the kit killed it"
                return ProcessDeath("connection lost", summary, worker.tail())
            return ProcessDeath("garbage answer", f"answered garbage: {error} (the kit killed it)", worker.tail())
        close_connection(worker.url)
        return self._exit_death(code, worker.tail(), shardkit_worker=not worker.foreign)

    def _foreign_raised(self, worker: _Worker, error: RemoteEngineCrashed) -> ProcessDeath:
        """A foreign worker answered INTERNAL with the type of what its engine raised, as the
        proto asks, and lives on: it is ended, as a Python worker ends itself, since its engine's
        state is unknown. Under --worker-memory an allocation refused is named as memory."""
        worker.kill()
        tail = worker.tail()
        raised = error.details or error.exception_type
        limit = self.options.worker_memory_mb
        if limit is not None and any(sign in text for text in (*tail, raised) for sign in _MEMORY_SIGNS):
            summary = f"ran out of memory within --worker-memory {limit} MB (its engine raised {raised})"
            return ProcessDeath("worker memory", summary, tail)
        return ProcessDeath("unexplained exception", f"answered that its engine raised {raised} (the kit ended it)", tail)

    def _exit_death(self, code: int, tail: tuple[str, ...], *, shardkit_worker: bool) -> ProcessDeath:
        limit = self.options.worker_memory_mb
        if (shardkit_worker and code == EXIT_OUT_OF_MEMORY) or (
            limit is not None and any(sign in line for line in tail for sign in _MEMORY_SIGNS)
        ):
            within = f" within --worker-memory {limit} MB" if limit is not None else ""
            return ProcessDeath("worker memory", f"ran out of memory{within} ({_exit_text(code)})", tail)
        if shardkit_worker and code == EXIT_ENGINE_RAISED:
            raised = next((line.partition(" raised ")[2] for line in reversed(tail) if " raised " in line), "")
            return ProcessDeath(
                "unexplained exception", f"exited after the engine raised {raised or 'an exception'}", tail
            )
        if code < 0:
            name = _signal_name(-code)
            return ProcessDeath(f"process killed by {name}", f"killed by {name}", tail)
        return ProcessDeath(f"process exited with code {code}", f"exited with code {code}", tail)

    def kill(self) -> None:
        with self._lock:
            current = self._current
            if current is not None and current.death is None:
                current.kill()
                current.death = ProcessDeath("killed", "was killed by the kit (an injected crash)", current.tail())
                self._deaths += 1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_every_process()
        shutil.rmtree(self._folder, ignore_errors=True)
        _OPEN_POOLS.discard(self)


def _engine_thread(lines: list[str]) -> tuple[str, ...]:
    """From a dump of every thread's stack, the thread running an engine call (innermost first).

    Several threads may be in a call (the lanes of a parallel phase): one running the engine
    is shown before one waiting for its turn (``_Slot.turn``) behind it."""
    starts = [index for index, line in enumerate(lines) if line.startswith(("Thread 0x", "Current thread 0x"))]
    blocks = [lines[start:end] for start, end in zip(starts, [*starts[1:], len(lines)])]  # noqa: B905 - one longer
    calls = [block for block in blocks if any("server.py" in line and " in _run" in line for line in block)]
    running = [block for block in calls if not any("server.py" in line and " in turn" in line for line in block)]
    return tuple((running or calls or [[]])[0][:TAIL_LINES])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_text(code: int) -> str:
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"


class _OpenPools:
    """The pools of this process not yet closed, held so that none is collected with its
    workers still running, and closed at exit; the process has one (``_OPEN_POOLS``)."""

    def __init__(self) -> None:
        self._pools: set[WorkerPool] = set()
        self._lock = threading.Lock()

    def add(self, pool: WorkerPool) -> None:
        with self._lock:
            self._pools.add(pool)

    def discard(self, pool: WorkerPool) -> None:
        with self._lock:
            self._pools.discard(pool)

    def snapshot(self) -> list[WorkerPool]:
        with self._lock:
            return list(self._pools)


_OPEN_POOLS = _OpenPools()


def live_worker_pids() -> list[int]:
    """Every worker process of this process's pools that still runs (for tests and checks)."""
    return [pid for pool in _OPEN_POOLS.snapshot() for pid in pool.pids]


@atexit.register
def _close_every_pool() -> None:
    for pool in _OPEN_POOLS.snapshot():
        pool.close()


def watch_parent(stdin_fd: int) -> None:
    """In a worker: end the process when the kit's end of stdin closes (the kit died or closed it)."""

    def wait_for_eof() -> None:
        # os.read, not a buffered reader: a daemon thread holding its lock would abort
        # the interpreter's shutdown when the worker exits for another reason.
        with contextlib.suppress(OSError):
            while os.read(stdin_fd, 4096):
                pass
        os._exit(0)

    threading.Thread(target=wait_for_eof, name="shardkit-worker-parent-watch", daemon=True).start()
