"""The ``shardkit`` command: a thin adapter that parses options and calls the library.

Exit codes: 0 no failure, 1 a failure found (or reproduced), 2 a usage or input
error, reported in one line without a traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

# Imports stay light here: `shardkit serve --worker` starts through this module, once per
# worker process, and should not pay for Hypothesis; each command imports what it runs.
from shardkit._cli.bench import bench_command
from shardkit._cli.campaign import campaign_command
from shardkit._cli.commands import contract_command, replay_command, serve_command
from shardkit._cli.fuzz import fuzz_command
from shardkit._cli.parser import EXIT_INTERRUPTED, EXIT_OUTPUT_CLOSED, EXIT_USAGE, build_parser, one_line
from shardkit._cli.report import report_command
from shardkit._core.targets import describe_exception
from shardkit.contract import EngineError
from shardkit.errors import EngineLost, KitBug, ShardkitError, UsageError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return its exit code. Whatever escapes the library is reported
    here, so no exit code lies: only a found (or reproduced) failure is 1, and only a run
    that checked everything it was asked to is 0."""
    try:
        # --help and --version end here with argparse's SystemExit(0), as they should.
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    handlers = {
        "fuzz": fuzz_command,
        "campaign": campaign_command,
        "replay": replay_command,
        "bench": bench_command,
        "contract": contract_command,
        "serve": serve_command,
        "report": report_command,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print("shardkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader stopped reading (`shardkit replay T | head`): what was printed stands, and
        # nothing more can be; without this, Python reports the closed pipe again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED
    except EngineLost as lost:
        # Not an Exception, so that it ends a run wherever it happens: the server went away.
        print(f"shardkit: error: {one_line(str(lost))}", file=sys.stderr)
        return EXIT_USAGE
    except (ShardkitError, EngineError, OSError) as error:
        print(_error_line(error), file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:
        # Nothing should get here: the library turns what an engine raises into a finding or an
        # input error. Keep the traceback for the bug report; the exit code still says "error".
        traceback.print_exc(file=sys.stderr)
        print(_kit_bug_line(f"unexpected {describe_exception(error)}"), file=sys.stderr)
        return EXIT_USAGE
    except BaseException as error:
        # A SystemExit (or another BaseException) raised by the engine under test: never the kit's
        # own exit, and never a pass, since nothing after it was checked.
        message = (
            f"shardkit: error: the engine under test raised {describe_exception(error)}, which ended the run "
            "before anything more was checked (a SystemExit from an engine is never the kit's own exit)"
        )
        print(message, file=sys.stderr)
        return EXIT_USAGE


def _error_line(error: ShardkitError | EngineError | OSError) -> str:
    """The line an input error (or a bug of the kit) that ended a command prints."""
    if isinstance(error, UsageError):
        return str(error)  # it names the command and the option already
    if isinstance(error, KitBug):
        return _kit_bug_line(str(error))
    if isinstance(error, EngineError):
        # The driver lets an engine's refusal of load or capabilities pass (as the contract
        # allows, and replay and the choice of roles rely on); one that ends a run lands here.
        status = error.status
        return f"shardkit: error: the engine refused with EngineError {status.code.name}: {status.message}"
    return f"shardkit: error: {error}"


def _kit_bug_line(what: str) -> str:
    line = f"shardkit: internal error: {one_line(what)}"
    if "bug in shardkit" not in what:
        line += "; this is a bug in shardkit: please report it with the command that ran"
    return line
