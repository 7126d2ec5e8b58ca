"""The twin oracle (contract §3): fresh engines that replay one session's history alone.

A memo of outputs only catches a wrong output when the same history comes round
again. A twin catches it the first time: a fresh engine from the same target,
loaded the same way, fed that session's tokens alone, chunked differently,
under another session id and epoch. Where the layer range can be split, a second twin runs
the same history through a two-stage pipeline of sub-range engines, which checks
composition. Twins write the memo; the engine under test is only compared to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shardkit._core.checks import HistoryMemo, Payload, output_problems, payload_difference, payloads_of
from shardkit._core.model import StepRequest
from shardkit._core.steps import Action, build_request, step_action
from shardkit._core.targets import short_name
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

__all__ = ["OracleFailure", "TwinSession", "split_ranges"]

TWIN_SESSION = "twin-oracle"


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


@dataclass
class _Stage:
    engine: ShardEngine
    caps: EngineCapabilities
    label: str


def _engine_name(build: Callable[[], ShardEngine]) -> str:
    name = getattr(build, "name", None) or getattr(build, "__qualname__", "engine")
    return short_name(str(name))


def _load_stage(build: Callable[[], ShardEngine], request: LoadRequest, start: int, end: int) -> _Stage:
    engine = build()
    sub = LoadRequest(request.model_id, start, end, request.total_layers, request.recipe)
    loaded = engine.load(sub)
    if not loaded.status.ok:
        message = f"loading layers {start}..{end} returned {loaded.status.code.name}: {loaded.status.message}"
        raise EngineError(loaded.status) from RuntimeError(message)
    return _Stage(engine, engine.capabilities(), f"layers {start}..{end}")


@dataclass
class TwinSession:
    """The twins shadowing one session epoch of the engine under test."""

    epoch: int
    single: list[_Stage]
    pipeline: list[_Stage] | None
    fed: tuple[int, ...] = field(default_factory=tuple)
    #: Why composition is not checked, when the engine cannot load the sub-ranges.
    pipeline_refused: str | None = None

    @classmethod
    def start(cls, build: Callable[[], ShardEngine], request: LoadRequest, epoch: int, split: bool) -> TwinSession:
        single = [_load_stage(build, request, request.shard_start, request.shard_end)]
        single[0].label = f"{_engine_name(build)}, {single[0].label}"
        ranges = split_ranges(request) if split else None
        if ranges is None:
            return cls(epoch, single, None)
        try:
            pipeline = [_load_stage(build, request, start, end) for start, end in ranges]
        except EngineError as refusal:
            return cls(epoch, single, None, pipeline_refused=f"the engine cannot load a split of its range: {refusal}")
        return cls(epoch, single, pipeline)

    steps: int = 0

    def advance(self, history: tuple[int, ...], memo: HistoryMemo) -> None:
        """Feed the twins the part of ``history`` they have not seen, and remember
        what they answer for each prefix they speak for.

        The new tokens go in as two pieces, the first token alone and then the
        rest, so the twins' chunk boundaries differ from the engine under test's
        (chunking invariance) at a cost of two calls per twin, not one per token.
        """
        assert history[: len(self.fed)] == self.fed, "a twin only ever moves forward"
        start = len(self.fed)
        for piece_start, piece_end in ((start, start + 1), (start + 1, len(history))):
            if piece_end > piece_start:
                self._feed_piece(history, piece_start, piece_end, memo)

    def _feed_piece(self, history: tuple[int, ...], start: int, end: int, memo: HistoryMemo) -> None:
        piece = history[start:end]
        op = "decode" if start > 0 and len(piece) == 1 else "prefill"
        action = step_action(op, TWIN_SESSION, 0, self.steps, piece)
        references = self._feed(self.single, action)
        ends = range(start + 1, end + 1) if len(references) == len(piece) else [end]
        if self.pipeline is not None:
            piped = self._feed(self.pipeline, action)
            for position, reference, other in zip(ends, references, piped, strict=True):
                difference = payload_difference(reference, other, self.single[0].caps.tolerance)
                if difference is not None:
                    stages = " → ".join(stage.label for stage in self.pipeline)
                    message = (
                        f"composition: after history {list(history[:position])}, the pipeline {stages} "
                        f"gave {difference} of the single engine ({self.single[0].label})"
                    )
                    raise OracleFailure("§3 composition", message)
        self.steps += 1
        self.fed = history[:end]
        source = f"a fresh twin ({self.single[0].label}, chunked differently)"
        for position, reference in zip(ends, references, strict=True):
            memo.remember(history[:position], reference, source)

    def _feed(self, stages: list[_Stage], action: Action) -> list[Payload]:
        request = build_request(action, stages[0].caps)
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
