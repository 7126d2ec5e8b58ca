"""The Hypothesis state machine: draws steps, hands them to the driver.

Every rule draws at most three small integers, with 0 the simplest choice,
and derives the concrete step from them and the model's state at run time
(which live session, which chunk, which epoch). That keeps each step a few
choices long, so Hypothesis's shrinker can delete whole steps (docs/extending.md).

This module owns the machine: ``ShardMachine`` and its rules, ``step_rule`` and the fault
rule. What a run observes of it is ``shardkit._machine.observer``'s; how pytest and HypoFuzz
meet it, ``shardkit._machine.suite_case``'s. Building a machine for an engine (``build_machine``)
is ``shardkit._machine.build``'s, which imports this module; this one never imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from hypothesis import event, reject
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from hypothesis.strategies import SearchStrategy

from shardkit._core.checks import MemoStore
from shardkit._core.driver import CustomOp, Driver, StepFailed, StepRecord
from shardkit._core.model import ReferenceModel, SessionState
from shardkit._core.outcomes import CRASHED
from shardkit._core.output_checks import flat_history
from shardkit._core.steps import (
    BEFORE_LOAD_CALLS,
    PARALLEL_OP,
    ROW_KINDS,
    STEP_OPS,
    Action,
    malformations_for,
    phase_action,
    row_code,
    step_action,
)
from shardkit._core.targets import ResolvedTarget
from shardkit._machine.hypothesis_adapter import stop_hypothesis
from shardkit._machine.observer import Choice, FailureReport, RunObserver
from shardkit._machine.suite_case import FailureSink, SuiteRunner, SuiteTestCase
from shardkit._parallel.runs import PHASE_RUNS, replay_steps
from shardkit._public import settle
from shardkit.contract import EPOCH_STEP_LIMIT, FAULT_KINDS, EngineCapabilities, LoadRequest, Role
from shardkit.errors import UsageError

__all__ = [
    "MachineSetup",
    "ShardMachine",
    "coverage_op",
    "extreme_values",
    "inject_fault",
    "layer_range",
    "step_rule",
]

#: Realistic ids: short and long, non-ASCII, with separators, and sharing prefixes. The
#: ids that share one come right after "a" and "b", so that an engine holding four or five
#: sessions often holds ``req-0001``, ``req-00010`` and ``req-0001/retry`` at once (a
#: session table keyed on a truncated or prefix-matched id mixes them up).
SESSION_IDS = ("a", "b", "req-0001", "req-00010", "req-0001/retry", "a b", "sess-é-日本語", "x" * 200)
#: The ids an example opens sessions with, one pool drawn per example (swarm-style focus):
#: every id, the short ones first so that a shrunk failure says "a" and "b"; or only the
#: three that share a prefix, so that every session of the example is of one family (a
#: cancel or a session table that matches a prefix mixes them up). With every id in one
#: pool, a cancel of ``req-0001`` while ``req-00010`` was live came up in none of 200
#: examples at some seeds.
SESSION_ID_POOLS = (SESSION_IDS, SESSION_IDS[2:5])
#: Session choices 0-5 pick a live session; from 6 on, an id the engine does not know.
LIVE_CHOICES = 6
#: The choices of the rules that open sessions: enough that every id of ``SESSION_IDS``
#: is one step away while it is unknown, however many sessions are live.
OPENING_CHOICES = LIVE_CHOICES + len(SESSION_IDS)
#: Chunk codes name a length (``_chunk_length``) and one of these token patterns.
CHUNK_PATTERNS = ("low ramp", "high ramp", "repeats", "follows a history")
#: The lengths a chunk code names, before ``_chunk_length`` sizes the last four to the engine.
CHUNK_LADDER = 8
#: No chunk is longer, however large the engine's budget: one step must not allocate
#: millions of tokens because an engine reports a budget that large.
MAX_CHUNK = 1 << 16
#: A ``decode_run`` of k decodes: k is one of these, or as many as the budget leaves room for.
DECODE_RUNS = (1, 8, 32)
#: No run is longer: a budget of millions of tokens would make one rule run for hours.
MAX_DECODE_RUN = 4096
#: Epochs a restart adds to a known session's (it must go up to restart at all).
EPOCH_JUMPS = (1, 2, 1000, 2**62)
#: Epochs a restart opens an unknown id at: 0 first, so a shrunk failure says epoch 0
#: wherever 0 fails the same way as 1 (rule 3 lets an id open at any epoch).
OPENING_EPOCHS = (0, 1, 1000, 2**62)
STEP_DELTAS = (1, 2, -2, 2**62)
#: What a cancel adds to the session's epoch (None: an empty id). Five of eight cancel the
#: session at its own epoch: with one in four, 33 of 1 000 cancels in a run were accepted
#: (the rest refused as stale, ahead, empty or unknown), and the bugs that live after a
#: cancel (a restart that keeps the flag, a cancel that frees another session) went unseen.
CANCEL_EPOCHS = (0, 0, 0, 0, 0, -1, 1, None)
DELAYS = (0.0, 0.0001, 0.0002, 0.001)  # seconds: the result must not change, however long
#: The values of ``extreme_values``: 0 the ordinary rows, then a prefill of each extreme kind of
#: ``ROW_KINDS`` in turn, then a decode of each (a bundle of one row).
EXTREME_CHOICES = 1 + 2 * (len(ROW_KINDS) - 1)


def step_rule(**strategies: SearchStrategy[int]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Hypothesis's ``@rule`` for a ``ShardMachine`` subclass, which also records the drawn
    arguments so the kit's minimiser can replay the rule without Hypothesis.

    Use it for every rule you add (see docs/extending.md). Give each argument a strategy of
    small integers, at most three per rule, where 0 is the simplest choice (e.g.
    ``session=st.integers(0, 7)``), and derive the concrete step from them and the model's
    state when the rule runs (``self.session_id(session)``, ``self.sessions``): a step
    then stays a few choices long, so Hypothesis's shrinker can delete whole steps and
    lower the rest towards 0, and a trace of the step replays without the strategies."""

    def decorate(function: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(function)
        def record_then_run(self: ShardMachine, **arguments: int) -> None:
            if self._phase_ran:
                return  # a parallel phase ends the example (shardkit._parallel.phase)
            self._choices.append(Choice(function.__name__, tuple(arguments.items())))
            function(self, **arguments)

        # The minimiser reads the strategies here, not from Hypothesis's private rule records.
        record_then_run.step_rule_arguments = dict(strategies)  # type: ignore[attr-defined]
        decorated: Callable[..., None] = rule(**strategies)(record_then_run)  # type: ignore[call-overload]
        return decorated

    return decorate


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


class MachineSetup(Protocol):
    """What a machine learns from its engine on first use (``ShardMachine._setup``): the values
    of its prepared attributes by name. ``shardkit._machine.build`` makes it; the machine
    only asks for the values, so this module never imports the one that builds machines."""

    def values(self) -> Mapping[str, Any]: ...


class ShardMachine(RuleBasedStateMachine):
    """Base of every machine ``machine_for`` builds; subclass it to add rules."""

    _target: ClassVar[ResolvedTarget]
    _role: ClassVar[Role | None] = None
    _fault_kinds: ClassVar[frozenset[str]] = frozenset()
    #: Lanes of the parallel phase (1: none; see shardkit._machine.parallel_rules).
    _concurrency: ClassVar[int] = 1
    #: Runs of a parallel phase before it counts as passing (``_run_phase``).
    _phase_runs: ClassVar[int] = PHASE_RUNS
    #: Kinds of ``--faults all`` the engine cannot take, each with why (the summary says so).
    _skipped_faults: ClassVar[Mapping[str, str]] = MappingProxyType({})
    _use_twins: ClassVar[bool] = True
    #: Set on first use by each class itself (``_oracle_memo``), never inherited.
    _oracle_memo_store: ClassVar[MemoStore]
    #: Whether an example of this class has failed (set on the class itself).
    _failed: ClassVar[bool] = False
    _reference: ClassVar[ResolvedTarget | None] = None
    model_factory: ClassVar[Callable[[], ReferenceModel]] = ReferenceModel
    #: Operations a backend adds; subclasses list them here (see CustomOp).
    custom_ops: ClassVar[Mapping[str, CustomOp]] = {}
    _total_layers: ClassVar[int] = 1
    _roles: ClassVar[tuple[Role, ...]] = ("full",)
    #: The run this machine reports to; ``observed`` sets it for each run. Without one (a
    #: machine run by Hypothesis directly), each example counts on its own.
    _observer: ClassVar[RunObserver | None] = None
    #: What its pytest ``TestCase`` runs: ``machine_for`` sets the kit's run (Hypothesis, then
    #: minimisation by replay, then the trace and regression test on disk).
    _suite_runner: ClassVar[SuiteRunner | None] = None
    #: What a failure becomes when a fuzzer such as HypoFuzz drives the machine directly
    #: (``fuzzing_machine``): ``machine_for`` sets the kit's, a trace of the shortest failure.
    _fuzzer_failures: ClassVar[FailureSink | None] = None
    #: pytest's ``TestCase`` for the machine (collect it as ``TestMyEngine = Machine.TestCase``).
    TestCase = SuiteTestCase()  # type: ignore[assignment]  # Hypothesis types its own TestCase class; ours runs the kit's run

    _driver: Driver
    #: The ``MachineOptions`` ``build_machine`` built this class with (None: not built), so
    #: that pytest can rebuild it for another engine and a run's identity names its machine
    #: and model. Read it with ``shardkit._machine.spec.options_of``, which types it (the
    #: options module imports this one, so this one cannot name the type).
    _options: ClassVar[object] = None
    #: What the machine learns from its engine on first use (see ``prepare``).
    _setup: ClassVar[MachineSetup]

    @classmethod
    def prepare(cls) -> type[ShardMachine]:
        """Meet the engine now: resolve the target (start an isolated target's workers), read
        its capabilities, and check the role and faults asked for against it. A run does it
        on first use; call it to report an option the engine cannot honour early. Returns
        the machine."""
        if "_setup" not in dir(cls):
            message = f"{cls.__name__} has no engine: build it with shardkit.machine_for(TARGET, base=...)"
            raise UsageError(message)
        cls._setup.values()
        return cls

    @classmethod
    def _oracle_memo(cls) -> MemoStore:
        """The twins' answers, shared by the examples of this machine class (a run's, or a
        suite's) until one fails: an example need not ask twins again what an earlier one
        asked them. From the first failure on, each example has a memo of its own, as it
        has on replay: Hypothesis then shrinks, and an engine whose twins' answers depend on
        what they served before (the bugs the twins catch by disagreeing among themselves)
        must fail or pass the same whatever example ran before."""
        store = cls.__dict__.get("_oracle_memo_store")
        if store is None or cls.__dict__.get("_failed"):
            store = MemoStore()
            cls._oracle_memo_store = store
        return store

    @property
    def _stats(self) -> RunObserver:
        """The observer this example reports to."""
        observer = type(self)._observer
        if observer is None:
            observer = self.__dict__.setdefault("_own_observer", RunObserver())
        return observer

    @initialize(layout=st.integers(0, 15), id_pool=st.integers(0, len(SESSION_ID_POOLS) - 1))
    def load_engine(self, layout: int, id_pool: int = 0) -> None:
        self._layout = layout
        self._id_pool = id_pool
        self._choices: list[Choice] = []
        #: Each lane's drawn (op, session, offset) steps (``shardkit._machine.parallel_rules``).
        self._lanes: list[list[tuple[int, int, int]]] = [[] for _ in range(self._concurrency)]
        self._phase_ran = False
        roles = self._roles if self._role is None else (self._role,)
        role = roles[layout % len(roles)]
        start, end = layer_range(role, self._total_layers, layout // len(roles))
        request = LoadRequest("shardkit-fuzz", start, end, self._total_layers)
        self._driver = Driver(
            self._target,
            request,
            faults=self._fault_kinds,
            twins=self._use_twins,
            reference=self._reference,
            model_factory=type(self).model_factory,
            custom_ops=self.custom_ops,
            memo=self._oracle_memo(),
        )
        #: The prefills and decodes this example's engines served or died on, by session id,
        #: oldest first, kept across releases, restarts and crashes (the driver's logs start
        #: again with each engine): what ``resend`` draws its ghosts from.
        self._sent: dict[str, list[Action]] = {}
        #: The decodes accepted in each session's current epoch, with the model's state
        #: object they count for (a new object means the epoch was opened again).
        self._decodes: dict[str, tuple[SessionState, int]] = {}
        self._longest = 0
        self._stats.examples += 1
        self._stats.longest_session[0] += 1
        if self._stats.shrink_stop_at_example is not None and self._stats.examples > self._stats.shrink_stop_at_example:
            stop_hypothesis()
        if self._stats.on_example is not None:
            self._stats.on_example(self._stats.examples, self._stats.steps, self._stats.failures_seen)

    def teardown(self) -> None:
        """Let go of the engines, twins and memo as soon as the example ends: Hypothesis keeps
        recent machine instances reachable from its strategy cache, and a run's memory must
        not grow with its number of examples. Subclasses that override it call ``super()``."""
        self.__dict__.pop("_driver", None)

    # --- helpers rules share -----------------------------------------------------------

    @property
    def capabilities(self) -> EngineCapabilities:
        """The loaded engine's capabilities, as it reported them right after ``load`` (the
        driver keeps them; after an injected crash, the restarted engine's). A
        memory_pressure fault lowers the token limit the model enforces later
        (``ReferenceModel.max_kv_tokens``), not ``max_kv_tokens`` here."""
        return self._driver.caps

    @property
    def sessions(self) -> Mapping[str, SessionState]:
        """The model's sessions, by id, oldest first: a read-only view for rules to read
        (their state changes only through steps)."""
        return MappingProxyType(self._driver.model.sessions)

    def _count_caveats(self, stats: RunObserver) -> None:
        """Count each check the driver could not make once per example, as soon as it knows:
        the counts at the first failure are those of the examples run until then."""
        caveats = self._driver.caveats
        if caveats:
            counted: set[str] = self.__dict__.setdefault("_caveats_counted", set())
            stats.caveats.update(caveats - counted)
            counted |= caveats

    def _remember(self, action: Action, outcome: str) -> None:
        """Keep a prefill or decode for ``resend`` if the engine served it or died on it,
        unless it repeats the session's last one. Those are the requests a duplicate or a
        client's retry sends again; one refused is refused again, and keeping those would
        push the served ones out of ``resend``'s reach."""
        if action.op in STEP_OPS and outcome in ("OK", CRASHED):
            sent = self._sent.setdefault(str(action.args["session"]), [])
            if not sent or sent[-1].args != action.args or sent[-1].op != action.op:
                sent.append(action)

    def _count_decode(self, stats: RunObserver, session_id: str, before: int | None) -> None:
        """Count an accepted decode that advanced its session (a retry does not), and move
        the example up ``longest_session`` when this session is its longest so far."""
        session = self._driver.model.sessions.get(session_id)
        if session is None or before is None or session.next_step != before + 1:
            return
        counted = self._decodes.get(session_id)
        decodes = counted[1] + 1 if counted is not None and counted[0] is session else 1
        self._decodes[session_id] = (session, decodes)
        if decodes > self._longest:
            stats.longest_session[self._longest] -= 1
            if not stats.longest_session[self._longest]:
                del stats.longest_session[self._longest]
            stats.longest_session[decodes] += 1
            self._longest = decodes

    def run(self, action: Action) -> StepRecord:
        """Execute ``action``, counting coverage and keeping the failure, if any."""
        stats = self._stats
        if stats.shrink_stop_at_step is not None and stats.steps >= stats.shrink_stop_at_step:
            stop_hypothesis()
        stats.steps += 1
        decoding = str(action.args["session"]) if action.op == "decode" else None
        before = None
        if decoding is not None:
            session = self._driver.model.sessions.get(decoding)
            before = session.next_step if session is not None else None
        try:
            record = self._driver.execute(action)
        except StepFailed as failure:
            self._report_failure(failure, coverage_op(action))
            raise
        self._count_caveats(stats)
        stats.coverage[(coverage_op(action), record.outcome)] += 1
        self._remember(action, record.outcome)
        if decoding is not None and record.outcome == "OK":
            self._count_decode(stats, decoding, before)
        if currently_in_test_context():
            event(f"{coverage_op(action)}→{record.outcome}")
        return record

    def _run_phase(self, lanes: list[list[Action]]) -> None:
        """Run ``lanes`` at the same time (``shardkit._parallel.phase``) until a run fails, at
        most ``_phase_runs`` times: a race shows on some runs only. Each run after the first
        is on a fresh engine that first replays this example's steps. Nothing runs after."""
        stats = self._stats
        self._phase_ran = True
        prefix = [record.action for record in self._driver.records]
        for run in range(self._phase_runs):
            if run:
                self._driver = self._driver.fresh()
            steps = [*(prefix if run else ()), phase_action(lanes)]
            stats.steps += (len(prefix) if run else 0) + sum(len(lane) for lane in lanes)
            failed = replay_steps(self._driver, steps)
            if failed is not None:
                self._report_failure(failed, coverage_op(failed.record.action))
                raise failed
            self._count_caveats(stats)
            for record in self._driver.records[len(prefix) :]:
                stats.coverage[(coverage_op(record.action), record.outcome)] += 1
        # Once per example, whatever its runs: a passing run shows its lanes ran and were checked.
        stats.coverage[(PARALLEL_OP, "OK")] += 1

    def _report_failure(self, failure: StepFailed, operation: str) -> None:
        """Count the failing step and keep the example's report (``stats.failure``)."""
        type(self)._failed = True  # no more sharing of the twins' answers (``_oracle_memo``)
        stats = self._stats
        self._count_caveats(stats)
        if stats.only_property is not None and failure.violation.property != stats.only_property:
            reject()
        stats.coverage[(operation, "FAILED")] += 1
        stats.failure = FailureReport(
            failure.violation,
            list(self._driver.records),
            self._driver.load_request,
            self._fault_kinds,
            self._layout,
            self._id_pool,
            tuple(self._choices),
            tuple(self._driver.notes),
        )
        stats.failures_seen += 1
        if stats.shortest is None or len(stats.failure.records) < len(stats.shortest.records):
            stats.shortest = stats.failure
        if stats.on_failure is not None:
            stats.on_failure(stats.failure)

    def session_id(self, choice: int) -> str:
        """Choices 0-5 pick a live session (0 is the oldest), 6 and up an id the engine does
        not know (6 the first of the example's pool of ``SESSION_ID_POOLS``, 7 the next, …;
        rules that open sessions draw up to ``OPENING_CHOICES - 1`` and so reach every one);
        with no live session every choice names an unknown id, 0 the first; with every id of
        the pool live, every choice names a live one."""
        live = list(self._driver.model.sessions)
        unknown = [session for session in SESSION_ID_POOLS[self._id_pool] if session not in live]
        if live and (choice < LIVE_CHOICES or not unknown):
            return live[choice % len(live)]
        return unknown[max(choice - LIVE_CHOICES, 0) % len(unknown) if live else choice % len(unknown)]

    def position(self, session_id: str) -> tuple[int, int]:
        """(epoch, next step) of a session, or (0, 0) for an unknown id."""
        session = self._driver.model.sessions.get(session_id)
        return (session.epoch, session.next_step) if session is not None else (0, 0)

    def room(self, session_id: str | None = None, *, restarting: bool = False) -> int:
        """Tokens the cache can still take under the model's limit (a memory_pressure fault
        lowers it), counting those a restart of ``session_id`` would free."""
        model = self._driver.model
        freed = 0
        if restarting and session_id is not None:
            session = model.sessions.get(session_id)
            freed = session.kv_tokens if session is not None else 0
        return max(model.max_kv_tokens - model.kv_tokens + freed, 0)

    def _chunk_length(self, code: int, room: int) -> int:
        """The length a chunk code names: 1, 2, 3, 8, then sized to the engine: a quarter
        plus one and half of its ``max_kv_tokens`` (the fake's 17 and 32; an engine with
        4 096 tokens gets 1 025 and 2 048), exactly ``room`` (fills the budget), and one
        over it (refused for capacity). Short ones first, so a shrunk chunk is short."""
        most = self._driver.caps.max_kv_tokens
        ladder = (1, 2, 3, 8, most // 4 + 1, most // 2, room, room + 1)
        return min(max(ladder[code % CHUNK_LADDER], 1), MAX_CHUNK)

    def history_tokens(self, session_id: str) -> tuple[int, ...]:
        """The token ids a live session's epoch has accepted, in order (for a middle or tail,
        the row codes of its bundles: ``shardkit._core.steps.row_code``); () for an unknown id."""
        session = self._driver.model.sessions.get(session_id)
        return flat_history(session, self._driver.caps) if session is not None else ()

    def chunk(self, code: int, session: str | None = None, *, restarting: bool = False) -> tuple[int, ...]:
        """One integer names a chunk for ``session``: its length (``_chunk_length``, code % 8)
        and its tokens (code // 8): a ramp from the low end of the vocabulary, one from the
        high end, a repeated motif using both ends, or tokens that follow the longest live
        history for all but the last token and then differ from it.

        The last pattern makes prefix families: two histories that agree on their first k
        tokens and differ after them, which a prefix cache keyed on the first tokens (or on
        the length and a prefix) mixes up. The low ramp ([0], [0, 3], [0, 3, 6], …) and the
        repeats ([0, 0, V-1, …]) share their first token, so short families exist without it."""
        vocab = self._driver.caps.vocab_size
        length = self._chunk_length(code, self.room(session, restarting=restarting))
        pattern = code // CHUNK_LADDER % len(CHUNK_PATTERNS)
        if pattern == 0:
            return tuple(index * 3 % vocab for index in range(length))
        if pattern == 1:
            return tuple((vocab - 1 - index * 5) % vocab for index in range(length))
        if pattern == 2:
            return tuple(vocab - 1 if index % 3 == 2 else 0 for index in range(length))
        return self._following(length, session, restarting=restarting)

    def _following(self, length: int, session: str | None, *, restarting: bool) -> tuple[int, ...]:
        """``length`` tokens continuing the longest live history (the session's own epoch
        being restarted included) from where ``session``'s history ends, except the last,
        which differs from the one that history has there. Without such a history, the low
        ramp stands in for it."""
        vocab = self._driver.caps.vocab_size
        own = 0 if restarting or session is None else len(self.history_tokens(session))
        source: tuple[int, ...] = ()
        for other in self._driver.model.sessions:
            if other != session or restarting:
                tokens = self.history_tokens(other)
                if len(tokens) > max(own, len(source)):
                    source = tokens
        if len(source) <= own:
            source = tuple(index * 3 % vocab for index in range(own + length))
        shared = list(source[own : own + length - 1])
        for position in range(own + len(shared), own + length):
            known = source[position] if position < len(source) else position * 3
            shared.append((known + 1) % vocab)
        return tuple(shared)

    def token(self, code: int) -> int:
        vocab = self._driver.caps.vocab_size
        return (0, vocab - 1, 1, 2, 3, 5, 8, 13)[code % 8] % vocab

    def _ghost_or_live(self, choice: int) -> str | None:
        """The session whose earlier requests ``resend`` sends again: choices 0-5 a live one,
        6 and up one this example sent requests for that holds no session now (released,
        or dropped by a crash), in the order they were first used; None if neither exists."""
        live = list(self._driver.model.sessions)
        ghosts = [session for session in self._sent if session not in live]
        if live and (choice < LIVE_CHOICES or not ghosts):
            return live[choice % len(live)]
        if ghosts:
            return ghosts[max(choice - LIVE_CHOICES, 0) % len(ghosts) if live else choice % len(ghosts)]
        return None

    # --- session rules -------------------------------------------------------------------

    @step_rule(session=st.integers(0, OPENING_CHOICES - 1), chunk=st.integers(0, 31))
    def prefill(self, session: int, chunk: int) -> None:
        """Prefill the next chunk (opening an unknown id at epoch 0)."""
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        self.run(step_action("prefill", sid, epoch, step, self.chunk(chunk, sid)))

    @step_rule(session=st.integers(0, 7), token=st.integers(0, 7))
    def decode(self, session: int, token: int) -> None:
        sid = self.session_id(session)
        epoch, step = self.position(sid)
        self.run(step_action("decode", sid, epoch, step, (self.token(token),)))

    @step_rule(session=st.integers(0, 7), length=st.integers(0, 3), token=st.integers(0, 7))
    def decode_run(self, session: int, length: int, token: int) -> None:
        """Decode one session 1, 8 or 32 times in a row, or as often as its budget has room
        for (``length`` 3), each decode a step of its own; stops at the first one not served.

        Engines ship bugs that only a long history reaches (a cache block, ring buffer or
        position counter that wraps), and single decodes drawn among a dozen rules almost
        never make one: this rule makes a session of 32 decodes a matter of two steps."""
        sid = self.session_id(session)
        count = (*DECODE_RUNS, self.room())[length]
        for offset in range(min(max(count, 1), MAX_DECODE_RUN)):
            epoch, step = self.position(sid)
            record = self.run(step_action("decode", sid, epoch, step, (self.token(token + offset),)))
            if record.outcome != "OK":
                return

    @step_rule(session=st.integers(0, 7), back=st.integers(0, 3))
    def resend(self, session: int, back: int) -> None:
        """Send an earlier request again exactly (0 = the session's last one), as a network
        duplicate or a client retrying late would: the session's requests of earlier epochs
        and from before a crash included, and with choices 6-7, or once no session is live,
        the requests of a session that is gone (a ghost: released, or dropped by a crash)."""
        sid = self._ghost_or_live(session)
        sent = self._sent.get(sid, []) if sid is not None else []
        if sent:
            earlier = sent[-1 - back % len(sent)]
            self.run(Action(earlier.op, earlier.args, note="resent"))

    @step_rule(session=st.integers(0, OPENING_CHOICES - 1), jump=st.integers(0, 3), chunk=st.integers(0, 31))
    def restart(self, session: int, jump: int, chunk: int) -> None:
        """Prefill step 0 at a higher epoch; an unknown id opens at epoch 0, 1, 1000 or 2**62."""
        sid = self.session_id(session)
        known = sid in self._driver.model.sessions
        epoch = min(self.position(sid)[0] + EPOCH_JUMPS[jump], EPOCH_STEP_LIMIT - 1) if known else OPENING_EPOCHS[jump]
        note = "epoch bump" if known else "opens at a higher epoch"
        self.run(step_action("prefill", sid, epoch, 0, self.chunk(chunk, sid, restarting=known), note=note))

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

    @step_rule(session=st.integers(0, 7), epoch_choice=st.integers(0, len(CANCEL_EPOCHS) - 1))
    def cancel(self, session: int, epoch_choice: int) -> None:
        """Cancel at the session's epoch (most choices), one below (maybe -1), one above, or
        with an empty id (``CANCEL_EPOCHS``)."""
        sid = self.session_id(session)
        shift = CANCEL_EPOCHS[epoch_choice]
        epoch = self.position(sid)[0] + (shift or 0)
        self.run(Action("cancel", {"session": "" if shift is None else sid, "epoch": epoch}))

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
        names = malformations_for(self._driver.caps)
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


# --- extreme values, added to a machine whose role takes bundles (middle, tail, or any) -----


def _takes_bundles(machine: ShardMachine) -> bool:
    return machine._driver.caps.role in ("middle", "tail")


@precondition(_takes_bundles)
@step_rule(
    session=st.integers(0, OPENING_CHOICES - 1), chunk=st.integers(0, 31), values=st.integers(0, EXTREME_CHOICES - 1)
)
def extreme_values(self: ShardMachine, session: int, chunk: int, values: int) -> None:
    """The next prefill (``values`` 1-4) or decode (5-8) of a session, with bundle rows of one
    of the extreme but finite kinds of ``ROW_KINDS`` (values near the dtype's largest,
    subnormal, ±0.0, or all of them side by side): legal input the engine must serve with a
    finite, deterministic answer (docs/contract.md#extreme-values). ``values`` 0 sends the
    ordinary rows, so a failure that does not need extreme values shrinks to an ordinary step;
    ``chunk`` names the chunk (or the decoded token) as ``prefill`` and ``decode`` do. A head or
    full shard (an example of ``--role any`` may load one) takes token ids, with no values to
    make extreme: the rule is not drawn there (its precondition), so that it neither spends
    the example's steps on nothing nor becomes a second way to spell a prefill or a decode,
    which would leave shrinking two minimal sequences for one bug."""
    if not _takes_bundles(self):  # the minimiser replays rules without their preconditions
        return
    sid = self.session_id(session)
    epoch, step = self.position(sid)
    kinds = len(ROW_KINDS) - 1
    op, kind = ("prefill", values) if values <= kinds else ("decode", values - kinds)
    tokens = self.chunk(chunk, sid) if op == "prefill" else (self.token(chunk),)
    tokens = tuple(row_code(token, kind) for token in tokens)
    self.run(step_action(op, sid, epoch, step, tokens))


# --- the fault rule, added to a machine only when it injects some kind -------------------


@step_rule(kind=st.integers(0, 3), value=st.integers(0, 15))
def inject_fault(self: ShardMachine, kind: int, value: int) -> None:
    """One rule for every fault kind, so faults stay a small share of the steps.

    ``value`` is relative to the model's state where that matters: memory
    pressure lowers the limit to the tokens in use plus ``value % 4`` (never raises it).
    """
    kinds = [name for name in FAULT_KINDS if name in self._fault_kinds]
    chosen = kinds[kind % len(kinds)]
    if chosen == "delay":
        amount = DELAYS[value % len(DELAYS)]
    elif chosen == "memory_pressure":
        model = self._driver.model
        # A few tokens of headroom at most: pressure that bites soon is the interesting kind.
        amount = float(min(model.max_kv_tokens, model.kv_tokens + value % 4))
    elif chosen == "crash":
        amount = float(value % 4 + 1)
    else:
        amount = 0.0
    self.run(Action("fault", {"kind": chosen, "value": amount}))


settle(__name__, globals())
