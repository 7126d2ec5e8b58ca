"""The twin oracle (contract §3): fresh engines that answer for one session's history by
independent paths.

A memo of outputs only catches a wrong output when the same history comes round again.
Twins catch it the first time: fresh engines from the same target, loaded the same way, fed
that session's tokens alone under another session id and epoch. One twin that takes the
same path as the engine under test would share its bugs (a decode fast path that goes wrong
after 20 decodes goes wrong in the twin too), so a history can be computed three ways:

- ``recompute``: the whole history in one prefill, on an engine loaded for that alone (the
  canonical recompute that KV-cache bugs break), for every history the engine under test
  answers for;
- ``stepwise``: one token per call, the first as a prefill and every other as a decode;
- ``chunked``: pseudo-random chunks (1 to 7 tokens) whose cuts depend on the position alone,
  never on how the engine under test was fed: a history that grows one decode at a time is
  still fed to this twin in chunks, which therefore answers only where a chunk ends.

``stepwise`` and ``chunked`` follow each session up to ``EAGER_TOKENS`` tokens, so a short
prefill already exercises the engine's decode and chunking paths. Beyond that, feeding them
every token cost more than the engine under test itself (one call per token of every long
prefill), so they answer a longer history only when the engine under test and the recompute
disagree on it. What that gives up: on a long history, a bug of the decode or chunking path
that the engine under test did not take itself is not seen.

The recompute runs on one engine per example, which serves each history as a session of
its own. An engine whose sessions leak into each other (a prefix cache that outlives a
release) can then answer a recompute wrongly while the engine under test answered right.
So before any answer is judged wrong, every path answers that history again on engines
loaded for it alone (``fresh_answers``), and only those answers are printed.

Where the layer range can be split, a two-stage pipeline of sub-range engines is fed the
``chunked`` path's pieces and must answer like the single engine (composition). Twins write
the memo; the engine under test is only compared to it (``shardkit._core.output_checks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from shardkit._core.checks import HistoryMemo, Payload, Tolerance, output_problems, payload_difference, payloads_of
from shardkit._core.model import StepRequest
from shardkit._core.outcomes import show
from shardkit._core.steps import Action, build_request, step_action
from shardkit._core.targets import ResolvedTarget
from shardkit.contract import (
    BoundaryBundle,
    EngineCapabilities,
    EngineError,
    LoadRequest,
    PrefillRequest,
    ShardEngine,
    StepResult,
    StructuredStatus,
)

__all__ = [
    "EAGER_TOKENS",
    "ORACLE_PATHS",
    "OneShotTwin",
    "OracleFailure",
    "TwinSession",
    "chunk_pieces",
    "fresh_answers",
    "fresh_fed",
    "listed",
    "paths_text",
    "split_ranges",
]

TWIN_SESSION = "twin-oracle"

#: Each path of the oracle, in the order messages name them, with how a message says it.
ORACLE_PATHS = MappingProxyType(
    {
        "recompute": "a recompute in one prefill",
        "stepwise": "one token per decode",
        "chunked": "a random chunking",
    }
)

#: How far the ``stepwise`` and ``chunked`` twins follow every session: a cost bound of the
#: oracle (their calls per session), not a size of any engine.
EAGER_TOKENS = 32

#: Chunk lengths of the ``chunked`` path: short, so a history is cut in several places.
_LONGEST_CHUNK = 7


def listed(phrases: Iterable[str]) -> str:
    """``a, b and c``."""
    items = list(phrases)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def paths_text(answers: Mapping[str, Payload]) -> str:
    """``a recompute in one prefill gives token 5, one token per decode gives token 19``."""
    return ", ".join(f"{ORACLE_PATHS[path]} gives {show(answers[path])}" for path in ORACLE_PATHS if path in answers)


class OracleFailure(Exception):
    """A twin disagreed, refused, or returned a bad output; ``property`` names what broke."""

    def __init__(self, property_name: str, message: str) -> None:
        super().__init__(message)
        self.property = property_name


def split_ranges(request: LoadRequest) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Two sub-ranges whose pipeline must equal ``request``'s range, or None.

    A middle cannot feed a middle (it accepts only post-head residuals), so a
    middle range is never split; a head splits into head → middle, a tail into
    middle → tail, a full model into head → tail.
    """
    start, end = request.shard_start, request.shard_end
    if end == start or request.role == "middle":
        return None
    cut = (start + end) // 2
    return (start, cut), (cut + 1, end)


