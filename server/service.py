"""The kenspec.v1.Generator servicer: a thin layer from gRPC to the engine (server.serving)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.api.convert import to_proto, usage_to_proto
from kenspec.api.outputs import FinishReason, TokenLogprob
from kenspec.server.engine.detokenizer import TokenTexts
from kenspec.server.engine.generation import Round
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.generate_params import (
    GenerateParams,
    check_prompt_length,
    check_request_id,
    parse_generate,
    parse_input,
)
from kenspec.server.runtime import Runtime
from kenspec.server.scheduler import Overloaded
from kenspec.server.serving import (
    RETRY_AFTER_MS,
    ClientGone,
    Serving,
    StreamStalled,
    Unavailable,
    failure_of,
)
from kenspec.server.tool_calls.parser import ChoiceParsers

log = structlog.get_logger("kenspec.service")

# gRFC A6's server pushback trailer: gRPC's built-in retries honour it, and the bundled client
# reads it into ServerBusy.retry_after_s.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
GENERATE_SPAN = "kenspec.v1.Generator/Generate"  # a gRPC span's name: service/method


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.metrics = serving.metrics

    async def Generate(
        self, request: pb.GenerateRequest | Unparseable, context: grpc.aio.ServicerContext
    ) -> None:
        request_id, bad_id = _request_id(request)
        metadata = context.invocation_metadata()
        # Made first, so that every call is counted, however early it fails.
        record = self.serving.record("grpc", GENERATE_SPAN, request_id, metadata)
        call = None  # admitted: counted by a drain, cut at the end of its grace
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                runtime = self._runtime(request)
                call = self.serving.admit()
                if bad_id is not None:
                    raise bad_id
                assert isinstance(request, pb.GenerateRequest)  # _runtime refuses the rest
                params = parse_generate(request, runtime.limits, runtime.defaults)
                tenant = self.serving.tenant(_authorization(metadata))
                rounds = self.serving.generate(runtime, params, request_id, record, tenant=tenant)
                report = self.serving.report_draft_source
                texts = self.serving.token_texts(runtime)
                calls = ToolCalls.of(runtime, params)
                async with contextlib.aclosing(rounds):
                    async for round_ in rounds:
                        response = to_response(round_, request_id, report, texts)
                        if calls is not None:
                            calls.split(response, round_)
                        await self._send(context, response)
                record.code = grpc.StatusCode.OK
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                if call is None or call.cut is None:
                    record.code = grpc.StatusCode.CANCELLED  # the client left
                    raise
                # Cut by the drain at the end of its grace: the client hears why.
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                failure = failure_of(call.cut, request_id)
                record.code = failure.code
                await context.abort(failure.code, failure.message)
            except ClientGone:
                record.code = grpc.StatusCode.CANCELLED  # left while a message was being sent
            except Exception as error:
                failure = failure_of(error, request_id)
                record.code = failure.code
                if isinstance(error, Overloaded):  # gRPC retry policies honour the pushback
                    context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(RETRY_AFTER_MS)),))
                await context.abort(failure.code, failure.message)
            finally:
                record.close()
                if call is not None:
                    self.serving.release(call)

    async def _send(self, context: grpc.aio.ServicerContext, response: pb.GenerateResponse) -> None:
        """Write one message; a client that reads nothing for stall_timeout_s loses its stream
        (gRPC's flow control holds a write once the client's window is full: without a limit,
        a client that stops reading would hold its slot, and its rounds, forever)."""
        timeout = self.serving.stall_timeout_s
        try:
            await asyncio.wait_for(context.write(response), timeout)
        except TimeoutError:
            self.metrics.stalled_streams.inc()
            raise StreamStalled(timeout) from None
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # gRPC fails a write to a call that ended while it was being sent: the client
            # cancelled, or its deadline passed (context.cancelled() does not say so yet at
            # that point). Nobody is left to tell; not a server fault.
            log.debug("write_failed", error=repr(error))
            raise ClientGone from error

    async def Tokenize(
        self, request: pb.TokenizeRequest | Unparseable, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """The same limits as Generate's prompt, checked the same way: over the character
        limit, refused before tokenizing; over max_prompt_tokens, refused with the count."""
        call_id = uuid.uuid4().hex[:16]  # in the log and the message of a server fault
        try:
            runtime = self._runtime(request)
            assert isinstance(request, pb.TokenizeRequest)  # _runtime refuses the rest
            prompt, messages = parse_input(request)
            with structlog.contextvars.bound_contextvars(request_id=call_id):
                ids = await self.serving.encode(runtime, prompt, messages)
            field = "prompt" if prompt is not None else "messages"
            check_prompt_length(len(ids), runtime.limits, field)
        except Exception as error:
            with structlog.contextvars.bound_contextvars(request_id=call_id):
                failure = failure_of(error, call_id)
            await context.abort(failure.code, failure.message)
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
        info.breaker.judged_by_time = runtime.engine.paced_breakers
        return info

    async def _ready(self, context: grpc.aio.ServicerContext, request: object) -> Runtime:
        try:
            return self._runtime(request)
        except (InvalidParameter, Unavailable) as error:
            failure = failure_of(error, "")
            await context.abort(failure.code, failure.message)
            raise  # unreachable: abort raises

    def _runtime(self, request: object) -> Runtime:
        """The runtime for a parsed request: bytes that did not parse are bad input (unless
        the server is draining: then they are told to go elsewhere, as every call is)."""
        if isinstance(request, Unparseable) and not self.serving.draining:
            raise request.error
        return self.serving.ready()


def _request_id(request: object) -> tuple[str, InvalidParameter | None]:
    """The call's request id: the client's, or a new one where it gave none or a bad one
    (returned beside it, to refuse the call once its record is made)."""
    given = getattr(request, "request_id", "")
    try:
        check_request_id(given)
    except InvalidParameter as error:
        return uuid.uuid4().hex[:16], error
    return given or uuid.uuid4().hex[:16], None


class Unparseable:
    """What arrives instead of a request whose bytes are not a valid message."""

    def __init__(self, type_name: str, error: str) -> None:
        self.error = InvalidParameter("request", f"not a valid {type_name}: {error}")


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


def _authorization(metadata) -> str:  # type: ignore[no-untyped-def]
    """The call's `authorization` metadata value ("" if none)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value.decode() if isinstance(value, bytes) else value
    return ""


