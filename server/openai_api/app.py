"""The HTTP routes (Starlette): completions, models, health; bearer tokens and body limits.

A generation's first round is awaited before the response starts, so every refusal (bad
input, a full queue, a server still loading) gets its own HTTP status; once streaming, a
failure ends the stream with an OpenAI-shaped error event. A client that disconnects cancels
its generation, whether it streams or waits for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from server.engine.generation import Round
from server.engine.params import InvalidParameter
from server.engine.tenant_index import SHARED_TENANT
from server.openai_api.requests import OpenAIRequest, parse_chat, parse_completion
from server.openai_api.responses import SSE_DONE, Completion, error_body, sse
from server.requests import check_request_id
from server.runtime import Runtime
from server.scheduler import Overloaded
from server.security import bearer_token, token_allowed
from server.serving import (
    RETRY_AFTER_MS,
    ClientGone,
    RequestRecord,
    Serving,
    StreamStalled,
    Unavailable,
    failure_of,
)

log = structlog.get_logger("kenspec.http")

REQUEST_ID_HEADER = "x-request-id"
# The metrics label a call with gRPC's status names whichever API it came through.
_OK, _CANCELLED = grpc.StatusCode.OK, grpc.StatusCode.CANCELLED
_STATUS_NAMES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class HttpError(Exception):
    """A refusal before any generation: its status and OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code or None

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = error_body(self.status, str(self), self.param, self.code)
        return JSONResponse(body, self.status, headers=headers)


def build_app(
    serving: Serving,
    *,
    model_name: str,
    tokens: tuple[bytes, ...] = (),
    max_body_bytes: int = 1 << 20,
) -> Starlette:
    """The ASGI app over `serving`; `model_name` is the id /v1/models lists."""
    api = OpenAIRoutes(serving, model_name, tokens, max_body_bytes)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})


