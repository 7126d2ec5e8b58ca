"""Bundled shard engines: ``fake`` is the deterministic fixture every suite can fuzz;
``numpy_llama`` is a real llama-style decoder in numpy float32."""

from .fake import FakeShardEngine, FakeShardEngineConfig
from .numpy_llama import NumpyShardEngine

__all__ = ["FakeShardEngine", "FakeShardEngineConfig", "NumpyShardEngine"]
