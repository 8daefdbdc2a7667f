"""The HTTP routes (Starlette): completions, models, health; bearer tokens and body limits.

A generate request passes, in order: the Host and Origin check (without tokens; guards.py),
the bearer token, its X-Request-Id, the server's readiness, the Content-Type, the body read
(within --max-message-bytes and --http-body-timeout-s) and the body's checks (openai_request.py).
Every refusal is an OpenAI-shaped JSON error, and every generate request is counted in
kenspec_requests_total whatever stage it ends at (a client that leaves mid-body as CANCELLED,
logged once at info). /v1/models and /health are not counted: the counter is of generations,
as on gRPC. /health answers without the Host check, for container probes that call the
container's own address. The generation itself is written by generation_response.py.
/tokenize and /detokenize (tokenize.py) and /metrics ask what /v1/models asks, and are not
counted either; /metrics does not wait for the model to load.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kenspec.server.engine.params import InvalidParameter
from kenspec.server.generate_params import check_request_id
from kenspec.server.openai_api.body import InvalidBody
from kenspec.server.openai_api.generation_response import GenerationResponse
from kenspec.server.openai_api.guards import HostPolicy, HttpError, check_json_content_type
from kenspec.server.openai_api.openai_request import OpenAIRequest, parse_request
from kenspec.server.openai_api.responses import Completion
from kenspec.server.openai_api.tokenize import detokenize, tokenize
from kenspec.server.runtime import Runtime
from kenspec.server.security import bearer_token, token_allowed
from kenspec.server.serving import RETRY_AFTER_MS, Call, RequestRecord, Serving, Unavailable
from kenspec.server.tool_calls.parser import ChoiceParsers

log = structlog.get_logger("kenspec.http")

REQUEST_ID_HEADER = "x-request-id"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
GENERATE_PATHS = (CHAT_PATH, COMPLETIONS_PATH)  # the routes counted in kenspec_requests_total
# The metrics label a call with gRPC's status names whichever API it came through.
_STATUS_NAMES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    421: grpc.StatusCode.PERMISSION_DENIED,
    431: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP request may send: its body's size and the time to send it all."""

    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0


def build_app(
    serving: Serving,
    *,
    model_name: str,
    tokens: tuple[bytes, ...] = (),
    limits: HttpLimits = HttpLimits(),
    allowed_hosts: str = "",
    bind_host: str = "127.0.0.1",
    metrics: bool = True,
) -> Starlette:
    """The ASGI app over `serving`; `model_name` is the id /v1/models lists. Without
    `tokens`, only loopback names, `bind_host` and `allowed_hosts` may call (guards.py).
    `metrics`: serve /metrics too (--http-metrics)."""
    hosts = None if tokens else HostPolicy.of(allowed_hosts, bind_host)
    api = OpenAIRoutes(serving, model_name, tokens, limits, hosts)
    routes = [
        Route(CHAT_PATH, api.chat, methods=["POST"]),
        Route(COMPLETIONS_PATH, api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        *([Route("/metrics", api.metrics, methods=["GET"])] if metrics else []),
    ]
    return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})


