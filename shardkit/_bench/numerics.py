"""The numerics section: how far a correct llama's answers move with the format it computes
in, measured on this machine's CPU (docs/numerics.md#measured).

For each model and format, histories are prefilled whole and token by token (a KV cache
step per token) and compared, as the twin oracle compares them; and each format's whole
prefill is compared with float32's. A figure is the largest difference seen, the same
beside the format's default relative tolerance (what an absolute tolerance must still
cover), the largest value, and for the logits of the last row the largest difference and
the largest top-2 margin at which the argmax flipped.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from shardkit._bench.settings import BenchSettings
from shardkit.contract import DEFAULT_RELATIVE_TOLERANCES
from shardkit.engines import numpy_llama
from shardkit.engines.llama_weights import LlamaConfig, LlamaWeights, random_weights

__all__ = ["NUMERICS_FORMATS", "NUMERICS_MODELS", "measure_numerics", "tf32_rounding"]

#: The formats compared, each with the relative tolerance its figures are taken beside.
#: "tf32-like" rounds every result to TF32's 10 bits of mantissa, where a GPU rounds only a
#: matmul's inputs: a bound on TF32's differences, not a copy of them.
NUMERICS_FORMATS = ("float32", "tf32-like", "bfloat16", "float16")
#: The models: the bundled engine's default, and the shape the numerics issue measured on a GPU.
NUMERICS_MODELS = MappingProxyType(
    {
        "bundled (4 layers, hidden 64)": LlamaConfig(),
        "8 layers, hidden 512, 8 heads": LlamaConfig(
            hidden_size=512, n_layers=8, n_heads=8, n_kv_heads=8, ff_size=1376
        ),
    }
)


def tf32_rounding(values: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """float32 values rounded to nearest (ties to even) at TF32's 10 bits of mantissa."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    kept = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    rounded: npt.NDArray[np.float32] = kept.view(np.float32)
    return rounded


def _shard(weights: LlamaWeights, layers: int, fmt: str) -> Any:
    if fmt == "tf32-like":
        return numpy_llama._load_shard(weights, range(layers), "full", "float32", rounding=tf32_rounding)
    return numpy_llama._load_shard(weights, range(layers), "full", fmt)


def _run(shard: Any, x: npt.NDArray[np.float32], token_by_token: bool) -> npt.NDArray[np.float32]:
    cache = shard.empty_cache()
    if not token_by_token:
        return shard.forward(cache, x)[1]  # type: ignore[no-any-return]
    rows = []
    for index in range(x.shape[0]):
        cache, row = shard.forward(cache, x[index : index + 1])
        rows.append(row)
    return np.concatenate(rows)


def _relative(fmt: str) -> float:
    return DEFAULT_RELATIVE_TOLERANCES["float32" if fmt == "tf32-like" else fmt]


def measure_numerics(config: BenchSettings) -> dict[str, Any]:
    """For each of ``NUMERICS_MODELS`` (random weights, seed 0) and ``NUMERICS_FORMATS``:
    ``config.numerics_histories`` histories of ``config.numerics_tokens`` random tokens,
    each prefilled whole and token by token."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # an install without it (the kit's dependency, but a wheel may be put in --no-deps)
        threadpool_limits = None

    figures: dict[str, Any] = {"histories": config.numerics_histories, "tokens": config.numerics_tokens, "models": {}}
    for name, model in NUMERICS_MODELS.items():
        weights = random_weights(model, seed=0)
        shards = {fmt: _shard(weights, model.n_layers, fmt) for fmt in NUMERICS_FORMATS}
        rows: dict[str, dict[str, float]] = {fmt: _empty() for fmt in NUMERICS_FORMATS}
        generator = np.random.default_rng(0)
        with threadpool_limits(limits=1) if threadpool_limits is not None else contextlib.nullcontext():
            for _ in range(config.numerics_histories):
                tokens = generator.integers(0, model.vocab_size, config.numerics_tokens)
                wide = _run(shards["float32"], shards["float32"].embedding[tokens], token_by_token=False)
                for fmt, shard in shards.items():
                    x = shard.embedding[tokens]
                    whole, stepwise = _run(shard, x, False), _run(shard, x, True)
                    _note(rows[fmt], "chunking", whole, stepwise, _relative(fmt))
                    _note(rows[fmt], "float32", wide, whole, _relative(fmt))
                    _note_logits(rows[fmt], shard.logits(whole[-1]), shard.logits(stepwise[-1]))
        figures["models"][name] = rows
    return figures


def _empty() -> dict[str, float]:
    return {
        "chunking": 0.0,
        "chunking_beside_relative": 0.0,
        "float32": 0.0,
        "float32_beside_relative": 0.0,
        "largest_value": 0.0,
        "logits": 0.0,
        "flips": 0,
        "flip_margin": 0.0,
    }


def _note(
    row: dict[str, float], name: str, expected: npt.NDArray[Any], observed: npt.NDArray[Any], relative: float
) -> None:
    reference = expected.astype(np.float64)
    difference = np.abs(observed.astype(np.float64) - reference)
    row[name] = max(row[name], float(difference.max()))
    row[f"{name}_beside_relative"] = max(
        row[f"{name}_beside_relative"], float((difference - relative * np.abs(reference)).max())
    )
    row["largest_value"] = max(row["largest_value"], float(np.abs(reference).max()))


def _note_logits(row: dict[str, float], whole: npt.NDArray[Any], stepwise: npt.NDArray[Any]) -> None:
    row["logits"] = max(row["logits"], float(np.abs(whole.astype(np.float64) - stepwise).max()))
    if int(np.argmax(whole)) != int(np.argmax(stepwise)):
        top = np.sort(whole.astype(np.float64))[-2:]
        row["flips"] += 1
        row["flip_margin"] = max(row["flip_margin"], float(top[1] - top[0]))