class OpenAIRoutes:
    def __init__(
        self, serving: Serving, model_name: str, tokens: tuple[bytes, ...], max_body_bytes: int
    ) -> None:
        self.serving = serving
        self.model_name = model_name
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes

    async def health(self, request: Request) -> JSONResponse:
        """Agrees with the gRPC health service: 200 SERVING once loaded and warm, else 503."""
        serving = self.serving.serving
        status = "SERVING" if serving else "NOT_SERVING"
        return JSONResponse({"status": status}, 200 if serving else 503)

    async def models(self, request: Request) -> Response:
        return await self._guarded(request, lambda card: {"object": "list", "data": [card]})

    async def model(self, request: Request) -> Response:
        def one(card: dict[str, Any]) -> dict[str, Any]:
            self._check_model(request.path_params["model"], "model")
            return card

        return await self._guarded(request, one)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion, chat=False)

    async def _guarded(
        self, request: Request, body: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Response:
        """`body` of the served model's card, for an authenticated caller of a ready server."""
        try:
            self._authenticate(request)
            runtime = self._ready()
            return JSONResponse(body(self._card(runtime)))
        except HttpError as error:
            return error.response()

    def _card(self, runtime: Runtime) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kenspec",
            "max_model_len": runtime.info.max_context_tokens,
        }

    async def _generate(self, request: Request, parse: Callable, *, chat: bool) -> Response:
        try:
            self._authenticate(request)
            request_id = _request_id(request)
            runtime = self._ready()
        except HttpError as error:
            return error.response()
        span_name = f"{request.method} {request.url.path}"
        record = self.serving.record("http", span_name, request_id, request.headers)
        try:
            body = await self._json(request)
            try:
                parsed = parse(body, runtime.limits, runtime.defaults)
            except InvalidParameter as error:
                raise HttpError(400, str(error), param=error.field) from None
            self._check_model(parsed.model, "model")
        except HttpError as error:
            record.code = _STATUS_NAMES.get(error.status, record.code)
            record.close()
            return error.response()
        completion = Completion(
            chat=chat,
            request_id=request_id,
            model=self.model_name,
            report_source=self.serving.report_draft_source,
        )
        return GenerationResponse(
            self.serving,
            runtime,
            parsed,
            completion,
            record,
            headers={REQUEST_ID_HEADER: request_id},
            tenant=self.serving.tenant(request.headers.get("authorization", "")),
        )

    def _authenticate(self, request: Request) -> None:
        if not self.tokens:
            return
        presented = bearer_token(request.headers.get("authorization", ""))
        if not presented:
            raise HttpError(
                401, "missing bearer token: send 'Authorization: Bearer <token>'", code="no_token"
            )
        if not token_allowed(presented, self.tokens):
            raise HttpError(401, "invalid bearer token", code="invalid_api_key")

    def _ready(self) -> Runtime:
        try:
            return self.serving.ready()
        except Unavailable as error:
            raise HttpError(503, str(error), code="unavailable") from None

    def _check_model(self, model: str, param: str) -> None:
        if model != self.model_name:
            raise HttpError(
                404,
                f"the model {model!r} is not served here; this server serves {self.model_name!r}",
                param=param,
                code="model_not_found",
            )

    async def _json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, read up to the size limit (413 beyond it)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise _too_large(len(data), self.max_body_bytes)
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise HttpError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body


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
    ) -> None:
        self.serving, self.runtime, self.request = serving, runtime, request
        self.tenant = tenant  # whose answers it drafts from and learns into
        self.completion, self.record = completion, record
        self.extra_headers = headers

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
                record.code = _CANCELLED
                raise
            finally:
                record.close()

    async def _whole(self, rounds: AsyncIterator[Round], send: Send) -> None:
        try:
            collected = [round_ async for round_ in rounds]
        except Exception as error:
            await self._refuse(error, send)
            return
        body = json.dumps(self.completion.whole(collected)).encode()
        await self._start(send, 200, "application/json")
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, rounds: AsyncIterator[Round], send: Send) -> None:
        try:  # the first round decides the status: every refusal comes before it
            first = await anext(rounds)
        except Exception as error:
            await self._refuse(error, send)
            return
        await self._start(send, 200, "text/event-stream")
        last = first
        try:
            await self._event(send, sse(self.completion.chunk(first)))
            async for last in rounds:
                await self._event(send, sse(self.completion.chunk(last)))
        except (ClientGone, StreamStalled):
            raise
        except Exception as error:  # after the headers: an error event ends the stream
            failure = failure_of(error, self.completion.request_id)
            self.record.code = failure.code
            await self._event(send, sse(error_body(failure.http_status, failure.message)))
            await self._end(send)
            raise _Reported from None
        if self.request.include_usage:
            await self._event(send, sse(self.completion.usage_chunk(last)))
        await self._event(send, SSE_DONE)
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
        await send({"type": "http.response.body", "body": body, "more_body": False})
        raise _Reported

    async def _start(
        self, send: Send, status: int, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        merged = {**self.extra_headers, **(headers or {}), "content-type": content_type}
        if content_type == "text/event-stream":
            merged.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        raw = [(k.encode(), v.encode()) for k, v in merged.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})

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

    @staticmethod
    async def _end(send: Send) -> None:
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Reported(Exception):
    """A failure already written to the client (its record holds the code)."""


async def _cancel_on_disconnect(receive: Receive, work: Awaitable[None]) -> bool:
    """Run `work` until it ends or the client disconnects (then cancel it); True if the
    client left first. What the work raises, it raises."""
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
    try:
        await task
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled():
            return True  # the client left: its generation was cancelled
        raise
    return False


def _request_id(request: Request) -> str:
    """The client's X-Request-Id (checked as gRPC's request_id), or a new one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    try:
        check_request_id(given)
    except InvalidParameter as error:
        message = f"{REQUEST_ID_HEADER}: {error.message}"
        raise HttpError(400, message, param=REQUEST_ID_HEADER) from None
    return given or uuid.uuid4().hex[:16]


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(413, f"the body is {size} bytes or more; the server limit is {limit}")


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return HttpError(404, f"no route {request.url.path}", code="not_found").response()


async def _not_allowed(request: Request, exc: Exception) -> JSONResponse:
    message = f"{request.method} is not allowed on {request.url.path}"
    return HttpError(405, message, code="method_not_allowed").response()
