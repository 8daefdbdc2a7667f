"""What the gRPC front (server.grpc_front) costs a call: health Check round trips through the
front (TCP, relayed to grpc's Unix socket) against grpc.aio listening on TCP itself, as before
the front, and on the Unix socket directly. Then the issue's scale: connections holding a
preface fill the cap, and a new client's first Check is timed.

    .venv/bin/python -m bench.grpc_front --calls 200 --repeats 5

One process, one event loop for the servers and the client (as a sanity check, not a
benchmark of the network); medians over the repeats, the three set-ups alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kenspec.server.grpc_front import FrontLimits, GrpcFront

HOST = "127.0.0.1"
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes(3) + bytes([0x4, 0]) + bytes(4)


def health_server() -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    return server


async def sequential_checks(target: str, calls: int) -> float:
    """Microseconds per Check, `calls` one after another on one channel (connected first)."""
    async with grpc.aio.insecure_channel(target, options=[OWN_CONNECTION]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        await stub.Check(request, timeout=10)
        started = time.perf_counter()
        for _ in range(calls):
            await stub.Check(request, timeout=10)
        return (time.perf_counter() - started) / calls * 1e6


async def concurrent_checks(target: str, calls: int) -> float:
    """Microseconds per Check, `calls` at once on one channel (wall time / calls)."""
    async with grpc.aio.insecure_channel(target, options=[OWN_CONNECTION]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        await stub.Check(request, timeout=10)
        started = time.perf_counter()
        await asyncio.gather(*(stub.Check(request, timeout=30) for _ in range(calls)))
        return (time.perf_counter() - started) / calls * 1e6


async def overhead(calls: int, repeats: int) -> dict[str, dict[str, float]]:
    direct = health_server()
    direct_port = direct.add_insecure_port(f"{HOST}:0")
    relayed = health_server()
    front = GrpcFront(HOST, 0, FrontLimits())
    unix = front.backend_address()
    relayed.add_insecure_port(unix)
    await direct.start()
    await relayed.start()
    front_port = await front.start()
    targets = {
        "grpc_tcp": f"{HOST}:{direct_port}",
        "front_tcp": f"{HOST}:{front_port}",
        "grpc_unix": unix,
    }
    runs: dict[str, dict[str, list[float]]] = {
        name: {"sequential_us": [], "concurrent_us": []} for name in targets
    }
    try:
        for _ in range(repeats):
            for name, target in targets.items():
                runs[name]["sequential_us"].append(await sequential_checks(target, calls))
                runs[name]["concurrent_us"].append(await concurrent_checks(target, calls))
    finally:
        await direct.stop(0)
        await relayed.stop(0)
        await front.close()
    return {
        name: {kind: round(statistics.median(values), 1) for kind, values in kinds.items()}
        for name, kinds in runs.items()
    }


async def hold_idle(port: int) -> asyncio.StreamWriter:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(PREFACE + EMPTY_SETTINGS)
    await asyncio.wait_for(reader.readexactly(9), 10)  # the server's SETTINGS begin
    return writer


async def lockout(held: int, cap: int) -> dict[str, float]:
    """`held` connections hold a preface at cap `cap`; a new client's first Check."""
    server = health_server()
    front = GrpcFront(HOST, 0, FrontLimits(max_connections=cap))
    server.add_insecure_port(front.backend_address())
    await server.start()
    port = await front.start()
    writers: list[asyncio.StreamWriter] = []
    try:
        started = time.perf_counter()
        for _ in range(held):
            writers.append(await hold_idle(port))
        holding_s = time.perf_counter() - started
        async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=[OWN_CONNECTION]) as new:
            stub = health_pb2_grpc.HealthStub(new)  # its first call connects
            answered = await timed(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=10))
        return {
            "held": held,
            "cap": cap,
            "seconds_to_open_them": round(holding_s, 3),
            "new_client_answered_s": round(answered, 4),
            "evicted": front.evicted,
        }
    finally:
        for writer in writers:
            writer.close()
        await server.stop(0)
        await front.close()


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def main(calls: int, repeats: int, held: int) -> dict[str, object]:
    return {
        "calls": calls,
        "repeats": repeats,
        "overhead": await overhead(calls, repeats),
        "lockout": await lockout(held, 256),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_front", description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--held", type=int, default=300)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.calls, args.repeats, args.held)), indent=2))
