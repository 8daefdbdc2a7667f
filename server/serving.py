"""What the gRPC and the HTTP APIs share: readiness, prompts to token ids, one generation's
rounds under the server's limits, how a failed call is reported, and each call's metrics.

Both APIs turn their request into GenerateParams, ask `Serving.generate` for the rounds and
write them out in their own framing; one scheduler, one batch, one set of limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
import structlog
import torch

from kenspec.api.outputs import FinishReason
from kenspec.server.engine.detokenizer import TokenTexts
from kenspec.server.engine.extras import ExtraMissing
from kenspec.server.engine.generation import Generation, Round
from kenspec.server.engine.grammar import GrammarSpec
from kenspec.server.engine.params import InvalidParameter, SamplingParams
from kenspec.server.engine.tenant_index import SHARED_TENANT
from kenspec.server.generate_params import (
    GenerateParams,
    Limits,
    check_prompt_chars,
    check_prompt_length,
    fit_stopping,
)
from kenspec.server.metrics import Metrics
from kenspec.server.request_spans import NO_SPAN, NO_TRACING, Carrier, RequestSpan, Tracing
from kenspec.server.runtime import Runtime
from kenspec.server.scheduler import Overloaded, Scheduler
from kenspec.server.security import tenant_of
from kenspec.server.tool_calls.request import ToolRequest, content_chars

log = structlog.get_logger("kenspec.service")

# A call refused for load says when to retry: gRPC in a trailer (gRFC A6's server pushback,
# which gRPC's built-in retries honour), HTTP in a Retry-After header.
RETRY_AFTER_MS = 1000
# Inputs of this many characters or more are tokenized under a permit (Serving._off_loop):
# about 10 ms of tokenizer time; shorter ones are not worth a wait.
LARGE_INPUT_CHARS = 16_384

_In = TypeVar("_In")
_Out = TypeVar("_Out")


class Unavailable(Exception):
    """The model is still loading, or the server is draining."""


class ShutDown(Unavailable):
    """The server stopped before the call finished: the drain's grace period ran out."""

    def __init__(self, grace_s: float) -> None:
        super().__init__(
            "the server shut down before this call finished (its drain's grace period, "
            f"--grace-period-s {grace_s:g}, ran out); retry on another replica"
        )


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


class Call:
    """A generate call admitted (past `Serving.ready`) and not yet ended: a drain waits for
    it, and when the grace period runs out cuts it, cancelling its task with `cut` set, which
    the API's handler then reports to the client (an error event, UNAVAILABLE)."""

    __slots__ = ("cut", "task")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task = task
        self.cut: ShutDown | None = None


