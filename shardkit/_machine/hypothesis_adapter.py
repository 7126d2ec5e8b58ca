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
bounds shrinking by a count of steps and examples instead (``Budgets``), so
within its runs that clock limit is lifted: which failure is reported never depends
on how busy the machine is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = [
    "DeclaredRule",
    "ShrinkBudgetSpent",
    "deterministic_hypothesis",
    "integer_range",
    "local_constants_hook_available",
    "mark_as_state_machine_test",
    "rules_and_initializers",
    "stop_hypothesis",
]

#: Guards installing and removing the patch when runs overlap in threads.
_LOCK = threading.Lock()
#: The attribute of Hypothesis's ``providers`` module where the patch in force is kept.
_PATCH_ATTRIBUTE = "_shardkit_deterministic_patch"


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


class _Patch:
    """Hypothesis's two settings as shardkit runs need them, and the values to restore;
    ``users`` counts the runs inside the block (they may nest or overlap in threads)."""

    def __init__(self, providers: Any, engine: Any) -> None:
        self.providers, self.engine, self.users = providers, engine, 0
        if providers is not None:
            self.saved_constants = providers._get_local_constants
            empty = providers.Constants()
            providers._get_local_constants = lambda: empty
            _clear_cache(providers)
        if engine is not None:
            self.saved_seconds = engine.MAX_SHRINKING_SECONDS
            engine.MAX_SHRINKING_SECONDS = _UNLIMITED_SECONDS

    def undo(self) -> None:
        if self.providers is not None:
            self.providers._get_local_constants = self.saved_constants
            _clear_cache(self.providers)
        if self.engine is not None:
            self.engine.MAX_SHRINKING_SECONDS = self.saved_seconds


@contextmanager
def deterministic_hypothesis() -> Iterator[None]:
    """Within the block, Hypothesis draws no constant collected from local modules and
    does not stop shrinking on the clock. Re-entrant; restored on exit. The patch in force
    is kept on Hypothesis's own module, the state it changes, not in this one."""
    providers, engine = _providers(), _engine()
    home = providers if providers is not None else engine
    if home is None:  # pragma: no cover - a Hypothesis without either internal
        yield
        return
    with _LOCK:
        patch: _Patch | None = getattr(home, _PATCH_ATTRIBUTE, None)
        if patch is None:
            patch = _Patch(providers, engine)
            setattr(home, _PATCH_ATTRIBUTE, patch)
        patch.users += 1
    try:
        yield
    finally:
        with _LOCK:
            patch.users -= 1
            if patch.users == 0:
                patch.undo()
                delattr(home, _PATCH_ATTRIBUTE)

class ShrinkBudgetSpent(BaseException):
    """Raised through Hypothesis to end a run whose shrink has spent its counted budget;
    the runner then minimises the shortest failure by replay. Hypothesis offers no public
    way to stop a shrink on a count: it lets a ``BaseException`` that is not an
    ``Exception`` pass through its engine (as it does ``KeyboardInterrupt``), and the
    tests of this adapter check that it still does."""


def stop_hypothesis() -> NoReturn:
    raise ShrinkBudgetSpent


def integer_range(strategy: object) -> range | None:
    """The values ``st.integers(lo, hi)`` draws, or None for any other strategy. Hypothesis
    wraps strategies lazily and keeps the bounds as attributes without a public accessor."""
    inner = getattr(strategy, "wrapped_strategy", strategy)
    low, high = getattr(inner, "start", None), getattr(inner, "end", None)
    if isinstance(low, int) and isinstance(high, int):
        return range(low, high + 1)
    return None


def mark_as_state_machine_test(run_test: Callable[..., object], fuzzed_machine: type | None) -> None:
    """Mark a suite's ``runTest`` as Hypothesis marks its own state machines' (its
    ``TestCase.runTest``): Hypothesis's pytest plugin then counts it as a Hypothesis test
    (``hypothesis.is_hypothesis_test``), and HypoFuzz, given ``fuzzed_machine``, fuzzes that
    machine example after example rather than calling ``runTest``. Both read attributes
    Hypothesis sets and documents no way to set."""
    setattr(run_test, "is_hypothesis_test", True)  # noqa: B010 - the attribute Hypothesis reads
    if fuzzed_machine is not None:
        setattr(run_test, "_hypothesis_state_machine_class", fuzzed_machine)  # noqa: B010


#: One ``@rule`` or ``@initialize`` of a state machine as its class declares it: the method's
#: name, its function (undecorated), and what draws each of its arguments, by argument name.
DeclaredRule = tuple[str, Callable[..., Any], dict[str, Any]]


def rules_and_initializers(machine: type) -> tuple[tuple[DeclaredRule, ...], tuple[DeclaredRule, ...]]:
    """The rules and the initializers of ``machine`` (its own and those it inherits), each in
    the order Hypothesis gathers them (by attribute name): what a copy of the machine's shape
    needs, such as ``shardkit bench``'s bare machine, which draws what the kit's draws.
    Hypothesis keeps each as a ``Rule`` (``function``, ``arguments``) under a marker attribute
    of the decorated method, and gathers them with a class method that is not public and was
    renamed (``rules()`` and ``initialize_rules()``, then ``setup_state()``); the markers and
    the two fields are the same in every release the kit allows, so they are read here."""
    import inspect

    from hypothesis.stateful import INITIALIZE_RULE_MARKER, RULE_MARKER

    def declared(marker: str) -> tuple[DeclaredRule, ...]:
        found = []
        for _, member in inspect.getmembers(machine):
            declaration = getattr(member, marker, None)
            if declaration is not None:
                function = declaration.function
                found.append((function.__name__, function, dict(declaration.arguments)))
        return tuple(found)

    return declared(RULE_MARKER), declared(INITIALIZE_RULE_MARKER)
