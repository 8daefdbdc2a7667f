"""Hostile grammars in response_format, over HTTP (chat, and completions streamed) and gRPC:
each is answered (200 / OK, the output masked by it) or refused (400 / INVALID_ARGUMENT whose
message names response_format and llguidance's reason), never a 5xx, INTERNAL or UNKNOWN, nor a
crash; and the server serves a plain request after them. Then random schemas, regexes and Lark
grammars, straight to the engine's GrammarCompiler, driven a few tokens: InvalidParameter is the
only exception they may raise.

Among them, what once failed: a grammar that matches no text ({"$ref": "#"}), or that
llguidance gives up on at its first steps ('start: "a" start', a{1000000}), ended in a 500
after the masked model chose EOS; a chain of 2,000 $refs overflowed the compile's stack and
killed the server (SIGSEGV).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine import grammar
from kenspec.server.engine.grammar import GrammarCompiler, GrammarSpec, GrammarState
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.engine.target import TargetModel
from tests.server.openai_api.test_openai_api import model_id
from tests.server.test_robustness import ServerThread

TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches
HELD_S = 10  # seconds a plain request may take while a compile is held (it takes well under 1)


def chain(levels: int) -> dict:
    """An object nested `levels` deep through a chain of $defs (each refers to the next)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(levels)
    }
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{levels}": {"type": "string"}}}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


