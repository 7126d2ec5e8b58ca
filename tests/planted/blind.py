"""Engines that keep the contract and whose answers ignore most of their history, so the
twin oracle can hardly see a corrupted cache in them: what ``history_sensitivity`` (and the
warning of ``shardkit contract``) exists to flag. Neither has a bug a check would find."""

from __future__ import annotations

from shardkit import EngineSpec, SessionEngine, StepInput, TokenOutput
from shardkit.contract import LoadRequest, Role

SPEC = EngineSpec(
    architecture="blind",
    total_layers=1,
    hidden_size=4,
    vocab_size=32,
    dtype="float32",
    max_sessions=4,
    max_kv_tokens=64,
)


class _HistoryEngine(SessionEngine[tuple[int, ...]]):
    EVIDENCE_CLASS = "fixture"
    TOLERANCE = 0.0

    def __init__(self) -> None:
        super().__init__(SPEC)

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        pass  # one layer: the full role

    def fresh_cache(self) -> tuple[int, ...]:
        return ()

    def forward(self, cache: tuple[int, ...], step: StepInput) -> tuple[tuple[int, ...], TokenOutput]:
        history = cache + (step.token_ids or ())
        return history, TokenOutput(self.answer(history))

    def answer(self, history: tuple[int, ...]) -> int:
        raise NotImplementedError


class LinearHashEngine(_HistoryEngine):
    """Answers from the high bits of a linear (additive) hash of its cache: one changed token
    moves the hash by less than the vocabulary, which seldom reaches the bits the answer
    reads, so a corrupted block of the cache mostly gives the same token."""

    def answer(self, history: tuple[int, ...]) -> int:
        return (sum(history) >> 8) % SPEC.vocab_size


class LastTokenOnly(_HistoryEngine):
    """Keeps its history in the cache and answers from the last token alone (a bigram table)."""

    def answer(self, history: tuple[int, ...]) -> int:
        return (history[-1] * 7 + 3) % SPEC.vocab_size