class Serving:
    """The loaded runtime and the scheduler, as both APIs reach them."""

    def __init__(
        self,
        scheduler: Scheduler,
        metrics: Metrics,
        max_deadline_s: float = 600.0,
        stall_timeout_s: float = 30.0,
        tracing: Tracing = NO_TRACING,
        *,
        tokens: tuple[bytes, ...] = (),
        report_draft_source: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.tokens = tokens  # the allowed bearer tokens: each is a tenant (none: one tenant)
        self.report_draft_source = report_draft_source  # each round's source, to the caller
        self.metrics = metrics
        self.tracing = tracing
        self.max_deadline_s = max_deadline_s
        self.stall_timeout_s = stall_timeout_s
        self.runtime: Runtime | None = None  # set once the model is loaded and warm
        self.draining = False  # set when a drain starts: new calls are refused at once
        self._calls: set[Call] = set()  # generate calls admitted and not ended (see admit)
        self._idle = asyncio.Event()  # set while no call is admitted
        self._idle.set()
        self._large_inputs: asyncio.Semaphore | None = None  # see _off_loop
        self._texts: TokenTexts | None = None  # see token_texts

    @property
    def serving(self) -> bool:
        """What the health checks report: loaded, warm and not draining."""
        return self.runtime is not None and not self.draining

    def ready(self) -> Runtime:
        """The runtime, or Unavailable with what the caller should do."""
        if self.draining:
            raise Unavailable(
                "the server is draining (shutting down): calls in flight finish, new ones are "
                "refused; retry on another replica"
            )
        if self.runtime is None:
            raise Unavailable(
                "the model is still loading; retry when the health check reports SERVING"
            )
        return self.runtime

    def admit(self) -> Call:
        """Count the current task's generate call as in flight until `release`: call it at
        once after `ready()` (no await between, so no call is admitted once a drain began)."""
        call = Call(asyncio.current_task())
        self._calls.add(call)
        self._idle.clear()
        return call

    def release(self, call: Call) -> None:
        self._calls.discard(call)
        if not self._calls:
            self._idle.set()

    @property
    def calls_in_flight(self) -> int:
        return len(self._calls)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generate call is in flight, at most `timeout_s`; True if none is."""
        if not self._calls:
            return True
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return not self._calls
        return True

    def cut(self, error: ShutDown) -> int:
        """End every generate call in flight: each task is cancelled with `error` set on its
        Call, for its handler to report. Returns how many were cut."""
        cut = 0
        for call in self._calls:
            if call.cut is None and call.task is not None:
                call.cut = error
                call.task.cancel(str(error))
                cut += 1
        return cut

    def record(self, api: str, name: str, request_id: str, carrier: Carrier) -> RequestRecord:
        """A generate call's record (its metrics, and its span named `name` when tracing is
        on, a child of the trace context in `carrier`: gRPC metadata or HTTP headers)."""
        span = self.tracing.request_span(api, name, request_id, carrier)
        return RequestRecord(self.metrics, api, span)

    async def encode(
        self,
        runtime: Runtime,
        prompt: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt or a chat (with the `tools` it offers, as the model's
        format has them), refused before any tokenizer work when over the character limit; a
        model without a chat template (or whose template refuses the messages) is bad input."""
        target, limits = runtime.engine.target, runtime.limits
        if prompt is not None:
            check_prompt_chars("prompt", len(prompt), limits)
            return await self._off_loop(len(prompt), limits, target.encode_prompt, prompt)
        # The words first (no template work on a chat whose words alone are too long), then
        # the rendered chat, which adds the template's text and the tools' descriptions.
        check_prompt_chars("messages", content_chars(messages or ()), limits)
        chat, described = runtime.tool_format.chat(messages or (), tools)
        try:
            text = await self._off_loop(
                0, limits, lambda chat: target.chat_text(chat, described), chat
            )
        except ValueError as error:
            raise InvalidParameter("messages", str(error)) from error
        check_prompt_chars("messages", len(text), limits)
        return await self._off_loop(len(text), limits, target.encode_chat_text, text)

    async def _off_loop(
        self, chars: int, limits: Limits, function: Callable[[_In], _Out], argument: _In
    ) -> _Out:
        """`function(argument)` in a worker thread. An input of LARGE_INPUT_CHARS or more
        first takes one of the `tokenize_concurrency` permits, held until its thread is done,
        even if the caller leaves meanwhile (a thread cannot be stopped): tokenizers release
        the GIL, so the permits are what bounds the CPU that huge inputs take from the engine,
        the health checks and everyone else's short prompts, which never wait for them."""
        if chars < LARGE_INPUT_CHARS:
            return await asyncio.to_thread(function, argument)
        if self._large_inputs is None:  # made in the serving loop, sized by the runtime
            self._large_inputs = asyncio.Semaphore(limits.tokenize_concurrency)
        permits = self._large_inputs
        await permits.acquire()
        work = asyncio.ensure_future(asyncio.to_thread(function, argument))
        work.add_done_callback(lambda done: _release(permits, done))
        return await asyncio.shield(work)

    def token_texts(self, runtime: Runtime) -> TokenTexts:
        """Each token's text for logprobs, cached per loaded tokenizer."""
        tokenizer = runtime.engine.target.tokenizer
        if self._texts is None or self._texts.tokenizer is not tokenizer:
            self._texts = TokenTexts(tokenizer)
        return self._texts

    def tenant(self, authorization: str) -> str:
        """The tenant of a call with this `authorization` value (security.tenant_of)."""
        return tenant_of(authorization, self.tokens)

    async def generate(
        self,
        runtime: Runtime,
        params: GenerateParams,
        request_id: str,
        record: RequestRecord,
        *,
        tenant: str = SHARED_TENANT,
    ) -> AsyncIterator[Round]:
        """The request's rounds as the batch verifies them: encoded, checked against the
        limits, queued for a slot within the deadline cap, then streamed from the batch."""
        if params.n > self.scheduler.max_active:
            raise InvalidParameter(
                "n",
                f"n={params.n} exceeds the server's {self.scheduler.max_active} concurrent "
                "streams (each choice is one)",
            )
        prompt_ids = await self.encode(runtime, params.prompt, params.messages, params.tools)
        prompt_field = "prompt" if params.prompt is not None else "messages"
        check_prompt_length(len(prompt_ids), runtime.limits, prompt_field)
        max_context = runtime.engine.target.max_context
        stopping = fit_stopping(params, len(prompt_ids), max_context, prompt_field)
        try:
            slot = await asyncio.wait_for(
                self.scheduler.acquire(params.n), record.remaining(self.max_deadline_s)
            )
        except TimeoutError:
            raise DeadlineCapExceeded(self.max_deadline_s) from None
        async with slot:
            generations = [
                runtime.engine.start(
                    prompt_ids,
                    sampling=sampling,
                    stopping=stopping,
                    speculation=params.speculation,
                    request_id=request_id,
                    tenant=tenant,
                    grammar=turn_grammar(runtime, params),
                    processing=params.processing,
                    top_logprobs=params.top_logprobs,
                    choice=choice,
                )
                for choice, sampling in enumerate(choice_sampling(params.sampling, params.n))
            ]
            started = time.perf_counter()
            outcome, last = "cancelled", None
            try:
                rounds = self._rounds(runtime, generations)
                async with contextlib.aclosing(rounds):
                    async for last in rounds:
                        record.observe(last)
                        yield last
                        # Checked between rounds: the cap is overshot by at most one round.
                        unfinished = any(not g.finished for g in generations)
                        if unfinished and record.remaining(self.max_deadline_s) <= 0:
                            raise DeadlineCapExceeded(self.max_deadline_s)
                outcome = "finished"
            except asyncio.CancelledError:
                raise
            except Exception:
                outcome = "failed"
                raise
            finally:
                _log_summary(last, outcome, time.perf_counter() - started)

    def _rounds(self, runtime: Runtime, generations: Sequence[Generation]) -> AsyncIterator[Round]:
        """The generations' rounds from the batch as they come; every choice after the first
        shares the first one's prefill."""
        batch, first = runtime.engine.batch, generations[0]
        streams = [
            self.scheduler.stream(batch, generation, follows=first if index else None)
            for index, generation in enumerate(generations)
        ]
        return streams[0] if len(streams) == 1 else merged(streams)