SCHEMAS: list[tuple[str, object]] = [
    ("ref-root", {"$ref": "#"}),
    ("ref-root-required", {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    (
        "defs-cycle",
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#"}}},
    ),
    ("defs-missing", {"$ref": "#/$defs/nope"}),
    ("ref-remote", {"$ref": "http://example.com/schema.json"}),
    ("ref-not-a-string", {"$ref": 5}),
    ("ref-chain-2000", chain(2000)),
    ("nested-12", nested(12)),
    ("nested-200", nested(200)),
    ("enum-20000", {"enum": [f"value-{i}" for i in range(20_000)]}),
    ("enum-empty", {"enum": []}),
    ("const-30kb", {"const": "x" * 30_000}),
    ("type-number", {"type": 5}),
    ("type-unknown", {"type": ["strin"]}),
    ("properties-list", {"properties": [1, 2]}),
    ("required-string", {"type": "object", "required": "a"}),
    ("min-items-huge", {"type": "array", "minItems": 10**9}),
    ("max-length-huge", {"type": "string", "maxLength": 10**12}),
    ("min-length-float", {"type": "string", "minLength": 1.5}),
    ("max-length-negative", {"type": "string", "maxLength": -1}),
    ("min-over-max", {"type": "integer", "minimum": 5, "maximum": 2}),
    ("pattern-unclosed", {"type": "string", "pattern": "a(b"}),
    ("pattern-lookahead", {"type": "string", "pattern": "(?=a)b"}),
    ("pattern-lookbehind", {"type": "string", "pattern": "(?<=a)b"}),
    ("pattern-backreference", {"type": "string", "pattern": "(a)\\1"}),
    ("pattern-repeat-huge", {"type": "string", "pattern": "^a{100000}$"}),
    ("pattern-properties-lookahead", {"patternProperties": {"(?=x)": {}}}),
    ("format-unknown", {"type": "string", "format": "nonsense"}),
    ("unique-items", {"type": "array", "uniqueItems": True}),
    ("not", {"not": {"type": "string"}}),
    ("if-then", {"if": {"type": "string"}, "then": {"maxLength": 2}}),
    ("true-property", {"type": "object", "properties": {"a": True}}),
    ("false-property-required", {"properties": {"a": False}, "required": ["a"]}),
    ("all-of-disjoint", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
    ("one-of-3000", {"oneOf": [{"const": i} for i in range(3000)]}),
    ("any-of-300", {"anyOf": [{"required": [f"k{i}"]} for i in range(300)]}),
    ("properties-1000", {"properties": {f"p{i}": {} for i in range(1000)}, "required": ["p0"]}),
    ("multiple-of-zero", {"type": "integer", "multipleOf": 0}),
    ("multiple-of-tiny", {"type": "number", "multipleOf": 1e-300}),
    ("unknown-keyword", {"type": "string", "frobnicate": True}),
    ("x-guidance-bad-separator", {"type": "array", "x-guidance": {"item_separator": 5}}),
    ("x-guidance-bad-whitespace", {"x-guidance": {"whitespace_pattern": "a(b"}}),
    ("dynamic-ref", {"$dynamicRef": "#meta"}),
    ("draft-04", {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string"}),
    ("lone-surrogate-key", {"type": "object", "properties": {"\ud800": {}}}),
]
# gRPC takes the schema as text: what HTTP's JSON body cannot carry (HTTP refuses a schema that
# is not an object before the engine sees it).
SCHEMA_TEXTS = ["true", "false", "3", "null", "[1]", '"x"', "{not json", " ", "{" * 500]
REGEXES = [
    "a(b",
    "(?=a)a",
    "(a)\\1",
    "\\bfoo\\b",
    "(?z)abc",
    "[a&&b]",
    "[^\\x00-\\x{10FFFF}]",
    "a{1000000}",
    "(" * 1000 + "a" + ")" * 1000,
    "(a|aa)*b[ab]{20}c",
    "x*",
    "\x00",
]
LARKS = [
    "start: ((",
    "start: undefined_rule",
    'rule: "a"',
    'start: start "a" | "a"',
    "start: x\nx: x",
    'start: "a" start',
    'start: "a" x | "b"\nx: x',
    'start: x*\nx: x x | "a" | ""',
    'start: %json {"$ref": "#"}',
    "start: %json {bad",
    'start: "a"{1000000}',
    'start: A\nA: A "a"',
    "start: %llguidance {}",
    "start: <[99999999]>",
    "start: <|nope|>",
    "start: /(?=a)a/",
    'start: "\x00"',
    "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(20_000)) + '\nr20000: "b"',
    "start: " + " | ".join(f'"w{i}"' for i in range(5000)),
]
HOSTILE: list[tuple[str, str, object]] = [
    *(("json_schema", name, schema) for name, schema in SCHEMAS),
    *(("json_schema_text", text[:12], text) for text in SCHEMA_TEXTS),
    *(("regex", regex[:24], regex) for regex in REGEXES),
    *(("lark", lark[:24], lark) for lark in LARKS),
]


def http_format(kind: str, source: object) -> dict:
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": source}}
    if kind == "json_schema_text":  # (not an object: refused by the body's checks)
        try:
            schema = json.loads(str(source))
        except ValueError:
            schema = source
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    return {"type": kind, kind: source}


def grpc_format(kind: str, source: object) -> pb.ResponseFormat:
    if kind == "json_schema":
        return pb.ResponseFormat(json_schema=json.dumps(source))
    if kind == "json_schema_text":
        return pb.ResponseFormat(json_schema=str(source))
    return pb.ResponseFormat(**{kind: source})


@pytest.fixture(scope="module")
def served(base_settings, runtime, serve_loaded) -> Iterator[tuple[httpx.Client, object, str]]:
    """The server in a thread of its own; an HTTP client, a gRPC stub and the model's id."""
    settings_ = base_settings.replace(port=0, max_new_tokens_limit=16, default_max_new_tokens=8)
    server = ServerThread(settings_, serve_loaded(runtime))
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{server.server.http_port}",
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    channel = grpc.insecure_channel(server.address)
    yield client, pb_grpc.GeneratorStub(channel), model_id(server.server)
    channel.close()
    client.close()
    server.stop()


def as_json(body: dict) -> bytes:
    """The body as JSON (escaped: a lone surrogate too)."""
    return json.dumps(body).encode()


def refused_by_name(message: str) -> None:
    assert "response_format" in message and "Traceback" not in message, message[:500]


def check_http(client: httpx.Client, model: str, response_format: dict) -> None:
    """Chat whole, completions streamed: 200, or 400 naming response_format (a stream that
    failed once under way ends with an error event that blames the request)."""
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": model, "max_tokens": 8, "response_format": response_format}
    chat = client.post("/v1/chat/completions", content=as_json({**body, "messages": messages}))
    assert chat.status_code in (200, 400), chat.text[:500]
    if chat.status_code == 400:
        refused_by_name(chat.json()["error"]["message"])
    streaming = as_json({**body, "prompt": "Hi", "stream": True})
    with client.stream("POST", "/v1/completions", content=streaming) as streamed:
        streamed.read()
    assert streamed.status_code in (200, 400), streamed.text[:500]
    if streamed.status_code == 400:
        refused_by_name(streamed.json()["error"]["message"])
        return
    for line in streamed.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            error = json.loads(line.removeprefix("data: "))["error"]
            assert error["type"] == "invalid_request_error", error
            refused_by_name(error["message"])


def check_grpc(stub, response_format: pb.ResponseFormat) -> None:
    request = pb.GenerateRequest(
        prompt="Hi",
        stopping=pb.StoppingCriteria(max_new_tokens=8),
        response_format=response_format,
    )
    try:
        for _ in stub.Generate(request, timeout=TIMEOUT):
            pass
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        refused_by_name(error.details())


@pytest.mark.parametrize(
    ("kind", "name", "source"), HOSTILE, ids=[f"{k}:{n}" for k, n, _ in HOSTILE]
)
def test_a_hostile_grammar_is_served_or_refused_by_name(served, kind, name, source) -> None:
    client, stub, model = served
    check_http(client, model, http_format(kind, source))
    check_grpc(stub, grpc_format(kind, source))


def test_the_server_serves_after_the_hostile_grammars(served) -> None:
    client, stub, model = served
    plain = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4})
    assert plain.status_code == 200
    regex = {"type": "regex", "regex": "(red|blue)!"}
    answer = client.post(
        "/v1/completions", json={"model": model, "prompt": "Hi", "response_format": regex}
    )
    assert answer.json()["choices"][0]["text"] in ("red!", "blue!")
    responses = list(stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=TIMEOUT))
    assert responses[-1].usage.completion_tokens > 0


def test_a_compile_holds_up_neither_the_event_loop_nor_the_engine(served, monkeypatch) -> None:
    """While a grammar compiles (held until the test lets it go), the server answers its
    health check and serves a plain request: compiles run in threads of their own."""
    client, _, model = served
    entered, release = threading.Event(), threading.Event()
    text_of = grammar._grammar_text

    def held(spec: GrammarSpec) -> str:
        entered.set()
        release.wait(TIMEOUT)
        return text_of(spec)

    monkeypatch.setattr(grammar, "_grammar_text", held)
    regex = {"type": "regex", "regex": "(red|blue)!"}
    body = {"model": model, "prompt": "Hi", "response_format": regex}
    url = client.base_url.join("/v1/completions")
    with ThreadPoolExecutor(1) as pool:
        constrained = pool.submit(httpx.post, url, json=body, timeout=TIMEOUT)
        assert entered.wait(TIMEOUT)
        try:
            assert client.get("/health", timeout=HELD_S).status_code == 200
            plain = {"model": model, "prompt": "Hi", "max_tokens": 4}
            assert client.post("/v1/completions", json=plain, timeout=HELD_S).status_code == 200
        finally:
            release.set()
        assert constrained.result(TIMEOUT).json()["choices"][0]["text"] in ("red!", "blue!")


# -- random grammars, straight to the compiler ---------------------------------------------------

TYPES = ["string", "integer", "number", "boolean", "null", "object", "array", "strin", 5]
REFS = [
    "#",
    "#",
    "#/$defs/a",
    "#/$defs/b",
    "#/$defs/missing",
    "#/properties/a",
    "http://x.invalid/",
]
# Odd values for any keyword: wrong types, huge and negative numbers, bad regexes, formats.
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.sampled_from(["a(b", "(?=a)a", "^\\d+$", "date-time", "email", 10**30, -1, 1.5, 1e308]),
)
KEYWORDS = [
    "type", "enum", "const", "pattern", "format", "minLength", "maxLength", "minimum",
    "maximum", "multipleOf", "minItems", "maxItems", "uniqueItems", "required", "not",
    "x-guidance", "additionalProperties", "contains", "propertyNames", "if",
]  # fmt: skip
leaves = st.one_of(
    st.booleans(),
    st.builds(dict),
    st.sampled_from(TYPES).map(lambda kind: {"type": kind}),
    st.sampled_from(REFS).map(lambda ref: {"$ref": ref}),
    st.lists(st.integers(0, 3) | st.text("ab", max_size=2), max_size=3).map(lambda e: {"enum": e}),
    st.text("ab()[]{}|*+?^$\\.0-9,=", max_size=10).map(lambda p: {"type": "string", "pattern": p}),
    st.dictionaries(st.sampled_from(KEYWORDS), ODD, min_size=1, max_size=2),
)


def composites(inner: st.SearchStrategy) -> st.SearchStrategy:
    keys = st.sampled_from(["a", "b", "c"])
    return st.one_of(
        st.builds(
            lambda properties, required, extra: {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": extra,
            },
            st.dictionaries(keys, inner, max_size=3),
            st.lists(keys, max_size=3, unique=True),
            st.booleans() | inner,
        ),
        st.builds(
            lambda items, low, high: {
                "type": "array",
                "items": items,
                "minItems": low,
                "maxItems": high,
            },
            inner,
            st.integers(0, 3) | st.just(10**9),
            st.integers(0, 3) | st.just(10**9),
        ),
        st.lists(inner, max_size=3).map(lambda options: {"anyOf": options}),
        st.lists(inner, max_size=3).map(lambda options: {"allOf": options}),
        st.lists(inner, max_size=3).map(lambda options: {"oneOf": options}),
        st.tuples(inner, st.dictionaries(st.sampled_from(KEYWORDS), ODD, max_size=2)).map(
            lambda pair: {**pair[0], **pair[1]} if isinstance(pair[0], dict) else pair[0]
        ),
    )


schemas = st.builds(
    lambda schema, defs: {**schema, "$defs": defs} if isinstance(schema, dict) else schema,
    st.recursive(leaves, composites, max_leaves=8),
    st.dictionaries(st.sampled_from(["a", "b"]), st.recursive(leaves, composites, max_leaves=4)),
)
REGEX_PIECES = [
    "a", "b", "[ab]", "[^a]", "[a&&b]", "(", ")", "|", "*", "+", "?", "{2}", "{0,3}", "{1000}",
    ".", "\\d", "^", "$", "(?=a)", "\\b", "\\1", "(?i)", "[^\\x00-\\x{10FFFF}]", "[a&&b]",
]  # fmt: skip
regexes = st.lists(st.sampled_from(REGEX_PIECES), max_size=10).map("".join)
LARK_PIECES = [
    '"a"', '"b"', '""', "x", "y", "start", "(", ")", "|", "*", "+", "?", "/[ab]+/", "/(?=a)/",
    "%json {}", '%json {"$ref": "#"}', "<[1]>", "~ 2", "~ 1000000", "A",
]  # fmt: skip
rule_bodies = st.lists(st.sampled_from(LARK_PIECES), min_size=1, max_size=6).map(" ".join)
larks = st.builds(
    lambda start, x, y, token: f"start: {start}\nx: {x}\ny: {y}\nA: {token}",
    rule_bodies,
    rule_bodies,
    rule_bodies,
    st.sampled_from(['"a"', "/[ab]+/", "A", '"a" A', '""']),
)
specs = st.one_of(
    schemas.map(lambda schema: GrammarSpec("json_schema", json.dumps(schema))),
    regexes.map(lambda regex: GrammarSpec("regex", regex)),
    larks.map(lambda lark: GrammarSpec("lark", lark)),
)


@pytest.fixture(scope="module")
def compiler(tiny_target) -> GrammarCompiler:
    eos = sorted(tiny_target.eos_token_ids)
    return GrammarCompiler(tiny_target.tokenizer, eos, tiny_target.vocab_size)


def drive(state: GrammarState, target: TargetModel, picks: list[int]) -> None:
    """The engine's calls for a few rounds of one token each: forced tokens, the mask, then
    one allowed token (EOS ends it)."""
    for pick in picks:
        state.forced()
        scores = state.process(torch.zeros(target.vocab_size), [], [])
        allowed = torch.isfinite(scores).nonzero().flatten().tolist()
        assert allowed, "a mask that allows nothing (not even EOS)"
        token = allowed[pick % len(allowed)]
        state.advance([token])
        if token in target.eos_token_ids:
            assert state.accepting
            return


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=specs, picks=st.lists(st.integers(0, 1000), min_size=1, max_size=6))
def test_random_grammars_compile_and_run_or_are_invalid_parameters(
    compiler, tiny_target, spec, picks
) -> None:
    try:
        drive(compiler.start(spec), tiny_target, picks)
    except InvalidParameter as error:
        assert error.field == "response_format" and str(error)