def to_response(
    round_: Round, request_id: str, draft_source: bool = False, texts: TokenTexts | None = None
) -> pb.GenerateResponse:
    """One round's message; its draft source only with --report-draft-source (operators'
    diagnostics: docs/design.md, the suffix index's tenants); its tokens' logprobs when the
    request asked for them (with their texts from `texts`)."""
    response = pb.GenerateResponse(
        request_id=request_id,
        choice_index=round_.choice,
        token_ids=round_.token_ids,
        text=round_.text,
        round=pb.RoundInfo(
            index=round_.index,
            drafted=round_.drafted,
            accepted=round_.accepted,
            mode=to_proto(round_.mode),
            breaker_state=to_proto(round_.breaker_state),
            window_acceptance=round_.window_acceptance,
            draft_source=round_.source if draft_source else "",
        ),
    )
    if round_.finish_reason is not None:
        response.finish_reason = to_proto(round_.finish_reason)
    if round_.usage is not None:
        response.usage.CopyFrom(usage_to_proto(round_.usage))
    for logprob in round_.logprobs or ():
        response.logprobs.append(_logprob(logprob, texts))
    return response


class ToolCalls:
    """A request's answers split into text and tool calls (server.tool_calls.parser), one
    parser per choice."""

    def __init__(self, runtime: Runtime) -> None:
        self._parsers = ChoiceParsers(runtime.tool_format, runtime.engine.target.tokenizer)

    @classmethod
    def of(cls, runtime: Runtime, params: GenerateParams) -> ToolCalls | None:
        """For a request that lets the model call tools; None for any other."""
        return cls(runtime) if params.tools is not None and params.tools.calls else None

    def split(self, response: pb.GenerateResponse, round_: Round) -> None:
        """`response`'s text to the round's content, its calls to tool_calls; the finish
        reason TOOL_CALLS for an answer that made calls and ended by EOS."""
        parsed, ended = self._parsers.round(
            round_.choice, round_.text, round_.token_ids, round_.finish_reason
        )
        if ended == FinishReason.TOOL_CALLS:
            response.finish_reason = to_proto(FinishReason.TOOL_CALLS)
        response.text = parsed.content
        for delta in parsed.calls:
            response.tool_calls.append(
                pb.ToolCallDelta(
                    index=delta.index,
                    id=delta.id or "",
                    name=delta.name or "",
                    arguments=delta.arguments,
                )
            )


def _logprob(logprob: TokenLogprob, texts: TokenTexts | None) -> pb.TokenLogprob:
    def text(token_id: int) -> str:
        return texts.text_of(token_id) if texts is not None else ""

    return pb.TokenLogprob(
        token_id=logprob.token_id,
        logprob=logprob.logprob,
        token=text(logprob.token_id),
        top_logprobs=[
            pb.TopLogprob(token_id=token_id, logprob=value, token=text(token_id))
            for token_id, value in logprob.top
        ],
    )
