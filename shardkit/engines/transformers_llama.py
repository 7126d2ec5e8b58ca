"""``TransformersShardEngine``: a Hugging Face transformers ``LlamaForCausalLM`` on PyTorch,
served in shards (the ``transformers`` extra: ``pip install 'shardkit[transformers]'``).

A shard runs the decoder layers of its range one by one, as ``LlamaModel.forward`` does:
a head embeds the token ids first, a tail applies the final norm and the LM head to the
last row, and greedy decoding picks the token. The boundary residual is the hidden state
after the shard's last layer, before the final norm.

Each session epoch has its own ``DynamicCache``, which holds the keys and values of this
shard's layers only (a layer writes at its own index; the others stay empty). Its length
is therefore never read from the cache, whose ``get_seq_length()`` reads layer 0, which a
middle or a tail does not hold: the engine counts a session's positions itself. The causal
mask and the rotary positions are built from that count.

A step writes its keys and values into the session's cache in place; one that fails part
way is cropped back to the positions it started from, so a refused or failed step leaves
the session as it was. Cancel, release and a restart drop the session's cache.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from shardkit._dtypes import numpy_dtype
from shardkit.contract import EngineCapabilities, LoadRequest, Role
from shardkit.engines._checks import check_budgets, is_tolerance
from shardkit.engines.base import EngineSpec, Produced, SessionEngine, StepInput
from shardkit.engines.llama_weights import LlamaWeights

__all__ = [
    "ARCHITECTURE",
    "TransformersEngineCrash",
    "TransformersShardEngine",
    "llama_from_weights",
    "numpy_weights",
    "tiny_llama",
]

ARCHITECTURE = "llama"
#: The boundary dtypes served, with the torch dtype each computes in.
_TORCH_DTYPES = ("float32", "bfloat16", "float16")


class TransformersEngineCrash(RuntimeError):
    """The transformers engine's simulated process death (the ``crash`` fault)."""

    def __init__(self, message: str = "TransformersShardEngine process died (simulated crash)") -> None:
        super().__init__(message)


def _torch() -> Any:
    return _import("torch")


def _transformers() -> Any:
    return _import("transformers")


def _import(name: str) -> Any:
    """``name`` as an untyped module: its signatures move between releases (the extra pins one)."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        message = (
            f"TransformersShardEngine needs PyTorch and transformers ({error}): pip install 'shardkit[transformers]'"
        )
        raise ImportError(message) from error


@functools.cache
def tiny_llama() -> Any:
    """A ``LlamaForCausalLM`` of the numpy engine's default shape (4 layers, hidden size 64,
    4 heads, vocab 256, feed-forward 128), randomly initialised from seed 0 in float32:
    the same weights on every machine, with no download."""
    torch, transformers = _torch(), _transformers()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def llama_from_weights(weights: LlamaWeights) -> Any:
    """A float32 ``LlamaForCausalLM`` holding ``weights``: the numpy engine's, or a GGUF
    file's as ``shardkit.engines.gguf_io.read_llama_gguf`` reads it. GGUF (and the numpy
    engine) rotate adjacent pairs of a head's query and key values, transformers the first
    half against the second: the query and key rows are put back in transformers' order, the
    inverse of the permutation llama.cpp's converter applies."""
    torch, transformers = _torch(), _transformers()
    shape = weights.config
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.ff_size,
        num_hidden_layers=shape.n_layers,
        num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=shape.context_length,
        rms_norm_eps=shape.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        attn_implementation="eager",
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()

    def tensor(values: npt.NDArray[Any]) -> Any:
        return torch.from_numpy(np.array(values, dtype=np.float32))

    state = {
        "model.embed_tokens.weight": tensor(weights.token_embd),
        "model.norm.weight": tensor(weights.output_norm),
        "lm_head.weight": tensor(weights.output),
    }
    for index, layer in enumerate(weights.layers):
        prefix = f"model.layers.{index}."
        state |= {
            prefix + "input_layernorm.weight": tensor(layer.attn_norm),
            prefix + "self_attn.q_proj.weight": tensor(_rows_halved(layer.attn_q, shape.n_heads)),
            prefix + "self_attn.k_proj.weight": tensor(_rows_halved(layer.attn_k, shape.n_kv_heads)),
            prefix + "self_attn.v_proj.weight": tensor(layer.attn_v),
            prefix + "self_attn.o_proj.weight": tensor(layer.attn_output),
            prefix + "post_attention_layernorm.weight": tensor(layer.ffn_norm),
            prefix + "mlp.gate_proj.weight": tensor(layer.ffn_gate),
            prefix + "mlp.up_proj.weight": tensor(layer.ffn_up),
            prefix + "mlp.down_proj.weight": tensor(layer.ffn_down),
        }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if "rotary" not in name]:
        message = f"llama_from_weights: the weights do not fit a LlamaForCausalLM (missing {missing}, unexpected {unexpected})"
        raise ValueError(message)
    return model


