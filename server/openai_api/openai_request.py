"""From an OpenAI-shaped JSON body to GenerateParams, checked against the server's limits.

Every field of the body is either used; accepted at the only value kenspec serves
(``best_of: 1``, ``echo: false``, ...) and refused at any other with a 400
naming it (as are other servers' extensions kenspec cannot honour: ``guided_json``,
``min_tokens``, ...); or accepted and not acted on, as vLLM does, and then listed in the
answer's ``x-kenspec-ignored-fields`` header and the request's log line (ignored.py): OpenAI's
fields that ask nothing of the output (``metadata``, ``store``, ``service_tier``, a content
part's ``cache_control``, a message's ``name``, ...) and fields outside the API
(docs/http-api.md has the table). Nothing is ignored silently. Served with speculation on:
``n`` (each choice a stream against the limits), ``logprobs`` (chat: with ``top_logprobs``;
completions: the number of alternatives), ``presence_penalty``, ``frequency_penalty`` and
``logit_bias``. kenspec's own knobs are extra top-level fields (what the openai SDK sends as
``extra_body``): ``top_k``, ``min_p``, ``repetition_penalty``, ``speculation``,
``num_draft_tokens``, ``adaptive``, ``draft_context``, ``ignore_eos``. ``response_format``
(both routes) takes OpenAI's ``text``, ``json_object`` and ``json_schema``, and kenspec's
``regex`` and ``lark`` (docs/structured-output.md). Chat takes ``tools``, ``tool_choice`` and
``parallel_tool_calls``, ``tool`` messages and assistant messages with ``tool_calls``
(server.tool_calls; docs/tool-calls.md).

Types are checked strictly, as JSON has them (fields.py): ``true`` is not ``1`` (nor ``0``
``false``), an integer field takes no float, numbers are finite and within 64 bits; ``model``
and ``user`` are at most 256 characters, ``user`` without control characters (it is logged),
while prompts, message content and stop sequences may hold any text. ``parse_request`` is the
one way in from the body's bytes (``body.decode_body`` refuses what no field check should
meet: bad UTF-8, deep nesting, lone surrogates); a failure is ``InvalidBody`` or
``InvalidParameter``, both a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kenspec.server.engine.grammar import GrammarSpec, schema_text
from kenspec.server.engine.params import (
    MAX_LOGIT_BIAS,
    InvalidParameter,
    ProcessorParams,
    SamplingParams,
    SpeculationParams,
    StoppingParams,
)
from kenspec.server.generate_params import (
    Defaults,
    GenerateParams,
    Limits,
    speculation_params,
    stopping_params,
)
from kenspec.server.openai_api.body import decode_body
from kenspec.server.openai_api.fields import (
    absent_or,
    boolean,
    integer,
    key,
    name_field,
    number,
    shown,
)
from kenspec.server.openai_api.ignored import IGNORED_FIELDS, Ignored
from kenspec.server.tool_calls.request import ToolRequest, history_calls, parse_tools, tool_request

# OpenAI's default temperature and top_p (a request that leaves them out samples).
DEFAULT_TEMPERATURE = 1.0
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    model: str
    params: GenerateParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    user: str | None
    ignored: Ignored = field(default_factory=Ignored)  # accepted, not acted on


def _absent(value: object) -> bool:
    return value is None


def _empty(value: object) -> bool:
    return value is None or value == [] or value == {}


# Other servers' extensions kenspec cannot honour: ignoring one would change what the client
# asked for (an unconstrained answer for guided_json), so any value but the neutral one is a 400.
_EXTENSIONS: dict[str, tuple[Callable[[object], bool], str]] = {
    "guided_json": (_absent, "not served: send response_format (type json_schema)"),
    "guided_regex": (_absent, "not served: send response_format (type regex)"),
    "guided_grammar": (_absent, "not served: send response_format (type lark)"),
    "guided_choice": (_absent, "not served: send response_format (type regex: a|b|c)"),
    "structured_outputs": (_absent, "not served: send response_format"),
    "min_tokens": (absent_or(0), "not served (a least number of new tokens)"),
    "stop_token_ids": (_empty, "not served: send stop strings"),
    "include_stop_str_in_output": (absent_or(False), "not served: stops are never in the output"),
    "use_beam_search": (absent_or(False), "beam search is not served"),
    "prompt_logprobs": (_absent, "the prompt's logprobs are not served"),
    "allowed_token_ids": (_empty, "not served: send logit_bias"),
    "bad_words": (_empty, "not served: send logit_bias"),
    "chat_template": (_absent, "not served: the server's template (--chat-template) is used"),
    "chat_template_kwargs": (_empty, "not served: the server's template is rendered as it is"),
    "add_generation_prompt": (absent_or(True), "only true is served"),
    "continue_final_message": (absent_or(False), "not served"),
}
# Fields kenspec accepts only at the value that means "nothing asked": anything else is refused.
_DEFAULT_ONLY: dict[str, tuple[Callable[[object], bool], str]] = {
    # the deprecated forms of tools and tool_choice
    "functions": (_empty, "not served: send tools"),
    "function_call": (absent_or("none"), "not served: send tool_choice"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is served"),
    "audio": (_absent, "audio output is not served"),
    "web_search_options": (_absent, "web search is not served"),
    **_EXTENSIONS,
}
_COMPLETION_DEFAULT_ONLY: dict[str, tuple[Callable[[object], bool], str]] = {
    "echo": (absent_or(False), "echo (the prompt's logprobs) is not supported"),
    "best_of": (absent_or(1), "only best_of=1 is served (n choices are all returned)"),
    "suffix": (absent_or(""), "suffix (insertion) is not supported"),
    **_EXTENSIONS,
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    # kenspec's own
    "top_k",
    "min_p",
    "repetition_penalty",
    "speculation",
    "num_draft_tokens",
    "adaptive",
    "draft_context",
    "ignore_eos",
    "response_format",
}
CHAT_FIELDS = (
    _COMMON
    | {"messages", "max_completion_tokens", "top_logprobs"}
    | {"tools", "tool_choice", "parallel_tool_calls"}
    | _DEFAULT_ONLY.keys()
)
COMPLETION_FIELDS = _COMMON | {"prompt"} | _COMPLETION_DEFAULT_ONLY.keys()


def parse_request(data: bytes, *, chat: bool, limits: Limits, defaults: Defaults) -> OpenAIRequest:
    """A body's bytes to the typed request of its route (chat or completions); InvalidBody
    or InvalidParameter, each naming what is wrong, for anything else."""
    body = decode_body(data)
    return (parse_chat if chat else parse_completion)(body, limits, defaults)


def parse_chat(body: Mapping[str, Any], limits: Limits, defaults: Defaults) -> OpenAIRequest:
    """POST /v1/chat/completions."""
    ignored = Ignored()
    _check_fields(body, CHAT_FIELDS, _DEFAULT_ONLY, ignored)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise InvalidParameter("max_tokens", "send max_tokens or max_completion_tokens, not both")
    tokens_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    logprobs = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", minimum=0)
    if top and not logprobs:
        raise InvalidParameter("top_logprobs", "needs logprobs: true")
    top_logprobs = (top or 0) if logprobs else None
    messages = parse_messages(body, ignored)
    tools = _tools(body)
    request = _request(body, limits, defaults, None, messages, tokens_field, top_logprobs, ignored)
    if tools is None:
        return request
    if tools.calls and request.params.grammar is not None:
        raise InvalidParameter(
            "response_format", "cannot be combined with tools unless tool_choice is 'none'"
        )
    return replace(request, params=replace(request.params, tools=tools))


def _tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls (server.tool_calls.request)."""
    listed = body.get("tools")
    tools = () if listed is None else parse_tools(listed)
    parallel = boolean(body, "parallel_tool_calls", True)
    return tool_request(tools, body.get("tool_choice"), parallel)


