"""The Hypothesis state machine: draws steps, hands them to the driver.

Every rule draws at most three small integers, with 0 the simplest choice,
and derives the concrete step from them and the model's state at run time
(which live session, which chunk, which epoch). That keeps each step a few
choices long, so Hypothesis's shrinker can delete whole steps (SHRINKING.md).
"""

from __future__ import annotations

import functools
import re
import unittest
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import event, reject, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule
from hypothesis.strategies import SearchStrategy

from . import _profiles  # noqa: F401  (registers the shardkit-* profiles)
from .contract import EPOCH_STEP_LIMIT, FAULT_KINDS, ROLES, EngineCapabilities, EngineError, LoadRequest, Role
from .driver import CustomOp, Driver, StepFailed, StepRecord, Violation, usable_faults
from .errors import ShardkitError
from .isolation import IsolationOptions, target_with_options
from .model import ReferenceModel
from .steps import Action, malformations_for, step_action
from .targets import EngineFactory, ResolvedTarget, resolve_target, short_name

__all__ = [
    "ROLES",
    "Choice",
    "FailureReport",
    "RunStats",
    "ShardMachine",
    "layer_range",
    "machine_for",
    "parse_faults",
    "step_rule",
]

#: Realistic ids: short and long, non-ASCII, sharing prefixes, with separators.
SESSION_IDS = ("a", "b", "req-0001", "req-0001/retry", "sess-é-日本語", "x" * 200, "a b", "req-00010")
CHUNK_LENGTHS = (1, 2, 3, 4, 5, 8, 17, 64)
LIVE_CHOICES = 6
EPOCH_JUMPS = (1, 2, 1000, 2**62)
STEP_DELTAS = (1, 2, -2, 2**62)
DELAYS = (0.0, 0.0001, 0.0002, 0.001)  # seconds: the result must not change, however long
BEFORE_LOAD_CALLS = ("prefill", "decode", "cancel", "release", "health")

@dataclass(frozen=True)
class Choice:
    """One rule as Hypothesis drew it: the rule's name and its small integers."""

    rule: str
    arguments: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        return f"{self.rule}({', '.join(f'{name}={value}' for name, value in self.arguments)})"


@dataclass
class FailureReport:
    """A failing example: its violation, the steps the driver recorded, and the
    drawn choices (layout and rules) that replay it without Hypothesis."""

    violation: Violation
    records: list[StepRecord]
    load_request: LoadRequest
    faults: frozenset[str]
    layout: int = 0
    choices: tuple[Choice, ...] = ()


