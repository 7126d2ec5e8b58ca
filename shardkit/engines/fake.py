"""A deterministic fixture engine: contract §2 lifecycle exactly, contract §3 numerics by construction.

The numbers come from hashing rather than arithmetic. Each layer keeps, per session
epoch, a running sha256 digest over every row it has consumed (that digest chain is the
"KV cache"), and emits a row derived from the digest. A row therefore depends on exactly
the rows before it, however the history was chunked, and a head/middle/tail split hashes
the same bytes as the whole model, so composition holds bit for bit. Nothing else (session
id, epoch number, call counts, other sessions, sidebands) enters a hash.

The session lifecycle and the faults come from ``SessionEngine``; this module holds the
configuration and the hash numerics only.
"""

from __future__ import annotations

import array
import functools
import hashlib
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from shardkit._public import settle
from shardkit.contract import LoadRequest, Role
from shardkit.engines._checks import is_int_at_least
from shardkit.engines.base import EngineSpec, Produced, SessionEngine, StepInput

__all__ = ["FakeEngineCrash", "FakeShardEngine", "FakeShardEngineConfig"]

_FLOAT32 = np.dtype("<f4")
_BIG_ENDIAN = sys.byteorder == "big"
_TWO_TO_MINUS_15 = 2.0**-15
_Value = TypeVar("_Value")


class FakeEngineCrash(RuntimeError):
    """The fake's simulated process death; the engine adds a note naming the dying call."""

    def __init__(self, message: str = "FakeShardEngine process died (simulated crash)") -> None:
        super().__init__(message)


@dataclass(frozen=True)
class FakeShardEngineConfig:
    """Sizes and budgets (contract §1 fixes the defaults) plus fault knobs, all off by default."""

    total_layers: int = 4
    hidden_size: int = 8
    vocab_size: int = 32
    max_sessions: int = 4
    max_kv_tokens: int = 64
    dtype: str = "float32"
    architecture: str = "shardkit-fake"
    step_delay_seconds: float = 0.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    malformed_output: bool = False
    #: N prefill/decode calls succeed, the next one raises ``crash_exception_factory()`` and the
    #: engine stays dead; cancel, release, health, metrics and capabilities do not count.
    crash_after_calls: int | None = None
    crash_exception_factory: Callable[[], BaseException] = field(default=FakeEngineCrash, compare=False)

    def __post_init__(self) -> None:
        delay, crash = self.step_delay_seconds, self.crash_after_calls
        checks = [
            ("dtype", self.dtype == "float32", "'float32' (the only dtype the fake computes in)"),
            ("total_layers", is_int_at_least(self.total_layers, 1), "an int >= 1"),
            ("hidden_size", is_int_at_least(self.hidden_size, 1), "an int >= 1"),
            ("vocab_size", is_int_at_least(self.vocab_size, 1), "an int >= 1"),
            ("max_sessions", is_int_at_least(self.max_sessions, 1), "an int >= 1"),
            ("max_kv_tokens", is_int_at_least(self.max_kv_tokens, 0), "an int >= 0"),
            ("step_delay_seconds", math.isfinite(delay) and delay >= 0, "a finite number of seconds >= 0"),
            ("crash_after_calls", crash is None or is_int_at_least(crash, 1), "a positive int or None"),
        ]
        for name, valid, expected in checks:
            if not valid:
                message = f"FakeShardEngineConfig.{name} must be {expected}, got {getattr(self, name)!r}"
                raise ValueError(message)


# --- numerics: a hash "transformer" ------------------------------------------------------


def _u64(number: int) -> bytes:
    return number.to_bytes(8, "little")


def _unit_floats(material: bytes, count: int) -> npt.NDArray[np.float32]:
    """``count`` float32 values in [-1, 1): multiples of 2**-15, so finite and exact."""
    words = np.frombuffer(hashlib.shake_256(material).digest(2 * count), dtype="<u2")
    return (words.astype(np.float32) / np.float32(32768) - np.float32(1)).astype(_FLOAT32)


class _BoundedMemo(Generic[_Value]):
    """Values by the bytes they are a function of, up to ``MAX_BYTES`` (keys and values), oldest
    out first, so a large ``hidden_size`` cannot make it grow without limit.

    It is shared by every fake in the process because the kit runs several on one history:
    the engine under test, the twin that recomputes each history in one prefill (all but the
    history's last token were computed for the previous one), the twins that follow the
    session. A value is a function of its key alone, so a memo changes no output."""

    MAX_BYTES: ClassVar[int] = 8 << 20

    def __init__(self) -> None:
        self._rows: dict[bytes, _Value] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def _recall(self, key: bytes, compute: Callable[[], _Value], size: Callable[[_Value], int]) -> _Value:
        found = self._rows.get(key)
        if found is not None:
            return found
        computed = compute()
        cost = len(key) + size(computed)
        with self._lock:
            if key not in self._rows and cost <= self.MAX_BYTES:
                while self._bytes + cost > self.MAX_BYTES:
                    oldest = next(iter(self._rows))  # dicts keep insertion order
                    self._bytes -= len(oldest) + size(self._rows.pop(oldest))
                self._rows[key] = computed
                self._bytes += cost
        return computed


class _RowMemo(_BoundedMemo[bytes]):
    """Rows by the bytes they were hashed from."""

    def row(self, material: bytes, count: int) -> bytes:
        return self._recall(material + count.to_bytes(8, "little"), lambda: _hashed_row(material, count), len)


