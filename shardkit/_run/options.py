"""``FuzzOptions``: what a fuzz run does, validated once: the machine's options
(``MachineOptions``) and the run's budget. The CLI, ``fuzz`` and the printed rerun command
read it; each option's default, help text and check is written beside its field, here or
in ``shardkit._machine.spec``, and nowhere else."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shardkit._core.targets import IsolationOptions, Target, WorkerCommand, worker_command_argv
from shardkit._machine.profiles import DEFAULT_EXAMPLES, DEFAULT_STEPS
from shardkit._machine.spec import MachineOptions, OptionValueError, declare, int_from_text, positive_int
from shardkit._machine.state_machine import ShardMachine
from shardkit._public import settle
from shardkit._run.database import DatabaseChoice, parse_database
from shardkit._run.trace import importable_name
from shardkit.errors import InvalidTarget, UsageError

__all__ = ["DEFAULT_BUDGETS", "Budgets", "FuzzOptions"]


@dataclass(frozen=True)
class Budgets:
    """How much work a run may spend, in counts, never in seconds: the same seed then
    reports the same failure on an idle laptop and on a loaded CI machine.

    ``single_run_examples`` and ``chunk_examples``: a run of at most
    ``single_run_examples`` is one Hypothesis run; a longer one is a series of Hypothesis
    runs of at most ``chunk_examples`` each, seeded from the run's seed, so memory stays
    flat however many examples are asked for (Hypothesis's bookkeeping of one run grows
    with its examples). ``shrink_steps`` and ``shrink_examples``: steps and examples
    Hypothesis's shrinker may run after the first failure before the replay minimiser
    takes over, whichever runs out first. ``minimize_replays``: replays the minimiser
    may make. ``deepening_examples``: examples of each search for a shorter failure
    (iterative deepening).
    """

    single_run_examples: int = 200
    chunk_examples: int = 100
    shrink_steps: int = 30_000
    shrink_examples: int = 3_000
    minimize_replays: int = 5_000
    deepening_examples: int = 200


DEFAULT_BUDGETS = Budgets()


def _shrink_examples(count: Any) -> int | None:
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise OptionValueError("must be an integer >= 0 (0: report the failure as first found)")
    return count


def _worker_command(command: str | None) -> str | None:
    if command is not None:
        try:
            worker_command_argv(command)
        except InvalidTarget as error:
            raise OptionValueError(str(error), after_colon=True) from None
    return command


@dataclass(frozen=True, kw_only=True)
class FuzzOptions(MachineOptions):
    """The options of one ``fuzz`` run (the CLI's ``shardkit fuzz`` options, by the same
    names): the machine's (``MachineOptions``: ``role``, ``faults``, ``twins``,
    ``reference``, ``model``, ``base``, ``isolate``, ``step_timeout``,
    ``worker_memory_mb``, ``concurrency``) and the run's. Invalid values raise
    ``UsageError`` naming the option and the fix.

    ``role``: "head", "middle", "tail", "full", or None/"any" to draw one per example.
    ``faults``: "all", "none", or kinds ("delay,crash" or a list); True and False mean
    "all" and "none". ``reference`` builds the twin oracle from another engine. ``isolate``
    runs each engine in a worker process whose calls get ``step_timeout`` seconds and
    whose memory ``worker_memory_mb`` limits. ``worker_command`` (``--worker-command``) names
    the engine instead of a target: a command in any language that serves contract v1 on
    the address the kit puts in its ``{address}``, run as isolated workers. ``base`` (``--machine``: a ``ShardMachine``
    subclass, or its ``module:Class`` / ``file.py:Class`` name) and ``model`` (default: the
    machine's ``model_factory``) extend the rules (docs/extending.md); ``minimize`` turns the replay minimiser off; ``budgets`` bounds
    the work by counts. ``concurrency`` of 2 or 3 ends examples with that many lanes of
    calls sent at the same time (docs/contract.md#linearizability); the engine must declare
    ``concurrent_calls`` in its capabilities. ``database`` (``--database``) is where failing
    examples are saved and replayed from first: "none" (the default), a folder, a
    ``redis://HOST:PORT/N`` URL or a ``DatabaseChoice``; ``database_read_only`` replays
    without saving (docs/scaling.md#database).
    """

    examples: int = field(
        default=DEFAULT_EXAMPLES,
        metadata=declare("--examples", "examples to run ({default})", check=positive_int(), from_text=int_from_text),
    )
    steps: int = field(
        default=DEFAULT_STEPS,
        metadata=declare("--steps", "steps per example ({default})", check=positive_int(), from_text=int_from_text),
    )
    worker_command: str | None = field(
        default=None,
        metadata=declare(
            "--worker-command",
            "the engine is this command, in any language, serving contract v1 on the address the kit puts in "
            "its {{address}}; the kit starts it as isolated workers (docs/any-language.md)",
            check=_worker_command,
            metavar="CMD",
        ),
    )
    shrink_examples: int | None = field(
        default=None,
        metadata=declare(
            "--shrink-examples",
            "at most N examples and replays spent shrinking a failure, all its stages together; 0 reports the "
            "failure as first found (default: each stage its own budget, docs/reproducing.md#shrink-budget)",
            check=_shrink_examples,
            from_text=int_from_text,
            metavar="N",
        ),
    )
    minimize: bool = True
    budgets: Budgets = DEFAULT_BUDGETS
    database: str | DatabaseChoice = "none"
    database_read_only: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        database = parse_database(self.database) if isinstance(self.database, str) else self.database
        if self.database_read_only:
            if database.kind == "none":
                message = "database_read_only (--database-read-only) replays a database without saving to it; name one (--database)"
                raise UsageError(message)
            database = replace(database, read_only=True)
        object.__setattr__(self, "database", database)
        object.__setattr__(self, "database_read_only", database.read_only)

    @classmethod
    def from_fields(cls, options: FuzzOptions | None, changes: dict[str, Any]) -> FuzzOptions:
        """``options`` (or the defaults) with ``changes``; an unknown name is a UsageError."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            message = f"unknown fuzz option(s) {', '.join(unknown)}; the options are: {', '.join(sorted(known))}"
            raise UsageError(message)
        return replace(options if options is not None else cls(), **changes)

    def command(self, target: Target, seed: int, reference: Target | None, isolation: IsolationOptions | None) -> str:
        """The ``shardkit fuzz`` command line of this run: the options that differ from the
        defaults. ``reference`` is the reference engine's target and ``isolation`` the
        isolation the run used, if any."""
        defaults = FuzzOptions()
        command = target.command if isinstance(target, WorkerCommand) else None
        named = ["--worker-command", shlex.quote(command)] if command is not None else [shlex.quote(target.name)]
        parts = ["shardkit", "fuzz", *named, "--seed", str(seed)]
        if self.role is not None:
            parts += ["--role", self.role]
        if self.examples != defaults.examples:
            parts += ["--examples", str(self.examples)]
        if self.steps != defaults.steps:
            parts += ["--steps", str(self.steps)]
        if self.shrink_examples is not None:
            # The shrunk failure depends on it: the line must reproduce that one.
            parts += ["--shrink-examples", str(self.shrink_examples)]
        if self.faults != defaults.faults:
            parts += ["--faults", self.faults]
        if not self.twins:
            parts.append("--no-twins")
        if not self.extreme_values:
            parts.append("--no-extreme-values")
        if self.concurrency != defaults.concurrency:
            parts += ["--concurrency", str(self.concurrency)]
        if reference is not None:
            parts += ["--reference", shlex.quote(reference.name)]
        if isolation is not None:
            parts += isolation.command_options(isolate_flag=command is None)
        elif self.step_timeout is not None:
            parts += ["--step-timeout", f"{self.step_timeout:g}"]
        parts += self.database_choice.command_options()
        return " ".join(parts) + self._machine_options()

    @property
    def database_choice(self) -> DatabaseChoice:
        """``database`` as ``__post_init__`` checked it."""
        assert isinstance(self.database, DatabaseChoice)
        return self.database

    def _machine_options(self) -> str:
        """`` --machine NAME``, or why the command line cannot name the extended rules."""
        base = self.base
        assert isinstance(base, type)  # __post_init__ resolved a name
        if base is ShardMachine and self.model is None:
            return ""
        machine = importable_name(base) if base is not ShardMachine else None
        if base is not ShardMachine and machine is None:
            return f"  # needs the machine {base.__qualname__}, which cannot be imported by name: rerun from Python"
        if self.model is not None and self.model is not base.model_factory:
            model = getattr(self.model, "__qualname__", repr(self.model))
            return f"  # needs the model {model}: set it as the machine's model_factory to rerun from here"
        return f" --machine {shlex.quote(machine)}" if machine is not None else ""


settle(__name__, globals())
