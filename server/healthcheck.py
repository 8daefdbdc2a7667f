"""`python -m server.healthcheck [address]`: exit 0 when the gRPC health service says SERVING.

Used by the container HEALTHCHECK; needs no grpc_health_probe binary.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, timeout: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as error:
            print(f"unhealthy: {error.code().name}: {error.details()}", file=sys.stderr)
            return False
    serving = response.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(
            f"unhealthy: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}",
            file=sys.stderr,
        )
    return serving


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return 0 if check(args[0] if args else "127.0.0.1:50051") else 1


if __name__ == "__main__":
    sys.exit(main())
