"""Bundled shard engines, and the base classes for writing your own.

``fake`` is the deterministic fixture every suite can fuzz; ``numpy_llama`` a real
llama-style decoder in numpy (float32, or computing in bfloat16 or float16); ``pipeline`` a coordinator chaining shards;
``llama_cpp`` llama.cpp (the ``llama`` extra); ``transformers_llama`` a Hugging Face
transformers Llama on PyTorch (the ``transformers`` extra). ``base.SessionEngine`` is the class they
are built on (write the maths, inherit the session lifecycle and the faults), and
``delegating.DelegatingEngine`` wraps an engine so a wrapper overrides only what it
changes; both are also importable from ``shardkit`` (see docs/extending.md)."""

from shardkit.engines.fake import FakeShardEngine, FakeShardEngineConfig
from shardkit.engines.numpy_llama import NumpyShardEngine

__all__ = ["FakeShardEngine", "FakeShardEngineConfig", "NumpyShardEngine"]
