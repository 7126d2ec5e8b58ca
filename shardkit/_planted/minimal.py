"""Minimal failing sequences that run: the steps a planted engine's ``MINIMAL`` lists.

A ``Step`` is written against the contract, not against the fake behind a planted engine:
session ids, epochs, steps and small token ids are plain values, and a length that depends
on the engine's budget is a ``KvTokens`` placeholder that ``Step.action(caps)`` turns into
concrete tokens from the loaded engine's ``capabilities()``. So a sequence still means the
same thing for an engine with another KV budget, and no test needs to know the fake's 64.

``Step.describe()`` (also its ``repr``) is the readable form messages and tests print, e.g.
``prefill(a, epoch=0, step=0, tokens=[0, 3])`` or
``prefill(b, epoch=0, step=0, tokens=[max_kv_tokens of 0])  # a is evicted``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardkit._core.steps import ROW_KINDS, Action, row_code, step_action
from shardkit.contract import EngineCapabilities, LoadRequest

__all__ = [
    "KvTokens",
    "Step",
    "Tokens",
    "actions",
    "cancel",
    "decode",
    "fault",
    "load_request_for",
    "prefill",
    "release",
]


@dataclass(frozen=True)
class KvTokens:
    """``max_kv_tokens * numerator // denominator + extra`` copies of ``token``: a chunk whose
    length is the engine's budget (or a fraction of it), read from its capabilities at replay."""

    numerator: int = 1
    denominator: int = 1
    extra: int = 0
    token: int = 0

    def count(self, caps: EngineCapabilities) -> int:
        return caps.max_kv_tokens * self.numerator // self.denominator + self.extra

    def resolve(self, caps: EngineCapabilities) -> tuple[int, ...]:
        count = self.count(caps)
        if count < 1:
            message = f"{self.describe()} is {count} tokens for max_kv_tokens={caps.max_kv_tokens}: no chunk to send"
            raise ValueError(message)
        return (self.token,) * count

    def describe(self) -> str:
        size = "max_kv_tokens"
        if self.numerator != 1:
            size += f"*{self.numerator}"
        if self.denominator != 1:
            size += f"//{self.denominator}"
        if self.extra:
            size += f"{self.extra:+d}".replace("+", " + ").replace("-", " - ")
        return f"[{size} of {self.token}]"


#: A chunk's tokens: literal ids (each must be below the engine's vocab_size), or a placeholder.
Tokens = tuple[int, ...] | KvTokens


@dataclass(frozen=True, repr=False)
class Step:
    """One step of a minimal sequence: an operation and its arguments, some of them
    placeholders resolved against an engine's capabilities (see ``action``)."""

    op: str
    session: str = ""
    epoch: int = 0
    step: int = 0
    tokens: Tokens = (0,)
    malformed: str | None = None
    #: What a bundle's rows hold, one of ``ROW_KINDS`` (a middle or tail's input; a step of a
    #: head or full shard sends token ids, which have no values).
    rows: str = "ordinary"
    #: A fault step's kind and value.
    kind: str = ""
    value: float = 0.0
    note: str = ""
    #: The arguments ``describe`` shows, in order (which of the fields the op has).
    shown: tuple[str, ...] = field(default=(), compare=False)

    def action(self, caps: EngineCapabilities) -> Action:
        """The concrete step for an engine with ``caps``: placeholders resolved, token ids
        checked against its vocabulary (a sequence that needs more ids than the engine has
        cannot be replayed against it, and says so)."""
        if self.op in ("prefill", "decode"):
            tokens = self.tokens.resolve(caps) if isinstance(self.tokens, KvTokens) else self.tokens
            too_big = [token for token in tokens if not 0 <= token < caps.vocab_size]
            if too_big and self.malformed is None:
                message = (
                    f"{self.describe()}: token ids {too_big} are outside this engine's vocab_size {caps.vocab_size}"
                )
                raise ValueError(message)
            if self.rows != "ordinary" and caps.role in ("middle", "tail"):
                tokens = tuple(row_code(token, ROW_KINDS.index(self.rows)) for token in tokens)
            return step_action(self.op, self.session, self.epoch, self.step, tokens, self.malformed)
        if self.op == "cancel":
            return Action("cancel", {"session": self.session, "epoch": self.epoch})
        if self.op == "release":
            return Action("release", {"session": self.session})
        if self.op == "fault":
            return Action("fault", {"kind": self.kind, "value": self.value}, self.note)
        message = f"a minimal sequence cannot hold a {self.op!r} step"
        raise ValueError(message)

    def describe(self) -> str:
        parts: list[str] = []
        for name in self.shown:
            value: Any = getattr(self, name)
            if name == "session":
                parts.append(value)
            elif name == "tokens":
                shown = value.describe() if isinstance(value, KvTokens) else f"[{', '.join(map(str, value))}]"
                parts.append(f"tokens={shown}")
            elif name == "kind":
                parts.append(value)
            else:
                parts.append(f"{name}={value!r}")
        note = f"  # {self.note}" if self.note else ""
        return f"{self.op}({', '.join(parts)}){note}"

    __repr__ = describe
    __str__ = describe


def prefill(
    session: str,
    epoch: int = 0,
    step: int = 0,
    tokens: Tokens = (0,),
    *,
    malformed: str | None = None,
    rows: str = "ordinary",
    note: str = "",
) -> Step:
    _check_rows(rows)
    shown = ("session", "epoch", "step", "tokens", *(("rows",) if rows != "ordinary" else ()))
    shown += ("malformed",) if malformed else ()
    return Step("prefill", session, epoch, step, tokens, malformed, rows, note=note, shown=shown)


def decode(
    session: str, epoch: int = 0, step: int = 1, token: int = 0, *, rows: str = "ordinary", note: str = ""
) -> Step:
    _check_rows(rows)
    shown = ("session", "epoch", "step", "tokens", *(("rows",) if rows != "ordinary" else ()))
    return Step("decode", session, epoch, step, (token,), rows=rows, note=note, shown=shown)


def _check_rows(rows: str) -> None:
    if rows not in ROW_KINDS:
        message = f"rows={rows!r} is not one of {', '.join(ROW_KINDS)}"
        raise ValueError(message)


def cancel(session: str, epoch: int = 0, *, note: str = "") -> Step:
    return Step("cancel", session, epoch, note=note, shown=("session", "epoch"))


def release(session: str, *, note: str = "") -> Step:
    return Step("release", session, note=note, shown=("session",))


def fault(kind: str, value: float, *, note: str = "") -> Step:
    return Step("fault", kind=kind, value=value, note=note, shown=("kind", "value"))


def actions(steps: Iterable[Step], caps: EngineCapabilities) -> list[Action]:
    """The concrete steps of a sequence for an engine with ``caps`` (see ``Step.action``)."""
    return [step.action(caps) for step in steps]


def load_request_for(role: str, caps: EngineCapabilities, model_id: str = "shardkit-planted") -> LoadRequest:
    """The widest layer range of ``role`` on an engine whose unloaded ``caps`` describe its
    whole model (what ``shardkit fuzz --role ROLE`` loads first)."""
    last = caps.total_layers - 1
    ranges: dict[str, Sequence[int]] = {
        "full": (0, last),
        "head": (0, last - 1),
        "tail": (1, last),
        "middle": (1, last - 1),
    }
    start, end = ranges[role]
    return LoadRequest(model_id, start, end, caps.total_layers)
