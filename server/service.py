"""The kenspec.v1.Generator servicer: a thin layer from gRPC to the engine via the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import structlog
import torch
from google.protobuf.message import DecodeError, Message

from kenspec_api import generator_pb2 as pb
from kenspec_api import generator_pb2_grpc as pb_grpc
from kenspec_api.convert import to_proto, usage_to_proto
from kenspec_api.outputs import FinishReason
from server.engine.batch import Batch
from server.engine.generation import Generation, Round
from server.engine.params import InvalidParameter
from server.metrics import Metrics
from server.requests import check_prompt_length, check_request_id, parse_generate, parse_input
from server.runtime import Runtime
from server.scheduler import Overloaded, Scheduler

log = structlog.get_logger("kenspec.service")

# A call refused for load carries this trailer: when to retry (gRFC A6's server pushback, which
# gRPC's built-in retries honour; the bundled client reads it into ServerBusy.retry_after_s).
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
RETRY_AFTER_MS = 1000


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics | None = None,
        max_deadline_s: float = 600.0,
        stall_timeout_s: float = 30.0,
    ) -> None:
        self.scheduler = scheduler
        self.max_deadline_s = max_deadline_s
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics or Metrics()
        self.metrics.active_streams.set_function(lambda: scheduler.active)
        self.metrics.queue_depth.set_function(lambda: scheduler.waiting)
        self.runtime: Runtime | None = None  # set once the model is loaded and warm
        self.draining = False  # set when a drain starts: new calls are refused at once

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        runtime = await self._ready(context, request)
        try:
            check_request_id(request.request_id)
        except InvalidParameter as error:
            await context.abort(*status_of(error, request_id=""))
        request_id = request.request_id or uuid.uuid4().hex[:16]
        record = RequestRecord(self.metrics)
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                async with contextlib.aclosing(
                    self._generate(runtime, request, request_id, record)
                ) as responses:
                    async for response in responses:
                        await self._send(context, response)
                record.code = grpc.StatusCode.OK
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                record.code = grpc.StatusCode.CANCELLED  # the client left
                raise
            except ClientGone:
                record.code = grpc.StatusCode.CANCELLED  # left while a message was being sent
            except Exception as error:
                code, message = status_of(error, request_id)
                record.code = code
                if isinstance(error, Overloaded):  # gRPC retry policies honour the pushback
                    context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(RETRY_AFTER_MS)),))
                await context.abort(code, message)
            finally:
                record.close()

    async def _send(self, context: grpc.aio.ServicerContext, response: pb.GenerateResponse) -> None:
        """Write one message; a client that reads nothing for stall_timeout_s loses its stream
        (gRPC's flow control holds a write once the client's window is full: without a limit,
        a client that stops reading would hold its slot, and its rounds, forever)."""
        try:
            await asyncio.wait_for(context.write(response), self.stall_timeout_s)
        except TimeoutError:
            self.metrics.stalled_streams.inc()
            raise StreamStalled(self.stall_timeout_s) from None
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # gRPC fails a write to a call that ended while it was being sent: the client
            # cancelled, or its deadline passed (context.cancelled() does not say so yet at
            # that point). Nobody is left to tell; not a server fault.
            log.debug("write_failed", error=repr(error))
            raise ClientGone from error

    async def _generate(
        self, runtime: Runtime, request: pb.GenerateRequest, request_id: str, record: RequestRecord
    ) -> AsyncIterator[pb.GenerateResponse]:
        params = parse_generate(request, runtime.limits, runtime.defaults)
        prompt_ids = await asyncio.to_thread(self._encode, runtime, params.prompt, params.messages)
        check_prompt_length(len(prompt_ids), runtime.limits)
        try:
            slot = await asyncio.wait_for(
                self.scheduler.acquire(), record.remaining(self.max_deadline_s)
            )
        except TimeoutError:
            raise DeadlineCapExceeded(self.max_deadline_s) from None
        async with slot:
            generation = runtime.engine.start(
                prompt_ids,
                sampling=params.sampling,
                stopping=params.stopping,
                speculation=params.speculation,
                request_id=request_id,
            )
            responses = self._stream(runtime.engine.batch, generation, request_id, record)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response

    async def _stream(
        self, batch: Batch, generation: Generation, request_id: str, record: RequestRecord
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.perf_counter()
        outcome = "cancelled"
        last: Round | None = None
        try:
            rounds = self.scheduler.stream(batch, generation)
            async with contextlib.aclosing(rounds):
                async for last in rounds:
                    record.observe(last)
                    yield to_response(last, request_id)
                    # Checked between rounds: the cap is overshot by at most one round.
                    if not generation.finished and record.remaining(self.max_deadline_s) <= 0:
                        raise DeadlineCapExceeded(self.max_deadline_s)
            outcome = "finished"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            _log_summary(last, outcome, time.perf_counter() - started)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        runtime = await self._ready(context, request)
        try:
            prompt, messages = parse_input(request)
            ids = await asyncio.to_thread(self._encode, runtime, prompt, messages)
        except InvalidParameter as error:
            await context.abort(*status_of(error, request_id=""))
        target = runtime.engine.target
        tokens = target.tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, token_count=len(ids))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        runtime = await self._ready(context, request)
        info = pb.ModelInfo()
        info.CopyFrom(runtime.info)
        info.breaker.fault_breaker_state = to_proto(runtime.engine.draft_breaker_state)
        if info.breaker.threshold_calibrated:  # it follows the live pass costs
            info.breaker.threshold = runtime.engine.breaker_threshold()
        return info

    async def _ready(self, context: grpc.aio.ServicerContext, request: object = None) -> Runtime:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica"
            )
        if isinstance(request, Unparseable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if self.runtime is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the model is still loading; retry when the health service reports SERVING",
            )
        return self.runtime

    @staticmethod
    def _encode(
        runtime: Runtime, prompt: str | None, messages: Sequence[dict[str, str]] | None
    ) -> list[int]:
        """Token ids of a raw prompt or a chat; a model without a chat template is bad input."""
        target = runtime.engine.target
        if prompt is not None:
            return target.encode_prompt(prompt)
        try:
            return target.encode_chat(messages or ())
        except ValueError as error:
            raise InvalidParameter("messages", str(error)) from error


class ClientGone(Exception):
    """A message could not be written: the call ended on the client's side."""