def chunk_pieces(start: int, end: int) -> Iterator[tuple[int, int]]:
    """The ``chunked`` path's complete pieces from position ``start`` (a cut) up to ``end``.
    Each piece's length (1 to 7) is a fixed hash of its start, so every history is cut at the
    same positions, whatever its length or however the engine under test was fed, and the
    cuts fall unlike a generator's. A piece that would end beyond ``end`` is not yet due."""
    while True:
        length = 1 + (start * 2654435761 >> 7) % _LONGEST_CHUNK
        if start + length > end:
            return
        yield start, start + length
        start += length


@runtime_checkable
class _TakesCallsTogether(Protocol):
    """An engine that takes several calls at once (``RemoteShardEngine.calls_together``): one
    round trip for a twin's steps in a row, where each would be one."""

    def calls_together(self, calls: Sequence[tuple[str, Any]]) -> Iterator[StepResult | StructuredStatus]: ...


@dataclass
class _Stage:
    engine: ShardEngine
    caps: EngineCapabilities
    label: str
    #: The dtype its input rows are made in (the engine under test's), when not its own.
    rows_dtype: str | None = None


def _engine_name(build: Callable[[], ShardEngine]) -> str:
    if isinstance(build, ResolvedTarget):
        return build.target.label
    name = str(getattr(build, "__qualname__", "engine"))
    return name.rpartition(":")[2] or name


def _load_stage(
    build: Callable[[], ShardEngine], request: LoadRequest, start: int, end: int, rows_dtype: str | None = None
) -> _Stage:
    engine = build()
    sub = LoadRequest(request.model_id, start, end, request.total_layers, request.recipe)
    loaded = engine.load(sub)
    if not loaded.status.ok:
        message = f"loading layers {start}..{end} returned {loaded.status.code.name}: {loaded.status.message}"
        raise EngineError(loaded.status) from RuntimeError(message)
    return _Stage(engine, engine.capabilities(), f"layers {start}..{end}", rows_dtype)


@dataclass
class _Feed:
    """One twin fed a history piece by piece, as one session at epoch 0."""

    stages: list[_Stage]
    session: str = TWIN_SESSION
    steps: int = 0

    def send(self, history: tuple[int, ...], start: int, end: int) -> tuple[range | list[int], list[Payload]]:
        """Feed ``history[start:end]`` as the next step: the payloads and the history
        lengths they speak for."""
        action = step_action(self._op(start, end), self.session, 0, self.steps, history[start:end])
        payloads = _feed(self.stages, action)
        self.steps += 1
        return self._ends(start, end, payloads), payloads

    def send_all(
        self, history: tuple[int, ...], pieces: Sequence[tuple[int, int]], *, release: bool = False
    ) -> Iterator[tuple[range | list[int], list[Payload]]]:
        """``send`` of each of ``pieces`` in turn, then ``release`` if asked, each judged as the
        iterator reaches it. To an engine that takes calls together they are all sent now,
        before any answer is awaited (with whatever else goes to its server before that), and
        judged in the same order, one by one; to any other, each is made as the iterator
        reaches it."""
        engine = self.stages[0].engine
        if len(self.stages) != 1 or not isinstance(engine, _TakesCallsTogether):
            return self._one_by_one(history, pieces, release)
        stage = self.stages[0]
        sent: list[tuple[int, int, Action, StepRequest]] = []
        for start, end in pieces:
            action = step_action(self._op(start, end), self.session, 0, self.steps + len(sent), history[start:end])
            sent.append((start, end, action, build_request(action, stage.caps, stage.rows_dtype)))
        calls: list[tuple[str, Any]] = [(action.op, request) for _, _, action, request in sent]
        answers = engine.calls_together([*calls, *([("release", self.session)] if release else [])])
        return self._judged(stage, sent, answers, release)

    def _one_by_one(
        self, history: tuple[int, ...], pieces: Sequence[tuple[int, int]], release: bool
    ) -> Iterator[tuple[range | list[int], list[Payload]]]:
        for start, end in pieces:
            yield self.send(history, start, end)
        if release:
            self.release()

    def _judged(
        self,
        stage: _Stage,
        sent: list[tuple[int, int, Action, StepRequest]],
        answers: Iterator[StepResult | StructuredStatus],
        release: bool,
    ) -> Iterator[tuple[range | list[int], list[Payload]]]:
        for start, end, action, request in sent:
            result = _checked(stage, request, action, next(answers))
            self.steps += 1
            assert result.output is not None
            payloads = payloads_of(result.output, end - start)
            yield self._ends(start, end, payloads), payloads
        if release:
            self._released(stage, next(answers))

    @staticmethod
    def _op(start: int, end: int) -> str:
        return "decode" if start > 0 and end - start == 1 else "prefill"

    @staticmethod
    def _ends(start: int, end: int, payloads: list[Payload]) -> range | list[int]:
        return range(start + 1, end + 1) if len(payloads) == end - start else [end]

    def release(self) -> None:
        for stage in self.stages:
            self._released(stage, stage.engine.release(self.session))

    def _released(self, stage: _Stage, released: object) -> None:
        if not isinstance(released, StructuredStatus) or not released.ok:
            message = f"a fresh twin ({stage.label}) answered release({self.session!r}) with {released!r}, not OK"
            raise OracleFailure("§3 twin oracle", message)