def choice_sampling(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """Each of n choices' sampling: one choice keeps the request's (its seed, or one the
    engine picks); with n > 1, choice i draws with seed + i (a random seed when unset), so
    each choice equals a single-choice request with that seed."""
    if n == 1:
        return [sampling]
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    return [replace(sampling, seed=(seed + index) % 2**63) for index in range(n)]


async def merged(streams: Sequence[AsyncIterator[Round]]) -> AsyncIterator[Round]:
    """The items of several streams as they come; the first failure ends (and closes) all."""
    queue: asyncio.Queue[Round | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Round]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    queue.put_nowait(item)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            queue.put_nowait(error)

    pumps = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        ended = 0
        while ended < len(pumps):
            item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class Failure:
    """How a failed call is reported: its gRPC status, its HTTP status, and the message."""

    code: grpc.StatusCode
    http_status: int
    message: str


# By exception: the status in each API, and the message: the exception's own (None) or a
# template. Anything else is a bug: INTERNAL, with a request id to report.
_FAILURES: tuple[tuple[type[BaseException], grpc.StatusCode, int, str | None], ...] = (
    (Unavailable, grpc.StatusCode.UNAVAILABLE, 503, None),
    (DeadlineCapExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, 504, None),
    (StreamStalled, grpc.StatusCode.DEADLINE_EXCEEDED, 408, None),
    (InvalidParameter, grpc.StatusCode.INVALID_ARGUMENT, 400, None),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
    (ExtraMissing, grpc.StatusCode.UNIMPLEMENTED, 501, None),  # server.extras
    (
        torch.OutOfMemoryError,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        503,
        "the target ran out of memory on this request (request_id={request_id}); "
        "retry with a shorter prompt or fewer new tokens",
    ),
    (Exception, grpc.StatusCode.INTERNAL, 500, "internal error (request_id={request_id})"),
)


def failure_of(error: Exception, request_id: str) -> Failure:
    """How a call that raised `error` ends (never with a traceback); bugs are logged."""
    for kind, code, http_status, template in _FAILURES:
        if isinstance(error, kind):
            if template is None:  # the caller's input or the server's load: nothing to log
                return Failure(code, http_status, str(error))
            log.exception("generate_failed", code=code.name)
            return Failure(code, http_status, template.format(request_id=request_id))
    raise AssertionError("unreachable: the table ends with Exception")


class RequestRecord:
    """One generate call's metrics: time to first token, gaps between rounds, the outcome
    (labelled by the API it came through), and once finished its latency, prompt tokens and
    time per output token; its span sees the same rounds and outcome."""

    def __init__(self, metrics: Metrics, api: str, span: RequestSpan = NO_SPAN) -> None:
        self._metrics = metrics
        self._api = api
        self._span = span
        self._started = self._last = self._first_at = time.perf_counter()
        self._first = True
        self._tokens = self._first_tokens = self._choice_tokens = self._prompt_tokens = 0
        self.code = grpc.StatusCode.UNKNOWN
        self.finish_reason: FinishReason | None = None

    def remaining(self, cap_s: float) -> float:
        return cap_s - (time.perf_counter() - self._started)

    def observe(self, round_: Round) -> None:
        now = time.perf_counter()
        histogram = self._metrics.ttft if self._first else self._metrics.round_seconds
        histogram.observe(now - self._last)
        if self._first:
            self._first_at = now
        if round_.choice == 0:  # time per output token is per sequence (vLLM's): the first's
            if not self._choice_tokens:
                self._first_tokens = len(round_.token_ids)
            self._choice_tokens += len(round_.token_ids)
        self._first, self._last = False, now
        self._tokens += len(round_.token_ids)
        if round_.usage is not None:  # (every choice's last round: the prompt is shared)
            self._prompt_tokens = round_.usage.prompt_tokens
        self._metrics.observe_round(round_)
        self._span.round(round_)
        if round_.finish_reason is not None:
            self.finish_reason = round_.finish_reason

    def close(self) -> None:
        reason = self.finish_reason.value if self.finish_reason else "none"
        self._metrics.count_request(self._api, reason, self.code.name)
        self._span.end(self.code)
        if self.finish_reason is None:
            return
        seconds = self._last - self._started
        metrics = self._metrics
        metrics.e2e_latency.observe(seconds)
        metrics.prompt_tokens.observe(self._prompt_tokens)
        if seconds > 0:
            metrics.tokens_per_second.observe(self._tokens / seconds)
        later = self._choice_tokens - self._first_tokens  # choice 0's after its first round
        if later > 0:
            metrics.time_per_output_token.observe((self._last - self._first_at) / later)


def _release(permits: asyncio.Semaphore, work: asyncio.Future) -> None:
    """A large input's thread is done: its permit is free, and its outcome read (a caller that
    left no longer awaits it, and an unread exception would be logged as an error)."""
    permits.release()
    if not work.cancelled():
        work.exception()


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


def turn_grammar(runtime: Runtime, params: GenerateParams) -> GrammarSpec | None:
    """What the output must match: the request's response_format, or, when it offers tools
    the model may call, the grammar of its turn (server.tool_calls.formats): stop sequences
    stay allowed (the text around calls is free; a stop inside a call ends it there)."""
    tools = params.tools
    if tools is None or not tools.calls:
        return params.grammar
    return GrammarSpec("lark", runtime.tool_format.grammar(tools), field="tools", stops=True)
