"""The gRPC API's public listener: a relay in front of grpc.aio that bounds connections as grpc
core cannot.

grpc core caps connections (`grpc.max_allowed_incoming_connections`) but cannot evict one: a
connection that sends the HTTP/2 preface and its SETTINGS and then nothing holds its place until
the idle timeout, so that many such connections lock every new client out for minutes. Hence
this front door, as the HTTP API has (server.openai_api.connections): grpc.aio listens only on a
Unix socket in a private directory (mode 0700, removed at close), and the front listens on the
public address, terminates TLS, and relays each connection's bytes to a connection of its own to
that socket. It reads the HTTP/2 frame heads in both directions, payloads skipped (but the
server's SETTINGS), to count each connection's open calls:

- a client HEADERS frame on a new stream opens a call; the server's HEADERS (or DATA) with
  END_STREAM, its trailers, or a RST_STREAM from either side closes it. A connection with no
  call open is idle since its last call closed, or since it opened;
- past the connection cap, the connection idle longest is closed to make room (a GOAWAY first,
  naming the last call it saw, so a grpc client opens a new connection for its next call), as
  nginx does with idle keep-alive connections; with none idle, the new connection is closed at
  once. Idle connections therefore cannot lock out a client that opens a call at once, and a
  connection with a call open is never evicted (whatever the call waits for: a Health/Watch
  stream, or a request message that never comes, keeps its connection busy; --grpc-max-
  connection-age-s bounds those). The close follows the GOAWAY at once, so a call the client
  sent in between may fail rather than be retried;
- a connection that has not finished its TLS handshake and sent the 24-byte preface and its
  first SETTINGS frame within the handshake timeout is closed (its Unix connection is only
  opened after that, so grpc never sees it); one idle for the idle timeout gets grpc's own
  GOAWAY (`grpc.max_connection_idle_ms`), and is closed by the front IDLE_GRACE_S later if it
  is still there;
- the SETTINGS_MAX_CONCURRENT_STREAMS in grpc's SETTINGS frames is capped at the streams per
  connection clients are told (FrontLimits.max_streams), below grpc's own limit
  (server.lifecycle.grpc_options says why): the only bytes of grpc's the relay changes.

The relay is asyncio Protocols writing in data_received (no await per chunk), with each side's
write buffer pausing the other side's reading. grpc now sees every call come from the Unix
socket: `context.peer()` names the socket, not the client, and with --tls-client-ca the client's
certificate is verified here, so grpc's `auth_context()` holds no peer certificate. Nothing in
kenspec reads either; a feature that needs the client's address or certificate must take it from
this front.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import struct
import tempfile
from dataclasses import dataclass

from kenspec.server.security import listening_socket

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM = ACK = 0x1
MAX_CONCURRENT_STREAMS = 0x3  # a SETTINGS identifier
MAX_FIRST_SETTINGS = 16_384  # bytes; SETTINGS_MAX_FRAME_SIZE before any SETTINGS is acked
IDLE_GRACE_S = 1.0  # after grpc's idle GOAWAY, before the front closes a connection left open
CLOSE_LINGER_S = 5.0  # a connection closed with bytes unsent is aborted after this
_HEAD = struct.Struct(">IBI")  # length (24 bits) and type, flags, reserved bit and stream id


@dataclass(frozen=True, slots=True)
class FrontLimits:
    max_connections: int = 256
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0
    max_streams: int = 1000  # the calls per connection clients are told (see the module doc)


def goaway_frame(last_stream: int) -> bytes:
    """A GOAWAY frame, NO_ERROR: calls after `last_stream` were not processed."""
    return _HEAD.pack(8 << 8 | GOAWAY, 0, 0) + struct.pack(">II", last_stream, 0)


class _Frames:
    """The frame heads of one direction of an HTTP/2 connection, fed its bytes chunk by chunk
    (after the client's preface); payloads are skipped, not copied. With `max_streams` (the
    server's direction), the SETTINGS_MAX_CONCURRENT_STREAMS its SETTINGS frames carry are
    capped at that many: after each feed, `patches` holds (offset in the chunk, byte) for the
    bytes to change before the chunk is relayed."""

    __slots__ = (
        "cap",
        "count",
        "first",
        "head",
        "patches",
        "setting",
        "settings_at",
        "settings_left",
        "skip",
        "verdict",
    )

    def __init__(self, max_streams: int | None = None) -> None:
        self.skip = 0  # payload bytes of the current frame still to come
        self.head = b""  # the start of a frame head split between chunks
        self.count = 0  # frames begun so far
        self.first: tuple[int, int] | None = None  # type and length of the first frame
        self.cap = struct.pack(">I", max_streams) if max_streams is not None else b""
        self.patches: list[tuple[int, int]] = []
        self.settings_left = 0  # payload bytes of a SETTINGS frame to be read (max_streams)
        self.settings_at = 0  # bytes of that payload read so far
        self.setting = 0  # the identifier of the setting being read
        self.verdict = 0  # its value against the cap so far: 0 equal, -1 below, 1 above

    def at_boundary(self) -> bool:
        """Between frames, and past the first (a frame of ours may be written now; before the
        peer's first frame, its SETTINGS, it may not)."""
        return self.count > 0 and not self.skip and not self.head

    def feed(self, data: bytes) -> list[tuple[int, int, int]]:
        """(type, flags, stream id) of each frame that begins in `data`, but DATA frames
        without END_STREAM (of no interest, and most of the frames)."""
        heads: list[tuple[int, int, int]] = []
        self.patches = []
        size, at = len(data), self.skip
        if self.settings_left:  # (the rest of a SETTINGS payload opens the chunk)
            self._settings(data, 0)
        if self.head:  # (self.skip is 0)
            taken = 9 - len(self.head)
            head = self.head + data[:taken]
            if len(head) < 9:
                self.head = head
                return heads
            self.head = b""
            at = taken + self._frame(head, 0, heads)
            if self.settings_left:
                self._settings(data, taken)
        while at + 9 <= size:
            payload = at + 9
            at = payload + self._frame(data, at, heads)
            if self.settings_left:
                self._settings(data, payload)
        if at <= size:
            self.skip, self.head = 0, data[at:]
        else:
            self.skip = at - size
        return heads

    def _frame(self, data: bytes, at: int, heads: list[tuple[int, int, int]]) -> int:
        """Note the frame whose head is at data[at:at+9]; returns its payload's length."""
        word, flags, stream = _HEAD.unpack_from(data, at)
        length, kind = word >> 8, word & 0xFF
        if self.first is None:
            self.first = (kind, length)
        self.count += 1
        if kind != DATA or flags & END_STREAM:
            heads.append((kind, flags, stream & 0x7FFFFFFF))
        if kind == SETTINGS and not flags & ACK and self.cap:
            self.settings_left, self.settings_at = length, 0
        return length

    def _settings(self, data: bytes, start: int) -> None:
        """Read the SETTINGS payload bytes in data[start:], if any: each is a 2-byte identifier
        and a 4-byte value. A MAX_CONCURRENT_STREAMS value above the cap becomes the cap, byte
        by byte as they pass (big-endian: the first byte that differs decides which is lower,
        so a value split between chunks needs no buffering)."""
        end = min(len(data), start + self.settings_left)
        for offset in range(start, end):
            at, byte = self.settings_at % 6, data[offset]
            if at < 2:
                self.setting = (self.setting << 8 | byte) & 0xFFFF
                self.verdict = 0
            elif self.setting == MAX_CONCURRENT_STREAMS:
                cap = self.cap[at - 2]
                if not self.verdict and byte != cap:
                    self.verdict = 1 if byte > cap else -1
                if self.verdict > 0:
                    self.patches.append((offset, cap))
            self.settings_at += 1
        self.settings_left -= max(0, end - start)


class _Backend(asyncio.Protocol):
    """The Unix socket side of one relayed connection."""

    def __init__(self, client: _Connection) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client.attach(transport)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        self.client.from_server(data)

    def eof_received(self) -> None:
        return None  # (closes this side; connection_lost closes the client's)

    def pause_writing(self) -> None:
        self.client.hold(1)

    def resume_writing(self) -> None:
        self.client.hold(-1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.shut()  # what grpc wrote last is still sent


class _Connection(asyncio.Protocol):
    """One client connection of the front, and the calls open on it."""

    def __init__(self, front: GrpcFront) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None  # the TLS one once handshaken
        self.backend: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # the client's bytes until the backend is connected
        self.up = _Frames()  # client to server
        self.down = _Frames(front.limits.max_streams)  # server to client
        self.preface_left = len(PREFACE)
        self.ready = False  # preface and first SETTINGS received: relayed from then on
        self.streams: set[int] = set()  # the calls open
        self.last_stream = 0  # the highest stream a client HEADERS frame opened
        self.idle_since: float | None = None
        self.closed = False
        self._tls_pending = False  # TLS handshake under way: self.transport is the raw one
        self._holds = 0  # reasons to pause reading the client (backend full, connecting)
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None  # the TLS handshake, then the Unix connection

    # -- the client's side ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.transport = transport  # type: ignore[assignment]
        front = self.front
        front.live.add(self)
        self.idle_since = self.loop.time()
        if not front.admit(self):
            self.closed = True
            transport.close()
            return
        limits = front.limits
        self._handshake_timer = self.loop.call_later(
            limits.handshake_timeout_s, self._handshake_timed_out
        )
        if front.tls is not None:
            self._tls_pending = True
            transport.pause_reading()  # type: ignore[attr-defined]  # (the ClientHello is TLS's)
            self._task = self.loop.create_task(self._start_tls(transport))  # type: ignore[arg-type]

    async def _start_tls(self, raw: asyncio.Transport) -> None:
        assert self.front.tls is not None
        timeout = self.front.limits.handshake_timeout_s  # (asyncio's own: 60 s, 30 s)
        try:
            tls = await self.loop.start_tls(
                raw,
                self,
                self.front.tls,
                server_side=True,
                ssl_handshake_timeout=timeout,
                ssl_shutdown_timeout=timeout,
            )
        except Exception:  # a failed handshake, whatever the error: close it
            self.shut(abort=True)
            return
        if tls is None or self.closed:
            if tls is not None:
                tls.abort()
            return
        self.transport, self._tls_pending = tls, False
        if self._holds:
            tls.pause_reading()

    def data_received(self, data: bytes) -> None:
        backend = self.backend
        if backend is not None and not self.closed:  # relaying
            self._from_client(data)
            backend.write(data)
            return
        if self.closed:
            return
        self.pending.append(data)
        if self.ready:  # connecting to grpc
            self._from_client(data)
            return
        if self.preface_left:
            expected = PREFACE[len(PREFACE) - self.preface_left :]
            taken = min(len(expected), len(data))
            if data[:taken] != expected[:taken]:
                self.shut(abort=True)  # not HTTP/2
                return
            self.preface_left -= taken
            data = data[taken:]
            if not data:
                return
        self._from_client(data)
        first, up = self.up.first, self.up
        if first is None or self.closed:
            return
        kind, length = first
        if kind != SETTINGS or length > MAX_FIRST_SETTINGS:
            self.shut(abort=True)  # the preface must be followed by a SETTINGS frame
        elif up.count > 1 or not up.skip:  # the whole SETTINGS frame is in
            self._handshaken()

    def _from_client(self, data: bytes) -> None:
        for kind, _, stream in self.up.feed(data):
            if kind == HEADERS:
                if stream > self.last_stream:
                    self.last_stream = stream
                    self._open(stream)
            elif kind == RST_STREAM:
                self._close(stream)

    def _handshaken(self) -> None:
        self.ready = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        if not self.streams:
            self._arm_idle()
        self.hold(1)  # until the backend is connected
        front = self.front

        async def connect() -> None:
            try:
                await self.loop.create_unix_connection(lambda: _Backend(self), front.backend_path)
            except Exception:  # grpc not listening (stopped, or failed)
                self.shut(abort=True)

        self._task = self.loop.create_task(connect())

    def pause_writing(self) -> None:
        if self.backend is not None:
            self.backend.pause_reading()  # type: ignore[attr-defined]

    def resume_writing(self) -> None:
        if self.backend is not None and not self.backend.is_closing():
            self.backend.resume_reading()  # type: ignore[attr-defined]

    def eof_received(self) -> None:
        return None  # (closes this side; connection_lost closes the backend's)

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.gone(self)
        self.shut()  # what the client sent last still reaches grpc

    # -- the Unix socket's side ----------------------------------------------------------

    def attach(self, backend: asyncio.Transport) -> None:
        """The backend connected: send it what the client has sent so far, and relay."""
        if self.closed:
            backend.abort()
            return
        self.backend = backend
        backend.write(b"".join(self.pending))
        self.pending = []
        self.hold(-1)

    def from_server(self, data: bytes) -> None:
        if self.closed:
            return
        for kind, flags, stream in self.down.feed(data):
            if kind == RST_STREAM or (kind in (HEADERS, DATA) and flags & END_STREAM):
                self._close(stream)  # (the trailers, or a reset)
        if self.down.patches:  # (a SETTINGS frame: the stream limit clients are told)
            patched = bytearray(data)
            for offset, byte in self.down.patches:
                patched[offset] = byte
            data = bytes(patched)
        self.transport.write(data)  # type: ignore[union-attr]

    def hold(self, delta: int) -> None:
        """Count a reason to pause reading the client (+1) or one gone (-1)."""
        before = self._holds
        self._holds += delta
        transport = self.transport
        if self._tls_pending or transport is None or transport.is_closing():
            return  # (applied once the TLS handshake ends)
        if not before and self._holds:
            transport.pause_reading()
        elif before and not self._holds:
            transport.resume_reading()

    # -- calls, idleness, closing --------------------------------------------------------

    def _open(self, stream: int) -> None:
        if not self.streams:
            self.idle_since = None
            self.front.busy(self)
        self.streams.add(stream)

    def _close(self, stream: int) -> None:
        if stream in self.streams:
            self.streams.discard(stream)
            if not self.streams and not self.closed:
                self.idle_since = self.loop.time()
                self.front.idle(self)
                self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle_timer is None and self.idle_since is not None:
            due = self.idle_since + self.front.limits.idle_timeout_s + IDLE_GRACE_S
            self._idle_timer = self.loop.call_at(due, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.closed or self.idle_since is None:
            return  # (a call open: armed again when the connection is idle again)
        due = self.idle_since + self.front.limits.idle_timeout_s + IDLE_GRACE_S
        if self.loop.time() >= due:
            self.shut(goaway=True)
        else:
            self._idle_timer = self.loop.call_at(due, self._idle_check)

    def _handshake_timed_out(self) -> None:
        self._handshake_timer = None
        self.shut(abort=True)

    def kill(self) -> None:
        """Close both sides at once, even if they were closing already."""
        self.shut(abort=True)
        for transport in (self.backend, self.transport):
            if transport is not None:
                transport.abort()

    def shut(self, *, abort: bool = False, goaway: bool = False) -> None:
        """Close both sides: at once (`abort`), or after sending what is buffered, and, with
        `goaway`, a GOAWAY first when the server's side is between frames."""
        if self.closed:
            return
        self.closed = True
        self.front.forget(self)
        for timer in (self._handshake_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._handshake_timer = self._idle_timer = None
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        backend, transport = self.backend, self.transport
        if backend is not None:
            backend.abort() if abort else backend.close()
        if transport is None or transport.is_closing():
            return
        if abort or self._tls_pending:
            transport.abort()
            if self._tls_pending:  # (asyncio tells no protocol of a handshake's end)
                self.front.gone(self)
            return
        if goaway and backend is not None and self.down.at_boundary():
            transport.write(goaway_frame(self.last_stream))
        transport.close()
        if transport.get_write_buffer_size():  # a client not reading: not for long
            self.loop.call_later(CLOSE_LINGER_S, transport.abort)


class GrpcFront:
    """The public gRPC listener (see the module doc). `backend_address()` names the Unix
    socket grpc.aio must listen on; `start()` listens, `close()` stops listening and closes
    every connection. Until close(), new connections are accepted (and relayed while grpc
    listens), so health checks reach grpc for as long as it serves."""

    loop: asyncio.AbstractEventLoop  # (set by start())

    def __init__(self, host: str, port: int, limits: FrontLimits = FrontLimits()) -> None:
        self.host, self.port = host, port
        self.limits = limits
        self.tls: ssl.SSLContext | None = None
        self._directory: str | None = None
        self._server: asyncio.Server | None = None
        self.connections: dict[_Connection, None] = {}  # counted against the cap
        self.idle_connections: dict[_Connection, None] = {}  # of those, idle: oldest first
        self.live: set[_Connection] = set()  # not yet lost, counted or not
        self.evicted = self.refused = 0  # connections closed for the cap, so far
        self._all_gone: asyncio.Event | None = None

    @property
    def backend_path(self) -> str:
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="kenspec-grpc-")  # (mode 0700)
        return os.path.join(self._directory, "grpc.sock")

    def backend_address(self) -> str:
        """The grpc target of the private Unix socket (its directory is made on first use)."""
        return f"unix:{self.backend_path}"

    async def start(self, tls: ssl.SSLContext | None = None) -> int:
        """Listen (with `tls`, TLS is terminated here); returns the bound port (port 0 picks
        a free one)."""
        self.tls = tls
        self.loop = asyncio.get_running_loop()
        sock = listening_socket(self.host, self.port, "gRPC")
        self.port = sock.getsockname()[1]
        self._server = await self.loop.create_server(
            lambda: _Connection(self), sock=sock, backlog=1024
        )
        return self.port

    # -- the connection cap (called by the connections) --------------------------------

    def admit(self, connection: _Connection) -> bool:
        """Count a new connection, closing the one idle longest to make room past the cap;
        False (not counted) when the cap is reached and no connection is idle."""
        if len(self.connections) >= self.limits.max_connections:
            oldest = next(iter(self.idle_connections), None)
            if oldest is None:
                self.refused += 1
                return False
            oldest.shut(goaway=True)
            self.evicted += 1
        self.connections[connection] = None
        self.idle_connections[connection] = None
        return True

    def idle(self, connection: _Connection) -> None:
        if connection in self.connections:
            self.idle_connections[connection] = None  # (last: idle the shortest)

    def busy(self, connection: _Connection) -> None:
        self.idle_connections.pop(connection, None)

    def forget(self, connection: _Connection) -> None:
        self.connections.pop(connection, None)
        self.idle_connections.pop(connection, None)

    def gone(self, connection: _Connection) -> None:
        self.live.discard(connection)
        if not self.live and self._all_gone is not None:
            self._all_gone.set()

    async def close(self) -> None:
        """Stop listening and close every connection: those relayed end as grpc closes its
        side (what it sent last is delivered), within CLOSE_LINGER_S; the rest at once."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.live):
            if connection.backend is None:
                connection.shut(abort=True)
        if self.live:
            self._all_gone = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), CLOSE_LINGER_S)
        for connection in list(self.live):
            connection.kill()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
