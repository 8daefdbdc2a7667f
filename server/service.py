"""The kenspec.v1.Generator servicer: a thin layer from gRPC to the engine via the scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import structlog
import torch

from client.api import generator_pb2 as pb
from client.api import generator_pb2_grpc as pb_grpc
from server.engine.generation import Generation
from server.engine.params import InvalidParameter
from server.engine.rounds import BreakerState, FinishReason, Mode, Round
from server.requests import GenerateParams, check_prompt_length, parse_generate, parse_input
from server.runtime import Runtime
from server.scheduler import Overloaded, Scheduler

log = structlog.get_logger("kenspec.service")

_MODES = {
    Mode.SPECULATIVE: pb.ROUND_MODE_SPECULATIVE,
    Mode.AUTOREGRESSIVE: pb.ROUND_MODE_AUTOREGRESSIVE,
}
_BREAKER = {
    BreakerState.CLOSED: pb.BREAKER_STATE_CLOSED,
    BreakerState.OPEN: pb.BREAKER_STATE_OPEN,
    BreakerState.HALF_OPEN: pb.BREAKER_STATE_HALF_OPEN,
}
_FINISH = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.runtime: Runtime | None = None  # set once the model is loaded and warm

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        runtime = await self._ready(context)
        request_id = request.request_id or uuid.uuid4().hex[:16]
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                params = parse_generate(request, runtime.limits, runtime.defaults)
                prompt_ids = await asyncio.to_thread(self._encode, runtime, params)
                check_prompt_length(len(prompt_ids), runtime.limits)
                async with self.scheduler.slot():
                    generation = runtime.engine.start(
                        prompt_ids,
                        sampling=params.sampling,
                        stopping=params.stopping,
                        speculation=params.speculation,
                        request_id=request_id,
                    )
                    async with contextlib.aclosing(self._stream(generation, request_id)) as rounds:
                        async for response in rounds:
                            yield response
            except InvalidParameter as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except Overloaded as error:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            except torch.OutOfMemoryError:
                log.exception("out_of_memory")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the target ran out of memory on this request (request_id={request_id}); "
                    "retry with a shorter prompt or fewer new tokens",
                )
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception:
                log.exception("generate_failed")
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"internal error (request_id={request_id})"
                )

    async def _stream(
        self, generation: Generation, request_id: str
    ) -> AsyncIterator[pb.GenerateResponse]:
        started = time.perf_counter()
        outcome = "cancelled"
        last: Round | None = None
        try:
            while not generation.finished:
                last = await self.scheduler.run(generation.step)
                yield to_response(last, request_id)
            outcome = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            # On the engine thread, after any round still in flight: never free a cache in use.
            self.scheduler.submit(generation.close)
            _log_summary(last, outcome, time.perf_counter() - started)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        runtime = await self._ready(context)
        try:
            prompt, messages = parse_input(request)
        except InvalidParameter as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        target = runtime.engine.target
        ids = await asyncio.to_thread(
            target.encode_prompt if prompt is not None else target.encode_chat,
            prompt if prompt is not None else messages,
        )
        tokens = target.tokenizer.convert_ids_to_tokens(ids) if request.return_tokens else []
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens, token_count=len(ids))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        runtime = await self._ready(context)
        info = pb.ModelInfo()
        info.CopyFrom(runtime.info)
        info.breaker.fault_breaker_state = _BREAKER[runtime.engine.faults.state]
        return info

    async def _ready(self, context: grpc.aio.ServicerContext) -> Runtime:
        if self.runtime is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the model is still loading; retry when the health service reports SERVING",
            )
        return self.runtime

    @staticmethod
    def _encode(runtime: Runtime, params: GenerateParams) -> list[int]:
        target = runtime.engine.target
        if params.prompt is not None:
            return target.encode_prompt(params.prompt)
        try:
            return target.encode_chat(params.messages or ())
        except ValueError as error:
            raise InvalidParameter("messages", str(error)) from error


def to_response(round_: Round, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=request_id,
        token_ids=round_.token_ids,
        text=round_.text,
        round=pb.RoundInfo(
            index=round_.index,
            drafted=round_.drafted,
            accepted=round_.accepted,
            mode=_MODES[round_.mode],
            breaker_state=_BREAKER[round_.breaker_state],
            window_acceptance=round_.window_acceptance,
        ),
    )
    if round_.finish_reason is not None:
        response.finish_reason = _FINISH[round_.finish_reason]
    if round_.usage is not None:
        usage = round_.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                drafted_tokens=usage.drafted_tokens,
                accepted_tokens=usage.accepted_tokens,
                rounds=usage.rounds,
                seed=usage.seed,
            )
        )
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