def parse_completion(body: Mapping[str, Any], limits: Limits, defaults: Defaults) -> OpenAIRequest:
    """POST /v1/completions: one prompt string (a list holding one string is the same)."""
    ignored = Ignored()
    _check_fields(body, COMPLETION_FIELDS, _COMPLETION_DEFAULT_ONLY, ignored)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidParameter(
            "prompt", "must be one string (lists of prompts and token ids are not served)"
        )
    if not prompt:
        raise InvalidParameter("prompt", "must not be empty")
    # the legacy API's logprobs is the number of alternatives per token (null: none)
    top_logprobs = integer(body, "logprobs", minimum=0)
    return _request(body, limits, defaults, prompt, None, "max_tokens", top_logprobs, ignored)


def _request(
    body: Mapping[str, Any],
    limits: Limits,
    defaults: Defaults,
    prompt: str | None,
    messages: tuple[dict[str, Any], ...] | None,
    tokens_field: str,  # the field that sets the token limit: max_tokens or its newer name
    top_logprobs: int | None,  # None: no logprobs
    ignored: Ignored,
) -> OpenAIRequest:
    model = name_field(body, "model")
    if model is None:
        raise InvalidParameter("model", "required: the id GET /v1/models lists")
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise InvalidParameter("stream_options", "only allowed when stream is true")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise InvalidParameter("stream_options", "must be an object (include_usage)")
    for name in options.keys() - {"include_usage"}:  # include_obfuscation, vLLM's, ...
        ignored.add(f"stream_options.{key(name)}", unknown=name != "include_obfuscation")
    user = name_field(body, "user")
    if user is not None and not user.isprintable():  # it is written to the request's logs
        raise InvalidParameter("user", "must hold no control characters (newlines, NUL, ...)")
    max_tokens = integer(body, tokens_field, minimum=1)
    params = GenerateParams(
        prompt=prompt,
        messages=messages,
        sampling=_sampling(body),
        stopping=_stopping(body, max_tokens, tokens_field, limits),
        speculation=_speculation(body, defaults),
        grammar=response_format(body.get("response_format")),
        processing=_processing(body),
        top_logprobs=top_logprobs,
        n=integer(body, "n", minimum=1) or 1,
        default_tokens=max_tokens is None,  # the rest of the context (generate_params)
        tokens_field=tokens_field,
    )
    return OpenAIRequest(
        model=model,
        params=params,
        stream=stream,
        include_usage=boolean(options, "include_usage", False),
        user=user,
        ignored=ignored,
    )


