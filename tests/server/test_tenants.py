"""Isolation between callers, through the in-process server with two bearer tokens: one
tenant's answers never reach another's drafts (unless --suffix-index-scope shared), one
tenant's flood leaves another's answers alone, and per-round draft sources are streamed only
with --report-draft-source.

Each test draws fresh tokens, so its tenants have learned nothing before it (the runtimes are
shared by the tests of this module). Chains, not trees (--tree-budget 1): a round's source
then names the index when the index drafted it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.server.engine.tenant_index import SHARED_TENANT
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.runtime import Runtime, load_runtime
from kenspec.server.security import tenant_of
from kenspec.server.settings import Settings
from tests.server.conftest import TIMEOUT, Servers

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def runtimes(base_settings: Settings) -> dict[str, Runtime]:
    """A runtime per suffix-index scope (and one with a small bound, for floods)."""
    chains = base_settings.replace(tree_budget=1)
    return {
        "tenant": load_runtime(chains),
        "shared": load_runtime(chains.replace(suffix_index_scope="shared")),
        "small": load_runtime(chains.replace(suffix_index_tokens=1200)),
    }


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, str, str]:
    """An auth tokens file of two fresh tokens, and the tokens."""
    first, second = secrets.token_hex(16), secrets.token_hex(16)
    path = tmp_path / "tokens"
    path.write_text(f"# two tenants\n{first}\n{second}\n")
    return path, first, second


@pytest.fixture
async def serve(base_settings, serve_loaded, servers: Servers) -> Callable:
    """serve(runtime, **settings) -> a started, loaded KenspecServer over `runtime`."""

    async def start(runtime: Runtime, **overrides: object) -> KenspecServer:
        return await servers.start(base_settings.replace(**overrides), serve_loaded(runtime))

    return start


async def rounds(server: KenspecServer, token: str, prompt: str = PROMPT, new: int = 24) -> list:
    """Every round of a greedy generation as the caller holding `token` sees it."""
    request = pb.GenerateRequest(
        prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=new, ignore_eos=True)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.GeneratorStub(channel).Generate(
            request, metadata=(("authorization", f"Bearer {token}"),), timeout=TIMEOUT
        )
        return [response.round async for response in call]


def index_sources(rounds_: list) -> list[str]:
    return [r.draft_source for r in rounds_ if r.draft_source.startswith("suffix")]


@pytest.mark.parametrize(
    ("scope", "leaks"),
    [("tenant", False), ("shared", True)],
)
async def test_a_second_tenants_drafts_never_come_from_the_firsts_answer(
    serve, runtimes, tokens, scope, leaks
) -> None:
    """Tenant a is served a prompt twice: the second time drafts its first answer from the
    index (so the observable works). Tenant b then sends the same prompt, whose continuation
    is a's answer: its drafts come from the index only when the scope is shared."""
    path, first, second = tokens
    server = await serve(runtimes[scope], auth_tokens_file=str(path), report_draft_source=True)
    await rounds(server, first)
    again = await rounds(server, first)
    assert index_sources(again), [r.draft_source for r in again]
    other = await rounds(server, second)
    assert bool(index_sources(other)) is leaks, [r.draft_source for r in other]
    assert [r.draft_source for r in other if r.drafted] != []  # b drafted: from KenLM, its own


async def test_the_tenant_is_the_token_whichever_api_the_call_came_through(
    serve, runtimes, tokens
) -> None:
    """Tenant a's answer, served over HTTP, is drafted for a over gRPC, and never for b."""
    path, first, second = tokens
    runtime = runtimes["tenant"]
    server = await serve(runtime, auth_tokens_file=str(path), report_draft_source=True, port=0)
    body = {
        "model": Path(server.settings.model.model).name,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        reply = await client.post(url, json=body, headers={"authorization": f"Bearer {first}"})
    assert reply.status_code == 200, reply.text
    suffix = runtime.engine.suffix
    assert suffix is not None
    assert suffix.learned(server.serving.tenant(f"Bearer {first}")) is not None
    assert index_sources(await rounds(server, first))
    assert not index_sources(await rounds(server, second))


async def test_a_tenants_flood_leaves_another_tenants_answers_in_place(
    serve, runtimes, tokens
) -> None:
    """With a bound of 1200 ids, tenant a floods the index with long answers (its share is
    half of it, beside b); b's answer is still held and still drafted, and the index never
    holds more than the bound."""
    path, first, second = tokens
    runtime = runtimes["small"]
    server = await serve(runtime, auth_tokens_file=str(path), report_draft_source=True)
    await rounds(server, second)
    suffix = runtime.engine.suffix
    assert suffix is not None
    tenant_b = server.serving.tenant(f"Bearer {second}")
    held = suffix.learned(tenant_b)
    assert held is not None
    before = held.tokens
    for number in range(12):  # 12 x (16 + 120 + 1) ids: about three times a's share
        await rounds(server, first, prompt=f"Flood number {number} of the index", new=120)
        assert suffix.tokens <= 1200
    assert suffix.learned(tenant_b) is held and held.tokens == before
    flooder = suffix.learned(server.serving.tenant(f"Bearer {first}"))
    assert flooder is not None and flooder.tokens <= suffix.share(len(suffix.tenants)) == 600
    assert index_sources(await rounds(server, second))


@pytest.mark.parametrize("report", [False, True])
async def test_per_round_draft_sources_are_streamed_only_with_the_operator_flag(
    start_server, report
) -> None:
    server, stub = await start_server(report_draft_source=report, port=0)
    request = pb.GenerateRequest(
        prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)
    )
    streamed = [response async for response in stub.Generate(request, timeout=TIMEOUT)]
    drafted = [response.round for response in streamed if response.round.drafted]
    assert drafted  # the rounds drafted: a source existed for each
    assert all(bool(r.draft_source) is report for r in drafted)
    assert streamed[-1].usage.drafted_tokens == sum(r.round.drafted for r in streamed)
    body = {
        "model": Path(server.settings.model.model).name,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        async with client.stream("POST", url, json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
    chunks = [event["kenspec"] for event in events if event["choices"]]
    assert any(chunk["drafted"] for chunk in chunks)
    assert all(("draft_source" in chunk) is report for chunk in chunks)
    assert events[-1]["kenspec"]["drafted"] == sum(chunk["drafted"] for chunk in chunks)


@pytest.mark.parametrize(
    ("authorization", "tokens", "same_as_first"),
    [
        ("Bearer first-token", (b"first-token", b"second"), True),
        ("bearer  first-token ", (b"first-token", b"second"), True),  # as bearer_token reads it
        ("Bearer second", (b"first-token", b"second"), False),
        ("", (b"first-token",), False),
    ],
)
def test_a_tenant_is_a_keyed_hash_of_the_token(authorization, tokens, same_as_first) -> None:
    first = tenant_of("Bearer first-token", tokens)
    tenant = tenant_of(authorization, tokens)
    assert (tenant == first) is same_as_first
    assert "first-token" not in tenant and len(tenant) == 17
    # Without tokens, whatever the caller sends: one shared tenant.
    assert tenant_of(authorization, ()) == SHARED_TENANT
