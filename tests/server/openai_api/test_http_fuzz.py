"""Property-based tests of the HTTP API's request schema, both routes: random JSON, random
bytes, and valid requests mutated (a wrong type at any field, huge integers, non-finite
numbers, deep nesting, lone surrogates, NUL, empty and oversized strings, unknown keys).

Most examples call `parse_request` directly: it must return a typed request whose strings all
encode, or raise InvalidBody/InvalidParameter with a short message that encodes (the error
body is JSON). A smaller set goes through a real uvicorn over the tiny model: 200 or a 4xx,
never a 5xx, nothing logged at error level, /health still 200 after.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kenspec.server.engine.params import InvalidParameter
from kenspec.server.generate_params import Defaults, Limits
from kenspec.server.openai_api.body import InvalidBody
from kenspec.server.openai_api.ignored import IGNORED_FIELDS
from kenspec.server.openai_api.openai_request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    OpenAIRequest,
    parse_request,
)
from tests.server.test_robustness import ServerThread

LIMITS = Limits(
    default_max_new_tokens=4,
    max_new_tokens=16,
    max_prompt_tokens=512,
    max_prompt_chars=512 * 16,
    tokenize_concurrency=2,
    max_stop_sequences=8,
    max_stop_length=128,
)
DEFAULTS = Defaults(num_draft_tokens=4, adaptive=False)
MAX_MESSAGE = 1000  # characters of an error message, whatever the body held

# Text of any code point, lone surrogates included (hypothesis leaves them out by default).
characters = st.characters() | st.characters(categories=["Cs"]) | st.sampled_from("\x00\n\ud800")
texts = st.one_of(
    st.text(characters, max_size=12),
    st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "\ud83d\ude00", "\u202e", "x" * 3000]),
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-(10**500), 10**500),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.0, 2**63, 2**63 - 1, 1e308, 5e-324]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
deep = st.integers(1, 40).map(lambda depth: json.loads("[" * depth + "]" * depth))
hostile = st.one_of(scalars, json_values, deep)


def base(chat: bool, model: str = "tiny") -> dict:
    if chat:
        content = [{"type": "text", "text": "Hi"}]
        return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return {"model": model, "prompt": "Hi", "max_tokens": 2}


# Where a mutation lands: every top-level field of the route, and the nested ones.
CHAT_PATHS = [
    *sorted(CHAT_FIELDS | IGNORED_FIELDS),
    "messages.0",
    "messages.0.role",
    "messages.0.content",
    "messages.0.content.0",
    "messages.0.content.0.type",
    "messages.0.content.0.text",
    "messages.0.content.0.cache_control",
    "messages.0.name",
    "messages.0.tool_calls",
    "messages.0.tool_calls.0.function.arguments",
    "messages.0.tool_call_id",
    "stream_options.include_usage",
    "tools.0",
    "tools.0.function",
    "tools.0.function.name",
    "tools.0.function.parameters",
    "tools.0.function.parameters.properties.a",
    "tool_choice.function.name",
]
COMPLETION_PATHS = [
    *sorted(COMPLETION_FIELDS | IGNORED_FIELDS),
    "prompt.0",
    "stop.0",
    "stream_options.x",
]


def mutate(body: dict, path: str, value: object, delete: bool) -> dict:
    """`body` with the value at the dotted `path` set (or deleted); containers on the way that
    are missing or of another type are made."""
    *parents, last = path.split(".")
    node: object = body
    for step in parents:
        index = _index(step)
        child = node[index] if _has(node, index) else None  # type: ignore[index]
        if not isinstance(child, dict | list):
            child = [{}] if isinstance(_index(last), int) or index == "messages" else {}
            _set(node, index, child)
        node = child
    target = _index(last)
    if delete:
        if _has(node, target):
            del node[target]  # type: ignore[arg-type,union-attr]
    else:
        _set(node, target, value)
    return body


def _index(step: str) -> int | str:
    return int(step) if step.isascii() and step.isdigit() else step


def _has(node: object, index: int | str) -> bool:
    if isinstance(node, list):
        return isinstance(index, int) and index < len(node)
    return isinstance(node, dict) and index in node


def _set(node: object, index: int | str, value: object) -> None:
    if isinstance(node, list):
        if not isinstance(index, int) or index > 8:  # (a random path may hold any number)
            return
        while len(node) <= index:
            node.append(None)
        node[index] = value
    elif isinstance(node, dict):
        node[index] = value


@st.composite
def mutated(draw, chat: bool, model: str = "tiny") -> bytes:
    body = base(chat, model)
    if draw(st.booleans()):
        body["stream"] = True
    if chat and draw(st.booleans()):  # a valid tool, for the tool paths' mutations to reach into
        parameters = {"type": "object", "properties": {"a": {"type": "string"}}}
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    paths = CHAT_PATHS if chat else COMPLETION_PATHS
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths) | texts)
        mutate(body, path, draw(hostile), delete=draw(st.integers(0, 5)) == 0)
    return json.dumps(body).encode()  # surrogates as \\ud800 escapes, NaN as NaN


def check_outcome(data: bytes, chat: bool) -> OpenAIRequest | None:
    """What parse_request must do with any bytes: a typed request, or a 400-worthy error."""
    try:
        parsed = parse_request(data, chat=chat, limits=LIMITS, defaults=DEFAULTS)
    except (InvalidBody, InvalidParameter) as error:
        message = str(error)
        param = error.param if isinstance(error, InvalidBody) else error.field
        assert len(message) <= MAX_MESSAGE, message[:200]
        message.encode("utf-8")  # the error body is JSON: it must encode
        assert param is None or isinstance(param, str)
        (param or "").encode("utf-8")
        return None
    params = parsed.params
    strings = [parsed.model, parsed.user or "", params.prompt or ""]
    strings += [m["content"] or "" for m in params.messages or ()] + list(params.stopping.stop)
    for text in strings:
        text.encode("utf-8")  # the tokenizer, the log and the answer all take it
    assert 1 <= len(parsed.model) <= 256
    assert type(params.stopping.max_new_tokens) is int
    assert 1 <= params.stopping.max_new_tokens <= LIMITS.max_new_tokens
    assert type(params.sampling.temperature) is float and 0 <= params.sampling.temperature <= 2
    assert type(params.sampling.top_k) is int and 0 <= params.sampling.top_k < 2**63
    assert (params.prompt is None) == chat
    for value in parsed.ignored.header().values():  # short, one line, no separator injected
        assert value.isascii() and value.isprintable() and len(value) <= 17 * 70
    return parsed


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_mutated_requests_parse_or_are_refused_by_name(chat, data) -> None:
    check_outcome(data.draw(mutated(chat)), chat)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@settings(max_examples=200, deadline=None)
@given(value=json_values | deep)
def test_random_json_is_refused_cleanly(chat, value) -> None:
    assert check_outcome(json.dumps(value).encode(), chat) is None or isinstance(value, dict)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=200), cut=st.integers(0, 200))
def test_random_and_truncated_bytes_are_refused_cleanly(chat, payload, cut) -> None:
    check_outcome(payload, chat)
    whole = json.dumps(base(chat)).encode()
    check_outcome(whole[:cut] + payload[:3], chat)


def test_the_valid_bases_parse() -> None:
    """The mutations start from requests that parse: what they change is what is refused."""
    for chat in (True, False):
        assert check_outcome(json.dumps(base(chat)).encode(), chat) is not None


def test_an_integer_past_the_parsers_limit_is_refused_cleanly() -> None:
    data = b'{"model": "tiny", "prompt": "x", "seed": ' + b"7" * 5000 + b"}"
    with pytest.raises(InvalidBody, match="5000 digits"):
        parse_request(data, chat=False, limits=LIMITS, defaults=DEFAULTS)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def served(base_settings, runtime, serve_loaded):
    """A real uvicorn over the tiny model in a thread of its own; every error-level line
    logged while the module runs, structlog's and the standard library's."""
    settings_ = base_settings.replace(port=0, max_new_tokens_limit=16, default_max_new_tokens=4)
    errors = _Errors()
    logging.getLogger().addHandler(errors)
    with structlog.testing.capture_logs() as events:
        server = ServerThread(settings_, serve_loaded(runtime))
        client = httpx.Client(base_url=f"http://127.0.0.1:{server.server.http_port}", timeout=60)

        def logged_errors() -> list[object]:
            ours = [e for e in events if e["log_level"] in ("error", "critical")]
            return ours + errors.records

        yield server, client, logged_errors
        client.close()
        server.stop()
    logging.getLogger().removeHandler(errors)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_through_the_server_never_a_5xx(served, chat, data) -> None:
    server, client, logged_errors = served
    model = Path(server.server.settings.model.model).name
    body = data.draw(mutated(chat, model) | st.binary(max_size=100))
    route = "/v1/chat/completions" if chat else "/v1/completions"
    answer = client.post(route, content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 200 or 400 <= answer.status_code < 500, answer.text[:300]
    if answer.status_code != 200:
        assert answer.json()["error"]["message"]
    assert logged_errors() == []


def test_the_server_is_healthy_after_the_fuzzing(served) -> None:
    server, client, logged_errors = served
    assert client.get("/health").status_code == 200
    model = Path(server.server.settings.model.model).name
    answer = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert answer.status_code == 200
    assert logged_errors() == []
