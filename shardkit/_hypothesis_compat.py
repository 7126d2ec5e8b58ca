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
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["fixed_local_constants", "local_constants_hook_available"]

_lock = threading.Lock()
_depth = 0
_saved: Any = None


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


@contextmanager
def fixed_local_constants() -> Iterator[None]:
    """Within the block, Hypothesis draws no constant collected from local modules."""
    global _depth, _saved
    providers = _providers()
    if providers is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _saved = providers._get_local_constants
            empty = providers.Constants()
            providers._get_local_constants = lambda: empty
            _clear_cache(providers)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                providers._get_local_constants = _saved
                _clear_cache(providers)