@dataclass
class TwinSession:
    """The twins following one session epoch of the engine under test: ``stepwise`` and
    ``chunked`` up to ``EAGER_TOKENS`` tokens, the composition pipeline all the way."""

    epoch: int
    stepwise: _Feed
    chunked: _Feed
    pipeline: _Feed | None
    label: str
    fed: tuple[int, ...] = field(default_factory=tuple)
    #: The end of the last chunk fed to the ``chunked`` twin, and to the pipeline.
    chunked_to: int = 0
    piped_to: int = 0
    #: Why composition is not checked, when the engine cannot load the sub-ranges.
    pipeline_refused: str | None = None

    @classmethod
    def start(
        cls,
        build: Callable[[], ShardEngine],
        request: LoadRequest,
        epoch: int,
        split: bool,
        rows_dtype: str | None = None,
    ) -> TwinSession:
        """The twins of a session epoch, from ``build`` (``rows_dtype``: see ``OneShotTwin``)."""
        whole = (request.shard_start, request.shard_end)
        stepwise = _Feed([_load_stage(build, request, *whole, rows_dtype)])
        chunked = _Feed([_load_stage(build, request, *whole, rows_dtype)])
        label = f"{_engine_name(build)}, layers {whole[0]}..{whole[1]}"
        ranges = split_ranges(request) if split else None
        if ranges is None:
            return cls(epoch, stepwise, chunked, None, label)
        try:
            pipeline = _Feed([_load_stage(build, request, start, end, rows_dtype) for start, end in ranges])
        except EngineError as refusal:
            refused = f"the engine cannot load a split of its range: {refusal}"
            return cls(epoch, stepwise, chunked, None, label, pipeline_refused=refused)
        return cls(epoch, stepwise, chunked, pipeline, label)

    def continues(self, history: tuple[int, ...], epoch: int) -> bool:
        """Whether this twin has been fed a beginning of ``history`` in ``epoch``."""
        return self.epoch == epoch and history[: len(self.fed)] == self.fed

    def advance(self, history: tuple[int, ...], memo: HistoryMemo) -> Callable[[], None]:
        """Feed the ``stepwise`` twin the part of ``history`` it has not seen, and the
        ``chunked`` twin each chunk now complete, both up to ``EAGER_TOKENS``: what takes
        calls together is sent now (``_Feed.send_all``); the function returned judges the
        answers and remembers them in ``memo``, and must be called before the next advance."""
        assert self.continues(history, self.epoch), "a twin only ever moves forward"
        eager_end = min(len(history), EAGER_TOKENS)
        steps = [(position, position + 1) for position in range(len(self.fed), eager_end)]
        stepwise = self.stepwise.send_all(history, steps)
        chunks = [*chunk_pieces(self.chunked_to, eager_end)]
        chunked = self.chunked.send_all(history, chunks)

        def judged() -> None:
            for ends, payloads in stepwise:
                _remember(memo, history, "stepwise", ends, payloads)
            self.fed = history
            for (_, piece_end), (ends, payloads) in zip(chunks, chunked, strict=True):
                _remember(memo, history, "chunked", ends, payloads)
                self.chunked_to = piece_end

        return judged

    def compose(
        self,
        history: tuple[int, ...],
        memo: HistoryMemo,
        answers_again: Callable[[tuple[int, ...]], Mapping[str, Payload]],
    ) -> None:
        """Feed the pipeline each chunk of ``history`` now complete, and check each answer
        against the single engine's: the ``chunked`` twin's, fed the same pieces, or beyond
        ``EAGER_TOKENS`` the recompute's, where it answered. A difference is judged on every
        path's answer again (``answers_again``, on fresh engines): the single engine's paths
        may disagree among themselves, or the recompute's engine may have gone wrong."""
        if self.pipeline is None:
            return
        tolerance = Tolerance.of(self.chunked.stages[0].caps)
        for piece_start, piece_end in chunk_pieces(self.piped_to, len(history)):
            ends, piped = self.pipeline.send(history, piece_start, piece_end)
            self.piped_to = piece_end
            for position, other in zip(ends, piped, strict=True):
                prefix = history[:position]
                known = memo.get(prefix)
                path = next((path for path in ("chunked", "recompute") if path in known), None)
                if path is not None and payload_difference(known[path], other, tolerance) is not None:
                    self._composition_failure(prefix, answers_again(prefix), other)

    def _composition_failure(self, history: tuple[int, ...], answers: Mapping[str, Payload], piped: Payload) -> None:
        assert self.pipeline is not None
        tolerance = Tolerance.of(self.chunked.stages[0].caps)
        stages = " → ".join(stage.label for stage in self.pipeline.stages)
        first, *others = answers.values()
        if any(payload_difference(first, answer, tolerance) is not None for answer in others):
            message = (
                f"after history {list(history)}, the single engine's own paths disagree ({self.label}): "
                f"{paths_text(answers)}; the pipeline {stages} gives {show(piped)}"
            )
            raise OracleFailure("§3 determinism", message)
        difference = payload_difference(first, piped, tolerance)
        if difference is not None:
            ways = listed(ORACLE_PATHS[path] for path in ORACLE_PATHS if path in answers)
            message = (
                f"composition: after history {list(history)}, the pipeline {stages} "
                f"gave {difference} of the single engine ({self.label}, by {ways})"
            )
            raise OracleFailure("§3 composition", message)


