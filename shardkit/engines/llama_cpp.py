"""``LlamaCppShardEngine``: llama.cpp, through llama-cpp-python's low-level API, as a full-role shard.

Needs the ``llama`` extra (``pip install 'shardkit[llama]'``, which pins
llama-cpp-python). One llama.cpp context serves every session: a session epoch
owns one sequence id of the context's unified KV cache, prefill and decode go
through ``llama_batch`` / ``llama_decode``, the token is the greedy argmax of the
last logits, and cancel, release and restart drop the sequence with
``llama_memory_seq_rm``. Every contract §2 rule is enforced by ``SessionEngine``
before anything reaches llama.cpp, so a bad token id or step never meets a
native assertion (which would abort the whole process).

Constructed with no arguments it serves the tiny deterministic GGUF of
``gguf_io.write_tiny_llama_gguf`` (written once into a cache folder), so the
class is a ``shardkit fuzz`` target as it is; a path argument loads any
llama-architecture GGUF.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from shardkit.contract import EngineError, LoadRequest, Role, StatusCode, StructuredStatus
from shardkit.engines._checks import check_budgets
from shardkit.engines.base import EngineSpec, Produced, SessionEngine, StepInput

__all__ = ["LlamaCppEngineCrash", "LlamaCppShardEngine", "numpy_reference", "tiny_gguf_path"]

EXTRA_HINT = "the llama.cpp engine needs llama-cpp-python: pip install 'shardkit[llama]'"
#: Where the tiny model is written once; override with SHARDKIT_CACHE.
CACHE_ENV = "SHARDKIT_CACHE"


class LlamaCppEngineCrash(RuntimeError):
    """The llama.cpp engine's simulated process death (the ``crash`` fault)."""

    def __init__(self, message: str = "LlamaCppShardEngine process died (simulated crash)") -> None:
        super().__init__(message)


def tiny_gguf_path() -> Path:
    """The tiny deterministic llama GGUF, written into the cache folder on first use."""
    folder = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "shardkit-cache")
    path = folder / "tiny-llama-f32-seed0.gguf"
    if not path.is_file():
        from shardkit.engines.gguf_io import write_tiny_llama_gguf

        write_tiny_llama_gguf(path)
    return path


def numpy_reference() -> Any:
    """A ``NumpyShardEngine`` on the same tiny GGUF: the reference for differential fuzzing
    (``shardkit fuzz shardkit.engines.llama_cpp:LlamaCppShardEngine --reference
    shardkit.engines.llama_cpp:numpy_reference``)."""
    from shardkit.engines.numpy_llama import NumpyShardEngine

    return NumpyShardEngine(_tiny_weights())


@functools.cache
def _tiny_weights() -> Any:
    from shardkit.engines.gguf_io import read_llama_gguf

    return read_llama_gguf(tiny_gguf_path())


@functools.cache
def _llama_and_log_callback() -> tuple[Any, Any]:
    """The llama_cpp module, with the backend initialised and its logging silenced, once; and
    the logging callback, which ctypes needs kept alive (the cache keeps it)."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError(EXTRA_HINT) from error
    llama_cpp.llama_backend_init()

    def ignore(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        pass

    quiet = llama_cpp.llama_log_callback(ignore)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    return llama_cpp, quiet


def _llama() -> Any:
    """The llama_cpp module, with the backend initialised and its logging silenced."""
    return _llama_and_log_callback()[0]


@dataclass(frozen=True)
class _Sequence:
    """A session epoch's slice of the KV cache: its sequence id and how many positions it holds."""

    seq_id: int
    positions: int


