"""The ``shardkit`` command's exit codes, in a module of their own: the supervising parent
(``supervise``) answers with them without importing the parser."""

from __future__ import annotations

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_OUTPUT_CLOSED", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C before any failure was found, as shells report SIGINT
EXIT_OUTPUT_CLOSED = 141  # the reader of stdout went away (`| head`), as shells report SIGPIPE
