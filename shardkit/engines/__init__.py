"""Bundled shard engines: ``fake`` is the deterministic fixture every suite can fuzz."""

from .fake import FakeShardEngine, FakeShardEngineConfig

__all__ = ["FakeShardEngine", "FakeShardEngineConfig"]
