"""Generated protobuf and gRPC modules for the kenspec.v1 API.

Produced by ``scripts/gen_proto.sh`` from ``proto/kenspec/v1/generator.proto``; never edit the
``generator_pb2*`` files by hand. Typical use::

    from client.api import generator_pb2 as pb, generator_pb2_grpc as pb_grpc
"""

from __future__ import annotations

from . import generator_pb2, generator_pb2_grpc

__all__ = ["generator_pb2", "generator_pb2_grpc"]
