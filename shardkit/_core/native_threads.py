"""How many threads the engines' native pools (BLAS, OpenMP) may use while the kit runs them.

numpy's OpenBLAS (and MKL, BLIS, an OpenMP runtime) starts a thread per core, and its idle
threads spin while they wait for work. On a busy machine (a two-core CI host whose other
core runs the other pytest-xdist worker) those threads fight the other process for the
cores: a 256-token prefill of ``NumpyShardEngine`` took 4 to 45 times as long with two
OpenBLAS threads as with one (docs/performance.md#native-threads). The kit's steps are
small, so one thread loses little on an idle machine and saves an order of magnitude on a
busy one. The last bits of an answer may change with the pool's size (OpenBLAS sums in
another order on some processors), so the pin holds for a whole run: every answer a run
compares is computed at one size. Across sizes an engine's answers agree within its
declared tolerance, not bit for bit (docs/performance.md#native-threads; checked by
tests/test_native_threads.py).

The policy, read from the environment when a run starts:

- ``SHARDKIT_NATIVE_THREADS=N`` (N >= 1) pins every native pool to N threads;
  ``SHARDKIT_NATIVE_THREADS=default`` leaves every pool as its library sets it;
- unset (or empty), the kit pins to 1, unless the environment already names a pool's size
  (any of ``THREAD_VARIABLES``): then the user has chosen, and the kit changes nothing.

It applies in two ways. A worker process (``--isolate``) gets the variables in its
environment, read by each library as it loads (``worker_environment``). In this process,
where numpy is already loaded, ``pinned_native_threads`` limits the pools through
threadpoolctl for the duration of a run and restores them after; a library loaded later
(an engine importing torch inside its constructor) keeps its own size.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shardkit.errors import UsageError

__all__ = [
    "DEFAULT_THREADS",
    "ENVIRONMENT",
    "LEAVE_ALONE",
    "THREAD_VARIABLES",
    "NativeThreads",
    "native_thread_policy",
    "pinned_native_threads",
    "worker_environment",
]

#: The kit's own setting: a number of threads, or ``LEAVE_ALONE``.
ENVIRONMENT = "SHARDKIT_NATIVE_THREADS"
#: ``SHARDKIT_NATIVE_THREADS=default``: every pool keeps the size its library chooses.
LEAVE_ALONE = "default"
#: The pool size the kit sets when nobody chose one.
DEFAULT_THREADS = 1
#: The variables that size a native pool as its library loads: OpenMP's (which OpenBLAS and
#: MKL also read when their own is unset), OpenBLAS's, MKL's, BLIS's, Apple Accelerate's and
#: numexpr's. Any of them set by the user means the user has chosen; the kit then adds none.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


@dataclass(frozen=True)
class NativeThreads:
    """What the kit does with the native pools: pin them to ``threads``, or (None) leave them
    alone; ``reason`` says why, in words (for a message or a bench report)."""

    threads: int | None
    reason: str
    #: Whether the user chose it with ``SHARDKIT_NATIVE_THREADS`` (the kit must honour it or say why not).
    chosen: bool = False


def native_thread_policy(environ: Mapping[str, str]) -> NativeThreads:
    """The policy ``environ`` asks for; a ``SHARDKIT_NATIVE_THREADS`` that is neither a
    number of threads nor ``default`` is a ``UsageError``, never ignored."""
    chosen = environ.get(ENVIRONMENT, "").strip()
    if chosen == LEAVE_ALONE:
        return NativeThreads(None, f"{ENVIRONMENT}={LEAVE_ALONE}", chosen=True)
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            message = (
                f"{ENVIRONMENT}={chosen!r} is not a number of threads: give 1 or more, or "
                f"'{LEAVE_ALONE}' to leave the native thread pools as their libraries set them"
            )
            raise UsageError(message)
        return NativeThreads(int(chosen), f"{ENVIRONMENT}={int(chosen)}", chosen=True)
    named = [name for name in THREAD_VARIABLES if environ.get(name, "").strip()]
    if named:
        return NativeThreads(None, f"{', '.join(named)} set in the environment")
    return NativeThreads(DEFAULT_THREADS, "shardkit's default")


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` for a worker process, with every pool's variable set to the
    policy's size (the child's libraries read them as they load); unchanged when the policy
    leaves the pools alone. ``SHARDKIT_NATIVE_THREADS=N`` sets them all to N, over any the
    environment had: the user's choice for the kit is the more particular one."""
    policy = native_thread_policy(environ)
    child = dict(environ)
    if policy.threads is not None:
        child.update(dict.fromkeys(THREAD_VARIABLES, str(policy.threads)))
    return child


@contextlib.contextmanager
def pinned_native_threads(environ: Mapping[str, str] | None = None) -> Iterator[NativeThreads]:
    """Limit this process's loaded native pools to the policy's size for the block (through
    threadpoolctl), and put them back as they were after it. Yields what was done.

    Without threadpoolctl (an install that skipped the dependencies) the kit's default
    pins nothing, and says so in the policy's reason; ``SHARDKIT_NATIVE_THREADS=N`` cannot
    be honoured then, which is a ``UsageError``."""
    policy = native_thread_policy(os.environ if environ is None else environ)
    if policy.threads is None:
        yield policy
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError as missing:
        if policy.chosen:
            message = f"{policy.reason} needs the threadpoolctl package to size this process's pools ({missing})"
            raise UsageError(message) from None
        yield NativeThreads(None, f"not pinned in this process: threadpoolctl is not installed ({missing})")
        return
    with threadpool_limits(limits=policy.threads):
        yield policy
