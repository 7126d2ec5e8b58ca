"""Generated gRPC stubs for contract v1 (``shard_engine.proto``, package ``shardkit.v1``).

The ``shard_engine_pb2*`` modules are generated and checked in; do not edit them.
Regenerate them from the repository root after changing the ``.proto`` file::

    pip install grpcio-tools==1.60.0
    python -m grpc_tools.protoc -I shardkit/proto --python_out=shardkit/proto \\
        --grpc_python_out=shardkit/proto --pyi_out=shardkit/proto shardkit/proto/shard_engine.proto
    sed -i 's/^import shard_engine_pb2 as/from . import shard_engine_pb2 as/' shardkit/proto/shard_engine_pb2_grpc.py

grpcio-tools 1.60.0 (protoc 25) is pinned for generation only: newer versions stamp a
minimum runtime version into the code, and the ``grpc`` extra promises ``grpcio>=1.60``
and ``protobuf>=4.25``; the code it generates runs on newer runtimes too. The ``sed``
makes the service module import its messages package-relatively.

This package imports nothing on purpose: a worker written without shardkit can load
the generated modules by file path (see ``tests/workers/standalone_worker.py``).
"""
