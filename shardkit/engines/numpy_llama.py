"""``NumpyShardEngine``: a real llama-style decoder in numpy, one layer range per engine.

The session lifecycle and the faults come from ``SessionEngine``; this module holds the
arithmetic. Each layer is the llama block as llama.cpp computes it: RMSNorm, Q/K/V
projections, rotary embeddings in the NORM layout (adjacent pairs ``(x[2i], x[2i+1])``
rotate by ``position * rope_theta ** (-2i / head_dim)``, the position being the token's
absolute position in the session), causal grouped-query attention over the session's
cached K/V plus the current chunk (consecutive query heads share a KV head), the output
projection and a residual add; then RMSNorm, the SwiGLU MLP and a residual add. A head
embeds token ids first; a tail applies the final RMSNorm and the output projection to the
last row, and greedy decoding picks the token. The boundary residual between shards is
the residual stream after the shard's last layer, before the final norm.

The KV cache of a session epoch is, per layer, K and V arrays of shape
``(n_kv_heads, positions, head_dim)``. A step builds new arrays and never writes into the
old ones (they are read-only), so a refused or failed step leaves the session as it was;
the base's capacity rule keeps the cached positions of all sessions <= ``max_kv_tokens``.

``NumpyBfloat16ShardEngine`` and ``NumpyFloat16ShardEngine`` compute as an accelerator does in
those formats: weights, activations, the KV cache and the boundary residual are bfloat16 or
float16 values, each operation accumulates in float32 and rounds its result to the format
(matmuls, norms, rotary, softmax, the SwiGLU product and the residual adds), and the logits
are the format's values read as float32.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

import numpy as np
import numpy.typing as npt

from shardkit._dtypes import numpy_dtype
from shardkit._public import settle
from shardkit.contract import LoadRequest, Role
from shardkit.engines._checks import check_budgets
from shardkit.engines.base import EngineSpec, Produced, SessionEngine, StepInput
from shardkit.engines.llama_weights import LlamaConfig, LlamaLayer, LlamaWeights, random_weights

__all__ = [
    "ARCHITECTURE",
    "NumpyBfloat16ShardEngine",
    "NumpyEngineCrash",
    "NumpyFloat16ShardEngine",
    "NumpyShardEngine",
    "default_weights",
]

ARCHITECTURE = "llama"
Array = npt.NDArray[np.float32]
_F32 = np.float32


class NumpyEngineCrash(RuntimeError):
    """The numpy engine's simulated process death (the ``crash`` fault)."""

    def __init__(self, message: str = "NumpyShardEngine process died (simulated crash)") -> None:
        super().__init__(message)


@functools.cache
def default_weights() -> LlamaWeights:
    """``random_weights(LlamaConfig(), seed=0)``, generated once per process."""
    return random_weights(LlamaConfig(), seed=0)


#: Rounds float32 values to the values of the engine's format (identity for float32).
Rounding = Callable[[npt.NDArray[Any]], Array]


def _rounding(dtype: str) -> Rounding:
    if dtype == "float32":
        return lambda values: values
    narrow = numpy_dtype(dtype)

    def rounded(values: npt.NDArray[Any]) -> Array:
        result: Array = np.asarray(values).astype(narrow).astype(_F32)
        return result

    return rounded


def _frozen(array: npt.NDArray[Any], rounding: Rounding) -> Array:
    """A C-contiguous float32 copy, rounded to the format, that nobody can write to."""
    copy = np.array(rounding(np.asarray(array, dtype=_F32)), dtype=_F32, order="C")
    copy.setflags(write=False)
    return copy


@dataclass(frozen=True)
class _Block:
    """One layer's weights, laid out for ``x @ W``: Q, K, V fused, and gate and up fused."""

    attn_norm: Array  # (hidden,)
    qkv: Array  # (hidden, hidden + 2 * kv_dim)
    attn_output: Array  # (hidden, hidden)
    ffn_norm: Array  # (hidden,)
    gate_up: Array  # (hidden, 2 * ff)
    ffn_down: Array  # (ff, hidden)

    @classmethod
    def of(cls, layer: LlamaLayer, rounding: Rounding) -> _Block:
        return cls(
            attn_norm=_frozen(layer.attn_norm, rounding),
            qkv=_frozen(np.concatenate([layer.attn_q, layer.attn_k, layer.attn_v]).T, rounding),
            attn_output=_frozen(layer.attn_output.T, rounding),
            ffn_norm=_frozen(layer.ffn_norm, rounding),
            gate_up=_frozen(np.concatenate([layer.ffn_gate, layer.ffn_up]).T, rounding),
            ffn_down=_frozen(layer.ffn_down.T, rounding),
        )


