"""Hostile gRPC messages: random field values of the right proto types and random or mutated
bytes, on every Generator method. Every call ends OK or with a status that blames the request
(never INTERNAL or UNKNOWN), nothing is logged as an error, and the server stays SERVING.

The server runs in a thread of its own (tests.server.test_robustness.ServerThread), so
hypothesis drives it with synchronous calls, as real clients would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.generate_params import ROLES
from tests.server.test_robustness import ServerThread

TIMEOUT = 60  # seconds; bounds waits that a passing run never reaches
# What a request may be answered with: accepted, or refused for what it asked.
REQUEST_FAULTS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


class ErrorRecords(logging.Handler):
    """Every stdlib log record at ERROR or above (gRPC's own, uvicorn's, ...)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def errors() -> Iterator[Callable[[], list[str]]]:
    """errors() -> what was logged at error level so far, by structlog or stdlib logging."""
    handler = ErrorRecords()
    root = logging.getLogger()
    root.addHandler(handler)
    with structlog.testing.capture_logs() as entries:
        yield lambda: [
            *(str(e) for e in entries if e.get("log_level") in ("error", "critical")),
            *(r.getMessage() for r in handler.records),
        ]
    root.removeHandler(handler)


# A chat template as strict as many real ones (Llama 2, Mistral, Gemma): it raises on a system
# message anywhere but first, as those raise on roles that do not alternate.
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def strict_template(runtime) -> Iterator[None]:
    tokenizer = runtime.engine.target.tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, STRICT_TEMPLATE
    yield
    tokenizer.chat_template = template


@pytest.fixture(scope="module")
def served(base_settings, runtime, serve_loaded, errors, strict_template):
    settings_ = base_settings.replace(
        max_new_tokens_limit=4,
        default_max_new_tokens=2,
        max_concurrent_streams=4,
        max_queue=100,
    )
    server = ServerThread(settings_, serve_loaded(runtime))
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.GeneratorStub(channel), channel
    channel.close()
    server.stop()


def outcome_or_raise(call: Callable[[], object]) -> None:
    """Make the call; a stream is read to its end."""
    result = call()
    if not isinstance(result, pb.TokenizeResponse | pb.ModelInfo | bytes):
        for _ in result:
            pass


