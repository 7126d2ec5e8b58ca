"""The ``shardkit`` command: a thin adapter that parses options and calls the library.

Exit codes: 0 no failure, 1 a failure found (or reproduced), 2 a usage or input
error, reported in one line without a traceback.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ._version import __version__
from .contract import FAULT_KINDS
from .errors import ContractViolation, InvalidTarget, ShardkitError
from .machine import ROLES, parse_faults
from .targets import DEFAULT_TARGET, resolve_target

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT = Path(".shardkit/failures")


class UsageError(Exception):
    """A mistake on the command line: one line on stderr, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(name: str) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            message = f"{name} must be a positive integer, got {text!r}"
            raise argparse.ArgumentTypeError(message)
        return value

    parse.__name__ = name
    return parse  # type: ignore[return-value]


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        message = f"--seed must be an integer in [0, 2**64), got {text!r}"
        raise argparse.ArgumentTypeError(message)
    return value


def _faults(text: str) -> str:
    try:
        parse_faults(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _parser() -> _Parser:
    parser = _Parser(prog="shardkit", description="Property-based state-machine testing for LLM shard engines.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    fuzz = commands.add_parser("fuzz", help="fuzz an engine against the reference model")
    fuzz.add_argument("target", nargs="?", default=DEFAULT_TARGET, help=f"engine target (default {DEFAULT_TARGET})")
    fuzz.add_argument("--role", choices=[*ROLES, "any"], default="any", help="shard role to load (default: any)")
    fuzz.add_argument("--examples", type=_positive_int("--examples"), default=200, help="examples to run (200)")
    fuzz.add_argument("--steps", type=_positive_int("--steps"), default=50, help="steps per example (50)")
    fuzz.add_argument("--seed", type=_seed, default=None, help="seed of the whole run (default: chosen and printed)")
    fuzz.add_argument(
        "--faults",
        type=_faults,
        default="all",
        help=f"all, none, or a comma-separated list of {', '.join(FAULT_KINDS)}",
    )
    fuzz.add_argument("--no-twins", action="store_true", help="skip the twin oracle (faster, finds less)")
    fuzz.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where failure traces go ({DEFAULT_OUT})")
    fuzz.add_argument("--report", type=Path, default=None, help="write the run report (JSON) here")

    contract = commands.add_parser("contract", help="run the quick static contract checks")
    contract.add_argument("target", help="engine target, e.g. my_pkg.engine:make_engine")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "fuzz":
            return _fuzz(args)
        return _contract(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    except (InvalidTarget, ShardkitError, OSError) as error:
        print(f"shardkit: error: {error}", file=sys.stderr)
        return EXIT_USAGE


def _fuzz(args: argparse.Namespace) -> int:
    from .report import print_summary
    from .runner import fuzz, report_document

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.report is not None and not args.report.parent.exists():
        message = f"shardkit fuzz: --report {args.report}: the folder {args.report.parent} does not exist"
        raise UsageError(message)
    target = resolve_target(args.target)
    print(f"shardkit fuzz {target.name} --seed {seed}", flush=True)
    result = fuzz(
        target,
        seed=seed,
        examples=args.examples,
        steps=args.steps,
        role=args.role,
        faults=args.faults,
        twins=not args.no_twins,
        out=args.out,
    )
    print_summary(result, sys.stdout)
    if args.report is not None:
        args.report.write_text(json.dumps(report_document(result), indent=2, ensure_ascii=False) + "\n")
        print(f"report: {args.report}")
    return EXIT_FAILURE if result.failure is not None else EXIT_OK


def _contract(args: argparse.Namespace) -> int:
    from . import assert_shard_engine_contract

    target = resolve_target(args.target)
    try:
        assert_shard_engine_contract(target)
    except ContractViolation as violation:
        print(violation)
        return EXIT_FAILURE
    print(f"{target.name}: every contract check passed")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
