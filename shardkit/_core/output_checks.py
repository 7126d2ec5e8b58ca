"""Judging an OK step's output against the reference, and the twin oracle that answers.

This module owns the comparison of an output: its shape and range, an idempotent retry
against the result first observed for that step, and each history the output speaks for
against the reference answer, from the memo or from a twin (a fresh engine from the target,
or from the reference engine a differential run compares it with). It decides when a
twin's own failure is a finding and when it is the reference engine's fault.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from shardkit._core.checks import (
    HistoryMemo,
    Payload,
    Tolerance,
    largest_difference,
    output_problems,
    payload_difference,
    payloads_agree,
    payloads_of,
)
from shardkit._core.model import InputChunk, Prediction, ReferenceModel, SessionState, StepRequest, input_length
from shardkit._core.outcomes import Fail, StepContext, raised, show, show_whole, status_text
from shardkit._core.steps import Action, row_codes_of
from shardkit._core.targets import ResolvedTarget, passes_through
from shardkit._core.twins import (
    EAGER_TOKENS,
    ORACLE_PATHS,
    OneShotTwin,
    OracleFailure,
    TwinSession,
    fresh_answers,
    fresh_fed,
    listed,
    paths_text,
)
from shardkit.contract import EngineCapabilities, EngineError, StepResult
from shardkit.errors import InvalidTarget

__all__ = ["OutputChecks", "SessionLog", "flat_history"]

T = TypeVar("T")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"

#: Shown under the run's coverage, per example it happened in.
LEAKY_RECOMPUTE = (
    "outputs compared with the recompute twin before it was replaced (docs/contract.md#twin-oracle): that "
    "instance of the engine, which recomputes each history, answered one differently, or failed, after serving "
    "other sessions, where a fresh instance did not (the engine's answers depend on the sessions it served "
    "before, so an earlier output could agree with it and still be wrong); fresh instances judged the rest"
)


def flat_history(session: SessionState, caps: EngineCapabilities | None = None) -> tuple[int, ...]:
    """The session epoch's inputs as row codes (``shardkit._core.steps``): token ids, and for
    a bundle the codes of its rows, which the kit built from them; a token's ordinary and
    extreme rows share its id in the sideband, so the rows name the history. Without
    ``caps`` a bundle's rows count as its sideband's tokens."""
    if len(session.history) > _CACHED_STEPS:
        return tuple(code for chunk in session.history for code in _codes(chunk, caps))
    return _flat(session.history, caps)


#: The longest history ``flat_history`` caches, in steps (``_flat`` recurses once a step).
_CACHED_STEPS = 256


@functools.lru_cache(maxsize=1 << 10)  # a session's next step asks for its last history: few are needed
def _flat(history: tuple[InputChunk, ...], caps: EngineCapabilities | None) -> tuple[int, ...]:
    # A history grows by a step at a time and is asked for at each: its beginning is cached.
    if not history:
        return ()
    return _flat(history[:-1], caps) + _codes(history[-1], caps)


def _codes(chunk: tuple[Any, ...], caps: EngineCapabilities | None) -> tuple[int, ...]:
    """One step's input as row codes (``flat_history``)."""
    if chunk and isinstance(chunk[0], bytes):
        sideband = chunk[1]
        assert isinstance(sideband, tuple)
        return sideband if caps is None else row_codes_of(caps, chunk[0], sideband)
    return tuple(chunk)


def _steps_of(session: SessionState, caps: EngineCapabilities) -> list[tuple[int, int]]:
    """Where each step's input starts and ends in ``flat_history(session, caps)``."""
    pieces: list[tuple[int, int]] = []
    for chunk in session.history:
        start = pieces[-1][1] if pieces else 0
        pieces.append((start, start + len(_codes(chunk, caps))))
    return pieces


@dataclass
class SessionLog:
    """What the driver saw of one session id, beyond what the model predicts."""

    sent: list[Action] = field(default_factory=list)
    #: The result observed for each accepted (epoch, step), which a retry must repeat.
    results: dict[tuple[int, int], StepResult] = field(default_factory=dict)
    #: Steps whose observed result carried an injected malformed output.
    tainted: set[tuple[int, int]] = field(default_factory=set)


