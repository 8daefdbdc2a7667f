"""Prometheus metrics move as requests run: counts, acceptance by position, breaker transitions."""

from __future__ import annotations

import urllib.request
from dataclasses import replace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kenspec_api import generator_pb2 as pb
from kenspec_api import generator_pb2_grpc as pb_grpc
from server.app import KenspecServer
from server.runtime import load_runtime
from tests.service.test_generate import collect, prompt_request


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
async def strict_server(base_settings):
    """A server whose per-request breaker opens quickly (threshold 0.95 over 2 rounds)."""
    settings = replace(base_settings, breaker_threshold=0.95, breaker_window=2, metrics_port=0)
    runtime = load_runtime(settings)
    server = KenspecServer(settings, loader=lambda _: runtime)
    await server.start()
    await server.load()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, pb_grpc.GeneratorStub(channel)
    await channel.close()
    await server.stop(0)


async def test_metrics_move_with_requests(strict_server) -> None:
    server, stub = strict_server
    before = scrape(server.metrics_port)
    assert value(before, "kenspec_draft_breaker_state", state="closed") == 1.0
    assert value(before, "kenspec_active_streams") == 0.0
    finished = await collect(stub.Generate(prompt_request(max_new_tokens=30)))
    with pytest.raises(grpc.aio.AioRpcError):
        await collect(stub.Generate(pb.GenerateRequest(prompt="")))
    after = scrape(server.metrics_port)

    assert value(after, "kenspec_requests_total", finish_reason="length", code="OK") == 1.0
    assert (
        value(after, "kenspec_requests_total", finish_reason="none", code="INVALID_ARGUMENT") == 1
    )
    rounds = len(finished)
    by_mode = sum(
        value(after, "kenspec_rounds_total", mode=m) for m in ("speculative", "autoregressive")
    )
    assert by_mode == rounds
    usage = finished[-1].usage
    assert value(after, "kenspec_drafted_tokens_total") == usage.drafted_tokens > 0
    assert value(after, "kenspec_accepted_tokens_total") == usage.accepted_tokens
    assert value(after, "kenspec_generated_tokens_total") == 30
    first = value(after, "kenspec_drafted_by_position_total", position="1")
    assert first == sum(1 for r in finished if r.round.drafted >= 1)
    assert value(after, "kenspec_accepted_by_position_total", position="1") == sum(
        1 for r in finished if r.round.accepted >= 1
    )
    assert value(after, "kenspec_time_to_first_token_seconds_count") == 1.0
    assert value(after, "kenspec_round_seconds_count") == rounds - 1
    assert value(after, "kenspec_batch_rows_count") == rounds  # one pass per round, alone
    assert value(after, "kenspec_batch_rows_sum") == rounds
    assert value(after, "kenspec_batch_pass_tokens_sum") >= rounds
    # The partly-matching draft falls below 0.95 acceptance: the request's breaker opened.
    assert any(r.round.breaker_state == pb.BREAKER_STATE_OPEN for r in finished)
    assert value(after, "kenspec_breaker_transitions_total", scope="request", state="open") >= 1
    assert value(after, "kenspec_active_streams") == 0.0
    assert value(after, "kenspec_queue_depth") == 0.0


async def test_a_repeated_prompt_counts_its_reused_tokens(strict_server, tiny_target) -> None:
    server, stub = strict_server
    prompt = "The quick brown fox jumps over the lazy dog"
    await collect(stub.Generate(prompt_request(prompt, max_new_tokens=4)))
    first = scrape(server.metrics_port)
    await collect(stub.Generate(prompt_request(prompt, max_new_tokens=4)))
    second = scrape(server.metrics_port)
    assert value(first, "kenspec_prefix_cache_reused_tokens_total") == 0.0
    reused = len(tiny_target.encode_prompt(prompt)) - 1  # all but the token its round feeds
    assert value(second, "kenspec_prefix_cache_reused_tokens_total") == reused
