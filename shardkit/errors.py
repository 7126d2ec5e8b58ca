"""The kit's exceptions: one root, and user mistakes that also subclass the builtin they resemble."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ContractViolation",
    "InvalidTarget",
    "KitBug",
    "ShardkitError",
    "TraceFormatError",
    "UntrustedTarget",
    "UsageError",
]


class ShardkitError(Exception):
    """The root of every error shardkit raises on its own account."""


class InvalidTarget(ShardkitError, ValueError):
    """An engine target that cannot be imported, called, or does not build a ShardEngine."""


class TraceFormatError(ShardkitError, ValueError):
    """A trace file that is missing, unreadable, not JSON, of another format or
    version, or whose steps do not fit the schema; the message names the problem."""


class ContractViolation(ShardkitError, AssertionError):
    """An engine broke contract v1; the message names each check, expected and observed."""

    def __init__(self, message: str, failed_checks: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failed_checks: tuple[str, ...] = tuple(failed_checks)


class UsageError(ShardkitError, ValueError):
    """An option or argument the user gave that cannot work; the message names it and the fix."""


class UntrustedTarget(ShardkitError, ValueError):
    """A trace names code to run (an engine target, a reference or a machine) that the user has not
    named and that does not resolve inside the current project; replay refuses to build it."""


class KitBug(ShardkitError):
    """A check of shardkit itself failed (for example an injected malformed output went
    undetected): a bug in shardkit, never reported as a failure of the engine under test."""
