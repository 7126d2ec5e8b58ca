"""The one place shardkit reaches into Hypothesis's internals, and why.

Recent Hypothesis releases bias a small share of its draws towards constants it
collects from the source of every *local* module loaded in the process (those
outside site-packages and the standard library). What a shardkit run draws from a
given seed would then depend on which other modules happen to be imported (a test
suite's, a conftest's, shardkit's own when it is installed in editable mode), so
``shardkit fuzz --seed N`` and ``pytest --shardkit-seed N`` could report different
failures. While a shardkit run draws, the local pool is held empty; Hypothesis's
global constants still apply, the same on every machine. Hypothesis has no public
switch for this; if a release renames the internals, the hook does nothing and
``tests/test_determinism.py`` fails, which is the cue to update it here.

Hypothesis also stops shrinking after five minutes of wall-clock time. A shardkit run
bounds shrinking by a count of steps and examples instead (``runner.Budgets``), so
within its runs that clock limit is lifted: which failure is reported never depends
on how busy the machine is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["deterministic_hypothesis", "local_constants_hook_available"]

_lock = threading.Lock()
_depth = 0
_saved: Any = None
_saved_seconds: Any = None


def _providers() -> Any:
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without that module
        return None
    if not hasattr(providers, "_get_local_constants") or not hasattr(providers, "CONSTANTS_CACHE"):
        return None
    return providers


def local_constants_hook_available() -> bool:
    """Whether this Hypothesis collects local constants in the way the hook neutralises."""
    return _providers() is not None


def _clear_cache(providers: Any) -> None:
    cache = providers.CONSTANTS_CACHE
    inner = getattr(cache, "cache", None)
    if inner is not None and hasattr(inner, "clear"):
        inner.clear()


def _engine() -> Any:
    try:
        from hypothesis.internal.conjecture import engine
    except ImportError:  # pragma: no cover
        return None
    return engine if isinstance(getattr(engine, "MAX_SHRINKING_SECONDS", None), int) else None


#: Long enough never to end a shrink that shardkit's own counted budget bounds.
_UNLIMITED_SECONDS = 10**9


@contextmanager
def deterministic_hypothesis() -> Iterator[None]:
    """Within the block, Hypothesis draws no constant collected from local modules and
    does not stop shrinking on the clock. Re-entrant; restored on exit."""
    global _depth, _saved, _saved_seconds
    providers, engine = _providers(), _engine()
    with _lock:
        if _depth == 0:
            if providers is not None:
                _saved = providers._get_local_constants
                empty = providers.Constants()
                providers._get_local_constants = lambda: empty
                _clear_cache(providers)
            if engine is not None:
                _saved_seconds = engine.MAX_SHRINKING_SECONDS
                engine.MAX_SHRINKING_SECONDS = _UNLIMITED_SECONDS
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if providers is not None:
                    providers._get_local_constants = _saved
                    _clear_cache(providers)
                if engine is not None:
                    engine.MAX_SHRINKING_SECONDS = _saved_seconds
