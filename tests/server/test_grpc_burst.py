"""A burst of calls on one gRPC channel, past the streams a connection may hold: every call is
answered, OK or RESOURCE_EXHAUSTED with its retry pushback, never UNAVAILABLE (grpc refusing a
stream with REFUSED_STREAM): the front tells clients the flag's limit, grpc enforces twice it.

Each burst runs on the tiny model with two generating streams, so most calls find the
scheduler full; the calls a connection cannot hold yet wait on the client's side."""

from __future__ import annotations

import asyncio
import collections
import random
import struct

import grpc
import pytest

from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.grpc_front import _Frames
from kenspec.server.lifecycle import STREAM_HEADROOM, grpc_front_limits, grpc_options
from kenspec.server.service import RETRY_PUSHBACK_KEY
from kenspec.server.serving import RETRY_AFTER_MS
from kenspec.server.settings import Settings
from tests.server.conftest import TIMEOUT

BURST = 200
STREAMS = 16  # --grpc-max-streams-per-connection
OWN_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
SETTINGS, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 0x4, 0x3, 0x4


@pytest.mark.parametrize("max_queue", [0, 8])
async def test_a_burst_on_one_channel_waits_or_is_refused_with_a_retry_delay(
    start_server, prompt_request, collect, max_queue
) -> None:
    server, stub = await start_server(
        grpc_max_streams_per_connection=STREAMS, max_concurrent_streams=2, max_queue=max_queue
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=[OWN_CONNECTION])
    burst = pb_grpc.GeneratorStub(channel)

    async def call() -> str:
        try:
            await collect(burst.Generate(prompt_request(max_new_tokens=2), timeout=TIMEOUT))
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "retry after" in (error.details() or "")
                pushback = dict(error.trailing_metadata() or ())
                assert pushback.get(RETRY_PUSHBACK_KEY) == str(RETRY_AFTER_MS)
            return f"{error.code().name}: {error.details()}"
        return "OK"

    answers = collections.Counter(await asyncio.gather(*(call() for _ in range(BURST))))
    await channel.close()
    assert {answer.split(":")[0] for answer in answers} <= {"OK", "RESOURCE_EXHAUSTED"}, answers
    assert answers["OK"] >= 2 + max_queue
    responses = await collect(stub.Generate(prompt_request(max_new_tokens=2)))
    assert responses[-1].usage.completion_tokens == 2  # and the server serves on


def settings_frame(*pairs: tuple[int, int], flags: int = 0) -> bytes:
    payload = b"".join(struct.pack(">HI", key, value) for key, value in pairs)
    return struct.pack(">IBI", len(payload) << 8 | SETTINGS, flags, 0) + payload


def relayed(frames: _Frames, chunk: bytes) -> bytes:
    """What the front writes to the client for `chunk` (grpc_front._Connection.from_server)."""
    frames.feed(chunk)
    patched = bytearray(chunk)
    for offset, byte in frames.patches:
        patched[offset] = byte
    return bytes(patched)


def test_the_front_caps_the_stream_limit_grpc_advertises_however_the_bytes_are_split() -> None:
    """Every SETTINGS frame of grpc's: MAX_CONCURRENT_STREAMS above the cap becomes the cap, one
    below it stays, other settings and frames pass unchanged, whatever the chunking."""
    rng = random.Random(3)
    data = struct.pack(">IBI", 5 << 8 | 0x0, 0, 1) + b"hello"  # DATA, not a setting
    wire = [
        settings_frame((INITIAL_WINDOW_SIZE, 0x03030303), (MAX_CONCURRENT_STREAMS, 32)),
        data,
        settings_frame(flags=0x1),  # an ACK
        settings_frame((MAX_CONCURRENT_STREAMS, 0x0100_0010), (MAX_CONCURRENT_STREAMS, 9)),
        settings_frame((MAX_CONCURRENT_STREAMS, 0x0000_0110)),
    ]
    expected = [
        settings_frame((INITIAL_WINDOW_SIZE, 0x03030303), (MAX_CONCURRENT_STREAMS, STREAMS)),
        data,
        settings_frame(flags=0x1),
        settings_frame((MAX_CONCURRENT_STREAMS, STREAMS), (MAX_CONCURRENT_STREAMS, 9)),
        settings_frame((MAX_CONCURRENT_STREAMS, STREAMS)),
    ]
    whole = b"".join(wire)
    for _ in range(50):
        frames, out, at = _Frames(STREAMS), b"", 0
        while at < len(whole):
            step = rng.choice([1, 2, 3, 5, 7, 9, 11, 64])
            out += relayed(frames, whole[at : at + step])
            at += step
        assert out == b"".join(expected)
    assert relayed(_Frames(), whole) == whole  # (the client's direction: no cap)


def test_clients_are_told_the_flag_and_grpc_enforces_twice_it() -> None:
    limits = Settings.of(grpc_max_streams_per_connection=STREAMS).limits
    assert grpc_front_limits(limits).max_streams == STREAMS
    enforced = dict(grpc_options(limits))["grpc.max_concurrent_streams"]
    assert enforced == STREAMS * STREAM_HEADROOM and STREAM_HEADROOM >= 2
