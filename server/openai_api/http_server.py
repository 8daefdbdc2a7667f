"""uvicorn, serving the HTTP API on the gRPC server's own event loop.

One loop for both APIs: the HTTP routes call the same Serving (scheduler, batch, metrics) as
the gRPC servicer, with no second copy of the engine and no thread hop. The process owns its
signals (a SIGTERM drains both APIs), so uvicorn's own signal capture is switched off.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # kenspec's __main__ handles SIGTERM/SIGINT and stops this server itself


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
    ) -> None:
        self._host, self._port = host, port
        self._config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
            ssl_ca_certs=tls_client_ca or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_client_ca else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(self._config)
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> int:
        """Listen; returns the bound port (port 0 picks a free one)."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as error:
            sock.close()
            raise OSError(f"cannot listen on {self._host}:{self._port} (HTTP): {error}") from None
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
        """Stop listening, give open requests `grace_s` to finish, then close them."""
        if self._task is None:
            return
        # (uvicorn reads 0 as "no time at all", and says so in an error line even when idle)
        self._config.timeout_graceful_shutdown = max(grace_s, 0.1)
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