class _PassMemo(_BoundedMemo[tuple[tuple[bytes, ...], bytes]]):
    """One row's pass through a shard's layers: the chains after it and the row it leaves
    with, by the shard, the chains before it and the row. A recompute of a history pushes
    every row but the last through the same chains as the recompute before it did: from
    here each costs one lookup instead of a hash per layer."""

    def passed(
        self, key: bytes, compute: Callable[[], tuple[tuple[bytes, ...], bytes]]
    ) -> tuple[tuple[bytes, ...], bytes]:
        return self._recall(key, compute, lambda value: sum(map(len, value[0])) + len(value[1]))


def _unit_float_bytes(material: bytes, count: int) -> bytes:
    """``_unit_floats(material, count).tobytes()``, from the memo where it was computed before."""
    return _ROW_MEMO.row(material, count)


def _hashed_row(material: bytes, count: int) -> bytes:
    """``_unit_floats(material, count).tobytes()`` without numpy: rows are hashed once
    per layer per token, and for a handful of values the array module is faster.
    Bit-identical: ``w / 2**15 - 1`` is exact in float64 and representable in float32."""
    words = array.array("H", hashlib.shake_256(material).digest(2 * count))
    if _BIG_ENDIAN:
        words.byteswap()
    values = array.array("f", [word * _TWO_TO_MINUS_15 - 1.0 for word in words])
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


_ROW_MEMO = _RowMemo()
_PASS_MEMO = _PassMemo()


@dataclass(frozen=True)
class _HashLayers:
    """The loaded shard's numerics: a seed from the model id, its layer range and role."""

    seed: bytes
    layers: range
    role: Role

    def fresh_chains(self) -> list[bytes]:
        return list(self._fresh_chains)

    @functools.cached_property
    def _fresh_chains(self) -> tuple[bytes, ...]:
        # Every session epoch starts from these: hashed once per load, not once per session.
        return tuple(hashlib.sha256(self.seed + b"chain" + _u64(layer)).digest() for layer in self.layers)

    def embed(self, token_id: int, hidden_size: int) -> bytes:
        return _unit_float_bytes(self.seed + b"embed" + _u64(token_id), hidden_size)

    def run_layers(self, chains: list[bytes], inputs: list[int] | list[bytes], hidden_size: int) -> list[bytes]:
        """Push ``inputs`` (token ids, embedded here, or residual rows) through the shard's
        layers in order, advancing ``chains`` in place."""
        shard = _u64(self.layers.start) + _u64(self.layers.stop) + _u64(hidden_size)
        outputs = []
        for item in inputs:
            # A token is keyed by its id (8 bytes), a row by its bytes (4 per value): the tag tells them apart.
            key = shard + b"".join(chains) + (b"token" + _u64(item) if isinstance(item, int) else b"row" + item)
            passed, output = _PASS_MEMO.passed(key, functools.partial(self._pass, tuple(chains), item, hidden_size))
            chains[:] = passed
            outputs.append(output)
        return outputs

    def _pass(self, chains: tuple[bytes, ...], item: int | bytes, hidden_size: int) -> tuple[tuple[bytes, ...], bytes]:
        row = self.embed(item, hidden_size) if isinstance(item, int) else item
        advanced = []
        for layer, chain in zip(self.layers, chains, strict=True):
            digest = hashlib.sha256(chain + _u64(layer) + row).digest()
            advanced.append(digest)
            row = _unit_float_bytes(b"layer" + _u64(layer) + digest, hidden_size)
        return tuple(advanced), row


class FakeShardEngine(SessionEngine[list[bytes]]):
    """A deterministic ``ShardEngine`` with native support for every contract §4 fault."""

    ENGINE_NAME: ClassVar[str] = "FakeShardEngine"
    EVIDENCE_CLASS: ClassVar[Literal["fixture"]] = "fixture"
    TOLERANCE: ClassVar[float] = 0.0  # hashes are exact: every property holds bit for bit

    def __init__(self, config: FakeShardEngineConfig | None = None) -> None:
        self._config = config if config is not None else FakeShardEngineConfig()
        config = self._config
        spec = EngineSpec(
            architecture=config.architecture,
            total_layers=config.total_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=config.dtype,
            max_sessions=config.max_sessions,
            max_kv_tokens=config.max_kv_tokens,
        )
        super().__init__(
            spec,
            crash_exception_factory=config.crash_exception_factory,
            step_delay_seconds=config.step_delay_seconds,
            sleep=config.sleep,
            malformed_output=config.malformed_output,
            crash_after_calls=config.crash_after_calls,
        )
        self._hash: _HashLayers | None = None

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        seed = hashlib.sha256(request.model_id.encode("utf-8", "surrogatepass")).digest()
        self._hash = _HashLayers(seed, layers, role)

    def fresh_cache(self) -> list[bytes]:
        assert self._hash is not None
        return self._hash.fresh_chains()

    def forward(self, cache: list[bytes], step: StepInput) -> tuple[list[bytes], Produced]:
        numerics, hidden = self._hash, self._config.hidden_size
        assert numerics is not None
        inputs: list[int] | list[bytes]
        if step.token_ids is not None:
            inputs = list(step.token_ids)
        else:
            assert step.residual is not None
            data, width = step.residual.data, hidden * _FLOAT32.itemsize
            inputs = [data[offset : offset + width] for offset in range(0, len(data), width)]
        chains = list(cache)  # the session's own chains stay as they were
        final_rows = numerics.run_layers(chains, inputs, hidden)
        if numerics.role in ("tail", "full"):
            # Read-only: the memo's bytes are shared by every call that asks for the same logits.
            logits = _unit_float_bytes(b"lm_head" + final_rows[-1], self._config.vocab_size)
            return chains, np.frombuffer(logits, dtype=_FLOAT32)
        return chains, b"".join(final_rows)


settle(__name__, globals())