class StreamStalled(Exception):
    """The client read nothing for the server's --stream-stall-timeout-s."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the client read nothing for {timeout_s:g} s (the server's stream stall timeout); "
            "the stream was cancelled"
        )


class DeadlineCapExceeded(Exception):
    """The request ran past the server's --max-deadline-s."""

    def __init__(self, cap_s: float) -> None:
        super().__init__(f"the request ran past the server's limit of {cap_s:g} s")


# The status of a Generate call that fails, by exception, with its message: the exception's own
# (None) or a template. Anything else is a bug: INTERNAL, with a request id to report.
_STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode, str | None], ...] = (
    (DeadlineCapExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, None),
    (StreamStalled, grpc.StatusCode.DEADLINE_EXCEEDED, None),
    (InvalidParameter, grpc.StatusCode.INVALID_ARGUMENT, None),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (
        torch.OutOfMemoryError,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the target ran out of memory on this request (request_id={request_id}); "
        "retry with a shorter prompt or fewer new tokens",
    ),
    (Exception, grpc.StatusCode.INTERNAL, "internal error (request_id={request_id})"),
)


def status_of(error: Exception, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a failed Generate call ends with (never a traceback)."""
    for kind, code, template in _STATUS_CODES:
        if isinstance(error, kind):
            if template is None:  # the caller's input or the server's load: nothing to log
                return code, str(error)
            log.exception("generate_failed", code=code.name)
            return code, template.format(request_id=request_id)
    raise AssertionError("unreachable: the table ends with Exception")


class Unparseable:
    """What arrives instead of a request whose bytes are not a valid message."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"the request is not a valid {type_name}: {error}"


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | Unparseable]:
    """gRPC answers INTERNAL when a deserializer raises; this lets the servicer answer
    INVALID_ARGUMENT for bytes that do not parse, as for any other bad input."""

    def parse(data: bytes) -> Message | Unparseable:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return Unparseable(message_type.DESCRIPTOR.full_name, str(error))

    return parse


def generator_handler(service: GeneratorService) -> grpc.GenericRpcHandler:
    """The kenspec.v1.Generator methods (as generated code registers them, lenient parsing)."""
    return grpc.method_handlers_generic_handler(
        pb.DESCRIPTOR.services_by_name["Generator"].full_name,
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                service.Generate,
                request_deserializer=_lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                service.Tokenize,
                request_deserializer=_lenient(pb.TokenizeRequest),
                response_serializer=pb.TokenizeResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                service.GetModelInfo,
                request_deserializer=_lenient(pb.GetModelInfoRequest),
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )


class RequestRecord:
    """One Generate call's metrics: time to first token, gaps between rounds, the outcome."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._started = self._last = time.perf_counter()
        self._first = True
        self._tokens = 0
        self.code = grpc.StatusCode.UNKNOWN
        self.finish_reason: FinishReason | None = None

    def remaining(self, cap_s: float) -> float:
        return cap_s - (time.perf_counter() - self._started)

    def observe(self, round_: Round) -> None:
        now = time.perf_counter()
        histogram = self._metrics.ttft if self._first else self._metrics.round_seconds
        histogram.observe(now - self._last)
        self._first, self._last = False, now
        self._tokens += len(round_.token_ids)
        self._metrics.observe_round(round_)
        if round_.finish_reason is not None:
            self.finish_reason = round_.finish_reason

    def close(self) -> None:
        reason = self.finish_reason.value if self.finish_reason else "none"
        self._metrics.requests.labels(finish_reason=reason, code=self.code.name).inc()
        seconds = self._last - self._started
        if self.finish_reason is not None and seconds > 0:
            self._metrics.tokens_per_second.observe(self._tokens / seconds)


def to_response(round_: Round, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=request_id,
        token_ids=round_.token_ids,
        text=round_.text,
        round=pb.RoundInfo(
            index=round_.index,
            drafted=round_.drafted,
            accepted=round_.accepted,
            mode=to_proto(round_.mode),
            breaker_state=to_proto(round_.breaker_state),
            window_acceptance=round_.window_acceptance,
            draft_source=round_.source,
        ),
    )
    if round_.finish_reason is not None:
        response.finish_reason = to_proto(round_.finish_reason)
    if round_.usage is not None:
        response.usage.CopyFrom(usage_to_proto(round_.usage))
    return response


def _log_summary(last: Round | None, outcome: str, seconds: float) -> None:
    usage = last.usage if last is not None else None
    if usage is None:
        log.info(
            "request_done",
            outcome=outcome,
            rounds=last.index + 1 if last else 0,
            seconds=round(seconds, 3),
        )
        return
    log.info(
        "request_done",
        outcome=outcome,
        finish_reason=last.finish_reason.value if last.finish_reason else None,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        drafted=usage.drafted_tokens,
        accepted=usage.accepted_tokens,
        acceptance=round(usage.accepted_tokens / usage.drafted_tokens, 3)
        if usage.drafted_tokens
        else None,
        rounds=usage.rounds,
        seconds=round(seconds, 3),
        tokens_per_s=round(usage.completion_tokens / seconds, 1) if seconds > 0 else None,
    )
