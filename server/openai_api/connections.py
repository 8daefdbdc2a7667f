"""Bounds on the HTTP API's connections: how many, how long a request's headers may take, how
many requests are in flight.

uvicorn alone bounds none of these. Its `limit_concurrency` counts idle connections too and only
answers 503 to the next *request*, so connections that never send one would fill it and lock out
every real client; and its keep-alive timer stops at a connection's first byte, so headers
trickled a byte at a time hold a connection for as long as the client likes. Hence a subclass of
its h11 protocol:

- a timer from the connection's opening, and again from each response, that closes the
  connection unless a request's complete headers arrive in time (a 408 first when some of them
  did: a client that sent nothing may be about to reuse the connection, and would read an
  unasked-for 408 as its answer);
- past the connection cap, the connection idle longest (waiting for headers, no request in
  flight) is closed to make room, as nginx does with idle keep-alive connections; with none
  idle, the new one gets 503 and is closed. Idle connections therefore cannot lock out a client
  that sends its request at once;
- a lingering close, as nginx's: a connection closed while the client may still be sending
  (a 413 or 408 with the body unread, a 429 or a draining 503 before it, the 503 past the
  cap, a 408 on half-sent headers) first has its write side shut (FIN after the response),
  then what still comes is read and thrown away until the client closes, for at most
  LINGER_S and LINGER_BYTES. Closed at once, with unread bytes in the kernel's buffer or
  more arriving, the socket sends a reset instead of a FIN, and a reset makes the client's
  kernel drop the response it has not read yet: the client sees "connection reset" instead
  of the status that says why. Lingering connections no longer count as open (nor against
  the cap); at most `max_connections` of them at once, beyond that one closes at once.

Requests in flight are capped by `RequestCap`, an ASGI wrapper, before the route reads a body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kenspec.server.openai_api.responses import error_body


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 256
    max_requests: int = 128
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 5.0


DEFAULT_LIMITS = ConnectionLimits()
LINGER_S = 3.0  # a lingering close reads what still comes at most this long,
LINGER_BYTES = 8 << 20  # and at most this much


def raw_response(status: int, reason: str, message: str, *headers: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, written past h11 (which has no
    request to answer yet)."""
    body = json.dumps(error_body(status, message)).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _LingeringTransport:
    """A connection's transport as uvicorn's protocol and request cycles hold it: the same,
    but its close() is the protocol's, which lingers when the client may still be sending."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a connection cap and a lingering close
    (see the module doc)."""

    def __init__(
        self,
        *args: object,
        limits: ConnectionLimits,
        lingering: set[BoundedH11Protocol] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._limits = limits
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the request cycle before the one awaited
        self.idle_since: float | None = None  # loop time it began to wait for headers
        self._socket: asyncio.Transport | None = None  # the transport itself
        self._lingering_set = lingering if lingering is not None else set()  # the server's
        self.lingering = False
        self._lingered = 0  # bytes read and thrown away while lingering
        self._linger_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        assert isinstance(transport, asyncio.Transport)
        self._socket = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._await_headers(self._limits.header_timeout_s)
        if len(self.connections) > self._limits.max_connections and not self._evict_idle():
            self._stop_waiting()
            limit = self._limits.max_connections
            self.transport.write(
                raw_response(
                    503,
                    "Service Unavailable",
                    f"server busy: {limit} HTTP connections open with a request in flight "
                    "(--http-max-connections); retry after the Retry-After delay",
                    "retry-after: 1",
                )
            )
            self.close_lingering(always=True)  # its request is likely on its way

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # thrown away: the response is out, the connection is closing
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES:
                self.abort()
            return
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._waiting_after:
            self._stop_waiting()  # a request's headers are complete: its route takes over

    def close_lingering(self, *, always: bool = False) -> None:
        """Close the connection: at once if the client has sent all it meant to, else (or
        `always`) after a lingering wait (see the module doc)."""
        socket = self._socket
        assert socket is not None
        if self.lingering or socket.is_closing():
            socket.close()
            return
        unread = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        room = len(self._lingering_set) < self._limits.max_connections
        if not (always or unread or self.flow.read_paused) or not room:
            socket.close()
            return
        self._stop_waiting()
        self._unset_keepalive_if_required()
        self.lingering = True
        self.connections.discard(self)  # no longer open, for the cap and the server's stop
        self._lingering_set.add(self)
        if socket.can_write_eof():  # (not with TLS: there the client reads to the length)
            socket.write_eof()  # after what is buffered: the client reads the response, then EOF
        socket.resume_reading()
        # The client's EOF closes the transport (eof_received returns None); else, this.
        self._linger_timer = self.loop.call_later(LINGER_S, self.abort)

    def abort(self) -> None:
        """Close at once, lingering or not (what is unsent is lost)."""
        if self._socket is not None:
            self._socket.abort()

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # (may start a pipelined request already received)
        if not self.transport.is_closing() and self.cycle is finished:
            # The next request's headers: within the header timeout of this response, or the
            # keep-alive timeout if longer (uvicorn's own timer closes a silent connection then).
            limits = self._limits
            self._await_headers(max(limits.header_timeout_s, limits.keepalive_timeout_s))

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._lingering_set.discard(self)
        super().connection_lost(exc)

    def _await_headers(self, timeout_s: float) -> None:
        self._stop_waiting()
        self._waiting_after = self.cycle
        self.idle_since = self.loop.time()
        self._header_timer = self.loop.call_later(timeout_s, self._headers_timed_out)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.idle_since = None

    def _headers_timed_out(self) -> None:
        self._header_timer, self.idle_since = None, None
        if self.transport.is_closing():
            return
        # Part of a request's headers buffered (not the rest of an earlier request's body).
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            message = (
                f"request headers not complete within {self._limits.header_timeout_s:g} s "
                "(--http-header-timeout-s)"
            )
            self.transport.write(raw_response(408, "Request Timeout", message))
        self.transport.close()

    def _evict_idle(self) -> bool:
        """Close the connection that has waited longest for a request; False if none waits."""
        idle = [
            connection
            for connection in self.connections
            if connection is not self
            and getattr(connection, "idle_since", None) is not None
            and not connection.transport.is_closing()  # (closed by uvicorn's keep-alive timer)
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda connection: connection.idle_since)  # type: ignore[union-attr]
        oldest.close_idle()  # type: ignore[union-attr]
        return True

    def close_idle(self) -> None:
        self._stop_waiting()
        self.transport.close()


class RequestCap:
    """At most `limit` HTTP requests in the app at once; beyond it 429 before the body is read.

    The refusal closes its connection (with a lingering close: the unread body is read and
    thrown away, within bounds, not parsed); `on_refused` hears the path of each request
    refused."""

    def __init__(
        self, app: ASGIApp, limit: int, on_refused: Callable[[str], None] | None = None
    ) -> None:
        self.app, self.limit, self.in_flight = app, limit, 0
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            if self.on_refused is not None:
                self.on_refused(scope["path"])
            await self._refuse(send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _refuse(self, send: Send) -> None:
        message = (
            f"server busy: {self.limit} HTTP requests in flight (--http-max-requests); retry "
            "after the Retry-After delay, or on another replica"
        )
        body = json.dumps(error_body(429, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
