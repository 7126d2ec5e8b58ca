"""``shardkit report REPORT.json -o report.html``: a ``--report`` document drawn as one HTML
page, and the check of an HTML file named on the command line (``fuzz --html``) before a run.

Every mistake of the user (a file that is missing, a folder, a FIFO or a device, larger than
``MAX_REPORT_BYTES``, not JSON, not a shardkit report, nowhere to write) is one line naming
the value and the fix, exit 2."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from shardkit._cli.parser import EXIT_OK, EXIT_USAGE
from shardkit._cli.paths import check_output_file
from shardkit.errors import UsageError

__all__ = ["MAX_REPORT_BYTES", "read_report", "report_command"]

#: What the user is asked to name when the file they named is not a report.
WHAT_TO_NAME = "name the JSON file `shardkit fuzz --report FILE` wrote"
#: The largest report read, as large as a trace may be (a campaign's report of many failures is a few MB).
MAX_REPORT_BYTES = 64 * 1024 * 1024


def report_command(args: argparse.Namespace) -> int:
    from shardkit._html import write_html

    source: Path = args.report
    output: Path = args.output if args.output is not None else source.with_suffix(".html")
    document = read_report(source)
    if output.resolve() == source.resolve():
        other = source.with_name(f"{source.stem}-report.html")
        raise UsageError(f"shardkit report: -o {output} is the report itself; name another file, e.g. -o {other}")
    check_output_file("report", "-o", output, "report.html")
    try:
        write_html(document, output)
    except OSError as error:
        print(f"shardkit report: could not write -o {output}: {error.strerror or error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"html: {output}")
    return EXIT_OK


def read_report(source: Path) -> dict[str, Any]:
    """The report document in ``source``; ``UsageError`` saying what is wrong with the file."""
    from shardkit._html import document_problem
    from shardkit._run.trace_reader import read_regular_file

    if source.is_dir():
        raise UsageError(f"shardkit report: {source} is a folder; {WHAT_TO_NAME}, e.g. {source / 'report.json'}")
    if not source.exists():
        raise UsageError(f"shardkit report: {source} does not exist; {WHAT_TO_NAME}")
    # Only a regular file of bounded size: a FIFO would wait for a writer forever, /dev/zero
    # would be read until memory runs out. The same check as replay's for a trace.
    data = read_regular_file(
        source, limit=MAX_REPORT_BYTES, noun="report", fix=WHAT_TO_NAME, error=lambda line: UsageError(f"shardkit report: {line}")
    )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"shardkit report: {source} is not UTF-8 text, so not a report; {WHAT_TO_NAME}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}: {error.msg}"
        raise UsageError(f"shardkit report: {source} is not JSON ({where}); {WHAT_TO_NAME}") from None
    except (ValueError, RecursionError):
        raise UsageError(f"shardkit report: {source} is not JSON a report can hold; {WHAT_TO_NAME}") from None
    if isinstance(document, dict) and document.get("format") == "shardkit-trace":
        message = f"shardkit report: {source} is a failure trace, not a run report; replay it with `shardkit replay {shlex.quote(str(source))}`, or {WHAT_TO_NAME}"
        raise UsageError(message)
    problem = document_problem(document)
    if problem is not None:
        raise UsageError(f"shardkit report: {source} is not a shardkit report: {problem}; {WHAT_TO_NAME}")
    assert isinstance(document, dict)  # document_problem accepts only an object
    return document


