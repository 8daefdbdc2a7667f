"""An in-process kenspec server on an ephemeral port, over the tiny model and a test ARPA draft."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from kenspec_api import generator_pb2_grpc as pb_grpc
from server.app import KenspecServer
from server.runtime import Runtime, load_runtime
from server.settings import Settings


@pytest.fixture(scope="session")
def base_settings(tiny_model_dir: Path, tiny_draft_path: Path) -> Settings:
    return Settings(
        model=str(tiny_model_dir),
        draft=str(tiny_draft_path),
        device="cpu",
        dtype="float32",
        port=0,
        metrics_port=-1,
        breaker_threshold=0.0,
        min_draft_prob=0.0,
        max_new_tokens_limit=400,
        default_max_new_tokens=32,
        grace_period_s=5.0,
    )


@pytest.fixture(scope="session")
def runtime(base_settings: Settings) -> Runtime:
    return load_runtime(base_settings)


@pytest.fixture
async def start_server(base_settings, runtime) -> AsyncIterator[Callable]:
    """start_server(**setting_overrides) -> (server, stub); every server is stopped afterwards."""
    servers: list[KenspecServer] = []
    channels: list[grpc.aio.Channel] = []

    async def start(load: bool = True, **overrides) -> tuple[KenspecServer, pb_grpc.GeneratorStub]:
        server = KenspecServer(replace(base_settings, **overrides), loader=lambda _: runtime)
        servers.append(server)
        await server.start()
        if load:
            await server.load()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        return server, pb_grpc.GeneratorStub(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)