def _rows_halved(rows: npt.NDArray[Any], heads: int) -> npt.NDArray[Any]:
    """Each head's rows reordered from adjacent pairs (GGUF) to halves (transformers)."""
    out, rest = rows.shape[0], rows.shape[1:]
    halved: npt.NDArray[Any] = rows.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)
    return halved


@dataclass(frozen=True)
class _SessionCache:
    """A session epoch's ``DynamicCache`` and how many positions it holds."""

    kv: Any
    positions: int


class TransformersShardEngine(SessionEngine[_SessionCache]):
    """A transformers Llama shard on PyTorch, with native support for every contract §4 fault.

    With no ``model`` it serves ``tiny_llama()``, so the class itself is a zero-argument
    engine target: ``shardkit fuzz shardkit.engines.transformers_llama:TransformersShardEngine``.
    ``dtype`` is the format it computes in and its boundary residual's: float32, bfloat16
    or float16. ``tolerance`` is the absolute tolerance it declares (None: ``TOLERANCES``
    of its dtype, measured on ``tiny_llama()``; measure your model's, docs/pytorch.md)."""

    ENGINE_NAME: ClassVar[str] = "TransformersShardEngine"
    EVIDENCE_CLASS: ClassVar[Literal["real"]] = "real"
    #: The absolute tolerance of each dtype (the relative one is the dtype's default).
    #: Measured on tiny_llama() (residual values up to 0.15, logits up to 0.7) as a head and
    #: as a full shard, over 300 histories of 1-96 tokens in float32 and 100 in the others,
    #: each run whole, token by token and in random chunks (PyTorch's CPU kernels sum in
    #: another order for another number of rows): a residual value or a logit differed by
    #: at most 2.4e-7 in float32, 4.9e-4 in float16 and 2.0e-3 in bfloat16. Each is declared
    #: about 20-40x above its figure.
    TOLERANCES: ClassVar[Mapping[str, float]] = MappingProxyType({"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2})
    TOLERANCE: ClassVar[float] = TOLERANCES["float32"]

    def __init__(
        self,
        model: Any = None,
        *,
        dtype: str = "float32",
        tolerance: float | None = None,
        max_sessions: int = 4,
        max_kv_tokens: int = 256,
    ) -> None:
        torch = _torch()
        if dtype not in _TORCH_DTYPES:
            message = f"TransformersShardEngine dtype must be one of {', '.join(_TORCH_DTYPES)}, got {dtype!r}"
            raise ValueError(message)
        check_budgets("TransformersShardEngine", max_sessions, max_kv_tokens)
        if tolerance is not None and not is_tolerance(tolerance):
            message = f"TransformersShardEngine tolerance must be a finite float >= 0 or None, got {tolerance!r}"
            raise ValueError(message)
        self._tolerance = self.TOLERANCES[dtype] if tolerance is None else float(tolerance)
        self._torch_dtype = getattr(torch, dtype)
        self._model = (model if model is not None else tiny_llama()).to(self._torch_dtype).eval()
        config = self._model.config
        spec = EngineSpec(
            architecture=ARCHITECTURE,
            total_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            dtype=dtype,
            max_sessions=max_sessions,
            max_kv_tokens=max_kv_tokens,
        )
        super().__init__(spec, crash_exception_factory=TransformersEngineCrash)
        self._layers: list[Any] = []
        self._role: Role | None = None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], **options: Any) -> TransformersShardEngine:
        """An engine serving the llama weights of a GGUF file, read by the kit's own reader (the
        ``gguf`` package): transformers' GGUF loading needs the ``accelerate`` package and a
        tokenizer in the file, which the kit's tiny files do not hold."""
        from shardkit.engines.gguf_io import read_llama_gguf

        return cls(llama_from_weights(read_llama_gguf(path)), **options)

    @property
    def model(self) -> Any:
        return self._model

    def capabilities(self) -> EngineCapabilities:
        return replace(super().capabilities(), tolerance=self._tolerance)

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        self._layers = [self._model.model.layers[index] for index in layers]
        self._role = role

    def fresh_cache(self) -> _SessionCache:
        return _SessionCache(_transformers().DynamicCache(config=self._model.config), 0)

    def forward(self, cache: _SessionCache, step: StepInput) -> tuple[_SessionCache, Produced]:
        torch = _torch()
        role = self._role
        past, count = cache.positions, len(step)
        with torch.no_grad():
            if step.token_ids is not None:
                x = self._model.model.embed_tokens(torch.tensor([step.token_ids], dtype=torch.long))
            else:
                x = _to_torch(torch, step.rows(), self._torch_dtype)[None]
            positions = torch.arange(past, past + count).unsqueeze(0)
            rotary = self._model.model.rotary_emb(x, positions)
            # Row i sees every cached position and the chunk's rows up to its own.
            mask = torch.full((count, past + count), float("-inf"), dtype=x.dtype).triu(past + 1)[None, None]
            try:
                for layer in self._layers:
                    x = layer(
                        x,
                        attention_mask=mask,
                        position_ids=positions,
                        cache=cache.kv,
                        use_cache=True,
                        position_embeddings=rotary,
                    )
                    x = x[0] if isinstance(x, tuple) else x
            except BaseException:
                cache.kv.crop(past)  # the session stays as it was
                raise
            advanced = _SessionCache(cache.kv, past + count)
            if role in ("tail", "full"):
                logits = self._model.lm_head(self._model.model.norm(x[:, -1:]))[0, -1]
                return advanced, _to_numpy(logits.float(), "float32")
            return advanced, _to_numpy(x[0], self.spec.dtype)