def step_rule(**strategies: SearchStrategy[int]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``@rule`` that also records the drawn arguments, so the minimiser can replay
    the rule without Hypothesis. Use it for the rules you add; keep the
    strategies small integers with 0 the simplest choice (SHRINKING.md)."""

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(function)
        def record_then_run(self: ShardMachine, **arguments: int) -> None:
            self.choices.append(Choice(function.__name__, tuple(arguments.items())))
            function(self, **arguments)

        decorated: Callable[..., None] = rule(**strategies)(record_then_run)  # type: ignore[call-overload]
        return decorated

    return decorate


@dataclass
class RunStats:
    """Counters shared by every example of one machine class, and the run's hooks."""

    examples: int = 0
    steps: int = 0
    failures_seen: int = 0
    coverage: Counter[tuple[str, str]] = field(default_factory=Counter)
    failure: FailureReport | None = None
    #: Called with each failing example as it happens (the runner writes its trace).
    on_failure: Callable[[FailureReport], object] | None = None
    #: Called as each example starts with (examples, steps, failures seen).
    on_example: Callable[[int, int, int], object] | None = None
    #: The failing example with the fewest steps so far.
    shortest: FailureReport | None = None
    #: Once ``steps`` passes this count, stop Hypothesis's shrinking: the replay minimiser takes
    #: over. A count of steps, never a time, so the same seed shrinks the same way on any machine.
    shrink_stop_at_step: int | None = None
    #: Likewise once ``examples`` passes this count (rules that make no step still cost examples).
    shrink_stop_at_example: int | None = None
    #: When set, a failure of any other property does not count (iterative deepening looks
    #: for a shorter failure of one property): the example is rejected instead.
    only_property: str | None = None


class ShrinkBudgetSpent(BaseException):
    """Raised through Hypothesis (which does not catch it) to end a shrink that has spent
    its counted budget of steps; the runner then minimises the shortest failure by replay."""


def coverage_op(action: Action) -> str:
    """The operation a step exercises: a call to a never-loaded engine counts as that call."""
    return str(action.args["call"]) if action.op == "unloaded" else action.op


def layer_range(role: Role, total_layers: int, choice: int) -> tuple[int, int]:
    """A layer range of ``role``, the ``choice``-th of those that exist (0 = the widest)."""
    last = total_layers - 1
    if role == "full":
        return 0, last
    if role == "head":
        return 0, last - 1 - choice % last
    if role == "tail":
        return 1 + choice % last, last
    pairs = [(start, end) for start in range(1, last) for end in range(last - 1, start - 1, -1)]
    return pairs[choice % len(pairs)]


def roles_for(total_layers: int) -> tuple[Role, ...]:
    minimum = {"full": 1, "head": 2, "tail": 2, "middle": 3}
    return tuple(role for role in ROLES if total_layers >= minimum[role])


def loadable_roles(target: ResolvedTarget, total_layers: int) -> tuple[Role, ...]:
    """The roles whose widest layer range a fresh engine from ``target`` agrees to load."""
    roles: list[Role] = []
    for role in roles_for(total_layers):
        start, end = layer_range(role, total_layers, 0)
        request = LoadRequest("shardkit-fuzz", start, end, total_layers)
        engine = target()
        try:
            # An exception other than EngineError (or the worker dying) names the call: exit 2, one line.
            loaded = target.guarded(f"load(layers {start}..{end} of {total_layers})", functools.partial(engine.load, request))
        except EngineError:
            continue
        if loaded.status.ok:
            roles.append(role)
    return tuple(roles)


def parse_faults(faults: bool | str | Iterable[str]) -> frozenset[str]:
    """``True``/"all", ``False``/"none", or kinds (a list or "delay,crash")."""
    if faults is True or faults == "all":
        return frozenset(FAULT_KINDS)
    if faults is False or faults == "none":
        return frozenset()
    kinds = [kind.strip() for kind in faults.split(",")] if isinstance(faults, str) else list(faults)
    unknown = [kind for kind in kinds if kind not in FAULT_KINDS]
    if unknown or not kinds:
        message = f"faults must be 'all', 'none' or a comma-separated list of {', '.join(FAULT_KINDS)}; got {faults!r}"
        raise ValueError(message)
    return frozenset(kinds)


class ShardMachine(RuleBasedStateMachine):
    """Base of every machine ``machine_for`` builds; subclass it to add rules."""

    target: ClassVar[ResolvedTarget]
    role: ClassVar[Role | None] = None
    fault_kinds: ClassVar[frozenset[str]] = frozenset()
    use_twins: ClassVar[bool] = True
    reference: ClassVar[ResolvedTarget | None] = None
    model_factory: ClassVar[Callable[[], ReferenceModel]] = ReferenceModel
    #: Operations a backend adds; subclasses list them here (see CustomOp).
    custom_ops: ClassVar[Mapping[str, CustomOp]] = {}
    total_layers: ClassVar[int] = 1
    roles: ClassVar[tuple[Role, ...]] = ("full",)
    stats: RunStats  # shared by the class's examples; the minimiser gives its instances their own

    driver: Driver
    #: The options machine_for built this class with, so pytest can rebuild it for another engine.
    build_options: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    @functools.lru_cache
    def _to_test_case(cls) -> type[unittest.TestCase]:  # type: ignore[override]
        """pytest's ``TestCase``: the same run as ``shardkit fuzz`` — Hypothesis, then
        minimisation by replay, then the trace and regression test on disk. It runs under
        the ``shardkit-ci`` profile unless a profile is loaded (``--hypothesis-profile``) or
        ``settings`` is set on it (``MyMachine.TestCase.settings = settings(...)``)."""
        machine = cls
        explicit: settings | None = None

        class ShardMachineTestCase(unittest.TestCase):
            settings = explicit

            def runTest(self) -> None:
                __tracebackhide__ = True
                from .runner import run_as_test

                run_as_test(machine, self.settings)

            runTest.is_hypothesis_test = True  # type: ignore[attr-defined]
            runTest._hypothesis_state_machine_class = machine  # type: ignore[attr-defined]

        ShardMachineTestCase.__name__ = f"{cls.__name__}.TestCase"
        ShardMachineTestCase.__qualname__ = f"{cls.__qualname__}.TestCase"
        return ShardMachineTestCase

    @initialize(layout=st.integers(0, 15))
    def load_engine(self, layout: int) -> None:
        self.layout = layout
        self.choices: list[Choice] = []
        roles = self.roles if self.role is None else (self.role,)
        role = roles[layout % len(roles)]
        start, end = layer_range(role, self.total_layers, layout // len(roles))
        request = LoadRequest("shardkit-fuzz", start, end, self.total_layers)
        self.driver = Driver(
            self.target,
            request,
            faults=self.fault_kinds,
            twins=self.use_twins,
            reference=self.reference,
            model_factory=type(self).model_factory,
            custom_ops=self.custom_ops,
        )
        self.stats.examples += 1
        if self.stats.shrink_stop_at_example is not None and self.stats.examples > self.stats.shrink_stop_at_example:
            raise ShrinkBudgetSpent
        if self.stats.on_example is not None:
            self.stats.on_example(self.stats.examples, self.stats.steps, self.stats.failures_seen)

    def teardown(self) -> None:
        """Let go of the engines, twins and memo as soon as the example ends: Hypothesis keeps
        recent machine instances reachable from its strategy cache, and a run's memory must
        not grow with its number of examples. Subclasses that override it call ``super()``."""
        self.__dict__.pop("driver", None)

    # --- helpers rules share -----------------------------------------------------------

    def run(self, action: Action) -> StepRecord:
        """Execute ``action``, counting coverage and keeping the failure, if any."""
        stats = self.stats
        if stats.shrink_stop_at_step is not None and stats.steps >= stats.shrink_stop_at_step:
            raise ShrinkBudgetSpent
        stats.steps += 1
        try:
            record = self.driver.execute(action)
        except StepFailed as failure:
            if stats.only_property is not None and failure.violation.property != stats.only_property:
                reject()
            stats.coverage[(coverage_op(action), "FAILED")] += 1
            stats.failure = FailureReport(
                failure.violation,
                list(self.driver.records),
                self.driver.load_request,
                self.fault_kinds,
                self.layout,
                tuple(self.choices),
            )
            stats.failures_seen += 1
            if stats.shortest is None or len(stats.failure.records) < len(stats.shortest.records):
                stats.shortest = stats.failure
            if stats.on_failure is not None:
                stats.on_failure(stats.failure)
            raise
        stats.coverage[(coverage_op(action), record.outcome)] += 1
        if currently_in_test_context():
            event(f"{coverage_op(action)}→{record.outcome}")
        return record

    def session_id(self, choice: int) -> str:
        """Choices 0-5 pick a live session (0 is the oldest), 6-7 an id the engine does
        not know; with no live session every choice names an unknown id, 0 the first."""
        live = list(self.driver.model.sessions)
        unknown = [session for session in SESSION_IDS if session not in live]
        if live and choice < LIVE_CHOICES:
            return live[choice % len(live)]
        return unknown[max(choice - LIVE_CHOICES, 0) % len(unknown) if live else choice % len(unknown)]

    def position(self, session_id: str) -> tuple[int, int]:
        """(epoch, next step) of a session, or (0, 0) for an unknown id."""
        session = self.driver.model.sessions.get(session_id)
        return (session.epoch, session.next_step) if session is not None else (0, 0)

    def chunk(self, code: int) -> tuple[int, ...]:
        """One integer names a chunk: its length, and tokens from the low or high end of the vocabulary."""
        vocab = self.driver.caps.vocab_size
        length = CHUNK_LENGTHS[code % len(CHUNK_LENGTHS)]
        if code // len(CHUNK_LENGTHS) == 0:
            return tuple(index * 3 % vocab for index in range(length))
        return tuple((vocab - 1 - index * 5) % vocab for index in range(length))

    def token(self, code: int) -> int:
        vocab = self.driver.caps.vocab_size
        return (0, vocab - 1, 1, 2, 3, 5, 8, 13)[code % 8] % vocab

    # --- session rules -------------------------------------------------------------------

    @step_rule(session=st.integers(0, 7), chunk=st.integers(0, 15))
    def prefill(self, session: int, chunk: int) -> None:
        """Prefill the next chunk (opening an unknown id at epoch 0)."""
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        self.run(step_action("prefill", sid, epoch, step, self.chunk(chunk)))

    @step_rule(session=st.integers(0, 7), token=st.integers(0, 7))
    def decode(self, session: int, token: int) -> None:
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        self.run(step_action("decode", sid, epoch, step, (self.token(token),)))

    @step_rule(session=st.integers(0, 7), back=st.integers(0, 3))
    def resend(self, session: int, back: int) -> None:
        """Send an earlier request again exactly, as a network duplicate would (0 = the last one)."""
        sent = self.driver.log(self.session_id(session)).sent
        if sent:
            earlier = sent[-1 - back % len(sent)]
            self.run(Action(earlier.op, earlier.args, note="resent"))

    @step_rule(session=st.integers(0, 7), jump=st.integers(0, 3), chunk=st.integers(0, 15))
    def restart(self, session: int, jump: int, chunk: int) -> None:
        """Prefill step 0 at a higher epoch (an unknown id opens there)."""
        sid = self.session_id(session)
        known = sid in self.driver.model.sessions
        epoch = min(self.position(sid)[0] + EPOCH_JUMPS[jump], EPOCH_STEP_LIMIT - 1) if known else EPOCH_JUMPS[jump]
        note = "epoch bump" if known else "opens at a higher epoch"
        self.run(step_action("prefill", sid, epoch, 0, self.chunk(chunk), note=note))

    @step_rule(session=st.integers(0, 7), higher=st.integers(0, 1), op=st.integers(0, 1))
    def wrong_epoch(self, session: int, higher: int, op: int) -> None:
        """Prefill or decode at the next step but an epoch below (stale) or above the
        session's; a stale request at epoch 0 cannot exist, so it goes above instead."""
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        if higher or epoch == 0:
            epoch, note = min(epoch + 1, EPOCH_STEP_LIMIT - 1), "epoch ahead"
        else:
            epoch, note = epoch - 1, "stale epoch"
        self.run(step_action(("prefill", "decode")[op], sid, epoch, step, (self.token(0),), note=note))

    @step_rule(session=st.integers(0, 7), epoch_choice=st.integers(0, 3))
    def cancel(self, session: int, epoch_choice: int) -> None:
        """Cancel at the session's epoch, one below (maybe -1), one above, or with an empty id."""
        sid = self.session_id(session)
        epoch = self.position(sid)[0] + (0, -1, 1, 0)[epoch_choice]
        self.run(Action("cancel", {"session": "" if epoch_choice == 3 else sid, "epoch": epoch}))

    @step_rule(session=st.integers(0, 7))
    def release(self, session: int) -> None:
        self.run(Action("release", {"session": self.session_id(session)}))

    @step_rule(session=st.integers(0, 7), delta=st.integers(0, 3), op=st.integers(0, 1))
    def misstep(self, session: int, delta: int, op: int) -> None:
        """A request whose step skips ahead or goes back."""
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        target_step = min(max(0, step + STEP_DELTAS[delta]), EPOCH_STEP_LIMIT - 1)
        self.run(step_action(("prefill", "decode")[op], sid, epoch, target_step, (self.token(0),), note="out of order"))

    @step_rule(session=st.integers(0, 7), kind=st.integers(0, 15), op=st.integers(0, 1))
    def malformed(self, session: int, kind: int, op: int) -> None:
        """A request that breaks one clause of §2 rule 2."""
        names = malformations_for(self.driver.caps)
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        name = ("prefill", "decode")[op]
        self.run(step_action(name, sid, epoch, step, (self.token(0),), malformed=names[kind % len(names)]))

    @step_rule(call=st.integers(0, 5))
    def probe(self, call: int) -> None:
        """health() of the engine (0), or a call to a fresh engine never loaded: rule 1."""
        if call == 0:
            self.run(Action("health"))
            return
        name = BEFORE_LOAD_CALLS[call - 1]
        args: dict[str, Any] = {"call": name, "session": "a"}
        if name in ("prefill", "decode"):
            args.update(epoch=0, step=0, tokens=(0,))
        self.run(Action("unloaded", args))


# --- the fault rule, added to a machine only when it injects some kind -------------------


@step_rule(kind=st.integers(0, 3), value=st.integers(0, 15))
def inject_fault(self: ShardMachine, kind: int, value: int) -> None:
    """One rule for every fault kind, so faults stay a small share of the steps.

    ``value`` is relative to the model's state where that matters: memory
    pressure lowers the limit to the tokens in use plus ``value % 4`` (never raises it).
    """
    kinds = [name for name in FAULT_KINDS if name in self.fault_kinds]
    chosen = kinds[kind % len(kinds)]
    if chosen == "delay":
        amount = DELAYS[value % len(DELAYS)]
    elif chosen == "memory_pressure":
        model = self.driver.model
        # A few tokens of headroom at most: pressure that bites soon is the interesting kind.
        amount = float(min(model.max_kv_tokens, model.kv_tokens + value % 4))
    elif chosen == "crash":
        amount = float(value % 4 + 1)
    else:
        amount = 0.0
    self.run(Action("fault", {"kind": chosen, "value": amount}))


def machine_for(
    target_or_factory: str | EngineFactory | ResolvedTarget,
    *,
    role: Role | str | None = None,
    faults: bool | str | Iterable[str] = True,
    twins: bool = True,
    reference: str | EngineFactory | ResolvedTarget | None = None,
    model: Callable[[], ReferenceModel] = ReferenceModel,
    base: type[ShardMachine] = ShardMachine,
    name: str | None = None,
    isolate: bool | IsolationOptions = False,
    step_timeout: float | None = None,
    worker_memory_mb: int | None = None,
) -> type[ShardMachine]:
    """A ``RuleBasedStateMachine`` fuzzing the engine against the reference model.

    ``role`` pins the shard role (None or "any" draws one per example); ``faults``
    is True/"all", False/"none" or a list of kinds; ``twins`` turns the twin
    oracle on; ``reference`` builds the twins from another engine, which fuzzes
    the target differentially against it (same statuses, same outputs); ``model`` builds the reference model (subclass it to extend the
    rules, see stateful/test_extending_rules.py); ``base`` is the machine class to
    extend with the fault rules. ``isolate`` runs every engine in a child process (see
    ``shardkit.isolation``), whose calls get ``step_timeout`` seconds each and whose
    memory ``worker_memory_mb`` limits; ``step_timeout`` also applies to a remote target.
    """
    if role == "any":
        role = None
    if role is not None and role not in ROLES:
        message = f"role must be one of {', '.join(ROLES)} or 'any', got {role!r}"
        raise ValueError(message)
    target = target_with_options(
        target_or_factory, isolate=isolate, step_timeout=step_timeout, worker_memory_mb=worker_memory_mb
    )
    try:
        caps, loadable, fault_kinds = _checked_options(target, role, faults, twins, reference)
    except BaseException:
        if target.isolation is not None and target is not target_or_factory:
            target.isolation.close()  # this call started its workers: do not leave them running
        raise
    namespace: dict[str, Any] = {
        "build_options": {
            "role": role,
            "faults": faults,
            "twins": twins,
            "reference": reference,
            "model": model,
            "base": base,
            "isolate": isolate,
            "step_timeout": step_timeout,
            "worker_memory_mb": worker_memory_mb,
        },
        "reference": resolve_target(reference) if reference is not None else None,
        "target": target,
        "role": role,
        "fault_kinds": fault_kinds,
        "use_twins": twins,
        "model_factory": staticmethod(model),
        "total_layers": caps.total_layers,
        "roles": loadable,
        "stats": RunStats(),
        **({"inject_fault": inject_fault} if fault_kinds else {}),
    }
    engine_name = re.sub(r"\W+", "_", short_name(target.name)).strip("_")
    class_name = name or f"ShardMachine_{engine_name}_{role or 'any'}"
    return type(class_name, (base,), namespace)


def _checked_options(
    target: ResolvedTarget,
    role: str | None,
    faults: bool | str | Iterable[str],
    twins: bool,
    reference: object,
) -> tuple[EngineCapabilities, tuple[Role, ...], frozenset[str]]:
    """The engine's capabilities, the roles it loads and the fault kinds to inject;
    ``ShardkitError`` for options this engine cannot honour."""
    probe = target()
    caps = target.guarded("capabilities()", probe.capabilities)
    loadable = loadable_roles(target, caps.total_layers)
    if role is not None and role not in loadable:
        message = f"{target.name} cannot serve a {role} shard (it serves: {', '.join(loadable) or 'nothing'})"
        raise ShardkitError(message)
    if not loadable:
        message = f"{target.name} refused to load even its whole range of {caps.total_layers} layers"
        raise ShardkitError(message)
    if reference is not None and not twins:
        message = "a reference engine is compared through the twin oracle; drop --no-twins or the reference"
        raise ShardkitError(message)
    wanted = parse_faults(faults)
    everything = faults is True or faults == "all"
    if not twins and "malformed_output" in wanted:
        # Without twins a wrong output of a first-seen history is undetectable, and an
        # undetected injection counts as a failure of the kit.
        if not everything:
            message = "the malformed_output fault needs the twin oracle to detect it; drop --no-twins or the fault"
            raise ShardkitError(message)
        wanted -= {"malformed_output"}
    native, boundary = usable_faults(caps, probe, wanted)
    unusable = wanted - native - boundary
    if unusable and not everything:
        message = (
            f"{target.name} cannot take the fault(s) {sorted(unusable)}: not in its supported_faults "
            f"{sorted(caps.supported_faults)} and not injectable at its boundary"
        )
        raise ShardkitError(message)
    return caps, loadable, native | boundary