class OutputChecks(StepContext):
    """Base of the driver: the checks of an OK output and the twin oracle behind them."""

    caps: EngineCapabilities
    model: ReferenceModel
    memo: HistoryMemo
    #: Each history the engine under test answered and passed on, with where and what:
    #: an answer that belongs to another history points at where state carried over from.
    served: dict[tuple[int, ...], tuple[str, Payload]]
    twins: dict[str, TwinSession]
    one_shot: OneShotTwin | None
    split_twins: bool
    use_twins: bool
    differential: bool
    reference: ResolvedTarget
    notes: list[str]
    caveats: set[str]

    def _output_problems(
        self, request: StepRequest, predicted: Prediction, result: StepResult, log: SessionLog, *, strict: bool
    ) -> tuple[list[Fail], list[tuple[int, ...]]]:
        """What is wrong with an OK result, and the histories it could not be compared on
        (no reference). ``strict``: an injected corruption is being looked for, so no
        near-tie token may flip and a retry is never accepted on its equality alone."""
        problems = self._shape_problems(request, predicted, result)
        if problems:
            return problems, []
        if predicted.is_retry:
            return self._retry_problems(request, result, log, strict=strict)
        return self._history_problems(request, result, strict=strict)

    def _shape_problems(self, request: StepRequest, predicted: Prediction, result: StepResult) -> list[Fail]:
        status = status_text(result.status, result.cache)
        return [
            Fail("§3 shape and range", f"{predicted} with a well-formed output", f"{status}: {problem}")
            for problem in output_problems(self.caps, request, result)
        ]

    def _retry_problems(
        self, request: StepRequest, result: StepResult, log: SessionLog, *, strict: bool
    ) -> tuple[list[Fail], list[tuple[int, ...]]]:
        key = (request.epoch, request.step)
        earlier = log.results.get(key)
        if earlier is None:
            raise self._kit_bug(
                f"the model predicts an idempotent retry of step {key}, but no earlier result is logged"
            )
        if result == earlier and not strict:
            return [], []
        if result == earlier or key in log.tainted:
            # The earlier answer may itself be wrong (an injected corruption), and a repeat of
            # it is no evidence either way: the reference decides.
            return self._history_problems(request, result, strict=strict)
        return [Fail("§2 rule 6", f"the earlier result exactly (an idempotent retry): {earlier!r}", repr(result))], []

    def _history_problems(
        self, request: StepRequest, result: StepResult, *, strict: bool
    ) -> tuple[list[Fail], list[tuple[int, ...]]]:
        """Compare the output with the reference for each history it speaks for:
        each row of a bundle, or the token after the whole history. ``strict`` (an
        injected corruption is due) lets no near-tie token flip: rounding noise within
        tolerance is not a detection, a wrong token always is."""
        session = self.model.sessions[request.session_id]
        history = flat_history(session, self.caps)  # ends with this request's input, retried or not
        count = input_length(request)
        assert result.output is not None
        payloads = payloads_of(result.output, count)
        ends = range(len(history) - count + 1, len(history) + 1) if len(payloads) == count else [len(history)]
        followed = None
        if self.use_twins:
            followed = self._asking_twins(lambda: self._consult_twins(request.session_id, session, history))
        unreferenced: list[tuple[int, ...]] = []
        for row, (end, payload) in enumerate(zip(ends, payloads, strict=True)):
            references = self.memo.get(history[:end])
            if not references:
                unreferenced.append(history[:end])
                continue
            failure = self._judge(history[:end], payload, references, strict=strict, row=row)
            if failure is not None:
                # Never blame on one path's word, nor on a twin that had served other sessions.
                again = self._answers_again(history[:end], history)
                failure = self._judge(history[:end], payload, again, strict=strict, row=row)
            if failure is not None:
                return [self._explained(failure, request.session_id, session, history[:end], payload)], unreferenced
            where = f"session {request.session_id!r}, epoch {request.epoch}, step {request.step}"
            self.served.setdefault(history[:end], (where, payload))
        if followed is not None:
            # After the engine under test is judged: a wrong recompute is blamed there, with every path.
            self._asking_twins(partial(followed.compose, history, self.memo, self._answers_again))
        return [], unreferenced

    def _judge(
        self,
        history: tuple[int, ...],
        payload: Payload,
        references: Mapping[str, Payload],
        *,
        strict: bool,
        row: int = 0,
    ) -> Fail | None:
        """The engine's ``payload`` (``row`` of the step's output) against every path's answer
        for ``history``. When the paths agree, their answer is expected; when they do not, no
        single one is taken for the truth: the engine disagrees with itself, and the message
        shows each path's answer. A row's message names where it differs most; the rows whole
        go to the failure's ``rows``."""
        tolerance = Tolerance.of(self.caps)
        answers = [(path, references[path]) for path in ORACLE_PATHS if path in references]
        groups: list[list[tuple[str, Payload]]] = []
        for path, answer in answers:
            group = next(
                (group for group in groups if payloads_agree(group[0][1], answer, tolerance)), None
            )
            if group is None:
                groups.append([(path, answer)])
            else:
                group.append((path, answer))
        after = f"after history {list(history)}"
        twins = f"fresh twins ({self.reference.target.label}, layers {self._twin_layers})"
        if len(groups) == 1:
            expected = groups[0][0][1]
            # Strict, a near tie may not flip; but an answer a twin of the same engine gave is not wrong.
            if any(payloads_agree(answer, payload, tolerance, near_ties_may_flip=not strict) for _, answer in answers):
                return None
            difference = payload_difference(answers[0][1], payload, tolerance, near_ties_may_flip=not strict)
            ways = listed(ORACLE_PATHS[path] for path, _ in answers)
            expected_text = f"{show(expected)} {after}, as {twins} gave by {ways}"
            if isinstance(payload, tuple):
                return Fail("§3 determinism", expected_text, show(payload), self._carried_from(history, payload))
            observed = f"output row {row} {difference}"
            whole = f"expected {show_whole(expected)}\nobserved {show_whole(payload)}"
            return Fail("§3 determinism", expected_text, observed, self._carried_from(history, payload), whole)
        each = paths_text(references)
        (first, first_answer), (second, second_answer) = groups[0][0], groups[1][0]
        if not isinstance(first_answer, tuple):
            # Where they part most, against the engine's tolerance: what the rows shown cut may hide.
            where = largest_difference(first_answer, second_answer, tolerance)
            each += f"; {ORACLE_PATHS[second]} differs from {ORACLE_PATHS[first]} {where}, tolerance {tolerance.text()}"
        if self.differential:
            what = f"its paths disagree {after}: {each}"
            raise self._broken_reference(what)
        agreeing = [group for group in groups if len(group) > 1]
        detail = ""
        if agreeing and payload_difference(agreeing[0][0][1], payload, tolerance) is not None:
            paths = listed(ORACLE_PATHS[path] for path, _ in agreeing[0])
            detail = f"{paths} agree on {show(agreeing[0][0][1])}"
        whole = "\n".join(
            [*(f"{ORACLE_PATHS[path]}: {show_whole(answer)}" for path, answer in answers), f"observed {show_whole(payload)}"]
        )
        return Fail(
            "§3 determinism",
            f"one answer {after}, however it is chunked",
            f"the engine's own paths disagree: {each}; the engine under test gave {show(payload)} ({twins})",
            detail,
            whole if not isinstance(payload, tuple) else "",
        )

    def _explained(
        self, failure: Fail, session_id: str, session: SessionState, history: tuple[int, ...], payload: Payload
    ) -> Fail:
        """``failure`` of a row that no other history was answered with, with what an engine
        loaded for it alone answers when fed ``history`` in the same steps as the session: the
        same row means the difference is the chunking's; another, that the engine's answer
        depends on more than the session's own steps. A failure explained already, or of a
        token (which one row's chunking rarely flips), is left as it is."""
        if failure.detail or isinstance(payload, tuple):
            return failure
        whole = flat_history(session, self.caps)
        # Whole steps: a row of a prefill is answered within that prefill.
        pieces = [(start, end) for start, end in _steps_of(session, self.caps) if start < len(history)]
        try:
            fed = self._asking_twins(lambda: fresh_fed(self.reference, self.load_request, whole, pieces, self.caps.dtype))
        except Fail:
            return failure  # the explanation's own twin failed: the verdict stands unexplained
        as_fed = fed.get(history)
        if as_fed is None:
            return failure
        loaded = f"the reference ({self.reference.target.label})" if self.differential else "an engine"
        fed_as = f"{loaded} loaded alone and fed as session {session_id!r} was ({_count(len(pieces), 'step')})"
        tolerance = Tolerance.of(self.caps)
        if payload_difference(as_fed, payload, tolerance) is None:
            detail = (
                f"{fed_as} gives the same row: the difference comes from how the history is split into steps "
                "(chunking), not from another session; if it is within the engine's precision, declare a "
                "tolerance above it (docs/contract.md#determinism)"
            )
        else:
            # With a reference, the steps were the same: the engine under test answers them otherwise.
            why = (
                "the engine under test answers the same steps otherwise than the reference"
                if self.differential
                else "its answer depends on more than this session's steps"
            )
            where = largest_difference(as_fed, payload, tolerance)
            detail = f"{fed_as} gives another row (the engine under test's differs from it {where}): {why}"
        return Fail(failure.property, failure.expected, failure.observed, detail, failure.rows)

    def _carried_from(self, history: tuple[int, ...], payload: Payload) -> str:
        """Where the engine gave ``payload`` before, for another history: the most recent
        such answer, or "" (a token may match by chance; a row of floats does not)."""
        tolerance = Tolerance.of(self.caps)
        for other, (where, answer) in reversed(self.served.items()):
            if other != history and payloads_agree(answer, payload, tolerance):
                vocabulary = self.caps.vocab_size
                chance = f" (unless by chance: one token in {vocabulary})" if isinstance(payload, tuple) else ""
                return f"the engine answered {show(payload)} to history {list(other)} before ({where}): state carried over from there{chance}"
        return ""

    @property
    def _twin_layers(self) -> str:
        return f"{self.load_request.shard_start}..{self.load_request.shard_end}"

    def _recompute(self, history: tuple[int, ...]) -> Callable[[], None]:
        """The recompute of ``history`` on the example's recompute twin, sent now where it
        takes calls together; the function returned judges it. If the twin fails at it, the
        sessions it served before may have led it astray: a fresh engine tries; if that one
        answers, it takes over (and the run says so), else its failure stands."""
        twin = self._one_shot()
        answered = twin.answer_later("recompute", history, self.memo)

        def judged() -> None:
            try:
                answered()
            except OracleFailure as failure:
                if twin.sessions == 1:
                    raise
                self.one_shot = None
                self._one_shot().answer("recompute", history, self.memo)
                self._leaky_recompute(f"the twin recomputing each history failed at {list(history)} ({failure})")

        return judged

    def _leaky_recompute(self, what: str) -> None:
        self.caveats.add(LEAKY_RECOMPUTE)
        self.notes.append(
            f"step {self._step[0]}: {what}. That twin is an instance of the engine under test that had served "
            f"other sessions: its answers depend on them too; fresh instances judge the engine from here on"
        )

    def _answers_again(self, history: tuple[int, ...], whole: tuple[int, ...] | None = None) -> Mapping[str, Payload]:
        """Every path's answer for ``history``, each from an engine loaded for it alone: what
        a verdict rests on. Where the twins' recompute had answered otherwise, either it was
        a recompute of a longer history (``whole``, whose prefill ``history`` starts) that an
        engine loaded alone repeats (chunking: the run says so), or the sessions the recompute
        twin had served led it astray: a fresh one takes over, and the run says that."""
        answers = self._asking_twins(lambda: fresh_answers(self.reference, self.load_request, history, self.caps.dtype))
        earlier = self.memo.get(history).get("recompute")
        tolerance = Tolerance.of(self.caps)
        if earlier is not None and payload_difference(earlier, answers["recompute"], tolerance) is not None:
            fresh = answers["recompute"]
            if whole is not None and len(whole) > len(history) and self._recomputes_so(whole, history, earlier):
                where = largest_difference(fresh, earlier)
                self.notes.append(
                    f"step {self._step[0]}: the twins answered {list(history)} within the prefill of {list(whole)} "
                    f"otherwise than alone ({where}), and so does an engine loaded alone: its answers depend on "
                    "how a history is chunked, not on the sessions a twin served"
                )
            else:
                self.one_shot = None
                self._leaky_recompute(
                    f"the twin recomputing each history answered {list(history)} with {show(earlier)} where an "
                    f"engine loaded alone answers {show(fresh)}"
                )
        self.memo.correct(history, answers)
        return answers

    def _recomputes_so(self, whole: tuple[int, ...], history: tuple[int, ...], earlier: Payload) -> bool:
        """Whether an engine loaded alone, recomputing ``whole`` in one prefill, answers
        ``history`` with ``earlier``."""
        try:
            fed = self._asking_twins(lambda: fresh_fed(self.reference, self.load_request, whole, [(0, len(whole))], self.caps.dtype))
        except Fail:
            return False
        again = fed.get(history)
        return again is not None and payload_difference(earlier, again, Tolerance.of(self.caps)) is None

    def _one_shot(self) -> OneShotTwin:
        if self.one_shot is None:
            self.one_shot = OneShotTwin(self.reference, self.load_request, self.caps.dtype)
        return self.one_shot

    def _consult_twins(self, session_id: str, session: SessionState, history: tuple[int, ...]) -> TwinSession | None:
        """Have the recompute answer for ``history``, and the twins that follow the session
        (``stepwise`` and ``chunked`` within ``EAGER_TOKENS``) catch up with it, unless the memo
        already holds their answers: the twins whose composition pipeline is still to be fed."""
        known = self.memo.get(history)
        # Seen before: every twin that follows sessions has answered it already. (The chunked
        # twin answers only where a chunk ends: it is not waited for.)
        seen = "stepwise" in known or (len(history) > EAGER_TOKENS and "recompute" in known)
        twin = None if seen else self._following_twin(session_id, session, history)
        # The recompute, then the twins that follow the session: to engines on a server with
        # the Calls stream, all sent before the first answer is awaited (one round trip).
        recomputed = self._recompute(history) if "recompute" not in known else None
        advanced = twin.advance(history, self.memo) if twin is not None else None
        if recomputed is not None:
            recomputed()
        if advanced is not None:
            advanced()
        return twin

    def _following_twin(self, session_id: str, session: SessionState, history: tuple[int, ...]) -> TwinSession:
        """The twins that follow ``session``, started afresh unless they have been fed a
        beginning of ``history`` in its epoch."""
        twin = self.twins.get(session_id)
        if twin is None or not twin.continues(history, session.epoch):
            twin = TwinSession.start(
                self.reference, self.load_request, session.epoch, split=self.split_twins, rows_dtype=self.caps.dtype
            )
            self.twins[session_id] = twin
            if twin.pipeline_refused is not None:
                self.split_twins = False
                self.caveats.add(f"composition (docs/contract.md#composition): {twin.pipeline_refused}")
        return twin

    def _asking_twins(self, ask: Callable[[], T]) -> T:
        """``ask()``; what a twin does wrong is the engine's failure, or with a reference
        engine the reference's."""
        try:
            return ask()
        except OracleFailure as failure:
            if self.differential:
                raise self._broken_reference(str(failure)) from None
            raise Fail(failure.property, "twins that agree", str(failure)) from None
        except BaseException as error:  # a twin is the same engine: its exceptions are findings too
            if passes_through(error):
                raise
            if self.differential:
                if isinstance(error, EngineError):
                    status = error.status
                    what = f"it refused to load {self.load_request}: {status.code.name} {status.message}"
                else:
                    isolation = self.reference.isolation
                    death = isolation.death(error) if isolation is not None else None
                    what = f"its process {death.summary}" if death is not None else f"it raised {raised(error)}"
                raise self._broken_reference(what) from error
            death = self._death(error)
            if death is not None:
                twin_call = getattr(error, "operation", None)
                raise self._death_failure(death, "a fresh twin to answer", in_twin=True, twin_call=twin_call) from error
            raise Fail(
                "unexplained exception", "a fresh twin to answer", f"a fresh twin raised {raised(error)}"
            ) from error

    def _broken_reference(self, what: str) -> InvalidTarget:
        """The reference engine (``reference=``, ``--reference``) failed: not a failure of the
        engine under test, whose outputs cannot be judged against it."""
        index, action = self._step
        message = (
            f"reference engine {self.reference.name} failed while answering for step {index} "
            f"({action.describe()}) of {self.target.name}: {what}; the reference must be a correct engine "
            "that serves the same model: fix it, or fuzz without a reference"
        )
        return InvalidTarget(message)
