"""Engines in another process or language, over the ``shardkit.v1`` gRPC service.

Needs the ``grpc`` extra (``pip install 'shardkit[grpc]'``). ``serve`` serves any
engine target; ``RemoteShardEngine`` (and the targets ``grpc://HOST:PORT`` and
``unix:PATH``) talks to any server of the service, whatever its language. The
service is defined in ``shardkit/proto/shard_engine.proto``.
"""

from __future__ import annotations

from shardkit._transport.client import DEFAULT_TIMEOUT_SECONDS as DEFAULT_TIMEOUT_SECONDS
from shardkit._transport.client import RemoteShardEngine as RemoteShardEngine
from shardkit._transport.client import close_connections as close_connections
from shardkit._transport.client import remote_target as remote_target
from shardkit._transport.codec import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from shardkit._transport.codec import PROTOCOL_VERSION as PROTOCOL_VERSION
from shardkit._transport.server import DEFAULT_MAX_ENGINES as DEFAULT_MAX_ENGINES
from shardkit._transport.server import EngineServer as EngineServer
from shardkit._transport.server import serve as serve
from shardkit.errors import RemoteDeadlineExceeded as RemoteDeadlineExceeded
from shardkit.errors import RemoteEngineCrashed as RemoteEngineCrashed
from shardkit.errors import RemoteEngineError as RemoteEngineError
from shardkit.errors import RemoteEngineEvicted as RemoteEngineEvicted
from shardkit.errors import RemoteProtocolError as RemoteProtocolError
from shardkit.errors import RemoteUnavailable as RemoteUnavailable
from shardkit.errors import WireFormatError as WireFormatError

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
