"""The gRPC server's connection bounds, over real connections on loopback: handshakes that
never come, a cap on connections, an idle limit, streams per connection, and keepalive
enforcement, plus the options they are set by.

Every channel here asks for a connection of its own (grpc otherwise shares one between
channels to the same target with the same arguments). Timeouts are a fraction of a second and
every wait for the server to act is bounded by BOUND, many times longer."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.channel import channel_spec
from kenspec_api import generator_pb2_grpc as pb_grpc
from server.lifecycle import grpc_options
from server.settings import Settings, parse_settings
from tests.server.conftest import TIMEOUT, until

BOUND = 20.0  # seconds; bounds a wait for a sub-second timeout to fire
HOST = "127.0.0.1"
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, MAX_CONCURRENT_STREAMS = 0x4, 0x3


def channel(server, *options: tuple[str, int]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"{HOST}:{server.port}", options=[OWN_CONNECTION, *options])


async def check(channel_: grpc.aio.Channel) -> None:
    request = health_pb2.HealthCheckRequest()
    await health_pb2_grpc.HealthStub(channel_).Check(request, timeout=TIMEOUT)


async def left_ready(channel_: grpc.aio.Channel) -> grpc.ChannelConnectivity:
    """Wait (within BOUND) for a connected channel to lose its connection; its new state."""
    assert channel_.get_state() == grpc.ChannelConnectivity.READY
    await asyncio.wait_for(channel_.wait_for_state_change(grpc.ChannelConnectivity.READY), BOUND)
    return channel_.get_state()


async def server_settings(port: int) -> dict[int, int]:
    """The HTTP/2 SETTINGS the server sends a new connection, read off the wire."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(PREFACE + bytes(3) + bytes([SETTINGS, 0]) + bytes(4))  # empty SETTINGS
    try:
        while True:
            head = await asyncio.wait_for(reader.readexactly(9), TIMEOUT)
            body = await asyncio.wait_for(reader.readexactly(int.from_bytes(head[:3])), TIMEOUT)
            if head[3] == SETTINGS and not head[4] & 1:  # (not an ACK)
                return dict(struct.unpack(">HI", body[i : i + 6]) for i in range(0, len(body), 6))
    finally:
        writer.close()


async def test_a_connection_that_never_sends_http2_settings_is_closed(start_server) -> None:
    server, _ = await start_server(grpc_handshake_timeout_s=0.5)
    reader, _ = await asyncio.open_connection(HOST, server.port)
    # Whatever the server wrote first (its SETTINGS, a GOAWAY), then the end: grpc's own
    # handshake timeout is 120 s.
    await asyncio.wait_for(reader.read(), BOUND)
    assert reader.at_eof()


async def test_connections_past_the_cap_are_refused_and_a_freed_place_is_reused(
    start_server,
) -> None:
    server, _ = await start_server(grpc_max_connections=2)
    first, second = channel(server), channel(server)
    await check(first)
    await check(second)
    third = channel(server)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await check(third)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    await first.close()
    for _ in range(int(TIMEOUT / 0.05)):  # until the server has seen the first one go
        try:
            await check(fourth := channel(server))
            break
        except grpc.aio.AioRpcError:
            await fourth.close()
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("no connection accepted after one closed")
    for open_ in (second, third, fourth):
        await open_.close()


async def test_an_idle_connection_is_closed_and_the_client_reconnects(start_server) -> None:
    server, _ = await start_server(grpc_idle_timeout_s=0.5)
    idle = channel(server)
    await check(idle)
    assert await left_ready(idle) == grpc.ChannelConnectivity.IDLE  # a GOAWAY, not a failure
    await check(idle)  # the next call connects again
    await idle.close()


async def test_a_connection_older_than_the_max_age_is_asked_to_go(start_server) -> None:
    server, _ = await start_server(grpc_max_connection_age_s=0.5)
    aged = channel(server)
    await check(aged)
    await left_ready(aged)
    await aged.close()


async def test_the_server_advertises_its_streams_per_connection(start_server) -> None:
    server, _ = await start_server(grpc_max_streams_per_connection=3)
    assert (await server_settings(server.port)).get(MAX_CONCURRENT_STREAMS) == 3


