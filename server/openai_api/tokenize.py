"""POST /tokenize and POST /detokenize, in vLLM's shapes, beside gRPC's Tokenize.

``/tokenize`` takes ``{"prompt": "..."}`` or ``{"messages": [...]}`` (``model`` optional, and the
served one when sent) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``: the
token ids a generation from the same input would start from, the chat rendered by the same
template, under the same limits as gRPC's Tokenize and the generate routes (the character
limit checked before any tokenizer work, then --max-prompt-tokens, each a 400 naming the
field). ``return_token_strs: true`` adds each token's vocabulary entry. vLLM's switches are
taken at the value kenspec tokenizes with (``add_special_tokens`` true for a prompt and false
for a chat, ``add_generation_prompt`` true, ``continue_final_message`` false) and refused at
any other, as is ``chat_template``; ``tools`` are rendered into the chat as a generation
renders them. Other fields are accepted and listed in the x-kenspec-ignored-fields header, as
the generate routes list theirs.

``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``, the ids decoded as
they are (special tokens included), at most the model's context of them, each an id of the
tokenizer's vocabulary (else a 400 naming ``tokens[i]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from kenspec.server.engine.params import InvalidParameter
from kenspec.server.generate_params import check_prompt_length
from kenspec.server.openai_api.body import InvalidBody, decode_body
from kenspec.server.openai_api.fields import absent_or, boolean, key, name_field, shown
from kenspec.server.openai_api.guards import HttpError
from kenspec.server.openai_api.ignored import Ignored
from kenspec.server.openai_api.openai_request import parse_messages
from kenspec.server.runtime import Runtime
from kenspec.server.serving import Serving, failure_of
from kenspec.server.tool_calls.request import ToolRequest, parse_tools

log = structlog.get_logger("kenspec.http")

ModelCheck = Callable[[str, str], None]  # (model, param): HttpError 404 when not served

# vLLM's fields, at the only value kenspec tokenizes with (by input: prompt, messages).
_PROMPT_ONLY = {"add_special_tokens": (absent_or(True), "only true is served for a prompt")}
_CHAT_ONLY = {
    "add_special_tokens": (
        absent_or(False),
        "only false is served for messages (the template writes the special tokens)",
    ),
    "add_generation_prompt": (absent_or(True), "only true is served (as a generation renders)"),
    "continue_final_message": (absent_or(False), "not served"),
    "chat_template": (lambda v: v is None, "not served: the server's template is used"),
    "chat_template_kwargs": (lambda v: v in (None, {}), "not served"),
}
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "return_token_strs", "tools"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


async def tokenize(
    serving: Serving, runtime: Runtime, data: bytes, check_model: ModelCheck
) -> tuple[dict[str, Any], Ignored]:
    """The /tokenize answer for a body's bytes, or HttpError."""
    with _errors():
        body = decode_body(data)
        ignored = Ignored()
        _check_model(body, check_model)
        chat = body.get("messages") is not None
        if chat == (body.get("prompt") is not None):
            raise InvalidParameter("prompt", "send either prompt (a string) or messages")
        _check_fields(body, _TOKENIZE_FIELDS, _CHAT_ONLY if chat else _PROMPT_ONLY, ignored)
        strings = boolean(body, "return_token_strs")
        if chat:
            prompt, messages = None, parse_messages(body, ignored)
        else:
            prompt, messages = body["prompt"], None
            if not isinstance(prompt, str) or not prompt:
                raise InvalidParameter("prompt", "must be a non-empty string")
        listed = body.get("tools")
        if listed not in (None, []) and not chat:
            raise InvalidParameter("tools", "need messages (a chat), not a prompt")
        tools = parse_tools(listed) if listed is not None else ()
        described = ToolRequest(tools) if tools else None
        ids = await serving.encode(runtime, prompt, messages, described)
        check_prompt_length(len(ids), runtime.limits, "messages" if chat else "prompt")
        tokenizer = runtime.engine.target.tokenizer
        answer = {
            "count": len(ids),
            "max_model_len": runtime.info.max_context_tokens,
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strings else None,
        }
        return answer, ignored


async def detokenize(
    serving: Serving, runtime: Runtime, data: bytes, check_model: ModelCheck
) -> tuple[dict[str, Any], Ignored]:
    """The /detokenize answer for a body's bytes, or HttpError."""
    with _errors():
        body = decode_body(data)
        ignored = Ignored()
        _check_model(body, check_model)
        _check_fields(body, _DETOKENIZE_FIELDS, {}, ignored)
        tokenizer = runtime.engine.target.tokenizer
        ids = _token_ids(body.get("tokens"), len(tokenizer), runtime.info.max_context_tokens)
        text = await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=False)
        return {"prompt": text}, ignored


def _check_model(body: Mapping[str, Any], check_model: ModelCheck) -> None:
    model = name_field(body, "model")
    if model is not None:
        check_model(model, "model")


def _check_fields(
    body: Mapping[str, Any],
    known: frozenset[str],
    default_only: Mapping[str, tuple[Callable[[object], bool], str]],
    ignored: Ignored,
) -> None:
    for name, value in body.items():
        check = default_only.get(name)
        if check is not None and not check[0](value):
            raise InvalidParameter(name, check[1])
        if check is None and name not in known:
            ignored.add(key(name), unknown=True)


def _token_ids(value: object, vocabulary: int, most: int) -> list[int]:
    if not isinstance(value, list):
        raise InvalidParameter("tokens", "must be a list of token ids")
    if len(value) > most:
        raise InvalidParameter(
            "tokens", f"{len(value)} ids; the limit is {most} (the model's context)"
        )
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocabulary:
            raise InvalidParameter(
                f"tokens[{index}]",
                f"{shown(item)} is not a token id of the model's vocabulary "
                f"(integers 0 to {vocabulary - 1})",
            )
    return value


@contextlib.contextmanager
def _errors() -> Iterator[str]:
    """What the checks raise, as the HTTP API's refusals: bad input a 400 naming the field,
    anything else as the generate routes report it (a bug: 500 with an id to quote). Yields
    the call's id, bound to every log line inside (the one failure_of writes included)."""
    call_id = uuid.uuid4().hex[:16]
    try:
        with structlog.contextvars.bound_contextvars(request_id=call_id):
            yield call_id
    except HttpError:
        raise
    except InvalidParameter as error:
        raise HttpError(400, str(error), param=error.field) from None
    except InvalidBody as error:
        raise HttpError(400, str(error), param=error.param) from None
    except Exception as error:
        with structlog.contextvars.bound_contextvars(request_id=call_id):
            failure = failure_of(error, call_id)
        raise HttpError(failure.http_status, failure.message) from None