def outcome(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        outcome_or_raise(call)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def assert_blames_the_request(code: grpc.StatusCode, errors: Callable[[], list[str]]) -> None:
    assert code in REQUEST_FAULTS, code
    assert errors() == []


# Values of the right proto types, from ordinary to hostile: each field is mostly ordinary, so
# that most requests get past the first check and reach the deeper ones (the chat template, the
# tokenizer, the engine), and now and then hostile.
def mostly(ordinary: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(*[ordinary] * 6, hostile)


HUGE = ["a" * 200_000, " " * 100_000, "\x00" * 50_000, "\u65e5" * 60_000, "\U0001f642" * 40_000]
ODD = ["", "\x00", "\u202e\u200b\ufeff", "<|im_start|>", "{{ 1/0 }}{% raw %}", "\U0010ffff"]
texts = mostly(st.text(min_size=1, max_size=60), st.one_of(st.sampled_from([*HUGE, *ODD])))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
uint32 = st.integers(0, 2**32 - 1)
int32 = st.integers(-(2**31), 2**31 - 1)
roles = mostly(st.sampled_from(ROLES), st.text(max_size=12))
messages = st.builds(
    pb.Messages,
    messages=mostly(
        st.lists(st.builds(pb.ChatMessage, role=roles, content=texts), min_size=1, max_size=4),
        st.lists(st.builds(pb.ChatMessage, role=roles, content=texts), max_size=300),
    ),
)


def inputs(message_type: type) -> st.SearchStrategy:
    """A request of `message_type` with a prompt, messages, or no input at all."""
    return st.one_of(
        st.builds(message_type, prompt=texts),
        st.builds(message_type, messages=messages),
        st.builds(message_type),
    )


generate_requests = st.builds(
    lambda base, request_id, sampling, stopping, speculation: pb.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        stopping=stopping,
        speculation=speculation,
        **{field.name: value for field, value in base.ListFields()},
    ),
    inputs(pb.GenerateRequest),
    mostly(
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
        st.sampled_from(["r" * 10_000, "\x00id", "caf\u00e9", "a\nb"]),
    ),
    st.builds(
        pb.SamplingParameters,
        temperature=mostly(st.floats(0, 2, width=32), floats),
        top_k=mostly(st.integers(0, 50), uint32),
        top_p=mostly(st.floats(0, 1, width=32), floats),
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    ),
    st.builds(
        pb.StoppingCriteria,
        max_new_tokens=mostly(st.integers(0, 4), uint32),
        stop=mostly(st.lists(texts, max_size=3), st.lists(texts, max_size=200)),
        ignore_eos=st.booleans(),
    ),
    st.builds(
        pb.SpeculationParameters,
        mode=mostly(st.integers(0, 2), int32),
        num_draft_tokens=mostly(st.integers(0, 8), uint32),
        adaptive=st.one_of(st.none(), st.booleans()),
        draft_context=mostly(st.integers(0, 2), int32),
    ),
)
tokenize_requests = st.builds(
    lambda base, return_tokens: pb.TokenizeRequest(
        return_tokens=return_tokens, **{field.name: value for field, value in base.ListFields()}
    ),
    inputs(pb.TokenizeRequest),
    st.booleans(),
)


@FUZZ
@given(request=generate_requests)
def test_generate_messages_never_get_internal(served, errors, request) -> None:
    stub, _ = served
    assert_blames_the_request(outcome(lambda: stub.Generate(request, timeout=TIMEOUT)), errors)


@FUZZ
@given(request=tokenize_requests)
def test_tokenize_messages_never_get_internal(served, errors, request) -> None:
    stub, _ = served
    assert_blames_the_request(outcome(lambda: stub.Tokenize(request, timeout=TIMEOUT)), errors)


def test_a_chat_its_template_refuses_is_invalid_argument(served, errors) -> None:
    stub, _ = served
    messages = pb.Messages(
        messages=[
            pb.ChatMessage(role="user", content="Hello"),
            pb.ChatMessage(role="system", content="Be terse."),
        ]
    )
    for call in (
        lambda: stub.Generate(pb.GenerateRequest(messages=messages), timeout=TIMEOUT),
        lambda: stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=TIMEOUT),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            outcome_or_raise(call)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details() == (
            "messages: the model's chat template refused the messages: "
            "a system message must come first"
        )
    assert errors() == []


def mutated(valid: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """The bytes of a valid message, with some bytes overwritten, then cut or extended."""

    def mutate(data: bytes, edits: list[tuple[int, int]], cut: int, tail: bytes) -> bytes:
        raw = bytearray(data)
        for position, value in edits:
            if raw:
                raw[position % len(raw)] = value
        return bytes(raw[: len(raw) - cut % (len(raw) + 1)]) + tail

    return st.builds(
        mutate,
        valid.map(lambda message: message.SerializeToString()),
        st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=6),
        st.integers(0, 64),
        st.binary(max_size=16),
    )


SMALL = settings(FUZZ, max_examples=40)
small_generate = generate_requests.filter(lambda r: r.ByteSize() < 4096)
small_tokenize = tokenize_requests.filter(lambda r: r.ByteSize() < 4096)
METHODS = {
    "Generate": (pb.GenerateResponse, st.one_of(st.binary(max_size=300), mutated(small_generate))),
    "Tokenize": (pb.TokenizeResponse, st.one_of(st.binary(max_size=300), mutated(small_tokenize))),
    "GetModelInfo": (pb.ModelInfo, st.binary(max_size=300)),
}


def raw_call(channel: grpc.Channel, method: str) -> Callable[[bytes], object]:
    """The method, called with raw bytes for a request (no serializer on the client side)."""
    path = f"/kenspec.v1.Generator/{method}"
    identity = {"request_serializer": None, "response_deserializer": None}
    if method == "Generate":
        return channel.unary_stream(path, **identity)
    return channel.unary_unary(path, **identity)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_raw_bytes_never_get_internal(served, errors, method) -> None:
    _, channel = served
    call = raw_call(channel, method)

    @SMALL
    @given(payload=METHODS[method][1])
    def check(payload: bytes) -> None:
        assert_blames_the_request(outcome(lambda: call(payload, timeout=TIMEOUT)), errors)

    check()


def test_still_serving_after_the_fuzzing(served, errors) -> None:
    stub, channel = served
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    request = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_new_tokens=3))
    responses = list(stub.Generate(request, timeout=TIMEOUT))
    assert responses[-1].usage.completion_tokens == 3
    assert errors() == []