@dataclass(frozen=True)
class _KVCache:
    """One session epoch's cache: ``positions`` tokens, and per layer its (K, V)."""

    positions: int
    layers: tuple[tuple[Array, Array], ...]


@dataclass(frozen=True)
class _Shard:
    """The loaded layer range's weights and the constants its arithmetic needs."""

    config: LlamaConfig
    blocks: tuple[_Block, ...]
    embedding: Array | None  # (vocab, hidden), for a head or full shard
    output_norm: Array | None  # (hidden,), for a tail or full shard
    output: Array | None  # (hidden, vocab), for a tail or full shard
    inverse_frequencies: npt.NDArray[np.float64]  # (head_dim / 2,)
    round: Rounding  # to the engine's format, after each operation

    def empty_cache(self) -> _KVCache:
        config = self.config
        empty = np.zeros((config.n_kv_heads, 0, config.head_dim), dtype=_F32)
        empty.setflags(write=False)
        return _KVCache(0, tuple((empty, empty) for _ in self.blocks))

    def forward(self, cache: _KVCache, x: Array) -> tuple[_KVCache, Array]:
        """Run the rows ``x`` (n, hidden) through every block on top of ``cache``."""
        positions = np.arange(cache.positions, cache.positions + x.shape[0], dtype=np.float64)
        angles = positions[:, None] * self.inverse_frequencies[None, :]
        # (n, 1, head_dim / 2): broadcast over heads.
        cos = self.round(np.cos(angles).astype(_F32))[:, None, :]
        sin = self.round(np.sin(angles).astype(_F32))[:, None, :]
        layers = []
        # SiLU's exp(-gate) overflows to inf for a very negative gate, and gate / inf = -0 is
        # the right answer: no warning (pytest's "error" filter would turn one into a crash).
        with np.errstate(over="ignore"):
            for block, (k_cache, v_cache) in zip(self.blocks, cache.layers, strict=True):
                x, k_all, v_all = self._block(block, x, k_cache, v_cache, cos, sin, cache.positions)
                layers.append((k_all, v_all))
        return _KVCache(cache.positions + x.shape[0], tuple(layers)), x

    def _block(
        self, block: _Block, x: Array, k_cache: Array, v_cache: Array, cos: Array, sin: Array, past: int
    ) -> tuple[Array, Array, Array]:
        config, round_ = self.config, self.round
        n, heads, kv_heads, head_dim = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
        group = heads // kv_heads
        qkv = round_(round_(_rms_norm(x, block.attn_norm, config.rms_eps)) @ block.qkv)
        q = round_(_rotate(qkv[:, : config.hidden_size].reshape(n, heads, head_dim), cos, sin))
        k = round_(
            _rotate(qkv[:, config.hidden_size : config.hidden_size + config.kv_dim].reshape(n, kv_heads, head_dim), cos, sin)
        )
        v = qkv[:, config.hidden_size + config.kv_dim :].reshape(n, kv_heads, head_dim)
        # New arrays: the old cache is never written to.
        k_all = np.concatenate([k_cache, k.transpose(1, 0, 2)], axis=1)
        v_all = np.concatenate([v_cache, v.transpose(1, 0, 2)], axis=1)
        k_all.setflags(write=False)
        v_all.setflags(write=False)
        # Query head h uses KV head h // group: (kv_heads, group * n, head_dim).
        q_grouped = q.reshape(n, kv_heads, group, head_dim).transpose(1, 2, 0, 3).reshape(kv_heads, group * n, head_dim)
        scores = round_((q_grouped @ k_all.transpose(0, 2, 1)) * _F32(1.0 / np.sqrt(head_dim)))
        if n > 1:  # a row may see every cached position and the chunk's rows up to its own
            scores = scores.reshape(kv_heads, group, n, past + n)
            future = np.arange(past + n)[None, :] > (past + np.arange(n))[:, None]
            scores = np.where(future, _F32(-np.inf), scores).reshape(kv_heads, group * n, past + n)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = round_(scores / scores.sum(axis=-1, keepdims=True))
        attended = round_(weights @ v_all).reshape(kv_heads, group, n, head_dim).transpose(2, 0, 1, 3).reshape(n, -1)
        x = round_(x + round_(attended @ block.attn_output))
        gate_up = round_(round_(_rms_norm(x, block.ffn_norm, config.rms_eps)) @ block.gate_up)
        gate, up = gate_up[:, : config.ff_size], gate_up[:, config.ff_size :]
        swiglu: Array = round_((gate / (_F32(1) + np.exp(-gate))) * up)
        x = round_(x + round_(swiglu @ block.ffn_down))
        return x, k_all, v_all

    def logits(self, row: Array) -> Array:
        """The output projection of the final-normed residual row (hidden,)."""
        assert self.output_norm is not None
        assert self.output is not None
        normed = self.round(_rms_norm(row[None, :], self.output_norm, self.config.rms_eps))
        logits: Array = self.round(normed[0] @ self.output)
        return logits


