"""The kit's exceptions: one root, and user mistakes that also subclass the builtin they resemble."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ContractViolation", "InvalidTarget", "ShardkitError", "TraceFormatError"]


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
