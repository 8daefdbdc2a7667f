"""The gRPC server's connection bounds, over real connections on loopback: handshakes that
never come, a cap on connections that closes the connection idle longest to make room (the
front, server.grpc_front), an idle limit, streams per connection, and keepalive enforcement,
plus the options they are set by.

Every channel here asks for a connection of its own (grpc otherwise shares one between
channels to the same target with the same arguments). Timeouts are a fraction of a second and
every wait for the server to act is bounded by BOUND, many times longer."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import struct
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.client.channel import channel_spec
from kenspec.server.grpc_front import FrontLimits, _Frames
from kenspec.server.lifecycle import grpc_front_limits, grpc_options
from kenspec.server.settings import Settings, parse_settings
from tests.server.conftest import TIMEOUT, until

BOUND = 20.0  # seconds; bounds a wait for a sub-second timeout to fire
HOST = "127.0.0.1"
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, MAX_CONCURRENT_STREAMS = 0x4, 0x3
EMPTY_SETTINGS = bytes(3) + bytes([SETTINGS, 0]) + bytes(4)
ANSWERED_WITHIN = 2.0  # seconds; a new client past the cap of idle connections is answered


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


async def read_settings(reader: asyncio.StreamReader) -> dict[int, int]:
    """The server's first HTTP/2 SETTINGS on a connection, read off the wire."""
    while True:
        head = await asyncio.wait_for(reader.readexactly(9), TIMEOUT)
        body = await asyncio.wait_for(reader.readexactly(int.from_bytes(head[:3])), TIMEOUT)
        if head[3] == SETTINGS and not head[4] & 1:  # (not an ACK)
            return dict(struct.unpack(">HI", body[i : i + 6]) for i in range(0, len(body), 6))


async def server_settings(port: int) -> dict[int, int]:
    """The HTTP/2 SETTINGS the server sends a new connection, read off the wire."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(PREFACE + EMPTY_SETTINGS)
    try:
        return await read_settings(reader)
    finally:
        writer.close()


Held = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def hold_idle(port: int) -> Held:
    """A connection that sends the preface and an empty SETTINGS frame, then nothing: once the
    server's SETTINGS are read, grpc holds it (unless it was closed at once)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(PREFACE + EMPTY_SETTINGS)
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        await read_settings(reader)
    return reader, writer


async def closed(reader: asyncio.StreamReader, within: float = BOUND) -> bool:
    """Whether the server closes the connection within `within` seconds (what it sent is
    read and dropped)."""
    try:
        await asyncio.wait_for(reader.read(), within)  # (to the end)
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def release(held: list[Held]) -> None:
    for _, writer in held:
        writer.close()


async def test_a_connection_that_never_sends_http2_settings_is_closed(start_server) -> None:
    server, _ = await start_server(grpc_handshake_timeout_s=0.5)
    reader, _ = await asyncio.open_connection(HOST, server.port)
    # The end (the front closes it: grpc never sees a connection before its client's
    # SETTINGS; grpc's own handshake timeout would be 120 s).
    await asyncio.wait_for(reader.read(), BOUND)
    assert reader.at_eof()


async def test_a_partial_preface_makes_room_at_the_cap_and_is_closed_after_the_handshake_timeout(
    start_server,
) -> None:
    """Connections that sent part of the preface are idle: at the cap the oldest is closed for
    a new client at once, and the others at the handshake timeout."""
    server, _ = await start_server(grpc_handshake_timeout_s=3.0, grpc_max_connections=3)
    opened = time.perf_counter()
    partial = []
    for _ in range(3):
        reader, writer = await asyncio.open_connection(HOST, server.port)
        writer.write(PREFACE[:10])
        partial.append((reader, writer))
    await until(lambda: len(server.front.connections) == 3, "three connections counted")
    newcomer = channel(server)
    await asyncio.wait_for(check(newcomer), ANSWERED_WITHIN)
    assert await closed(partial[0][0])
    assert time.perf_counter() - opened < 3.0  # made room: not timed out
    for reader, _ in partial[1:]:
        assert await closed(reader)
    assert time.perf_counter() - opened >= 3.0 - 0.1  # timed out
    await check(newcomer)
    await newcomer.close()
    release(partial)


