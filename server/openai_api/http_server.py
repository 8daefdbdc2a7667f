"""uvicorn, serving the HTTP API on the gRPC server's own event loop.

One loop for both APIs: the HTTP routes call the same Serving (scheduler, batch, metrics) as
the gRPC servicer, with no second copy of the engine and no thread hop. The process owns its
signals (a SIGTERM drains both APIs), so uvicorn's own signal capture is switched off.

Connections are bounded (server.openai_api.connections): uvicorn runs kenspec's subclass of
its h11 protocol, whatever else is installed, and listens with TLS handshakes bounded by the
header timeout (uvicorn leaves asyncio's 60 s), so a connection that never finishes one cannot
hold its descriptor longer than one that never sends its headers.

Stopping (after the drain, server.lifecycle): the listener closes, idle connections close, open
requests get the stop's grace to finish, then every connection left (lingering ones too) is
closed by this server, before uvicorn's own deadline would cancel requests with an error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import Callable, Iterator

import uvicorn
from starlette.types import ASGIApp

from kenspec.server.openai_api.connections import (
    DEFAULT_LIMITS,
    BoundedH11Protocol,
    ConnectionLimits,
    RequestCap,
)
from kenspec.server.security import listening_socket

# After the stop's grace has closed every connection, how long uvicorn may still wait for the
# requests on them to end (each sees its disconnect at once) before cancelling them itself.
_UVICORN_MARGIN_S = 5.0


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits) -> None:
        super().__init__(config)
        self._limits = limits

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # kenspec's __main__ handles SIGTERM/SIGINT and stops this server itself

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup for given sockets and no lifespan, with the TLS timeouts set."""
        config, loop = self.config, asyncio.get_running_loop()

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=_loop,
            )

        tls = {}
        if config.ssl is not None:  # (asyncio refuses these timeouts without TLS)
            timeout = self._limits.header_timeout_s
            tls = {"ssl_handshake_timeout": timeout, "ssl_shutdown_timeout": timeout}
        self.servers = [
            await loop.create_server(
                create_protocol, sock=sock, ssl=config.ssl, backlog=config.backlog, **tls
            )
            for sock in sockets or ()
        ]
        self.started = True


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        *,
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
        limits: ConnectionLimits = DEFAULT_LIMITS,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self._host, self._port = host, port
        self.requests = RequestCap(app, limits.max_requests, on_refused)
        self._lingering: set[BoundedH11Protocol] = set()  # closed, reading what still comes
        protocol = functools.partial(BoundedH11Protocol, limits=limits, lingering=self._lingering)
        self._config = uvicorn.Config(
            self.requests,
            http=protocol,  # type: ignore[arg-type]
            ws="none",  # no WebSocket routes: no upgrades to parse
            timeout_keep_alive=limits.keepalive_timeout_s,  # type: ignore[arg-type]
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
            ssl_ca_certs=tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(self._config, limits)
        self._task: asyncio.Task | None = None
        self.port = 0

    @property
    def connections(self) -> int:
        """HTTP connections open now (TLS handshakes under way not counted)."""
        return len(self._server.server_state.connections)

    async def start(self) -> int:
        """Listen; returns the bound port (port 0 picks a free one)."""
        sock = listening_socket(self._host, self._port, "HTTP")
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # it failed to start (a bad certificate, say)
                self._task.result()
                raise OSError(f"the HTTP server on port {self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop listening, give open requests `grace_s` to finish, then close their
        connections (a request then sees its client gone and ends)."""
        if self._task is None:
            return
        self._config.timeout_graceful_shutdown = grace_s + _UVICORN_MARGIN_S
        self._server.should_exit = True
        closing = asyncio.get_running_loop().call_later(grace_s, self._close_connections)
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        finally:
            closing.cancel()
            self._close_connections()  # lingering ones, which uvicorn does not wait for
        self._task = None

    def _close_connections(self) -> None:
        for connection in [*self._server.server_state.connections, *self._lingering]:
            if isinstance(connection, BoundedH11Protocol):
                connection.abort()
