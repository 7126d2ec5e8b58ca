"""``MachineOptions``: what a machine fuzzes with, declared and checked once.

Each option is one dataclass field whose metadata (``Declared``) holds its command-line
flag, its help text and its check; the field holds its default. ``build_machine`` takes a
``MachineOptions`` and checks nothing again; ``FuzzOptions`` extends it with the run's
budget, and the command line's options are generated from the same fields
(``shardkit._cli.parser``). A bad value raises ``UsageError`` naming the option, its flag
and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from shardkit._core.importing import import_named
from shardkit._core.model import ReferenceModel
from shardkit._core.targets import (
    MAX_STEP_TIMEOUT,
    EngineFactory,
    IsolationOptions,
    ResolvedTarget,
    Target,
    typed_target,
)
from shardkit._machine.parallel_rules import MAX_CONCURRENCY
from shardkit._machine.state_machine import ShardMachine
from shardkit.contract import FAULT_KINDS, ROLES, Role
from shardkit.errors import UsageError

__all__ = [
    "Declared",
    "MachineOptions",
    "OptionValueError",
    "check_declared",
    "check_option",
    "declare",
    "declared",
    "int_from_text",
    "options_of",
    "parse_faults",
    "positive_int",
]


class OptionValueError(ValueError):
    """What an option's check raises: ``reason`` completes "NAME (--FLAG) …, got VALUE", or
    with ``after_colon`` "NAME (--FLAG): …", for a reason that shows the value itself."""

    def __init__(self, reason: str, *, after_colon: bool = False) -> None:
        super().__init__(reason)
        self.after_colon = after_colon


@dataclass(frozen=True)
class Declared:
    """An option's declaration beside its field: its flag (``--role``), its help text (where
    ``{default}`` stands for the field's default), the values the command line offers
    (``choices``), the command line's reading of its text (``from_text``: None keeps the text)
    and its ``check``, which returns the value canonical or raises ``OptionValueError``."""

    flag: str
    help: str
    check: Callable[[Any], Any] | None = None
    from_text: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def declare(flag: str, help: str, **declared: Any) -> dict[str, Declared]:
    """The metadata of an option's field: ``field(default=…, metadata=declare(flag, help, check=…))``."""
    return {"option": Declared(flag, help, **declared)}


def declared(options: type, name: str) -> Declared:
    """The declaration of the option ``name`` of an options class."""
    for each in fields(options):
        if each.name == name and "option" in each.metadata:
            found: Declared = each.metadata["option"]
            return found
    raise KeyError(name)


def check_declared(options: object) -> None:
    """Run each declared field's check on ``options`` (a frozen dataclass), storing what it returns."""
    for each in fields(options):  # type: ignore[arg-type]
        declaration = each.metadata.get("option")
        if declaration is not None and declaration.check is not None:
            object.__setattr__(options, each.name, _checked(each.name, declaration, getattr(options, each.name)))


def check_option(name: str, value: Any) -> Any:
    """``value`` as the ``MachineOptions`` option ``name`` takes it (for a command that takes
    that option alone); ``UsageError`` names the option and the fix."""
    declaration = declared(MachineOptions, name)
    return _checked(name, declaration, value) if declaration.check is not None else value


def _checked(name: str, declaration: Declared, value: Any) -> Any:
    assert declaration.check is not None
    try:
        return declaration.check(value)
    except OptionValueError as error:
        shown = f": {error}" if error.after_colon else f" {error}, got {value!r}"
        raise UsageError(f"{name} ({declaration.flag}){shown}") from None


def positive_int(reason: str = "must be a positive integer") -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionValueError(reason)
        return value

    return check


def int_from_text(text: str) -> Any:
    """An integer, or the text itself for the check to refuse by name."""
    try:
        return int(text)
    except ValueError:
        return text


def parse_faults(faults: bool | str | Iterable[str]) -> frozenset[str]:
    """``True``/"all", ``False``/"none", or kinds (a list or "delay,crash")."""
    if faults is True or faults == "all":
        return frozenset(FAULT_KINDS)
    if faults is False or faults == "none":
        return frozenset()
    kinds = [kind.strip() for kind in faults.split(",")] if isinstance(faults, str) else list(faults)
    unknown = [kind for kind in kinds if kind not in FAULT_KINDS]
    if unknown or not kinds:
        raise OptionValueError(f"must be 'all', 'none' or a comma-separated list of {', '.join(FAULT_KINDS)}")
    return frozenset(kinds)


def _canonical_faults(faults: bool | str | Iterable[str]) -> str:
    """ "all", "none", or the kinds in the contract's order joined by commas."""
    kinds = parse_faults(faults)
    if faults is True or faults == "all":
        return "all"
    if not kinds:
        return "none"
    return ",".join(kind for kind in FAULT_KINDS if kind in kinds)


def _role(role: Any) -> Role | None:
    if role == "any" or role is None:
        return None
    if role not in ROLES:
        raise OptionValueError(f"must be one of {', '.join(ROLES)} or 'any'")
    found: Role = role
    return found


def _concurrency(lanes: Any) -> int:
    if lanes not in range(1, MAX_CONCURRENCY + 1) or isinstance(lanes, bool | float):
        raise OptionValueError(f"must be a number of lanes from 1 to {MAX_CONCURRENCY}")
    return int(lanes)


def _step_timeout(seconds: Any) -> float | None:
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= MAX_STEP_TIMEOUT
    ):
        raise OptionValueError(f"must be a number of seconds in (0, {MAX_STEP_TIMEOUT:g}]")
    return seconds