def _check_fields(
    body: Mapping[str, Any],
    known: set[str],
    default_only: Mapping[str, tuple[Callable[[object], bool], str]],
    ignored: Ignored,
) -> None:
    """Refuse a field at a value kenspec cannot honour; note the ones it does not act on."""
    for name in body:
        check = default_only.get(name)
        if check is not None:
            if not check[0](body[name]):
                raise InvalidParameter(name, check[1])
        elif name in IGNORED_FIELDS:
            ignored.add(name)
        elif name not in known:  # outside OpenAI's API: ignored, as vLLM does
            ignored.add(key(name), unknown=True)


def parse_messages(body: Mapping[str, Any], ignored: Ignored) -> tuple[dict[str, Any], ...]:
    """A chat's messages, as the chat route and /tokenize read them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages", "must be a non-empty list of messages")
    return tuple(_message(index, message, ignored) for index, message in enumerate(messages))


def _message(index: int, message: object, ignored: Ignored) -> dict[str, Any]:
    """One message: role and content; an assistant's tool_calls (then content may be null),
    a tool result's tool_call_id and name."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidParameter(where, "must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidParameter(f"{where}.role", f"{shown(role)} is not one of {', '.join(ROLES)}")
    parsed: dict[str, Any] = {"role": ROLES[role]}
    own = {"role", "content"}
    if role == "assistant" and message.get("tool_calls") is not None:
        parsed["tool_calls"] = history_calls(message["tool_calls"], f"{where}.tool_calls")
        own.add("tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidParameter(f"{where}.tool_call_id", "required: the id of the call")
        parsed["tool_call_id"] = call_id
        own |= {"tool_call_id", "name"}
        if isinstance(message.get("name"), str):
            parsed["name"] = message["name"]
    for name, value in message.items():
        if name in own or value is None:  # null: as if not sent
            continue
        if name in _TOOL_MESSAGE_FIELDS or name == "audio":
            raise InvalidParameter(f"{where}.{name}", _TOOL_MESSAGE_FIELDS.get(name, "not served"))
        # name (a participant's), refusal, reasoning_content, ...: the text is what counts
        ignored.add(f"messages[].{key(name)}", unknown=name not in ("name", "refusal"))
    content = message.get("content")
    if content is None and "tool_calls" in parsed:
        parsed["content"] = None  # a turn of calls only
    else:
        parsed["content"] = _content(where, content, ignored)
    return parsed


# A message's fields that are not of its role (or are the deprecated functions' form).
_TOOL_MESSAGE_FIELDS = {
    "tool_calls": "only an assistant message makes tool calls",
    "tool_call_id": "only a tool message answers a call",
    "function_call": "not served: send tool_calls",
}


def _content(where: str, content: object, ignored: Ignored) -> str:
    """A string, or a list of text parts (joined); images, audio and files are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(f"{where}.content", "must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise InvalidParameter(at, "only text parts ({'type': 'text'}) are served")
        for name in part:
            if name not in ("type", "text"):  # cache_control (prompt caching hints), ...
                known = name == "cache_control"
                ignored.add(f"messages[].content[].{key(name)}", unknown=not known)
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidParameter(f"{at}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    temperature = number(body, "temperature", DEFAULT_TEMPERATURE)
    if temperature > 2.0:
        raise InvalidParameter("temperature", f"must be in [0, 2], got {temperature}")
    return SamplingParams(
        temperature=temperature,
        top_p=number(body, "top_p", 1.0),
        top_k=integer(body, "top_k", minimum=0) or 0,  # (a k beyond the vocabulary keeps all)
        seed=integer(body, "seed", minimum=0),
        min_p=number(body, "min_p", 0.0),
    )


def _processing(body: Mapping[str, Any]) -> ProcessorParams:
    return ProcessorParams(
        repetition_penalty=number(body, "repetition_penalty", 1.0),
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": amount}, ids as decimal strings (JSON keys)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidParameter("logit_bias", "must be an object mapping token ids to numbers")
    if len(value) > MAX_LOGIT_BIAS:  # before any per-entry work
        raise InvalidParameter("logit_bias", f"{len(value)} entries; the limit is {MAX_LOGIT_BIAS}")
    bias = []
    for name in value:
        if not (name.isascii() and name.isdigit()) or len(name) > 12:
            raise InvalidParameter(
                f"logit_bias.{key(name)}", "keys must be token ids written in decimal"
            )
        bias.append((int(name), number(value, name, 0.0)))
    return tuple(sorted(bias))


def _stopping(
    body: Mapping[str, Any], max_tokens: int | None, tokens_field: str, limits: Limits
) -> StoppingParams:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidParameter("stop", "must be a string or a list of strings")
    ignore_eos = boolean(body, "ignore_eos")
    return stopping_params(max_tokens, stops, ignore_eos, limits, tokens_field=tokens_field)


# response_format's types: what else each takes besides "type" (and which of those it needs)
_FORMATS: dict[str, tuple[set[str], set[str]]] = {
    "text": (set(), set()),
    "json_object": (set(), set()),
    "json_schema": ({"json_schema"}, {"json_schema"}),
    "regex": ({"regex"}, {"regex"}),  # kenspec's
    "lark": ({"lark"}, {"lark"}),  # kenspec's
}
_JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


def response_format(value: object) -> GrammarSpec | None:
    """OpenAI's response_format as a grammar (None: free text). Whether the grammar compiles
    is the engine's to say (a 400 naming llguidance's reason)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or not isinstance(kind, str) or kind not in _FORMATS:
        raise InvalidParameter(
            "response_format", f"must be an object whose type is one of {', '.join(_FORMATS)}"
        )
    allowed, required = _FORMATS[kind]
    for name in value:
        if name != "type" and name not in allowed:
            raise InvalidParameter(f"response_format.{key(name)}", f"not a field of type {kind}")
    for name in required - value.keys():
        raise InvalidParameter(f"response_format.{name}", f"required for type {kind}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        return _json_schema(value["json_schema"])
    source = value[kind]
    if not isinstance(source, str) or not source:
        raise InvalidParameter(f"response_format.{kind}", "must be a non-empty string")
    return GrammarSpec("regex" if kind == "regex" else "lark", source)


def _json_schema(value: object) -> GrammarSpec:
    """{"name": ..., "schema": {...}, "strict": ...}; without a schema, any JSON object."""
    where = "response_format.json_schema"
    if not isinstance(value, dict):
        raise InvalidParameter(where, "must be an object with name and schema")
    for name in value:
        if name not in _JSON_SCHEMA_FIELDS:
            raise InvalidParameter(f"{where}.{key(name)}", "unknown field")
    name_field(value, "name")
    boolean(value, "strict")
    schema = value.get("schema")
    if schema is None:
        return GrammarSpec("json_object")
    if not isinstance(schema, dict):
        raise InvalidParameter(f"{where}.schema", "must be a JSON schema object")
    return GrammarSpec("json_schema", schema_text(schema))


def _speculation(body: Mapping[str, Any], defaults: Defaults) -> SpeculationParams:
    mode = body.get("speculation", "auto")
    if not isinstance(mode, str) or mode not in ("auto", "off"):
        raise InvalidParameter("speculation", f"must be 'auto' or 'off', not {shown(mode)}")
    context = body.get("draft_context")
    if context is not None and not isinstance(context, bool):
        raise InvalidParameter("draft_context", "must be true, false or null (server default)")
    adaptive = body.get("adaptive")
    return speculation_params(
        enabled=mode == "auto",
        num_draft_tokens=integer(body, "num_draft_tokens", minimum=1),
        adaptive=None if adaptive is None else boolean(body, "adaptive"),
        draft_context=context,
        defaults=defaults,
    )
