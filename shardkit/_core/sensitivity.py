"""How much an engine's answer depends on its history: what the twin oracle can see.

The twin oracle finds a corrupted cache (a block overwritten, another session's state,
stale tokens) only when the corruption changes an answer. An engine whose answer
ignores most of its history, such as one whose output comes from the last token alone
or from a hash folded down to a few bits, passes every comparison with a corrupted cache.
``history_sensitivity`` measures it: it changes one token of a history, at positions
before the last, and counts how often the answer to the whole history changes beyond
the engine's tolerance. A token answer counts as changed when its token or its reported
margin (top-1 minus top-2 logit) moves, so that a real model, whose argmax often
survives one changed token, is measured on the logits it reports; a bundle counts on
the residual row of the last position (the row of the changed position itself would
change whatever the engine keeps of the past).

Everything here is fixed by the engine's capabilities and a constant seed: the same
engine gives the same figure on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardkit._core.checks import Tolerance, payload_difference, payloads_of
from shardkit._core.conformance import _CheckFailed, _Probe
from shardkit._core.targets import EngineFactory
from shardkit.contract import BoundaryBundle, EngineError, PrefillRequest, Role, TokenOutput

__all__ = ["HistorySensitivity", "history_sensitivity"]

#: Histories measured, each with one changed token at up to ``POSITIONS`` positions.
HISTORIES = 3
POSITIONS = 5
#: The longest history measured: enough positions before the last to change, and short
#: enough for the smallest KV budget an engine may declare to hold it.
LONGEST_HISTORY = 16
#: Below this share of changed answers the oracle is called nearly blind (a warning).
BLIND_BELOW = 0.5
_SEED = 20260101


@dataclass(frozen=True)
class HistorySensitivity:
    """How many one-token changes of a history (``trials``) changed the engine's answer
    (``changed``), measured on a ``role`` shard, comparing ``compared``; ``unmeasured``
    says why nothing was measured (then ``trials`` is 0)."""

    role: Role | None
    history_length: int
    trials: int
    changed: int
    compared: str
    unmeasured: str | None = None

    @property
    def blind(self) -> bool:
        """Fewer than half the changes showed: a corrupted cache would mostly go unseen."""
        return self.trials > 0 and self.changed < BLIND_BELOW * self.trials

    def summary(self) -> str:
        if self.unmeasured is not None:
            return f"history sensitivity not measured: {self.unmeasured}"
        return (
            f"history sensitivity: {self.changed} of {self.trials} one-token changes before the last token "
            f"of a {self.history_length}-token history changed {self.compared} ({self.role} shard)"
        )

    def caveat(self) -> str | None:
        """What a fuzz run of a nearly blind engine could not check (its summary's "not checked" lines)."""
        if not self.blind:
            return None
        return (
            f"most corruption of the engine's KV cache: only {self.changed} of {self.trials} changes of one token "
            "before the last changed its answer, and the twin oracle sees a corruption only through a changed "
            "answer (docs/contract.md#history-sensitivity)"
        )

    def warning(self) -> str | None:
        """What to tell the engine's author when the oracle is nearly blind to cache corruption."""
        if not self.blind:
            return None
        whole = "derive the answer from the whole history the cache holds"
        advice = (
            "if the answer is the argmax of logits, report TokenOutput.margin (top-1 minus top-2 logit) so that "
            f"the kit sees what the argmax survives; otherwise {whole}"
            if "margin" not in self.compared and self.role in ("tail", "full")
            else whole
        )
        return (
            f"warning: only {self.changed} of {self.trials} changes of one earlier token changed the answer; the "
            "twin oracle sees a corrupted KV cache only through a changed answer, so most corruption of this "
            f"engine's cache would go unseen: {advice}"
        )


def history_sensitivity(make_engine: EngineFactory) -> HistorySensitivity:
    """Measure on fresh engines from ``make_engine`` (a full shard, else the first role it
    loads), one session at a time, each released before the next."""
    total_layers = make_engine().capabilities().total_layers
    roles: tuple[Role, ...] = ("full", "head", "middle", "tail") if total_layers >= 3 else ("full", "head", "tail")
    if total_layers < 2:
        roles = ("full",)
    for role in roles:
        try:
            probe = _Probe(make_engine, role)
        except (_CheckFailed, EngineError):  # a layer range the engine does not load: try the next
            continue
        try:
            return _measure(probe, role)
        except _CheckFailed as failure:
            return HistorySensitivity(role, 0, 0, 0, "", unmeasured=f"a step failed: {failure}")
        except Exception as error:  # an engine's exception is a finding of the contract checks, not a crash here
            reason = f"the engine raised {type(error).__name__}: {error}"
            return HistorySensitivity(role, 0, 0, 0, "", unmeasured=reason)
    return HistorySensitivity(None, 0, 0, 0, "", unmeasured="the engine loads no layer range")


def _measure(probe: _Probe, role: Role) -> HistorySensitivity:
    caps = probe.caps
    length = min(LONGEST_HISTORY, caps.max_kv_tokens)
    if length < 2 or caps.vocab_size < 2:
        reason = f"a history needs 2 tokens of a vocabulary of 2 (max_kv_tokens {caps.max_kv_tokens}, vocab_size {caps.vocab_size})"
        return HistorySensitivity(role, length, 0, 0, "", unmeasured=reason)
    random = np.random.default_rng(_SEED)
    positions = sorted({round(share * (length - 2)) for share in np.linspace(0, 1, POSITIONS)})
    trials = changed = 0
    compared = "the residual row of the last token" if role in ("head", "middle") else "the token"
    sessions = 0
    for _ in range(HISTORIES):
        history = [int(token) for token in random.integers(0, caps.vocab_size, length)]
        sessions += 1
        answer = _answer(probe, f"sensitivity-{sessions}", history)
        if isinstance(answer, tuple) and answer[1] is not None:
            compared = "the token or its margin"
        for position in positions:
            changed_history = list(history)
            changed_history[position] = (history[position] + int(random.integers(1, caps.vocab_size))) % caps.vocab_size
            sessions += 1
            trials += 1
            changed += _differs(answer, _answer(probe, f"sensitivity-{sessions}", changed_history), Tolerance.of(caps))
    return HistorySensitivity(role, length, trials, changed, compared)


_Answer = np.ndarray | tuple[int, float | None]


def _answer(probe: _Probe, session_id: str, history: list[int]) -> _Answer:
    """The answer to ``history`` prefilled whole in a fresh session, which is then released."""
    token_ids, bundle = probe.inputs_of(session_id, 0, 0, tuple(history))
    result = probe.send(PrefillRequest(session_id, 0, 0, token_ids, bundle))
    probe.release(session_id)
    output = result.output
    if not isinstance(output, BoundaryBundle | TokenOutput):
        raise _CheckFailed(f"prefill of session {session_id!r}", "a bundle or a token", type(output).__name__)
    return payloads_of(output, len(history))[-1]


def _differs(first: _Answer, second: _Answer, tolerance: Tolerance) -> bool:
    """Whether the answer moved beyond ``tolerance``: any other token (a near tie too: the
    answer did change), or a row, as the oracle compares them; or the same token with a
    reported margin that moved."""
    if payload_difference(first, second, tolerance, near_ties_may_flip=False) is not None:
        return True
    if isinstance(first, tuple) and isinstance(second, tuple):
        before, after = first[1], second[1]
        return before is not None and after is not None and abs(before - after) > tolerance.margin
    return False