def _worker_memory(memory: Any) -> int | None:
    return None if memory is None else positive_int("must be a positive integer number of MiB")(memory)


def _reference(reference: str | EngineFactory | Target | ResolvedTarget | None) -> Target | ResolvedTarget | None:
    return typed_target(reference) if reference is not None else None


def _machine_class(base: object) -> type[ShardMachine]:
    """The ``ShardMachine`` subclass ``base`` is or names (``module:Class``, ``file.py:Class``)."""
    found = (
        import_named(base, "--machine", "'package.module:Machine' or 'path/to/file.py:Machine'")
        if isinstance(base, str)
        else base
    )
    if not (isinstance(found, type) and issubclass(found, ShardMachine)):
        what = f"--machine {base!r} names" if isinstance(base, str) else "base (--machine) is"
        message = f"{what} {found!r}, not a ShardMachine subclass; name the class that extends shardkit.ShardMachine"
        raise UsageError(message)
    return found


def options_of(machine: type[ShardMachine]) -> MachineOptions:
    """The options ``machine`` was built with (``build_machine``); the defaults for a machine not built."""
    options = machine._options
    if options is None:
        return MachineOptions()
    assert isinstance(options, MachineOptions)
    return options


@dataclass(frozen=True, kw_only=True)
class MachineOptions:
    """The options of the machine that fuzzes an engine, checked when made.

    ``role``: "head", "middle", "tail", "full", or None/"any" to draw one per example.
    ``faults``: "all", "none", or kinds ("delay,crash" or a list); True and False mean "all"
    and "none". ``twins`` turns the twin oracle on; ``reference`` builds the twins from
    another engine, which fuzzes the target differentially against it. ``model`` builds the
    reference model (None: the ``model_factory`` of ``base``, the machine class extended;
    docs/extending.md). ``isolate`` runs each engine in a worker process whose calls get
    ``step_timeout`` seconds (a remote target's too) and whose memory ``worker_memory_mb``
    limits. ``concurrency`` of 2 or 3 ends examples with that many lanes of calls sent at
    the same time (docs/contract.md#linearizability). ``extreme_values`` False leaves out
    the rule that sends rows at the edges of the dtype's range (docs/numerics.md#extreme-values).
    """

    role: Role | None = field(
        default=None,
        metadata=declare("--role", "shard role to load (default: any)", check=_role, choices=(*ROLES, "any")),
    )
    faults: str = field(
        default="all",
        metadata=declare(
            "--faults",
            f"all, none, or a comma-separated list of {', '.join(FAULT_KINDS)}",
            check=_canonical_faults,
        ),
    )
    twins: bool = field(default=True, metadata=declare("--no-twins", "skip the twin oracle (faster, finds less)"))
    extreme_values: bool = field(
        default=True,
        metadata=declare(
            "--no-extreme-values",
            "never send a middle or tail rows at the edges of its dtype's range (huge, subnormal, zero)",
        ),
    )
    reference: Target | ResolvedTarget | None = field(
        default=None,
        metadata=declare(
            "--reference",
            "build the twin oracle from this engine instead: fuzz TARGET differentially against it",
            check=_reference,
            metavar="TARGET",
        ),
    )
    model: Callable[[], ReferenceModel] | None = None
    base: type[ShardMachine] = field(
        default=ShardMachine,
        metadata=declare(
            "--machine",
            "fuzz with this ShardMachine subclass: the rules and model extended for a backend (docs/extending.md)",
            check=_machine_class,
            metavar="MODULE:CLASS",
        ),
    )
    isolate: bool | IsolationOptions = False
    step_timeout: float | None = field(
        default=None,
        metadata=declare(
            "--step-timeout",
            "seconds each engine call may take (isolated or grpc:// engines; default 5)",
            check=_step_timeout,
            metavar="S",
        ),
    )
    worker_memory_mb: int | None = field(
        default=None,
        metadata=declare(
            "--worker-memory",
            "limit the worker's memory (RLIMIT_DATA) to MB MiB; needs --isolate or --worker-command",
            check=_worker_memory,
            from_text=int_from_text,
            metavar="MB",
        ),
    )
    concurrency: int = field(
        default=1,
        metadata=declare(
            "--concurrency",
            "end examples with N lanes of calls sent at the same time, checked for linearizability "
            f"(1 to {MAX_CONCURRENCY}; default {{default}}: none); the engine must declare concurrent_calls",
            check=_concurrency,
            from_text=int_from_text,
            metavar="N",
        ),
    )

    def __post_init__(self) -> None:
        check_declared(self)
        if self.reference is not None and not self.twins:
            message = "a reference engine is compared through the twin oracle; drop --no-twins or the reference"
            raise UsageError(message)
        if not self.twins and "malformed_output" in self.fault_set and not self.all_faults:
            # Without twins a wrong output of a first-seen history is undetectable, and an
            # undetected injection counts as a failure of the kit.
            message = "the malformed_output fault needs the twin oracle to detect it; drop --no-twins or the fault"
            raise UsageError(message)

    @property
    def all_faults(self) -> bool:
        """Every kind the engine can take (``--faults all``): a kind it cannot is left out, not refused."""
        return self.faults == "all"

    @property
    def fault_set(self) -> frozenset[str]:
        return parse_faults(self.faults)

    @property
    def wanted_faults(self) -> frozenset[str]:
        """The fault kinds asked for that the other options allow."""
        return self.fault_set if self.twins else self.fault_set - {"malformed_output"}

    @property
    def model_factory(self) -> Callable[[], ReferenceModel]:
        """What builds the reference model: ``model``, else the machine class's own."""
        return self.model if self.model is not None else self.base.model_factory
