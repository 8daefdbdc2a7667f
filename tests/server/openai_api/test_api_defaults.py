"""The HTTP API's defaults as the ecosystem has them (vLLM's, llama-server's): no max_tokens runs
to the end of the context, a max_tokens that cannot fit is refused naming the numbers, many
stop sequences, fields OpenAI defines that kenspec does not act on accepted and listed in a
header; /tokenize, /detokenize and /metrics on the API port, the metrics labelled by model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import grpc
import httpx
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.generate_params import Defaults, Limits
from kenspec.server.openai_api.ignored import IGNORED_HEADER, MAX_LISTED
from kenspec.server.openai_api.openai_request import parse_request
from kenspec.server.runtime import new_token_limits
from kenspec.server.settings import LimitSettings, Settings, parse_settings
from tests.server.openai_api.test_openai_api import MESSAGES, TIMEOUT, grpc_chat, model_id

CONTEXT = 512  # the tiny model's
LIMITS = Limits(
    default_max_new_tokens=CONTEXT,
    max_new_tokens=CONTEXT,
    max_prompt_tokens=CONTEXT,
    max_prompt_chars=CONTEXT * 16,
    tokenize_concurrency=2,
    max_stop_sequences=64,
    max_stop_length=128,
)
DEFAULTS = Defaults(num_draft_tokens=4, adaptive=False)


@pytest.fixture
async def context_server(servers, base_settings, runtime, serve_loaded):
    """start(**settings) -> (server, base_url): the HTTP API over the session's runtime with the
    default token limits (--default-max-new-tokens 0, --max-new-tokens-limit 0: the context)."""

    async def start(**overrides):
        limits = dataclasses.replace(
            runtime.limits, default_max_new_tokens=CONTEXT, max_new_tokens=CONTEXT
        )
        loaded = dataclasses.replace(runtime, limits=limits)
        settings = base_settings.replace(port=0, **overrides)
        server = await servers.start(settings, serve_loaded(loaded))
        return server, f"http://localhost:{server.http_port}"

    return start


def _client(url: str, **options) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=TIMEOUT, **options)


# --- token limits -------------------------------------------------------------------------


def test_the_token_limits_default_to_the_context_and_stops_to_64() -> None:
    limits = LimitSettings()
    assert limits.default_max_new_tokens == 0  # the rest of the context
    assert limits.max_new_tokens_limit == 0  # the model's context
    assert limits.max_stop_sequences == 64
    flags = parse_settings(["--max-new-tokens-limit", "4096"], {}).limits
    assert flags.max_new_tokens_limit == 4096
    with pytest.raises(SystemExit):
        parse_settings(["--default-max-new-tokens", "-1"], {})


def test_a_runtime_resolves_them_to_the_models_context() -> None:
    assert new_token_limits(Settings(), 8192) == (8192, 8192)  # the rest of the context
    assert new_token_limits(Settings.of(max_new_tokens_limit=4096), 8192) == (4096, 4096)
    assert new_token_limits(Settings.of(default_max_new_tokens=256), 8192) == (256, 8192)
    # A default above the limit is the limit (it could never be served).
    over = Settings.of(default_max_new_tokens=300, max_new_tokens_limit=200)
    assert new_token_limits(over, 8192) == (200, 200)


async def test_no_max_tokens_runs_to_the_end_of_the_context(context_server) -> None:
    server, url = await context_server()
    body = {"model": model_id(server), "prompt": "The quick brown fox", "temperature": 0}
    async with _client(url) as client:
        answer = await client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_a_max_tokens_that_cannot_fit_names_the_numbers(context_server) -> None:
    server, url = await context_server()
    body = {"model": model_id(server), "messages": MESSAGES, "max_completion_tokens": 500}
    async with _client(url) as client:
        answer = await client.post("/v1/chat/completions", json=body)
        prompt = await client.post(
            "/tokenize", json={"model": model_id(server), "messages": MESSAGES}
        )
        fits = CONTEXT - prompt.json()["count"]
        served = await client.post(
            "/v1/chat/completions",
            json={**body, "max_completion_tokens": fits, "ignore_eos": True, "temperature": 0},
        )
        over = await client.post(
            "/v1/chat/completions", json={**body, "max_completion_tokens": CONTEXT + 1}
        )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "max_completion_tokens"  # as the request named it
    assert f"({prompt.json()['count']} tokens)" in error["message"]
    assert "(500)" in error["message"] and f"context of {CONTEXT}" in error["message"]
    assert f"at most {fits} fit" in error["message"]
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == fits
    # Over --max-new-tokens-limit (the context, unless set) is refused before any prompt work.
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_completion_tokens"
    assert f"server limit of {CONTEXT}" in over.json()["error"]["message"]


def test_a_large_max_tokens_is_served_within_a_large_context() -> None:
    """What an IDE assistant sends (4096) is within a model's context of 8,192 (SmolLM2's)."""
    large = dataclasses.replace(LIMITS, max_new_tokens=8192, default_max_new_tokens=8192)
    body = b'{"model": "m", "prompt": "x", "max_tokens": 4096}'
    parsed = parse_request(body, chat=False, limits=large, defaults=DEFAULTS)
    assert parsed.params.stopping.max_new_tokens == 4096 and not parsed.params.default_tokens
    absent = parse_request(
        b'{"model": "m", "prompt": "x"}', chat=False, limits=large, defaults=DEFAULTS
    )
    assert absent.params.default_tokens and absent.params.stopping.max_new_tokens == 8192


async def test_grpc_follows_the_same_rule(servers, base_settings, runtime, serve_loaded) -> None:
    limits = dataclasses.replace(
        runtime.limits, default_max_new_tokens=CONTEXT, max_new_tokens=CONTEXT
    )
    server = await servers.start(
        base_settings, serve_loaded(dataclasses.replace(runtime, limits=limits))
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.GeneratorStub(channel)
        stopping = pb.StoppingCriteria(ignore_eos=True)  # max_new_tokens 0: the default
        request = pb.GenerateRequest(prompt="The quick brown fox", stopping=stopping)
        responses = [r async for r in stub.Generate(request, timeout=TIMEOUT)]
        usage = responses[-1].usage
        assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        stopping = pb.StoppingCriteria(max_new_tokens=CONTEXT - 1)
        request = pb.GenerateRequest(prompt="The quick brown fox", stopping=stopping)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stub.Generate(request, timeout=TIMEOUT)]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_new_tokens ({CONTEXT - 1})" in error.value.details()
    assert f"({usage.prompt_tokens} tokens)" in error.value.details()


async def test_a_prompt_that_fills_the_context_is_refused(context_server) -> None:
    server, url = await context_server()
    # Two bytes a character that the tiny tokenizer never merged: a token each.
    body = {"model": model_id(server), "prompt": "\u0416" * (CONTEXT // 2)}
    async with _client(url) as client:
        counted = await client.post("/tokenize", json={"prompt": body["prompt"]})
        answer = await client.post("/v1/completions", json=body)
    assert counted.json()["count"] == CONTEXT
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert f"{CONTEXT} tokens fill the model's context" in answer.json()["error"]["message"]


# --- stop sequences -----------------------------------------------------------------------


async def test_many_stop_sequences_are_served(http_server) -> None:
    server, _, url = await http_server()
    body = {"model": model_id(server), "prompt": "Hi", "max_tokens": 4}
    stops = [f"<stop {index}>" for index in range(64)]
    async with _client(url) as client:
        served = await client.post("/v1/completions", json={**body, "stop": stops})
        refused = await client.post("/v1/completions", json={**body, "stop": [*stops, "x"]})
    assert served.status_code == 200, served.text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
    assert "the limit is 64" in refused.json()["error"]["message"]


# --- fields accepted and not acted on -----------------------------------------------------


def _parse(body: bytes, chat: bool = True):  # type: ignore[no-untyped-def]
    return parse_request(body, chat=chat, limits=LIMITS, defaults=DEFAULTS)


async def test_fields_kenspec_does_not_act_on_are_listed_in_a_header(http_server) -> None:
    server, _, url = await http_server()
    messages = [
        {"role": "system", "content": "Be terse.", "name": "rules"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "Again"},
    ]
    body = {
        "model": model_id(server),
        "messages": messages,
        "max_tokens": 3,
        "metadata": {"team": "ide"},
        "store": False,
        "service_tier": "auto",
        "reasoning_effort": "low",
        "user": "someone",
        "foo": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    with structlog.testing.capture_logs() as logs:
        async with _client(url) as client:
            answer = await client.post("/v1/chat/completions", json=body)
            quiet = await client.post(
                "/v1/chat/completions",
                json={"model": model_id(server), "messages": MESSAGES, "max_tokens": 2},
            )
            known = await client.post(
                "/v1/chat/completions",
                json={
                    "model": model_id(server),
                    "messages": MESSAGES,
                    "max_tokens": 2,
                    "metadata": {},
                },
            )
    assert answer.status_code == 200 and "data: [DONE]" in answer.text
    assert answer.headers[IGNORED_HEADER].split(",") == [
        "metadata",
        "store",
        "service_tier",
        "reasoning_effort",
        "foo",
        "messages[].name",
        "messages[].content[].cache_control",
        "stream_options.include_obfuscation",
    ]
    assert IGNORED_HEADER not in quiet.headers  # nothing ignored: no header
    assert known.headers[IGNORED_HEADER] == "metadata"
    lines = [line for line in logs if line["event"] == "ignored_fields"]
    assert len(lines) == 2  # one per request that sent any
    assert lines[0]["log_level"] == "warning" and lines[0]["unknown"]  # foo is no API's
    assert lines[1]["log_level"] == "info" and lines[1]["fields"] == ["metadata"]
    assert "foo" in lines[0]["fields"] and lines[0]["request_id"]


def test_the_header_stays_short_and_printable() -> None:
    names = {f"field_{index}_" + "x" * 200: index for index in range(40)}
    names["a,b\r\nInjected: yes é"] = 1
    parsed = _parse(json.dumps({"model": "m", "prompt": "Hi", **names}).encode(), chat=False)
    value = parsed.ignored.header()[IGNORED_HEADER]
    listed = value.split(",")
    assert len(listed) == MAX_LISTED + 1 and listed[-1] == f"+{41 - MAX_LISTED} more"
    assert all(len(name) <= 67 for name in listed)
    assert value.isascii() and value.isprintable() and " " not in value.replace(" more", "")
    strange = _parse(b'{"model": "m", "prompt": "Hi", "a,b\\r\\nX: \\u00e9": 1}', chat=False)
    assert strange.ignored.header()[IGNORED_HEADER] == "a%2Cb%0D%0AX%3A%20%C3%A9"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"min_tokens": 5}, "min_tokens"),
        ({"stop_token_ids": [2]}, "stop_token_ids"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ],
)
def test_completion_fields_kenspec_cannot_honour_stay_400(fields, named) -> None:
    # (beside a field that is only ignored: that one is no reason to refuse)
    body = {"model": "m", "prompt": "Hi", "metadata": {"a": "b"}, **fields}
    with pytest.raises(InvalidParameter) as error:
        _parse(json.dumps(body).encode(), chat=False)
    assert error.value.field == named


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),  # (without tools)
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "x": 1}]}]},
            "content[0]",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
            "tool_calls[0]",
        ),
    ],
)
def test_chat_fields_kenspec_cannot_honour_stay_400(fields, named) -> None:
    body = {"metadata": {}, "model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    body |= fields
    with pytest.raises(InvalidParameter) as error:
        _parse(json.dumps(body).encode())
    assert named in error.value.field


def test_neutral_values_are_neither_refused_nor_listed() -> None:
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [],'
        b' "tool_choice": "none", "parallel_tool_calls": true, "modalities": ["text"],'
        b' "audio": null, "min_tokens": 0, "use_beam_search": false}'
    )
    assert _parse(body).ignored.header() == {}


# --- /tokenize and /detokenize ------------------------------------------------------------


async def test_tokenize_mirrors_grpc_tokenize(http_server) -> None:
    server, stub, url = await http_server()
    prompt = "The quick brown fox \U0001f642"
    grpc_prompt = await stub.Tokenize(pb.TokenizeRequest(prompt=prompt, return_tokens=True))
    grpc_chat_ids = await stub.Tokenize(pb.TokenizeRequest(messages=grpc_chat(MESSAGES)))
    async with _client(url) as client:
        plain = await client.post(
            "/tokenize",
            json={"model": model_id(server), "prompt": prompt, "return_token_strs": True},
        )
        chat = await client.post("/tokenize", json={"messages": MESSAGES})
        short = await client.post("/tokenize", json={"prompt": "Hi"})
        back = await client.post("/detokenize", json={"tokens": plain.json()["tokens"]})
    assert plain.status_code == 200, plain.text
    assert plain.json() == {
        "count": grpc_prompt.token_count,
        "max_model_len": CONTEXT,
        "tokens": list(grpc_prompt.token_ids),
        "token_strs": list(grpc_prompt.tokens),
    }
    assert chat.json()["tokens"] == list(grpc_chat_ids.token_ids)
    assert short.json()["token_strs"] is None
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens"),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "\u0416" * 300}, 400, "prompt"),  # over --max-prompt-tokens
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [1, True]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * (CONTEXT + 1)}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
    ],
)
async def test_tokenizer_routes_refuse_by_name(http_server, route, body, status, param) -> None:
    _, _, url = await http_server()
    async with _client(url) as client:
        answer = await client.post(route, json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    assert "Traceback" not in answer.text


async def test_tokenize_refuses_over_the_character_limit(http_server, runtime) -> None:
    _, _, url = await http_server()
    too_long = "x" * (runtime.limits.max_prompt_chars + 1)
    async with _client(url) as client:
        answer = await client.post("/tokenize", json={"prompt": too_long})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert "characters exceed" in answer.json()["error"]["message"]


async def test_tokenizer_routes_ask_what_the_api_asks(http_server, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    _, _, url = await http_server(auth_tokens_file=str(tokens), max_message_bytes=4096)
    async with _client(url) as client:
        for route, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
            refused = await client.post(route, json=body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "no_token"
            served = await client.post(route, json=body, headers={"authorization": "Bearer sesame"})
            assert served.status_code == 200, served.text
        form = await client.post(
            "/tokenize", content=b"prompt=Hi", headers={"authorization": "Bearer sesame"}
        )
        assert form.status_code == 415
        big = await client.post(
            "/detokenize",
            content=b'{"tokens": [' + b"1," * 3000 + b"1]}",
            headers={"authorization": "Bearer sesame", "content-type": "application/json"},
        )
        assert big.status_code == 413 and "4096" in big.json()["error"]["message"]


# --- /metrics on the API port, labelled by model -------------------------------------------


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_on_the_api_port_behind_its_tokens(http_server, tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("sesame\n")
    server, _, url = await http_server(auth_tokens_file=str(tokens), metrics_port=-1)
    auth = {"authorization": "Bearer sesame"}
    name = model_id(server)
    async with _client(url) as client:
        refused = await client.get("/metrics")
        wrong = await client.get("/metrics", headers={"authorization": "Bearer nope"})
        done = await client.post(  # one token a round: some after the first round's
            "/v1/completions",
            json={
                "model": name,
                "prompt": "Hi",
                "max_tokens": 6,
                "ignore_eos": True,
                "speculation": "off",
            },
            headers=auth,
        )
        scraped = await client.get("/metrics", headers=auth)
    assert refused.status_code == 401 and wrong.status_code == 401
    assert done.status_code == 200
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    samples = _samples(scraped.text)
    labels = (("api", "http"), ("code", "OK"), ("finish_reason", "length"), ("model_name", name))
    assert samples[("kenspec_requests_total", labels)] == 1
    model = (("model_name", name),)
    for histogram in (
        "kenspec_e2e_request_latency_seconds",
        "kenspec_request_prompt_tokens",
        "kenspec_time_per_output_token_seconds",
        "kenspec_time_to_first_token_seconds",
        "kenspec_request_tokens_per_second",
    ):
        assert samples[(f"{histogram}_count", model)] == 1, histogram
    prompt = done.json()["usage"]["prompt_tokens"]
    assert samples[("kenspec_request_prompt_tokens_sum", model)] == prompt


async def test_metrics_on_the_api_port_follow_its_host_check_and_switch(http_server) -> None:
    _, _, url = await http_server(metrics_port=-1)
    async with _client(url) as client:
        assert (await client.get("/metrics")).status_code == 200  # loopback, no tokens
        stranger = await client.get("/metrics", headers={"host": "evil.example"})
        assert stranger.status_code == 421
    _, _, url = await http_server(metrics_port=-1, http_metrics=False)
    async with _client(url) as client:
        assert (await client.get("/metrics")).status_code == 404


async def test_grpc_requests_carry_the_model_name_too(http_server) -> None:
    server, stub, _ = await http_server()
    request = pb.GenerateRequest(prompt="Hi", stopping=pb.StoppingCriteria(max_new_tokens=3))
    [r async for r in stub.Generate(request, timeout=TIMEOUT)]
    count = server.metrics.registry.get_sample_value
    labels = {"api": "grpc", "finish_reason": "length", "code": "OK"}
    assert count("kenspec_requests_total", {**labels, "model_name": model_id(server)}) == 1
    assert server.metrics.model_name == Path(server.settings.model.model).name
    assert isinstance(Settings().server.http_metrics, bool)
