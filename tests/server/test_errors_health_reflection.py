"""Invalid input gets INVALID_ARGUMENT and the server keeps serving; health; reflection."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from structlog.testing import capture_logs

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.settings import Settings


def chat(*messages: tuple[str, str]) -> pb.Messages:
    return pb.Messages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


INVALID = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(messages=pb.Messages()), "messages"),
    (pb.GenerateRequest(messages=chat(("wizard", "hi"))), "messages[0].role"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(temperature=-1)), "temperature"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(top_p=1.5)), "top_p"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(top_p=-0.2)), "top_p"),
    (
        pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(temperature=float("nan"))),
        "NaN",
    ),
    (pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=100000)), "400"),
    (pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop=[""])), "stop[0]"),
    (pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop=["a"] * 65)), "stop"),
    (pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop=["a" * 129])), "stop[0]"),
    (
        pb.GenerateRequest(prompt="x", speculation=pb.SpeculationParameters(num_draft_tokens=65)),
        "num_draft_tokens",
    ),
    (pb.GenerateRequest(prompt="x", speculation=pb.SpeculationParameters(mode=7)), "mode"),
    (pb.GenerateRequest(prompt="x", request_id="r" * 100_000), "request_id"),
    (pb.GenerateRequest(prompt="x", request_id="r" * 129), "request_id"),
    (pb.GenerateRequest(prompt="x", request_id="two\nlines"), "request_id"),
    (pb.GenerateRequest(prompt="x", request_id="caf\u00e9"), "request_id"),
    (pb.GenerateRequest(prompt="word " * 600), "prompt"),  # longer than the 512-token context
    (
        pb.GenerateRequest(prompt="word " * 200, stopping=pb.StoppingCriteria(max_new_tokens=390)),
        "max_new_tokens",  # prompt + max_new_tokens beyond the context
    ),
]


@pytest.mark.parametrize(("request_", "named"), INVALID)
async def test_invalid_input_is_invalid_argument_naming_the_field(
    start_server, request_, named, collect, prompt_request
) -> None:
    _, stub = await start_server()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(request_))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in error.value.details()
    assert "Traceback" not in error.value.details()
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=3)))
    assert responses[-1].usage.completion_tokens == 3


async def test_tokenize_invalid_input(start_server) -> None:
    _, stub = await start_server()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Tokenize(pb.TokenizeRequest())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unexpected_error_is_internal_with_request_id(
    start_server, monkeypatch, collect
) -> None:
    server, stub = await start_server()

    def broken_round(self, row, emitted, path):
        raise RuntimeError("secret internals")

    monkeypatch.setattr("kenspec.server.engine.generation.Generation.accept", broken_round)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(pb.GenerateRequest(prompt="x", request_id="rid-7")))
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "rid-7" in error.value.details() and "secret" not in error.value.details()
    assert server.scheduler.active == 0


async def test_a_request_refused_mid_answer_is_invalid_and_logged_without_a_traceback(
    start_server, monkeypatch, collect
) -> None:
    """Its own grammar leading nowhere (a limit reached further on): the caller's 400, an
    info line, not an error with a traceback."""
    server, stub = await start_server()

    def nowhere(self, *round_):
        raise InvalidParameter("response_format", "the grammar allows no token here")

    monkeypatch.setattr("kenspec.server.engine.generation.Generation.accept", nowhere)
    with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(pb.GenerateRequest(prompt="x", request_id="rid-8")))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the grammar allows no token here" in error.value.details()
    refused = [line for line in logs if line["event"] == "request_refused_mid_answer"]
    assert refused and refused[0]["log_level"] == "info" and "exc_info" not in refused[0]
    assert not [line for line in logs if line["log_level"] == "error"]
    assert server.scheduler.active == 0


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return response.status


async def test_health_not_serving_while_loading_then_serving_then_draining(
    base_settings, runtime, serve_loaded
) -> None:
    release = threading.Event()
    server = KenspecServer(base_settings, loader=serve_loaded(runtime, gate=release))
    await server.start()
    loading = asyncio.create_task(server.load())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = pb.DESCRIPTOR.services_by_name["Generator"]
            assert stub.full_name == "kenspec.v1.Generator"
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await pb_grpc.GeneratorStub(channel).GetModelInfo(pb.GetModelInfoRequest())
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            release.set()
            await asyncio.wait_for(loading, 30)
            assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
            assert (
                await health_status(channel, "kenspec.v1.Generator")
                == health_pb2.HealthCheckResponse.SERVING
            )
            await server.health.enter_graceful_shutdown()
            assert await health_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        release.set()  # a failed check must not leave the loader waiting
        await server.stop(0)


async def test_health_answers_while_generating(start_server, held_passes, prompt_request) -> None:
    """Health is answered on the event loop, never behind the engine: here the engine is held
    inside a pass that does not end until the check has been answered."""
    server, stub = await start_server()
    request = prompt_request(max_new_tokens=300)
    request.speculation.mode = pb.SPECULATION_MODE_OFF
    held_passes.allow(1)
    call = stub.Generate(request)
    await asyncio.wait_for(call.read(), 30)
    await held_passes.arrival(2)  # the engine thread is in the stream's second pass
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        assert await health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert len(held_passes.arrived) == 2  # the engine is still inside that pass
    call.cancel()


def test_reflection_lists_services_and_resolves_types(serve_loaded) -> None:
    """What grpcurl relies on, through grpc_reflection's descriptor-database client (v1alpha)."""
    # The descriptor database is a synchronous client: run the server in its own loop thread.
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder = {}

    async def serve():
        settings = Settings.of(grpc_port=0, draft="none", metrics_port=-1)
        server = KenspecServer(settings, loader=serve_loaded(None))  # never loaded
        holder["done"] = asyncio.Event()
        holder["port"] = await server.start()
        ready.set()
        await holder["done"].wait()
        await server.stop(0)

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()))
    thread.start()
    try:
        assert ready.wait(10)
        with grpc.insecure_channel(f"127.0.0.1:{holder['port']}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            assert {"kenspec.v1.Generator", "grpc.health.v1.Health"} <= services
            assert "grpc.reflection.v1alpha.ServerReflection" in services
            assert "grpc.reflection.v1.ServerReflection" in services
            pool = DescriptorPool(database)
            service = pool.FindServiceByName("kenspec.v1.Generator")
            generate = service.methods_by_name["Generate"]
            assert generate.server_streaming
            assert generate.input_type.full_name == "kenspec.v1.GenerateRequest"
            response = pool.FindMessageTypeByName("kenspec.v1.GenerateResponse")
            assert "token_ids" in response.fields_by_name
            assert pool.FindMessageTypeByName("kenspec.v1.ModelInfo").fields_by_name["breaker"]
            # v1 (asked first by current grpcurl): the same messages under the v1 service name.
            v1 = channel.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            answers = list(v1(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
            names = {s.name for s in answers[0].list_services_response.service}
            assert "kenspec.v1.Generator" in names
    finally:
        if "done" in holder:
            loop.call_soon_threadsafe(holder["done"].set)
        thread.join(10)
        loop.close()


async def test_container_healthcheck_command(start_server) -> None:
    from kenspec.server import healthcheck

    server, _ = await start_server()
    assert await asyncio.to_thread(healthcheck.main, [f"127.0.0.1:{server.port}"]) == 0
    await server.health.enter_graceful_shutdown()
    assert await asyncio.to_thread(healthcheck.main, [f"127.0.0.1:{server.port}"]) == 1
    assert await asyncio.to_thread(healthcheck.check, "127.0.0.1:1", 1.0) is False


async def test_chat_without_a_template_is_invalid_argument(
    start_server, runtime, monkeypatch, collect
) -> None:
    """Generate and Tokenize share one encoder: a chat to a model without a chat template is
    the caller's error on both."""
    _, stub = await start_server()
    monkeypatch.setattr(runtime.engine.target.tokenizer, "chat_template", None)
    messages = chat(("user", "hi"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.Tokenize(pb.TokenizeRequest(messages=messages))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat template" in error.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub.Generate(pb.GenerateRequest(messages=messages)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
