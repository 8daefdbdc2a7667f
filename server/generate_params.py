"""From a GenerateRequest to engine parameters, checked against the server's limits."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kenspec.api import generator_pb2 as pb
from kenspec.server.engine.grammar import GrammarSpec
from kenspec.server.engine.params import (
    CHAIN_TOKENS,
    MAX_TOP_LOGPROBS,
    InvalidParameter,
    ProcessorParams,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.tool_calls.request import (
    MAX_TOOLS,
    ToolRequest,
    history_call,
    tool_of,
    tool_request,
)

ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID = 128  # characters; the id is echoed in every streamed message and logged


@dataclass(frozen=True, slots=True)
class Limits:
    default_max_new_tokens: int  # a request that sets none: this, cut to the context left
    max_new_tokens: int  # the most a request may ask for (it must fit the context too)
    max_prompt_tokens: int
    max_prompt_chars: int  # checked before tokenizing: see prompt_char_limit
    tokenize_concurrency: int  # large inputs tokenized at once (serving.LARGE_INPUT_CHARS)
    max_stop_sequences: int
    max_stop_length: int


@dataclass(frozen=True, slots=True)
class Defaults:
    num_draft_tokens: int  # the cap on a round's draft tokens (nodes)
    adaptive: bool
    chain_tokens: int = CHAIN_TOKENS  # k, an ordinary chain's length


@dataclass(frozen=True, slots=True)
class GenerateParams:
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None  # role, content; tool_calls, tool_call_id
    sampling: SamplingParams
    stopping: StoppingParams
    speculation: SpeculationParams
    grammar: GrammarSpec | None = None  # response_format: what the output must match
    processing: ProcessorParams = field(default_factory=ProcessorParams)  # penalties, bias
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token (0-20)
    n: int = 1  # choices, each a stream against the limits
    # The request set no token limit: stopping holds the server's default, which
    # fit_stopping cuts to the context the prompt leaves (one set is refused if it does not fit).
    default_tokens: bool = False
    tokens_field: str = "max_new_tokens"  # the token limit as the request calls it
    tools: ToolRequest | None = None  # functions the model may call (server.tool_calls)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise InvalidParameter("n", f"must be >= 1, got {self.n}")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameter(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )


def parse_input(
    request: pb.GenerateRequest | pb.TokenizeRequest,
) -> tuple[str | None, tuple | None]:
    """The raw prompt or the chat messages; exactly one, and not empty."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidParameter("input", "set exactly one of prompt or messages")
    if which == "prompt":
        if not request.prompt:
            raise InvalidParameter("prompt", "must not be empty")
        return request.prompt, None
    messages = request.messages.messages
    if not messages:
        raise InvalidParameter("messages", "must contain at least one message")
    return None, tuple(_message(index, message) for index, message in enumerate(messages))


