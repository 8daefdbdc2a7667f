"""The shared answer stream (--share-answers): replicas of one model learn each other's answers.

Every answer this replica's suffix index learns is published to a Redis Stream,
`kenspec:answers:<model fingerprint>`, trimmed with XADD MAXLEN ~; every replica reads that
stream from its start (a replica started late catches up on what it still holds) and adds the
answers other replicas published to its own index, each to its own tenant's (server.security
names a caller alike on every replica with the same tokens file).

Nothing here may slow a request. The engine thread only appends a copy of the answer to a
bounded buffer and wakes the publisher (a task on the server's loop, with redis.asyncio:
the loop is idle between a request's rounds, and no thread is added); a full buffer, or a
Redis known to be down, drops the answer at once (counted). Redis errors are caught where the
commands are sent, logged once per outage at warning, and retried with backoff; the reader
resumes from the last id it read, so after an outage it catches up on what the stream kept.

The redis package is the `redis` extra (server.extras): imported by AnswerStream only, so a
server without it runs, and --share-answers without it is refused (ExtraMissing).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import structlog

from kenspec.server.answer_records import AnswerRecord, decode, encode, stream_key
from kenspec.server.engine.extras import require
from kenspec.server.engine.tenant_index import SHARED_TENANT, TenantSuffixIndex
from kenspec.server.metrics import Metrics

log = structlog.get_logger("kenspec.answer_stream")

PUBLISH_BATCH = 128  # records per pipelined round trip
READ_BATCH = 256  # entries per XREAD
READ_BLOCK_MS = 1_000  # how long an XREAD waits for new entries
COMMAND_TIMEOUT_S = 2.0  # a Redis slower than this counts as down
BACKOFF_S = (0.1, 5.0)  # first and longest wait between attempts while Redis is down


@dataclass(frozen=True, slots=True)
class StreamSettings:
    url: str
    fingerprint: str  # server.answer_records.model_fingerprint
    vocab_size: int
    maxlen: int = 100_000
    buffer: int = 1024
    # False (--suffix-index-scope shared): only records of SHARED_TENANT are learned.
    isolate_tenants: bool = True


class _Link:
    """Whether one direction works, logged once per change (not once per failed record)."""

    def __init__(self, name: str, metrics: Metrics) -> None:
        self.name = name
        self.up = True  # until a command fails: answers wait in the buffer, not dropped
        self._gauge = metrics.shared_connected.labels(link=name)
        self._gauge.set(0)
        self._warned = False
        self._connected = False
        self.delay = BACKOFF_S[0]

    @property
    def recovering(self) -> bool:
        """No command has gone through yet, or none since the last failure."""
        return not (self.up and self._connected)

    def ok(self) -> None:
        """A command went through."""
        if self.recovering:
            log.info("shared_answers_connected", link=self.name)
        self.up, self._connected, self.delay = True, True, BACKOFF_S[0]
        self._gauge.set(1)
        self._warned = False

    def failed(self, error: BaseException) -> float:
        """A command failed: the wait before the next attempt (doubling up to BACKOFF_S[1])."""
        self.up = False
        self._gauge.set(0)
        if not self._warned:
            log.warning(
                "shared_answers_unreachable",
                link=self.name,
                error=f"{type(error).__name__}: {error}",
                retry="with backoff; answers are not shared meanwhile",
            )
            self._warned = True
        delay, self.delay = self.delay, min(self.delay * 2, BACKOFF_S[1])
        return delay


class AnswerStream:
    """Publishes this replica's learned answers and learns the other replicas' (see above)."""

    def __init__(self, settings: StreamSettings, index: TenantSuffixIndex, metrics: Metrics):
        redis = _redis()  # first: without the package, ExtraMissing before anything is made
        self.settings = settings
        self.key = stream_key(settings.fingerprint)
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._index = index
        self._metrics = metrics
        self._buffer: deque[AnswerRecord] = deque()
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publish = _Link("publish", metrics)
        self._read = _Link("read", metrics)
        self._tasks: list[asyncio.Task[None]] = []
        # what a Redis that is down or slow raises (the commands catch these)
        self._failures: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        retry = redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0)
        options = {"socket_connect_timeout": COMMAND_TIMEOUT_S, "retry": retry}
        self._writer = redis.asyncio.Redis.from_url(
            settings.url, socket_timeout=COMMAND_TIMEOUT_S, **options
        )
        self._reader = redis.asyncio.Redis.from_url(
            settings.url, socket_timeout=READ_BLOCK_MS / 1000 + COMMAND_TIMEOUT_S, **options
        )
        self.last_id = b"0"  # the last entry read: from the stream's start at first

    def offer(self, tenant: str, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """An answer just learned (engine thread): buffered for the publisher, or dropped and
        counted; never waits."""
        if len(answer) < 2 or self._closing:
            return
        record = AnswerRecord.of(tenant, prompt, answer)
        with self._lock:  # the same lock as _down's: no record slips in after its take
            if not self._publish.up:
                dropped, first = "redis_down", False
            elif len(self._buffer) >= self.settings.buffer:
                dropped, first = "buffer_full", False
            else:
                dropped, first = "", not self._buffer
                self._buffer.append(record)
        if dropped:
            self._drop(dropped)
        elif first and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone
                self._loop.call_soon_threadsafe(self._wake.set)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="shared-answers-publish"),
            asyncio.create_task(self._read_loop(), name="shared-answers-read"),
        ]
        log.info(
            "shared_answers",
            redis=_redacted(self.settings.url),
            key=self.key,
            replica=self.replica,
            maxlen=self.settings.maxlen,
            buffer=self.settings.buffer,
        )

    async def stop(self, grace_s: float) -> None:
        """Stop reading, publish what is buffered within grace_s (the rest is dropped,
        counted), close the connections."""
        self._closing = True
        self._wake.set()
        publisher, reader = self._tasks or (None, None)
        if reader is not None:
            reader.cancel()
        if publisher is not None and not self._publish.up:
            publisher.cancel()  # waiting for Redis to come back: nothing will go out
        elif publisher is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(publisher, grace_s)
        self._drop("stopped", len(self._take(self.settings.buffer)))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for client in (self._writer, self._reader):
            with contextlib.suppress(*self._failures):
                await client.aclose()

    async def _publish_loop(self) -> None:
        try:
            await self._writer.ping()
            self._publish.ok()
        except self._failures as error:
            await self._until_up(self._down(error))
        while True:
            self._wake.clear()
            batch = self._take(PUBLISH_BATCH)
            if not batch:
                if self._closing:
                    return
                await self._wake.wait()
                continue
            try:
                async with self._writer.pipeline(transaction=False) as pipe:
                    for record in batch:
                        fields = encode(record, self.replica, self.settings.fingerprint)
                        pipe.xadd(self.key, fields, maxlen=self.settings.maxlen, approximate=True)
                    await pipe.execute()
            except self._failures as error:
                delay = self._down(error, len(batch))
                if self._closing:
                    return
                await self._until_up(delay)
                continue
            self._publish.ok()
            self._metrics.shared_published.inc(len(batch))

    def _down(self, error: BaseException, unsent: int = 0) -> float:
        """Publishing failed: offers from now on are dropped, and so is what the buffer
        holds (with `unsent`, the batch that failed), all counted as redis_down. The same
        whether the first PING or a later XADD failed. The wait before the next attempt."""
        with self._lock:
            delay = self._publish.failed(error)
            unsent += len(self._buffer)
            self._buffer.clear()
        self._drop("redis_down", unsent)
        return delay

    async def _until_up(self, delay: float) -> None:
        """Wait with backoff until Redis answers a PING (answers offered meanwhile are
        dropped as redis_down: the buffer holds only what a working Redis will take)."""
        while True:
            await asyncio.sleep(delay)
            try:
                await self._writer.ping()
            except self._failures as error:
                delay = self._publish.failed(error)
                continue
            self._publish.ok()
            return

    async def _read_loop(self) -> None:
        while True:
            try:
                reply = await self._reader.xread(
                    {self.key: self.last_id}, count=READ_BATCH, block=READ_BLOCK_MS
                )
                if self._read.recovering:
                    await self._check_restarted()
                self._read.ok()
            except self._failures as error:
                await asyncio.sleep(self._read.failed(error))
                continue
            for _key, entries in reply or ():
                if entries:
                    self.last_id = entries[-1][0]
                    await asyncio.to_thread(self._learn, entries)

    async def _check_restarted(self) -> None:
        """After an outage: a stream whose newest entry is older than the last one read was
        made anew (Redis restarted empty, the key deleted), so read it from its start."""
        newest = await self._reader.xrevrange(self.key, count=1)
        if not newest or _stream_id(newest[0][0]) < _stream_id(self.last_id):
            self.last_id = b"0"

    def _learn(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Add the other replicas' answers to this replica's index (a worker thread: the
        index has its own locks, and a catch-up of many entries stays off the loop)."""
        for _entry_id, fields in entries:
            try:
                received = decode(fields, self.settings.vocab_size)
            except (ValueError, UnicodeDecodeError):
                self._drop("malformed")
                continue
            if received.replica == self.replica.encode():
                continue  # learned when it was answered
            if received.fingerprint != self.settings.fingerprint:
                self._drop("foreign_model")
                continue
            record = received.record
            if not self.settings.isolate_tenants and record.tenant != SHARED_TENANT:
                # A replica with tenants published it: drafting it for every caller here
                # would undo that replica's isolation.
                self._drop("tenant_scope")
                continue
            self._index.add(record.tenant, record.answer, record.prompt_tail)
            self._metrics.shared_received.inc()

    def _take(self, most: int) -> list[AnswerRecord]:
        with self._lock:
            return [self._buffer.popleft() for _ in range(min(most, len(self._buffer)))]

    def _drop(self, reason: str, count: int = 1) -> None:
        if count:
            self._metrics.shared_dropped.labels(reason=reason).inc(count)


def _stream_id(entry_id: bytes | str) -> tuple[int, int]:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    milliseconds, _, sequence = raw.partition("-")
    return int(milliseconds), int(sequence or 0)


def _redacted(url: str) -> str:
    """The URL without its user and password, for the log."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2]


def _redis() -> ModuleType:
    """The redis package, with the modules AnswerStream uses; ExtraMissing, naming the extra
    to install, if it is not installed."""
    require("redis", "--share-answers", "start without --share-answers")
    import redis.asyncio
    import redis.asyncio.retry
    import redis.backoff
    import redis.exceptions

    return redis