#: The smallest normal float32: a scale below it is subnormal and keeps fewer bits.
_F32_TINY = float(np.finfo(_F32).tiny)


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """``x / sqrt(mean(x^2) + eps) * w``. The squares are summed in float64, so a huge but
    finite input row (up to float32's 3.4e38, whose square float32 cannot hold) still
    normalises to finite values. A row that large has a scale below float32's smallest
    normal value (3.3e-39 for a row of 3e38), which float32 holds with fewer bits: such a
    row is scaled in float64 instead. Every other row takes the float32 product, as before."""
    mean_square = np.square(x, dtype=np.float64).mean(axis=-1, keepdims=True)
    scale64 = 1.0 / np.sqrt(mean_square + eps)
    scale = scale64.astype(_F32)
    scaled = x * scale
    subnormal = scale64 < _F32_TINY
    if subnormal.any():
        scaled = np.where(subnormal, (x * scale64).astype(_F32), scaled)
    normed: Array = scaled * weight
    return normed


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """Rotary embedding, NORM layout: the pair (x[2i], x[2i+1]) turns by angle_i. x: (n, heads, head_dim)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = np.empty_like(x)
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


def _load_shard(
    weights: LlamaWeights, layers: range, role: Role, dtype: str, rounding: Rounding | None = None
) -> _Shard:
    """The shard of ``layers`` computing in ``dtype`` (``rounding``: another format's, kept in float32)."""
    config = weights.config
    rounding = rounding or _rounding(dtype)
    first, last = role in ("head", "full"), role in ("tail", "full")
    half = np.arange(config.head_dim // 2, dtype=np.float64)
    return _Shard(
        config=config,
        blocks=tuple(_Block.of(weights.layers[index], rounding) for index in layers),
        embedding=_frozen(weights.token_embd, rounding) if first else None,
        output_norm=_frozen(weights.output_norm, rounding) if last else None,
        output=_frozen(weights.output.T, rounding) if last else None,
        inverse_frequencies=config.rope_theta ** (-2.0 * half / config.head_dim),
        round=rounding,
    )


class NumpyShardEngine(SessionEngine[_KVCache]):
    """A llama decoder shard in numpy float32, with native support for every contract §4 fault.

    With no ``weights`` it serves ``random_weights(LlamaConfig(), seed=0)`` (4 layers,
    hidden size 64, 4 heads, vocab 256), so the class itself is a zero-argument engine
    target: ``shardkit fuzz shardkit.engines.numpy_llama:NumpyShardEngine``.
    """

    ENGINE_NAME: ClassVar[str] = "NumpyShardEngine"
    EVIDENCE_CLASS: ClassVar[Literal["real"]] = "real"
    # Float32 rounding depends on how a history is chunked: BLAS accumulates a matmul in
    # another order for another number of rows (gemv for one, gemm tiles for many), and the
    # softmax sums run over another number of positions. Measured on the default weights
    # over ~1900 random histories of 1-256 tokens, each run whole, token by token (the KV
    # cache), in random chunks and as the twins chunk it, with OpenBLAS single- and
    # multi-threaded: the worst residual difference was 6.1e-6 and the worst logit
    # difference 4.9e-6, on residual values up to ~10. Splits compose bit for bit (a
    # boundary residual travels as exact float32). 1e-4 is 16x the worst residual figure
    # and 5000x below the malformed_output shift (0.5). Weights of a bigger model have
    # bigger residuals and longer sums: measure again before trusting 1e-4 for them.
    TOLERANCE: ClassVar[float] = 1e-4
    #: The boundary residual's dtype, and the format the arithmetic rounds to.
    DTYPE: ClassVar[str] = "float32"

    def __init__(self, weights: LlamaWeights | None = None, *, max_sessions: int = 4, max_kv_tokens: int = 256) -> None:
        if weights is not None and not isinstance(weights, LlamaWeights):
            message = f"NumpyShardEngine weights must be LlamaWeights or None, got {type(weights).__name__}"
            raise TypeError(message)
        check_budgets("NumpyShardEngine", max_sessions, max_kv_tokens)
        self._weights = weights if weights is not None else default_weights()
        config = self._weights.config
        spec = EngineSpec(
            architecture=ARCHITECTURE,
            total_layers=config.n_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=self.DTYPE,
            max_sessions=max_sessions,
            max_kv_tokens=max_kv_tokens,
        )
        super().__init__(spec, crash_exception_factory=NumpyEngineCrash)
        self._shard: _Shard | None = None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, max_sessions: int = 4, max_kv_tokens: int = 256) -> Self:
        """An engine serving the llama weights of a GGUF file (needs the ``gguf`` package)."""
        from shardkit.engines.gguf_io import read_llama_gguf

        return cls(read_llama_gguf(path), max_sessions=max_sessions, max_kv_tokens=max_kv_tokens)

    @property
    def weights(self) -> LlamaWeights:
        return self._weights

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        self._shard = _load_shard(self._weights, layers, role, self.DTYPE)

    def fresh_cache(self) -> _KVCache:
        assert self._shard is not None
        return self._shard.empty_cache()

    def forward(self, cache: _KVCache, step: StepInput) -> tuple[_KVCache, Produced]:
        shard = self._shard
        assert shard is not None
        if step.token_ids is not None:
            assert shard.embedding is not None
            x: Array = shard.embedding[np.asarray(step.token_ids, dtype=np.intp)]
        else:
            x = step.rows().astype(_F32, copy=False)
        new_cache, x = shard.forward(cache, x)
        if shard.output is not None:
            return new_cache, shard.logits(x[-1])
        return new_cache, x



class NumpyBfloat16ShardEngine(NumpyShardEngine):
    """``NumpyShardEngine`` computing in bfloat16, as an accelerator does (float32
    accumulation, each result rounded): its residual crosses the boundary as bfloat16.
    ``shardkit fuzz shardkit.engines.numpy_llama:NumpyBfloat16ShardEngine``."""

    ENGINE_NAME: ClassVar[str] = "NumpyBfloat16ShardEngine"
    DTYPE: ClassVar[str] = "bfloat16"
    # Measured on the default weights, residual values up to ~12 (docs/numerics.md): a
    # value differs by at most 0.094 between chunkings, and by 0.131 from a float32
    # engine's answer to the same bfloat16 input; beside the relative tolerance
    # bfloat16 gets by default (1.6e-2·|reference|), 0.06 and 0.112 remain. Those
    # differences sit near zero as often as anywhere: each value sums bfloat16-rounded
    # terms of the row's own scale. 0.25 is over 2x the worst; the logits differ by at
    # most 0.068, and 0.25 is the margin under which a token may flip.
    TOLERANCE: ClassVar[float] = 0.25


class NumpyFloat16ShardEngine(NumpyShardEngine):
    """``NumpyShardEngine`` computing in float16, as an accelerator does (float32
    accumulation, each result rounded): its residual crosses the boundary as float16.
    ``shardkit fuzz shardkit.engines.numpy_llama:NumpyFloat16ShardEngine``."""

    ENGINE_NAME: ClassVar[str] = "NumpyFloat16ShardEngine"
    DTYPE: ClassVar[str] = "float16"
    # Measured as for bfloat16 (docs/numerics.md): at most 0.0156 between chunkings and
    # 0.0181 from a float32 engine's answer on ordinary rows, 0.014 beside float16's
    # default relative tolerance (1e-3·|reference|). On rows of huge values (~5.7e4) the
    # answers differ from float32's by up to 7.5, 1.3e-4 of the value: the relative
    # tolerance covers them, an absolute one would have to be 500x larger.
    TOLERANCE: ClassVar[float] = 0.03


settle(__name__, globals())