def _message(index: int, message: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as templates read it (past calls' arguments parsed from their JSON)."""
    where = f"messages[{index}]"
    if message.role not in ROLES:
        raise InvalidParameter(
            f"{where}.role", f"{message.role!r} is not one of {', '.join(ROLES)}"
        )
    parsed: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidParameter(f"{where}.tool_calls", "only an assistant message makes calls")
        parsed["tool_calls"] = [
            history_call(call.id, call.name, call.arguments, f"{where}.tool_calls[{number}]")
            for number, call in enumerate(message.tool_calls)
        ]
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidParameter(f"{where}.tool_call_id", "required: the id of the call")
        parsed["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id:
        raise InvalidParameter(f"{where}.tool_call_id", "only a tool message answers a call")
    return parsed


def _tools(request: pb.GenerateRequest) -> ToolRequest | None:
    """tools, tool_choice, tool_function and parallel_tool_calls (server.tool_calls)."""
    tools = tuple(
        tool_of(
            {
                "name": tool.name,
                "description": tool.description,
                "parameters": _schema(tool.parameters, f"tools[{index}].parameters"),
            },
            f"tools[{index}]",
        )
        for index, tool in enumerate(request.tools)
    )
    if len({tool.name for tool in tools}) < len(tools):
        raise InvalidParameter("tools", "a function is offered twice")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameter("tools", f"{len(tools)} tools; the limit is {MAX_TOOLS}")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    if tools and request.WhichOneof("input") != "messages":
        raise InvalidParameter("tools", "need messages (a chat), not a raw prompt")
    if request.tool_function:
        if request.tool_choice not in (pb.TOOL_CHOICE_UNSPECIFIED, pb.TOOL_CHOICE_REQUIRED):
            raise InvalidParameter("tool_function", "set with tool_choice unset or REQUIRED")
        function = {"type": "function", "function": {"name": request.tool_function}}
        return tool_request(tools, function, parallel, "tool_function")
    choice = _TOOL_CHOICES.get(request.tool_choice)
    if choice is None:  # (an open enum: any number arrives)
        raise InvalidParameter("tool_choice", f"{request.tool_choice} is not a ToolChoice")
    return tool_request(tools, choice, parallel)


_TOOL_CHOICES = {
    pb.TOOL_CHOICE_UNSPECIFIED: "auto",
    pb.TOOL_CHOICE_AUTO: "auto",
    pb.TOOL_CHOICE_NONE: "none",
    pb.TOOL_CHOICE_REQUIRED: "required",
}


def _schema(text: str, where: str) -> object:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidParameter(where, "must be a JSON schema as JSON text") from None


def check_request_id(request_id: str) -> None:
    """A client's request id: at most MAX_REQUEST_ID printable ASCII characters (it is echoed in
    every streamed message and written to every log line of the request)."""
    if len(request_id) > MAX_REQUEST_ID:
        raise InvalidParameter(
            "request_id", f"{len(request_id)} characters; the limit is {MAX_REQUEST_ID}"
        )
    for position, character in enumerate(request_id):
        if not " " <= character <= "~":
            raise InvalidParameter(
                "request_id",
                f"character {position} is {character!r}: only printable ASCII is allowed",
            )


def parse_generate(
    request: pb.GenerateRequest, limits: Limits, defaults: Defaults
) -> GenerateParams:
    prompt, messages = parse_input(request)
    if request.top_logprobs and not request.logprobs:
        raise InvalidParameter("top_logprobs", "needs logprobs set")
    tools = _tools(request)
    grammar = _grammar(request)
    if tools is not None and tools.calls and grammar is not None:
        raise InvalidParameter(
            "response_format", "cannot be combined with tools unless tool_choice is NONE"
        )
    return GenerateParams(
        prompt=prompt,
        messages=messages,
        sampling=_sampling(request.sampling),
        stopping=_stopping(request.stopping, limits),
        speculation=_speculation(request.speculation, defaults),
        grammar=grammar,
        processing=_processing(request.sampling),
        top_logprobs=request.top_logprobs if request.logprobs else None,
        n=request.n or 1,
        default_tokens=request.stopping.max_new_tokens == 0,
        tools=tools,
    )


def _grammar(request: pb.GenerateRequest) -> GrammarSpec | None:
    """The response format's grammar; None when unset (free text). Compiled by the engine."""
    if not request.HasField("response_format"):
        return None
    which = request.response_format.WhichOneof("format")
    if which is None:
        raise InvalidParameter(
            "response_format", "set one of json_object, json_schema, regex, lark"
        )
    if which == "json_object":
        return GrammarSpec("json_object")
    source = getattr(request.response_format, which)
    if not source:
        raise InvalidParameter(f"response_format.{which}", "must not be empty")
    return GrammarSpec(which, source)


def prompt_char_limit(max_prompt_chars: int, max_prompt_tokens: int, vocab: Iterable[str]) -> int:
    """The most characters an input may have: `max_prompt_chars` when set, else the token limit
    times the longest token of the vocabulary. A token covers at most as many characters of
    the text as its vocabulary entry has (byte-level BPE: an entry is one character per byte;
    SentencePiece: one per character, a byte-fallback entry six for one), so text over that
    many characters is over the token limit too. A tokenizer that maps a whole unknown word to
    one token, or normalizes text into fewer characters, can beat it: set the limit there."""
    if max_prompt_chars:
        return max_prompt_chars
    return max_prompt_tokens * max(map(len, vocab), default=1)


def check_prompt_chars(field: str, chars: int, limits: Limits) -> None:
    """Refuse an input over the character limit, before any tokenizer work is spent on it."""
    if chars > limits.max_prompt_chars:
        raise InvalidParameter(
            field,
            f"{chars} characters exceed the server limit of {limits.max_prompt_chars} "
            f"(prompts are limited to {limits.max_prompt_tokens} tokens)",
        )


def check_prompt_length(prompt_tokens: int, limits: Limits, field: str = "prompt") -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        raise InvalidParameter(
            field,
            f"{prompt_tokens} tokens exceed the server limit of {limits.max_prompt_tokens}",
        )


def _sampling(sampling: pb.SamplingParameters) -> SamplingParams:
    _no_nan(sampling, "temperature", "top_p", "min_p")
    top_p = 1.0 if sampling.top_p == 0.0 else sampling.top_p  # proto3 default 0 = no filter
    seed = sampling.seed if sampling.HasField("seed") else None
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=top_p,
        seed=seed,
        min_p=sampling.min_p,
    )


def _processing(sampling: pb.SamplingParameters) -> ProcessorParams:
    _no_nan(sampling, "presence_penalty", "frequency_penalty", "repetition_penalty")
    for token_id, amount in sampling.logit_bias.items():
        if math.isnan(amount):
            raise InvalidParameter(f"sampling.logit_bias[{token_id}]", "must be a number, not NaN")
    repetition = sampling.repetition_penalty or 1.0  # proto3 default 0 = none
    return ProcessorParams(
        repetition_penalty=repetition,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
    )


def _no_nan(sampling: pb.SamplingParameters, *names: str) -> None:
    for name in names:
        if math.isnan(getattr(sampling, name)):
            raise InvalidParameter(f"sampling.{name}", "must be a number, not NaN")


def _stopping(stopping: pb.StoppingCriteria, limits: Limits) -> StoppingParams:
    return stopping_params(
        stopping.max_new_tokens or None, stopping.stop, stopping.ignore_eos, limits
    )


def stopping_params(
    max_new_tokens: int | None,
    stop: Sequence[str],
    ignore_eos: bool,
    limits: Limits,
    *,
    tokens_field: str = "max_new_tokens",
) -> StoppingParams:
    """When to stop, checked against the server's limits (both APIs; `tokens_field` names the
    token limit as the request called it). None: the server's default."""
    max_new_tokens = max_new_tokens or limits.default_max_new_tokens
    if max_new_tokens > limits.max_new_tokens:
        raise InvalidParameter(
            tokens_field,
            f"{tokens_field}={max_new_tokens} exceeds the server limit of {limits.max_new_tokens}",
        )
    if len(stop) > limits.max_stop_sequences:
        raise InvalidParameter(
            "stop", f"{len(stop)} stop sequences; the limit is {limits.max_stop_sequences}"
        )
    for index, text in enumerate(stop):
        if len(text) > limits.max_stop_length:
            raise InvalidParameter(
                f"stop[{index}]",
                f"{len(text)} characters; the limit is {limits.max_stop_length}",
            )
    return StoppingParams(max_new_tokens=max_new_tokens, stop=tuple(stop), ignore_eos=ignore_eos)


def fit_stopping(
    params: GenerateParams, prompt_tokens: int, max_context: int, prompt_field: str = "prompt"
) -> StoppingParams:
    """The request's stopping once its prompt is tokenized, as vLLM has it: a token limit the
    request left to the server is cut to the context the prompt leaves (the generation then
    ends with finish reason length at the context's end); one the request set must fit with
    the prompt, else it is refused naming both numbers (never silently cut)."""
    stopping, room = params.stopping, max_context - prompt_tokens
    if room < 1:
        raise InvalidParameter(
            prompt_field,
            f"{prompt_tokens} tokens fill the model's context of {max_context} tokens: "
            "no room is left for a new token",
        )
    if params.default_tokens:
        return replace(stopping, max_new_tokens=min(stopping.max_new_tokens, room))
    if stopping.max_new_tokens > room:
        name = params.tokens_field
        raise InvalidParameter(
            name,
            f"the prompt ({prompt_tokens} tokens) + {name} ({stopping.max_new_tokens}) exceed "
            f"the model's context of {max_context} tokens: at most {room} fit after this "
            f"prompt (leave {name} unset for the rest of the context)",
        )
    return stopping


def _speculation(speculation: pb.SpeculationParameters, defaults: Defaults) -> SpeculationParams:
    if speculation.mode not in pb.SpeculationMode.values():
        raise InvalidParameter("speculation.mode", f"unknown mode {speculation.mode}")
    if speculation.draft_context not in pb.DraftContext.values():
        raise InvalidParameter(
            "speculation.draft_context", f"unknown value {speculation.draft_context}"
        )
    adaptive = speculation.adaptive if speculation.HasField("adaptive") else None
    context = {pb.DRAFT_CONTEXT_ON: True, pb.DRAFT_CONTEXT_OFF: False}.get(
        speculation.draft_context
    )
    return speculation_params(
        enabled=speculation.mode != pb.SPECULATION_MODE_OFF,
        num_draft_tokens=speculation.num_draft_tokens or None,
        adaptive=adaptive,
        draft_context=context,
        defaults=defaults,
    )


def speculation_params(
    *,
    enabled: bool,
    num_draft_tokens: int | None,
    adaptive: bool | None,
    draft_context: bool | None,
    defaults: Defaults,
) -> SpeculationParams:
    """How much to draft (both APIs), range-checked by SpeculationParams; None: the server's
    default (for draft_context, decided per request by the engine)."""
    return SpeculationParams(  # its range is checked there, once, for flags and requests alike
        enabled=enabled,
        num_draft_tokens=num_draft_tokens or defaults.num_draft_tokens,
        chain_tokens=defaults.chain_tokens,
        adaptive=defaults.adaptive if adaptive is None else adaptive,
        draft_context=draft_context,
    )