def numpy_weights() -> TransformersShardEngine:
    """A ``TransformersShardEngine`` on the numpy engine's default weights (the tiny GGUF's):
    the same model as ``NumpyShardEngine()`` and llama.cpp's tiny file, for differential
    fuzzing (``shardkit fuzz shardkit.engines.transformers_llama:numpy_weights --reference
    shardkit.engines.numpy_llama:NumpyShardEngine``)."""
    from shardkit.engines.numpy_llama import NumpyShardEngine, default_weights

    # Residual values up to ~10, as the numpy engine's: its chunkings differ by up to 3.2e-6
    # (200 histories of 1-96 tokens), and from the numpy engine's by 2.3e-6. The numpy
    # engine's tolerance serves both.
    return TransformersShardEngine(llama_from_weights(default_weights()), tolerance=NumpyShardEngine.TOLERANCE)


def _to_torch(torch: Any, rows: npt.NDArray[Any], dtype: Any) -> Any:
    if rows.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(np.ascontiguousarray(rows).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(rows)).to(dtype)


def _to_numpy(values: Any, dtype: str) -> npt.NDArray[Any]:
    """A CPU tensor as a numpy array of ``dtype`` (bfloat16 through ``ml_dtypes``, bit for bit)."""
    if dtype == "bfloat16":
        bits: npt.NDArray[Any] = values.contiguous().view(_torch().int16).numpy()
        return bits.view(numpy_dtype("bfloat16"))
    array: npt.NDArray[Any] = values.numpy().astype(numpy_dtype(dtype), copy=False)
    return array