async def test_a_call_past_the_connection_stream_limit_waits_for_the_first_to_end(
    start_server, held_passes, prompt_request, collect
) -> None:
    server, _ = await start_server(grpc_max_streams_per_connection=1)
    shared, other = channel(server), channel(server)
    stub, other_stub = pb_grpc.GeneratorStub(shared), pb_grpc.GeneratorStub(other)
    first = asyncio.create_task(collect(stub.Generate(prompt_request(max_new_tokens=2))))
    await held_passes.arrival(1)  # the first holds the connection's one stream
    second = asyncio.create_task(collect(stub.Generate(prompt_request("Hello", max_new_tokens=2))))
    await asyncio.sleep(0.1)  # the second is sent first...
    third = asyncio.create_task(collect(other_stub.Generate(prompt_request(max_new_tokens=2))))
    scheduler = server.scheduler
    await until(lambda: scheduler.active + scheduler.waiting >= 2, "the third call admitted")
    await asyncio.sleep(0.2)
    assert scheduler.active + scheduler.waiting == 2  # ...but waits on the client's side
    held_passes.open()
    for call in (first, second, third):
        responses = await call
        assert responses[-1].usage.completion_tokens == 2
    await shared.close()
    await other.close()


async def test_a_client_pinging_an_idle_connection_gets_goaway(start_server) -> None:
    """(grpc's server defaults refuse these pings too; this pins that they stay refused.)"""
    server, _ = await start_server()
    quiet = channel(server)
    pinging = channel(
        server,
        ("grpc.keepalive_time_ms", 50),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )
    await check(quiet)
    await check(pinging)
    await left_ready(pinging)  # GOAWAY too_many_pings
    assert quiet.get_state() == grpc.ChannelConnectivity.READY
    await quiet.close()
    await pinging.close()


async def test_keepalive_pings_as_often_as_the_flag_allows_keep_a_call_alive(
    start_server, held_passes, prompt_request, collect
) -> None:
    """Pings every second during a call: grpc's default minimum of 5 minutes would end the
    connection at the fourth (too_many_pings); --grpc-min-ping-interval-s 0.2 allows them."""
    server, _ = await start_server(grpc_min_ping_interval_s=0.2)
    pinging = channel(
        server, ("grpc.keepalive_time_ms", 1000), ("grpc.http2.max_pings_without_data", 0)
    )
    call = asyncio.create_task(
        collect(pb_grpc.GeneratorStub(pinging).Generate(prompt_request(max_new_tokens=2)))
    )
    await held_passes.arrival(1)
    await asyncio.sleep(5.5)  # no data sent meanwhile: five pings
    held_passes.open()
    responses = await call
    assert responses[-1].usage.completion_tokens == 2
    await pinging.close()


def test_the_grpc_options_carry_the_flags() -> None:
    settings = Settings.of(grpc_idle_timeout_s=2.5, grpc_max_streams_per_connection=7)
    options = dict(grpc_options(settings.limits))
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.max_allowed_incoming_connections"] == 256
    assert options["grpc.server_handshake_timeout_ms"] == 10_000
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 60_000
    assert options["grpc.http2.max_ping_strikes"] == 2
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert "grpc.max_connection_age_ms" not in options  # off by default: streams may be long
    aged = dict(grpc_options(settings.replace(grpc_max_connection_age_s=60).limits))
    assert aged["grpc.max_connection_age_ms"] == 60_000


def test_the_bundled_client_never_pings_faster_than_the_server_allows() -> None:
    options = dict(channel_spec("127.0.0.1:1", None, None).options)
    keepalive_ms = options.get("grpc.keepalive_time_ms")  # (grpc's client default: no pings)
    assert keepalive_ms is None or keepalive_ms >= 1000 * Settings().limits.grpc_min_ping_interval_s
    assert not options.get("grpc.keepalive_permit_without_calls")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--http-max-connections", "0", "--http-max-connections must be at least 1, not 0"),
        ("--grpc-max-streams-per-connection", "0", "must be at least 1, not 0"),
        ("--http-header-timeout-s", "0", "--http-header-timeout-s must be above 0"),
        ("--grpc-idle-timeout-s", "nan", "--grpc-idle-timeout-s must be above 0"),
        ("--grpc-min-ping-interval-s", "inf", "and at most 1000000, not inf"),
        ("--grpc-max-connection-age-s", "-1", "must be 0 (no limit) to 1000000, not -1.0"),
    ],
)
def test_connection_flags_out_of_range_are_refused(flag, value, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings([flag, value], env={})
    assert message in capsys.readouterr().err
