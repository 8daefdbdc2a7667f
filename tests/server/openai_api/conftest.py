"""The HTTP API's fixture: a server with gRPC and HTTP on free ports."""

from __future__ import annotations

import pytest


@pytest.fixture
async def http_server(start_server):
    """start(**overrides) -> (server, stub, base_url) with the HTTP API on a free port."""

    async def start(**overrides):
        server, stub = await start_server(port=0, **overrides)
        scheme = "https" if overrides.get("tls_cert") else "http"
        return server, stub, f"{scheme}://localhost:{server.http_port}"

    return start
