"""The kenspec.v1 API, shared by server and client.

- ``generator_pb2`` / ``generator_pb2_grpc``: the protobuf and gRPC modules, produced by
  ``scripts/gen_proto.sh`` from ``proto/kenspec/v1/generator.proto`` (never edit them by hand);
- ``outputs``: what a round reports (modes, breaker states, finish reasons, usage) as plain
  Python, which the engine produces and the client reads;
- ``convert``: the one mapping between ``outputs`` and the protobuf enums.

Typical use::

    from kenspec.api import generator_pb2 as pb, generator_pb2_grpc as pb_grpc

Importing the package imports nothing else, so the engine can use ``outputs`` without gRPC.
"""