async def test_an_idle_connection_that_ignores_the_goaway_is_closed(start_server) -> None:
    server, _ = await start_server(grpc_idle_timeout_s=0.5)
    reader, writer = await hold_idle(server.port)
    started = time.perf_counter()
    assert await closed(reader)
    assert time.perf_counter() - started >= 0.4
    writer.close()


async def test_with_tls_a_silent_connection_counts_until_the_handshake_timeout(
    start_server, pki
) -> None:
    """TLS ends at the front: a TCP connection that never sends its ClientHello counts against
    the cap, idle (so it makes room for a TLS client), and is closed at the handshake timeout."""
    server, _ = await start_server(
        tls_cert=str(pki["server_cert"]),
        tls_key=str(pki["server_key"]),
        grpc_max_connections=2,
        grpc_handshake_timeout_s=3.0,
    )
    opened = time.perf_counter()
    silent = [await asyncio.open_connection(HOST, server.port) for _ in range(2)]
    await until(lambda: len(server.front.connections) == 2, "two connections counted")
    credentials = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
    secure = grpc.aio.secure_channel(
        f"{HOST}:{server.port}",
        credentials,
        options=[OWN_CONNECTION, ("grpc.ssl_target_name_override", "localhost")],
    )
    await asyncio.wait_for(check(secure), ANSWERED_WITHIN)
    assert await closed(silent[0][0])
    assert time.perf_counter() - opened < 3.0  # made room: not timed out
    assert await closed(silent[1][0])
    assert time.perf_counter() - opened >= 3.0 - 0.1  # timed out
    await check(secure)
    await secure.close()
    release(silent)


async def test_past_the_cap_the_connection_idle_longest_makes_room(start_server) -> None:
    """Connections that sent the preface and their SETTINGS, then nothing, fill the cap: a new
    client is answered at once all the same, as the one idle longest is closed for it (grpc
    core alone holds them all until the idle timeout and refuses the new one)."""
    server, _ = await start_server(grpc_max_connections=8)
    held = [await hold_idle(server.port) for _ in range(8)]
    newcomer = channel(server)
    await asyncio.wait_for(check(newcomer), ANSWERED_WITHIN)
    assert await closed(held[0][0])  # the oldest
    still_open = await asyncio.gather(*(closed(reader, 0.2) for reader, _ in held[1:]))
    assert not any(still_open)
    assert (server.front.evicted, server.front.refused) == (1, 0)
    assert len(server.front.connections) == 8
    await check(newcomer)  # its connection stays, idle now itself
    await newcomer.close()
    release(held)


async def test_an_evicted_client_reconnects_on_its_next_call(start_server) -> None:
    """Eviction sends a GOAWAY first: the client's channel goes IDLE, not into failure, and its
    next call connects again (making room in turn)."""
    server, _ = await start_server(grpc_max_connections=1)
    first, second = channel(server), channel(server)
    await check(first)
    await check(second)  # first evicted
    await until(lambda: first.get_state() != grpc.ChannelConnectivity.READY, "first evicted")
    assert first.get_state() == grpc.ChannelConnectivity.IDLE  # a GOAWAY, not a failure
    await check(first)  # second evicted
    await until(lambda: second.get_state() != grpc.ChannelConnectivity.READY, "second evicted")
    assert second.get_state() == grpc.ChannelConnectivity.IDLE
    assert server.front.evicted == 2
    await first.close()
    await second.close()


async def test_300_idle_connections_do_not_lock_out_a_new_client(start_server) -> None:
    """The issue's scale: 300 connections holding a preface at the default cap (256)."""
    server, _ = await start_server()
    assert server.settings.limits.grpc_max_connections == 256
    held = [await hold_idle(server.port) for _ in range(300)]
    newcomer = channel(server)
    started = time.perf_counter()
    await asyncio.wait_for(check(newcomer), ANSWERED_WITHIN)
    answered_s = time.perf_counter() - started
    assert answered_s < ANSWERED_WITHIN
    assert len(server.front.connections) == 256
    assert server.front.evicted == 300 + 1 - 256
    await newcomer.close()
    release(held)


