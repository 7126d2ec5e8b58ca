"""Weights of a llama-style decoder, in the layout GGUF and llama.cpp use.

Shared by the numpy engine (which computes with them), the GGUF reader and
writer, and the tests. Matrices are stored as ``(out_features, in_features)``
float32 arrays — the numpy view of a GGUF tensor named as below — so a layer
computes ``x @ W.T``. Rotary embeddings use llama.cpp's ``LLAMA_ROPE_TYPE_NORM``
layout (adjacent pairs ``(x[2i], x[2i+1])`` rotate together), so tokens agree
with llama.cpp on the same file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["LAYER_TENSORS", "LlamaConfig", "LlamaLayer", "LlamaWeights", "random_weights"]

Matrix = npt.NDArray[np.float32]

#: GGUF tensor names of one block, ``blk.{i}.{name}.weight``, with their shapes as functions of the config.
LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ff_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ff_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                message = f"LlamaConfig.{name} must be a positive int, got {value!r}"
                raise ValueError(message)
        if self.hidden_size % self.n_heads or (self.hidden_size // self.n_heads) % 2:
            message = (
                f"LlamaConfig.hidden_size={self.hidden_size} must split into n_heads={self.n_heads} heads "
                "of an even size (rotary embeddings rotate pairs)"
            )
            raise ValueError(message)
        if self.n_heads % self.n_kv_heads:
            message = f"LlamaConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            raise ValueError(message)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        hidden, kv, ff = self.hidden_size, self.kv_dim, self.ff_size
        return {
            "attn_norm": (hidden,),
            "attn_q": (hidden, hidden),
            "attn_k": (kv, hidden),
            "attn_v": (kv, hidden),
            "attn_output": (hidden, hidden),
            "ffn_norm": (hidden,),
            "ffn_gate": (ff, hidden),
            "ffn_up": (ff, hidden),
            "ffn_down": (hidden, ff),
        }


@dataclass(frozen=True)
class LlamaLayer:
    attn_norm: Matrix
    attn_q: Matrix
    attn_k: Matrix
    attn_v: Matrix
    attn_output: Matrix
    ffn_norm: Matrix
    ffn_gate: Matrix
    ffn_up: Matrix
    ffn_down: Matrix


@dataclass(frozen=True)
class LlamaWeights:
    config: LlamaConfig
    token_embd: Matrix  # (vocab, hidden)
    layers: tuple[LlamaLayer, ...]
    output_norm: Matrix  # (hidden,)
    output: Matrix  # (vocab, hidden)
    name: str = field(default="shardkit-tiny-llama")


def random_weights(config: LlamaConfig | None = None, seed: int = 0) -> LlamaWeights:
    """Deterministic random weights: the same ``config`` and ``seed`` give the same bytes
    on every machine (numpy's PCG64 stream, drawn in a fixed order)."""
    config = config or LlamaConfig()
    generator = np.random.Generator(np.random.PCG64(seed))

    def matrix(shape: tuple[int, ...]) -> Matrix:
        fan_in = shape[-1]
        return np.asarray(generator.standard_normal(shape) / np.sqrt(fan_in), dtype=np.float32)

    def norm(size: int) -> Matrix:
        return np.asarray(1.0 + 0.1 * generator.standard_normal(size), dtype=np.float32)

    token_embd = generator.standard_normal((config.vocab_size, config.hidden_size)).astype(np.float32)
    layers = []
    for _ in range(config.n_layers):
        shapes = config.layer_shapes()
        tensors = {name: norm(shape[0]) if len(shape) == 1 else matrix(shape) for name, shape in shapes.items()}
        layers.append(LlamaLayer(**tensors))
    output_norm = norm(config.hidden_size)
    output = matrix((config.vocab_size, config.hidden_size))
    return LlamaWeights(config, token_embd, tuple(layers), output_norm, output)