class OneShotTwin:
    """A twin engine that answers a whole history by one path at once, as a session of its
    own released at once. The driver keeps one per example for the ``recompute`` of every
    history (loading an engine per history cost a real engine more than the prefill)."""

    def __init__(self, build: Callable[[], ShardEngine], request: LoadRequest, rows_dtype: str | None = None) -> None:
        """``rows_dtype``: the engine under test's dtype, which a middle's or tail's input
        rows are made in before they are cast to the twin's (a reference in a wider one)."""
        self.stage = _load_stage(build, request, request.shard_start, request.shard_end, rows_dtype)
        self.sessions = 0

    def answer(self, path: str, history: tuple[int, ...], memo: HistoryMemo) -> None:
        """Answer ``history`` (and the prefixes an output row speaks for) by ``path``; the
        ``chunked`` path's last chunk is cut where the history ends."""
        self.answer_later(path, history, memo)()

    def answer_later(self, path: str, history: tuple[int, ...], memo: HistoryMemo) -> Callable[[], None]:
        """``answer``, its calls sent now where the engine takes calls together
        (``_Feed.send_all``): the function returned judges the answers and remembers them."""
        feed = self._session()
        if path == "recompute":
            pieces: list[tuple[int, int]] = [(0, len(history))]
        elif path == "stepwise":
            pieces = [(position, position + 1) for position in range(len(history))]
        else:
            pieces = [*chunk_pieces(0, len(history))]
            last = pieces[-1][1] if pieces else 0
            pieces += [(last, len(history))] if last < len(history) else []
        answered = feed.send_all(history, pieces, release=True)

        def judged() -> None:
            for ends, payloads in answered:
                _remember(memo, history, path, ends, payloads)

        return judged

    def fed(self, history: tuple[int, ...], pieces: list[tuple[int, int]]) -> dict[tuple[int, ...], Payload]:
        """The answers to ``history`` fed in ``pieces`` ((start, end), one step each) as one
        session, by the history each answer speaks for."""
        feed = self._session()
        answers: dict[tuple[int, ...], Payload] = {}
        for ends, payloads in feed.send_all(history, pieces, release=True):
            answers.update((history[:position], payload) for position, payload in zip(ends, payloads, strict=True))
        return answers

    def _session(self) -> _Feed:
        self.sessions += 1
        return _Feed([self.stage], f"{TWIN_SESSION}-{self.sessions}")


