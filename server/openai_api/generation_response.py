"""One generation, written as the HTTP API answers it: server-sent events (one per round,
then [DONE]) or one JSON body.

The first round is awaited before the response starts, so every refusal (bad input, a full
queue, a server still loading) gets its own HTTP status; once streaming, a failure ends the
stream with an OpenAI-shaped error event (and a complete chunked body; no [DONE] after it). A
client that disconnects cancels its generation, whether it streams or waits for the whole
answer. A generation the drain cuts at the end of its grace (Serving.cut) ends the same way:
a 503 if nothing was sent yet, else the error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

import grpc
import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kenspec.server.engine.generation import Round
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.engine.tenant_index import SHARED_TENANT
from kenspec.server.openai_api.openai_request import OpenAIRequest
from kenspec.server.openai_api.responses import SSE_DONE, Completion, error_body, sse
from kenspec.server.runtime import Runtime
from kenspec.server.scheduler import Overloaded
from kenspec.server.serving import (
    RETRY_AFTER_MS,
    Call,
    ClientGone,
    RequestRecord,
    Serving,
    StreamStalled,
    failure_of,
)

log = structlog.get_logger("kenspec.http")

_OK, _CANCELLED = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED


class GenerationResponse(Response):
    """Runs one generation and writes it: server-sent events (one per round, then [DONE]) or
    one JSON body; a disconnect cancels it."""

    def __init__(
        self,
        serving: Serving,
        runtime: Runtime,
        request: OpenAIRequest,
        completion: Completion,
        record: RequestRecord,
        headers: dict[str, str],
        tenant: str = SHARED_TENANT,
        call: Call | None = None,
    ) -> None:
        self.serving, self.runtime, self.request = serving, runtime, request
        self.tenant = tenant  # whose answers it drafts from and learns into
        self.completion, self.record = completion, record
        self.extra_headers = headers
        self.call = call  # the admitted call, released when the response ends
        self._started = self._complete = False  # what of the response has been sent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = self.completion.request_id
        record = self.record
        fields = {"request_id": request_id, "api": "http"}
        if self.request.user:
            fields["user"] = self.request.user[:128]
        with structlog.contextvars.bound_contextvars(**fields):
            params, tenant = self.request.params, self.tenant
            rounds = self.serving.generate(self.runtime, params, request_id, record, tenant=tenant)
            try:
                async with contextlib.aclosing(rounds):
                    write = self._stream if self.request.stream else self._whole
                    left = await _cancel_on_disconnect(receive, write(rounds, send))
                record.code = _CANCELLED if left else _OK
            except _Reported:
                pass  # the failure was written to the client; its record holds the code
            except ClientGone:
                record.code = _CANCELLED
            except StreamStalled as error:
                record.code = grpc.StatusCode.DEADLINE_EXCEEDED
                log.info("stream_stalled", error=str(error))
            except asyncio.CancelledError:
                cut = self.call.cut if self.call is not None else None
                if cut is None:
                    record.code = _CANCELLED
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                await self._report_cut(cut, send)
            finally:
                record.close()
                if self.call is not None:
                    self.serving.release(self.call)

    async def _report_cut(self, error: Exception, send: Send) -> None:
        """Cut by the drain: a refusal if nothing was sent, else an error event that ends the
        stream. A client that reads nothing more is past helping (the server's stop closes
        its connection)."""
        if self._complete:  # (cut as it ended: it did end)
            if self.record.code is grpc.StatusCode.UNKNOWN:
                self.record.code = _OK
            return
        with contextlib.suppress(_Reported, ClientGone, StreamStalled):
            if not self._started:
                await self._refuse(error, send)
            elif self.request.stream:
                await self._stream_error(error, send)
            else:  # (a whole answer whose body was being written)
                await self._end(send)

    async def _whole(self, rounds: AsyncIterator[Round], send: Send) -> None:
        try:
            collected = [round_ async for round_ in rounds]
        except Exception as error:
            await self._refuse(error, send)
            return
        body = json.dumps(self.completion.whole(collected)).encode()
        await self._start(send, 200, "application/json")
        await self._last(send, body)

    async def _stream(self, rounds: AsyncIterator[Round], send: Send) -> None:
        try:  # the first round decides the status: every refusal comes before it
            first = await anext(rounds)
        except Exception as error:
            await self._refuse(error, send)
            return
        await self._start(send, 200, "text/event-stream")
        try:
            await self._event(send, sse(self.completion.chunk(first)))
            async for round_ in rounds:
                await self._event(send, sse(self.completion.chunk(round_)))
        except (ClientGone, StreamStalled):
            raise
        except Exception as error:  # after the headers: an error event ends the stream
            await self._stream_error(error, send)
            raise _Reported from None
        if self.request.include_usage:
            await self._event(send, sse(self.completion.usage_chunk()))
        await self._event(send, SSE_DONE)
        await self._end(send)

    async def _stream_error(self, error: Exception, send: Send) -> None:
        """The error event that ends a stream, then the end of the body."""
        failure = failure_of(error, self.completion.request_id)
        self.record.code = failure.code
        await self._event(send, sse(error_body(failure.http_status, failure.message)))
        await self._end(send)

    async def _refuse(self, error: Exception, send: Send) -> None:
        failure = failure_of(error, self.completion.request_id)
        self.record.code = failure.code
        headers = {}
        if isinstance(error, Overloaded):  # as gRPC's pushback trailer
            headers["retry-after"] = str(max(1, RETRY_AFTER_MS // 1000))
        param = error.field if isinstance(error, InvalidParameter) else None
        body = json.dumps(error_body(failure.http_status, failure.message, param)).encode()
        await self._start(send, failure.http_status, "application/json", headers)
        await self._last(send, body)
        raise _Reported

    async def _start(
        self, send: Send, status: int, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        merged = {**self.extra_headers, **(headers or {}), "content-type": content_type}
        if content_type == "text/event-stream":
            merged.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        raw = [(k.encode(), v.encode()) for k, v in merged.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        self._started = True

    async def _event(self, send: Send, data: bytes) -> None:
        """One event; a client that reads nothing for the stall timeout loses its stream (the
        transport holds a write once its buffer is full)."""
        timeout = self.serving.stall_timeout_s
        try:
            await asyncio.wait_for(
                send({"type": "http.response.body", "body": data, "more_body": True}), timeout
            )
        except TimeoutError:
            self.serving.metrics.stalled_streams.inc()
            raise StreamStalled(timeout) from None
        except OSError as error:  # the connection closed under the write
            raise ClientGone from error

    async def _end(self, send: Send) -> None:
        with contextlib.suppress(OSError):
            await self._last(send, b"")

    async def _last(self, send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._complete = True


class _Reported(Exception):
    """A failure already written to the client (its record holds the code)."""


async def _cancel_on_disconnect(receive: Receive, work: Awaitable[None]) -> bool:
    """Run `work` until it ends or the client disconnects (then cancel it); True if the
    client left first. What the work raises, it raises. Cancelled itself, it cancels the work
    and waits for it to end before it raises: the caller then closes the rounds the work was
    reading, which it could not while they are still being read."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # read: raised by the caller's cancellation, not news
    try:
        await task
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled():
            return True  # the client left: its generation was cancelled
        raise
    return False
