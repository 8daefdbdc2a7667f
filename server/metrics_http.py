"""/metrics over HTTP(S), bounded, behind the APIs' TLS and tokens.

prometheus_client's own server starts a thread per connection and reads with no timeout, so
idle or trickling clients pile up threads. This one is an asyncio server on one thread of its
own (its own loop: a scrape neither waits for the APIs' loop nor delays it, and a caller on
that loop may scrape synchronously): at most `max_connections` at once (more are closed as
they come), a request head read (and a TLS handshake) within `read_timeout_s`, one answer per
connection. With TLS it serves the server's certificate (and asks for a client certificate with
--tls-client-ca); with tokens, a scrape needs `Authorization: Bearer <token>` of
--auth-tokens-file, else 401.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kenspec.server.security import bearer_token, tls_context, token_allowed
from kenspec.server.settings import MetricsAuth, SecuritySettings

READ_TIMEOUT_S = 10.0  # for the handshake and the request head; a scrape sends both at once
MAX_CONNECTIONS = 16  # a scraper or two, and someone with curl
_MAX_HEAD_BYTES = 16 * 1024
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
}


@dataclass(frozen=True, slots=True)
class MetricsAccess:
    """What a scrape must bring: a token of `tokens` (none when empty), over TLS when `tls`."""

    tokens: tuple[bytes, ...] = ()
    tls: ssl.SSLContext | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


def metrics_access(security: SecuritySettings, tokens: tuple[bytes, ...]) -> MetricsAccess:
    """--metrics-auth resolved: 'auto' asks what the APIs ask (TLS with --tls-cert, a token
    of `tokens`, the APIs' --auth-tokens-file as the server read it); parse_settings checked
    that what it names is configured."""
    if security.metrics_auth == MetricsAuth.AUTO:
        parts = {"tls"} if security.tls_cert else set()
        parts |= {"token"} if security.authenticates else set()
    else:
        parts = set(security.metrics_auth.parts)
    tls = None
    if "tls" in parts:
        cert, key, client_ca = security.tls_cert, security.tls_key, security.tls_client_ca
        tls = tls_context(cert, key, client_ca, alpn="http/1.1")
    return MetricsAccess(tokens if "token" in parts else (), tls)


class MetricsEndpoint:
    def __init__(
        self,
        registry: CollectorRegistry,
        access: MetricsAccess,
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._registry = registry
        self._access = access
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on (host, port) from a thread of its own; port 0 picks a free one. Returns
        the bound port; raises OSError when it cannot listen."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="kenspec-metrics", daemon=True)
        thread.start()
        try:
            port = asyncio.run_coroutine_threadsafe(self._listen(host, port), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        self._loop, self._thread = loop, thread
        return port

    def close(self) -> None:
        """Stop listening, drop the connections open now and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shut(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        self._loop = self._thread = None

    async def _listen(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(
            self._connection,
            host,
            port,
            ssl=self._access.tls,
            ssl_handshake_timeout=self._read_timeout_s if self._access.tls else None,
            ssl_shutdown_timeout=self._read_timeout_s if self._access.tls else None,
            limit=_MAX_HEAD_BYTES,
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()  # not close(): no TLS goodbye to wait for
        for _ in range(100):  # their handlers see the loss and end before the loop stops
            if not self._open:
                break
            await asyncio.sleep(0.01)

    @property
    def connections(self) -> int:
        """Connections being read or answered now."""
        return len(self._open)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self._max_connections:
            writer.close()  # refused as it comes: the ones open hold their read timeout
            return
        self._open.add(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._read_timeout_s)
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), self._read_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # idle, trickling, oversized or gone: dropped, nothing to tell anyone
        finally:
            self._open.discard(writer)
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        request = lines[0].split(" ")
        if len(request) != 3 or not request[2].startswith("HTTP/1."):
            return _response(400, b"malformed request line\n")
        method, target, _ = request
        if method not in ("GET", "HEAD"):
            return _response(405, b"GET /metrics\n", {"Allow": "GET, HEAD"})
        if self._access.tokens and not self._authorized(lines[1:]):
            challenge = {"WWW-Authenticate": 'Bearer realm="kenspec metrics"'}
            return _response(401, b"send 'Authorization: Bearer <token>'\n", challenge)
        if target.partition("?")[0] != "/metrics":
            return _response(404, b"metrics are at /metrics\n")
        body = generate_latest(self._registry)
        headers = {"Content-Type": CONTENT_TYPE_LATEST}
        return _response(200, body, headers, head_only=method == "HEAD")

    def _authorized(self, header_lines: list[str]) -> bool:
        for line in header_lines:
            name, _, value = line.partition(":")
            if name.strip().lower() == "authorization":
                return token_allowed(bearer_token(value.strip()), self._access.tokens)
        return False


def _response(
    status: int, body: bytes, headers: dict[str, str] | None = None, *, head_only: bool = False
) -> bytes:
    fields = {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}
    fields |= {"Content-Length": str(len(body)), "Connection": "close"}
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}"] + [f"{k}: {v}" for k, v in fields.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body
