"""Engines in another process or language, over the ``shardkit.v1`` gRPC service.

Needs the ``grpc`` extra (``pip install 'shardkit[grpc]'``). ``serve`` serves any
engine target; ``RemoteShardEngine`` (and the targets ``grpc://HOST:PORT`` and
``unix:PATH``) talks to any server of the service, whatever its language. The
service is defined in ``shardkit/proto/shard_engine.proto``.
"""

from __future__ import annotations

from .client import DEFAULT_TIMEOUT_SECONDS as DEFAULT_TIMEOUT_SECONDS
from .client import RemoteDeadlineExceeded as RemoteDeadlineExceeded
from .client import RemoteEngineCrashed as RemoteEngineCrashed
from .client import RemoteEngineError as RemoteEngineError
from .client import RemoteEngineEvicted as RemoteEngineEvicted
from .client import RemoteProtocolError as RemoteProtocolError
from .client import RemoteShardEngine as RemoteShardEngine
from .client import RemoteUnavailable as RemoteUnavailable
from .client import close_connections as close_connections
from .client import remote_target as remote_target
from .codec import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from .codec import PROTOCOL_VERSION as PROTOCOL_VERSION
from .codec import WireFormatError as WireFormatError
from .server import DEFAULT_MAX_ENGINES as DEFAULT_MAX_ENGINES
from .server import EngineServer as EngineServer
from .server import serve as serve

__all__ = [
    "DEFAULT_MAX_ENGINES",
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "EngineServer",
    "RemoteDeadlineExceeded",
    "RemoteEngineCrashed",
    "RemoteEngineError",
    "RemoteEngineEvicted",
    "RemoteProtocolError",
    "RemoteShardEngine",
    "RemoteUnavailable",
    "WireFormatError",
    "close_connections",
    "remote_target",
    "serve",
]