class OpenAIRoutes:
    def __init__(
        self,
        serving: Serving,
        model_name: str,
        tokens: tuple[bytes, ...],
        limits: HttpLimits,
        hosts: HostPolicy | None,
    ) -> None:
        self.serving = serving
        self.model_name = model_name
        self.tokens = tokens
        self.limits = limits
        self.hosts = hosts

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

    async def metrics(self, request: Request) -> Response:
        """Prometheus' text format, to a caller the API would serve (loaded or not)."""
        try:
            self._admit(request)
        except HttpError as error:
            return error.response()
        # (off the loop, as the metrics port answers: a scrape never delays the streams)
        text = await asyncio.to_thread(generate_latest, self.serving.metrics.registry)
        return Response(text, headers={"content-type": CONTENT_TYPE_LATEST})

    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer(request, tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer(request, detokenize)

    async def _tokenizer(self, request: Request, answer: Callable[..., Any]) -> Response:
        """/tokenize and /detokenize: the generate routes' checks, then `answer` of the body."""
        try:
            self._admit(request)
            runtime = self._ready()
            check_json_content_type(request.headers)
            data = await self._body(request)
            body, ignored = await answer(self.serving, runtime, bytes(data), self._check_model)
        except HttpError as error:
            return error.response()
        except ClientDisconnect:
            return _NoResponse()
        ignored.log("", request.url.path)
        return JSONResponse(body, headers=ignored.header())

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _guarded(
        self, request: Request, body: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Response:
        """`body` of the served model's card, for an authenticated caller of a ready server."""
        try:
            self._admit(request)
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

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            self._admit(request)
            request_id = _request_id(request)
            runtime = self._ready()
        except HttpError as error:  # counted, but no span: the caller may be anyone
            _count_refusal(RequestRecord(self.serving.metrics, "http"), error)
            return error.response()
        # In flight from here (a drain waits for it) to the end of its response, which releases
        # it; a refusal before that is released here.
        call = self.serving.admit()
        try:
            response = await self._admitted(request, runtime, request_id, call, chat=chat)
        except BaseException:
            self.serving.release(call)
            raise
        if not isinstance(response, GenerationResponse):
            self.serving.release(call)
        return response

    async def _admitted(
        self, request: Request, runtime: Runtime, request_id: str, call: Call, *, chat: bool
    ) -> Response:
        span_name = f"{request.method} {request.url.path}"
        record = self.serving.record("http", span_name, request_id, request.headers)
        try:
            parsed = await self._parse(request, runtime, chat=chat)
        except HttpError as error:
            _count_refusal(record, error)
            return error.response()
        except ClientDisconnect:  # nothing can be answered: the connection is gone
            log.info("client_gone", request_id=request_id, api="http", stage="body")
            record.code = grpc.StatusCode.CANCELLED
            record.close()
            return _NoResponse()
        except asyncio.CancelledError:
            if call.cut is None:
                record.code = grpc.StatusCode.CANCELLED
                record.close()
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            # Cut mid-body by the end of a drain: refused as a late call is, and closed.
            refusal = HttpError(503, str(call.cut), code="unavailable", close=True)
            _count_refusal(record, refusal)
            return refusal.response()
        parsed.ignored.log(request_id, request.url.path)  # (listed in its answer's headers)
        tools = parsed.params.tools
        calls = tools is not None and tools.calls
        completion = Completion(
            chat=chat,
            request_id=request_id,
            model=self.model_name,
            report_source=self.serving.report_draft_source,
            texts=self.serving.token_texts(runtime),
            tool_calls=(
                ChoiceParsers(runtime.tool_format, runtime.engine.target.tokenizer)
                if calls
                else None
            ),
        )
        return GenerationResponse(
            self.serving,
            runtime,
            parsed,
            completion,
            record,
            headers={REQUEST_ID_HEADER: request_id, **parsed.ignored.header()},
            tenant=self.serving.tenant(request.headers.get("authorization", "")),
            call=call,
        )

    def _admit(self, request: Request) -> None:
        """The caller may call: its Host and Origin (without tokens) or its bearer token."""
        if self.hosts is not None:
            self.hosts.check(request.headers)
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
            # Draining: the connection closes too, so that the client's retry opens a new one
            # (through a balancer, to another replica).
            raise HttpError(
                503,
                str(error),
                code="unavailable",
                close=self.serving.draining,
                headers={"retry-after": str(max(1, RETRY_AFTER_MS // 1000))},
            ) from None

    def _check_model(self, model: str, param: str) -> None:
        if model != self.model_name:
            raise HttpError(
                404,
                f"the model {model!r} is not served here; this server serves {self.model_name!r}",
                param=param,
                code="model_not_found",
            )

    async def _parse(self, request: Request, runtime: Runtime, *, chat: bool) -> OpenAIRequest:
        """The typed request of the body, or the HttpError that says what is wrong with it."""
        check_json_content_type(request.headers)
        data = await self._body(request)
        try:
            parsed = parse_request(
                bytes(data), chat=chat, limits=runtime.limits, defaults=runtime.defaults
            )
        except InvalidParameter as error:
            raise HttpError(400, str(error), param=error.field) from None
        except InvalidBody as error:
            raise HttpError(400, str(error), param=error.param) from None
        self._check_model(parsed.model, "model")
        return parsed

    async def _body(self, request: Request) -> bytearray:
        """The body, read up to the size limit (413 beyond it) within the body timeout (408
        past it: a client that trickles its body must not hold the connection forever)."""
        limit, timeout = self.limits.max_body_bytes, self.limits.body_timeout_s
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        data = bytearray()
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(len(data), limit)
        except TimeoutError:
            log.info("body_timeout", received_bytes=len(data), timeout_s=timeout)
            message = f"the body did not arrive within {timeout:g} s (--http-body-timeout-s)"
            raise HttpError(408, message, code="body_timeout", close=True) from None
        return data


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
    message = f"the body is {size} bytes or more; the server limit is {limit}"
    return HttpError(413, message, close=True)


def _count_refusal(record: RequestRecord, error: HttpError) -> None:
    record.code = _STATUS_NAMES.get(error.status, grpc.StatusCode.UNKNOWN)
    record.close()


class _NoResponse(Response):
    """For a client that has gone: there is no one to answer."""

    def __init__(self) -> None:
        super().__init__(status_code=499)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return HttpError(404, f"no route {request.url.path}", code="not_found").response()


async def _not_allowed(request: Request, exc: Exception) -> JSONResponse:
    message = f"{request.method} is not allowed on {request.url.path}"
    return HttpError(405, message, code="method_not_allowed").response()
