"""Every gRPC Generate call is counted in kenspec_requests_total with the status it ended with,
however early it failed: while loading or draining, bytes that are not a request, a bad
request id. Tokenize and GetModelInfo are not generate calls, and are not counted there."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kenspec.api import generator_pb2 as pb

TIMEOUT = 60.0  # seconds; bounds waits that a passing run never reaches


def counted(server, code: str) -> float:  # type: ignore[no-untyped-def]
    labels = {"api": "grpc", "finish_reason": "none", "code": code}
    labels["model_name"] = server.metrics.model_name
    return server.metrics.registry.get_sample_value("kenspec_requests_total", labels) or 0.0


async def until_counted(server, code: str, count: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until `count` calls ended with `code` (the server counts a call once its status is
    sent: the client can see the status first)."""
    async with asyncio.timeout(TIMEOUT):
        while counted(server, code) < count:
            await asyncio.sleep(0.005)
    assert counted(server, code) == count


def total(server) -> float:  # type: ignore[no-untyped-def]
    return sum(
        sample.value
        for metric in server.metrics.registry.collect()
        if metric.name == "kenspec_requests"
        for sample in metric.samples
        if sample.name == "kenspec_requests_total"
    )


async def status_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    return raised.value.code()


async def test_a_call_refused_while_loading_or_draining_is_counted(start_server) -> None:
    server, stub = await start_server(load=False)
    request = pb.GenerateRequest(prompt="Hello")
    assert await status_of(stub.Generate(request, timeout=TIMEOUT)) == grpc.StatusCode.UNAVAILABLE
    await until_counted(server, "UNAVAILABLE", 1)
    await server.load()
    server.serving.draining = True
    assert await status_of(stub.Generate(request, timeout=TIMEOUT)) == grpc.StatusCode.UNAVAILABLE
    await until_counted(server, "UNAVAILABLE", 2)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff",  # not a message
        pb.GenerateRequest(prompt="Hello", request_id="r" * 129).SerializeToString(),
        pb.GenerateRequest(prompt="Hello", request_id="two\nlines").SerializeToString(),
    ],
    ids=["unparseable", "long-id", "unprintable-id"],
)
async def test_a_request_refused_before_parsing_is_counted(start_server, payload) -> None:
    server, _ = await start_server()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    raw = channel.unary_stream("/kenspec.v1.Generator/Generate")
    try:
        assert await status_of(raw(payload, timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
    await until_counted(server, "INVALID_ARGUMENT", 1)
    assert total(server) == 1


async def test_tokenize_and_model_info_are_not_generate_calls(start_server) -> None:
    server, stub = await start_server()
    await stub.Tokenize(pb.TokenizeRequest(prompt="Hello"), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Tokenize(pb.TokenizeRequest(), timeout=TIMEOUT)
    await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    # A Generate call after them is the first one counted (and a sync point: once it is
    # counted, anything the calls before it would have counted is too).
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in stub.Generate(pb.GenerateRequest(), timeout=TIMEOUT):
            pass
    await until_counted(server, "INVALID_ARGUMENT", 1)
    assert total(server) == 1