async def test_a_connection_with_a_call_open_is_never_evicted(
    start_server, held_passes, prompt_request, collect
) -> None:
    """At the cap, an idle connection is closed for a new one, not one with a call open; with
    every connection busy, a new one is refused at once (UNAVAILABLE)."""
    server, _ = await start_server(grpc_max_connections=2)
    busy = channel(server)
    first = asyncio.create_task(
        collect(pb_grpc.GeneratorStub(busy).Generate(prompt_request(max_new_tokens=2)))
    )
    await held_passes.arrival(1)  # its call is open, its pass held at the gate
    idle = [await hold_idle(server.port)]
    other = channel(server)  # the idle one makes room, though the busy one is older
    second = asyncio.create_task(
        collect(pb_grpc.GeneratorStub(other).Generate(prompt_request("Hello", max_new_tokens=2)))
    )
    assert await closed(idle[0][0])
    scheduler = server.scheduler
    await until(lambda: scheduler.active + scheduler.waiting == 2, "the second call admitted")
    refused = channel(server)  # both connections have a call open
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await asyncio.wait_for(check(refused), BOUND)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.front.evicted == 1 and server.front.refused >= 1
    held_passes.open()
    for call in (first, second):
        responses = await call
        assert responses[-1].usage.completion_tokens == 2
    replacement = channel(server)  # both idle again: one of them makes room
    await asyncio.wait_for(check(replacement), ANSWERED_WITHIN)
    for open_ in (busy, other, refused, replacement):
        await open_.close()
    release(idle)


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


async def test_150_concurrent_calls_on_one_channel_are_queued_or_refused_never_unavailable(
    start_server, held_passes, prompt_request, collect
) -> None:
    """One channel, 150 Generate calls at once: the scheduler runs 8, queues 32 and answers the
    rest RESOURCE_EXHAUSTED with its retry message; none is UNAVAILABLE (REFUSED_STREAM, which
    grpc's stream limit per connection answered past 100)."""
    server, _ = await start_server()
    shared = channel(server)
    stub = pb_grpc.GeneratorStub(shared)

    async def call() -> str:
        try:
            await collect(stub.Generate(prompt_request(max_new_tokens=2)))
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "retry after" in (error.details() or "")
            return error.code().name
        return "OK"

    calls = [asyncio.create_task(call()) for _ in range(150)]
    limits = server.settings.limits
    admitted = limits.max_concurrent_streams + limits.max_queue
    await until(lambda: sum(c.done() for c in calls) >= 150 - admitted, "the rest answered")
    held_passes.open()
    codes = collections.Counter(await asyncio.gather(*calls))
    assert codes == {"OK": admitted, "RESOURCE_EXHAUSTED": 150 - admitted}, codes
    await shared.close()


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


def test_the_front_reads_the_same_frame_heads_however_the_bytes_are_split() -> None:
    """Heads split between chunks, payloads longer than a chunk, many frames in one: the
    front's scanner reports every frame but plain DATA, in order, whatever the chunking."""
    rng = random.Random(7)
    frames, expected = [], []
    for stream in range(1, 400, 2):
        kind, flags = rng.choice([(0x1, 0x4), (0x0, 0x0), (0x0, 0x1), (0x1, 0x5), (0x3, 0x0)])
        payload = bytes(rng.choice([0, 1, 8, 9, 100, 20_000]))
        frames.append(struct.pack(">IBI", len(payload) << 8 | kind, flags, stream) + payload)
        if kind != 0x0 or flags & 0x1:
            expected.append((kind, flags, stream))
    wire = b"".join(frames)
    for _ in range(20):
        scanner, seen, at = _Frames(), [], 0
        while at < len(wire):
            step = rng.choice([1, 2, 5, 9, 10, 64, 4096, 70_000])
            seen += scanner.feed(wire[at : at + step])
            at += step
        assert seen == expected
        assert scanner.count == len(frames) and scanner.at_boundary()


def test_the_grpc_options_carry_the_flags() -> None:
    settings = Settings.of(grpc_idle_timeout_s=2.5, grpc_max_streams_per_connection=7)
    options = dict(grpc_options(settings.limits))
    assert options["grpc.max_connection_idle_ms"] == 2500
    assert options["grpc.max_concurrent_streams"] == 14  # 7 told to clients; twice it enforced
    assert "grpc.max_allowed_incoming_connections" not in options  # the front's, evicting
    assert grpc_front_limits(settings.limits) == FrontLimits(
        max_connections=256, handshake_timeout_s=10.0, idle_timeout_s=2.5, max_streams=7
    )
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