def fresh_answers(
    build: Callable[[], ShardEngine], request: LoadRequest, history: tuple[int, ...], rows_dtype: str | None = None
) -> dict[str, Payload]:
    """Every path's answer for ``history``, each path on an engine loaded for it alone: what
    a verdict rests on, whatever sessions the twins had served before."""
    memo = HistoryMemo()
    for path in ORACLE_PATHS:
        OneShotTwin(build, request, rows_dtype).answer(path, history, memo)
    return dict(memo.get(history))


def fresh_fed(
    build: Callable[[], ShardEngine],
    request: LoadRequest,
    history: tuple[int, ...],
    pieces: list[tuple[int, int]],
    rows_dtype: str | None = None,
) -> dict[tuple[int, ...], Payload]:
    """What an engine loaded for it alone answers when ``history`` comes in ``pieces``
    ((start, end), one step each, as a session of the engine under test was fed), by the
    history each answer speaks for: whether a difference is the chunking's or another
    session's doing."""
    return OneShotTwin(build, request, rows_dtype).fed(history, pieces)


def _remember(
    memo: HistoryMemo, history: tuple[int, ...], path: str, ends: range | list[int], payloads: list[Payload]
) -> None:
    for position, payload in zip(ends, payloads, strict=True):
        memo.remember(history[:position], path, payload)


def _feed(stages: list[_Stage], action: Action) -> list[Payload]:
    request = build_request(action, stages[0].caps, stages[0].rows_dtype)
    result = _send(stages[0], request, action)
    for stage in stages[1:]:
        # output_problems has already checked that an upstream stage returns a bundle.
        assert isinstance(result.output, BoundaryBundle)
        request = replace(request, token_ids=None, bundle=result.output)
        result = _send(stage, request, action)
    assert result.output is not None
    return payloads_of(result.output, len(action.args["tokens"]))


def _send(stage: _Stage, request: StepRequest, action: Action) -> StepResult:
    result = stage.engine.prefill(request) if isinstance(request, PrefillRequest) else stage.engine.decode(request)
    return _checked(stage, request, action, result)


def _checked(stage: _Stage, request: StepRequest, action: Action, result: object) -> StepResult:
    """``result``, which ``stage`` answered to ``request``, if it is a good answer."""
    if not isinstance(result, StepResult) or not isinstance(result.status, StructuredStatus):
        message = f"a fresh twin ({stage.label}) returned {result!r} for {action.describe()}, not a StepResult"
        raise OracleFailure("§3 twin oracle", message)
    if not result.status.ok:
        message = f"{_where(stage, action)} with {result.status.code.name}: {result.status.message}"
        raise OracleFailure("§3 twin oracle", message)
    problems = output_problems(stage.caps, request, result)
    if problems:
        raise OracleFailure("§3 shape and range", f"{_where(stage, action)} with a bad output: {'; '.join(problems)}")
    return result


def _where(stage: _Stage, action: Action) -> str:
    return f"a fresh twin ({stage.label}) answered {action.describe()}"
