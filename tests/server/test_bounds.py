"""Everything a client sends or withholds is bounded: request ids, message sizes, the queue,
and a stream whose client stops reading."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.client.errors import ServerBusy, from_rpc_error
from kenspec.server.generate_params import MAX_REQUEST_ID
from tests.server.conftest import TIMEOUT


async def test_request_id_at_the_limit_is_echoed(start_server, collect, prompt_request) -> None:
    _, stub = await start_server()
    request = prompt_request(max_new_tokens=2)
    request.request_id = "id-" + "x~ " * ((MAX_REQUEST_ID - 3) // 3)
    request.request_id += "z" * (MAX_REQUEST_ID - len(request.request_id))
    responses = await collect(stub.Generate(request))
    assert {response.request_id for response in responses} == {request.request_id}


async def test_a_message_over_max_message_bytes_is_refused(
    start_server, collect, prompt_request
) -> None:
    _, stub = await start_server(max_message_bytes=4096)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(pb.GenerateRequest(prompt="word " * 1000)))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "4096" in error.value.details()  # gRPC names the limit
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=2)))
    assert responses[-1].usage.completion_tokens == 2


async def test_overload_is_refused_at_once_with_a_retry_hint_and_health_serving(
    start_server, held_passes, prompt_request
) -> None:
    server, stub = await start_server(max_concurrent_streams=1, max_queue=0)
    request = prompt_request(max_new_tokens=300)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    held_passes.allow(1)
    running = stub.Generate(request)
    await asyncio.wait_for(running.read(), TIMEOUT)  # holds the only slot; its next pass waits
    refused = stub.Generate(prompt_request(max_new_tokens=2))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(refused.read(), TIMEOUT)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry" in error.value.details()
    busy = from_rpc_error(error.value, "here")
    assert isinstance(busy, ServerBusy) and busy.retry_after_s == 1.0
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    await channel.close()
    running.cancel()
    held_passes.open()


async def test_a_stream_whose_client_stops_reading_is_cancelled_and_frees_its_slot(
    start_server, collect, prompt_request, tiny_target
) -> None:
    """The stalled client's window is a kilobyte, so the server's writes wait on it; after the
    stall timeout its stream ends (DEADLINE_EXCEEDED), and the one slot serves the next."""
    server, stub = await start_server(max_concurrent_streams=1, stream_stall_timeout_s=0.5)
    stalled_channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}",
        options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)],
    )
    request = prompt_request(max_new_tokens=390)
    request.speculation.mode = pb.SPECULATION_MODE_OFF  # one token a message: many messages
    stalled = pb_grpc.GeneratorStub(stalled_channel).Generate(request)
    await asyncio.wait_for(stalled.read(), TIMEOUT)  # it holds the only slot, then reads no more
    # This one queues for the slot and gets it once the stalled stream is cancelled.
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=3)))
    assert responses[-1].usage.completion_tokens == 3
    with pytest.raises(grpc.aio.AioRpcError) as error:
        while await asyncio.wait_for(stalled.read(), TIMEOUT) is not grpc.aio.EOF:
            pass
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "read nothing" in error.value.details()
    assert server.metrics.stalled_streams._value.get() == 1
    await stalled_channel.close()