class LlamaCppShardEngine(SessionEngine[_Sequence]):
    """llama.cpp as a full-role ``ShardEngine``; every contract §4 fault is native."""

    ENGINE_NAME: ClassVar[str] = "LlamaCppShardEngine"
    EVIDENCE_CLASS: ClassVar[Literal["real"]] = "real"
    # Greedy tokens are compared, and a near-tie may flip: llama.cpp's logits move by up to
    # ~2e-3 with batching (how a history is chunked, which sessions share a batch). A margin
    # below 1e-2 is a near-tie that may legitimately flip; larger ones must not.
    TOLERANCE: ClassVar[float] = 1e-2

    def __init__(
        self, model_path: str | os.PathLike[str] | None = None, *, max_sessions: int = 4, max_kv_tokens: int = 256
    ) -> None:
        check_budgets("LlamaCppShardEngine", max_sessions, max_kv_tokens, kv_minimum=1)
        llama = _llama()
        self._path = Path(model_path) if model_path is not None else tiny_gguf_path()
        if not self._path.is_file():
            message = f"LlamaCppShardEngine: no GGUF file at {str(self._path)!r}"
            raise FileNotFoundError(message)
        self._model = llama.llama_model_load_from_file(str(self._path).encode(), llama.llama_model_default_params())
        if not self._model:
            message = f"llama.cpp could not load {str(self._path)!r} (not a llama GGUF it understands)"
            raise ValueError(message)
        vocab = llama.llama_model_get_vocab(self._model)
        spec = EngineSpec(
            architecture="llama",
            total_layers=llama.llama_model_n_layer(self._model),
            hidden_size=llama.llama_model_n_embd(self._model),
            vocab_size=llama.llama_vocab_n_tokens(vocab),
            dtype="float32",
            max_sessions=max_sessions,
            max_kv_tokens=max_kv_tokens,
        )
        super().__init__(spec, crash_exception_factory=LlamaCppEngineCrash)
        self._context: Any = None
        self._batch: Any = None
        self._free_sequences: list[int] = []

    def __del__(self) -> None:
        batch, context, model = (getattr(self, name, None) for name in ("_batch", "_context", "_model"))
        if batch is None and not context and not model:
            return  # __init__ stopped before llama.cpp held anything (e.g. without the llama extra)
        llama = _llama()
        if batch is not None:
            llama.llama_batch_free(batch)
        if context:
            llama.llama_free(context)
        if model:
            llama.llama_model_free(model)

    def load_layers(self, request: LoadRequest, layers: range, role: Role) -> None:
        if role != "full":
            message = (
                f"LlamaCppShardEngine serves the whole model only (layers 0..{self.spec.total_layers - 1}); "
                f"got layers {layers.start}..{layers.stop - 1}"
            )
            raise EngineError(StructuredStatus(StatusCode.INVALID_ARGUMENT, message))
        llama = _llama()
        params = llama.llama_context_default_params()
        # One sequence per session, plus one so a restart can start its new epoch's sequence.
        sequences = self.spec.max_sessions + 1
        params.n_seq_max = sequences
        params.kv_unified = True
        params.n_ctx = self.spec.max_kv_tokens * 2 + 32  # room for a restart's old and new epoch
        params.n_batch = params.n_ubatch = self.spec.max_kv_tokens
        params.n_threads = params.n_threads_batch = 1
        self._context = llama.llama_init_from_model(self._model, params)
        if not self._context:
            message = f"llama.cpp could not create a context for {str(self._path)!r}"
            raise EngineError(StructuredStatus(StatusCode.INTERNAL, message))
        self._batch = llama.llama_batch_init(self.spec.max_kv_tokens, 0, 1)
        self._free_sequences = list(range(sequences))

    def fresh_cache(self) -> _Sequence:
        return _Sequence(self._free_sequences.pop(0), 0)

    def release_cache(self, cache: _Sequence) -> None:
        llama = _llama()
        llama.llama_memory_seq_rm(llama.llama_get_memory(self._context), cache.seq_id, -1, -1)
        self._free_sequences.append(cache.seq_id)

    def forward(self, cache: _Sequence, step: StepInput) -> tuple[_Sequence, Produced]:
        llama = _llama()
        assert step.token_ids is not None, "a full shard takes token ids"
        batch, count = self._batch, len(step.token_ids)
        batch.n_tokens = count
        for index, token in enumerate(step.token_ids):
            batch.token[index] = token
            batch.pos[index] = cache.positions + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = cache.seq_id
            batch.logits[index] = index == count - 1
        code = llama.llama_decode(self._context, batch)
        if code != 0:
            message = f"llama_decode returned {code} for {count} tokens of sequence {cache.seq_id}"
            raise RuntimeError(message)
        logits = llama.llama_get_logits_ith(self._context, count - 1)
        row = np.ctypeslib.as_array(logits, shape=(self.spec.vocab_size,)).copy()
        return _Sequence(cache.seq_id, cache.positions + count), row
