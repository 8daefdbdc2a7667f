"""Prometheus metrics move as requests run: counts, acceptance by position, breaker transitions.

The server loads its own runtime here (the real loader), so that the engine reports to the
server's metrics; what the warm-up reported at load is taken out by comparing with a scrape
made before the requests."""

from __future__ import annotations

import grpc
import pytest

from kenspec.api import generator_pb2 as pb
from kenspec.api import generator_pb2_grpc as pb_grpc
from kenspec.api.outputs import BreakerState, FinishReason, Mode
from kenspec.server.engine.generation import Round
from kenspec.server.lifecycle import KenspecServer
from kenspec.server.metrics import Metrics
from kenspec.server.serving import RequestRecord


@pytest.fixture
async def strict_server(base_settings):
    """A server whose per-request breaker opens quickly (threshold 0.95 over 2 rounds)."""
    settings = base_settings.replace(breaker_threshold=0.95, breaker_window=2, metrics_port=0)
    server = KenspecServer(settings)
    await server.start()
    await server.load()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, pb_grpc.GeneratorStub(channel)
    await channel.close()
    await server.stop(0)


async def test_metrics_move_with_requests(strict_server, scrape, collect, prompt_request) -> None:
    server, stub = strict_server
    before = scrape(server.metrics_port)
    assert before.value("kenspec_draft_breaker_state", state="closed") == 1.0
    assert before.value("kenspec_active_streams") == 0.0
    finished = await collect(stub.Generate(prompt_request(max_new_tokens=30)))
    with pytest.raises(grpc.aio.AioRpcError):
        await collect(stub.Generate(pb.GenerateRequest(prompt="")))
    after = scrape(server.metrics_port)

    def moved(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    model = {"model_name": server.metrics.model_name}
    ok = {"api": "grpc", "finish_reason": "length", "code": "OK", **model}
    assert after.value("kenspec_requests_total", **ok) == 1.0
    refused = {"api": "grpc", "finish_reason": "none", "code": "INVALID_ARGUMENT", **model}
    assert after.value("kenspec_requests_total", **refused) == 1
    rounds = len(finished)
    by_mode = sum(
        after.value("kenspec_rounds_total", mode=m) for m in ("speculative", "autoregressive")
    )
    assert by_mode == rounds
    usage = finished[-1].usage
    assert after.value("kenspec_drafted_tokens_total") == usage.drafted_tokens > 0
    assert after.value("kenspec_accepted_tokens_total") == usage.accepted_tokens
    assert after.value("kenspec_generated_tokens_total") == 30
    first = after.value("kenspec_drafted_by_position_total", position="1")
    assert first == sum(1 for r in finished if r.round.drafted >= 1)
    assert after.value("kenspec_accepted_by_position_total", position="1") == sum(
        1 for r in finished if r.round.accepted >= 1
    )
    assert after.value("kenspec_time_to_first_token_seconds_count", **model) == 1.0
    assert after.value("kenspec_round_seconds_count", **model) == rounds - 1
    assert after.value("kenspec_e2e_request_latency_seconds_count", **model) == 1.0
    assert after.value("kenspec_request_prompt_tokens_sum", **model) == usage.prompt_tokens
    assert moved("kenspec_batch_rows_count") == rounds  # one pass per round, alone
    assert moved("kenspec_batch_rows_sum") == rounds
    assert moved("kenspec_batch_pass_tokens_sum") >= rounds
    # Every engine round's own work, by kind: those that verified drafts and those that did not.
    drafting = sum(1 for r in finished if r.round.drafted)
    assert moved("kenspec_round_overhead_seconds_count", kind="draft") == drafting
    assert moved("kenspec_round_overhead_seconds_count", kind="plain") == rounds - drafting
    assert moved("kenspec_round_overhead_seconds_sum", kind="draft") > 0
    # The partly-matching draft falls below 0.95 acceptance: the request's breaker opened.
    assert any(r.round.breaker_state == pb.BREAKER_STATE_OPEN for r in finished)
    assert moved("kenspec_breaker_transitions_total", scope="request", state="open") >= 1
    assert after.value("kenspec_active_streams") == 0.0
    assert after.value("kenspec_queue_depth") == 0.0


async def test_a_repeated_prompt_counts_its_reused_tokens(
    strict_server, tiny_target, scrape, collect, prompt_request
) -> None:
    server, stub = strict_server
    prompt = "The quick brown fox jumps over the lazy dog"
    before = scrape(server.metrics_port)
    await collect(stub.Generate(prompt_request(prompt, max_new_tokens=4)))
    first = scrape(server.metrics_port)
    await collect(stub.Generate(prompt_request(prompt, max_new_tokens=4)))
    second = scrape(server.metrics_port)
    name = "kenspec_prefix_cache_reused_tokens_total"
    assert first.value(name) == before.value(name)  # nothing stored yet shares its beginning
    reused = len(tiny_target.encode_prompt(prompt)) - 1  # all but the token its round feeds
    assert second.value(name) - first.value(name) == reused


@pytest.mark.parametrize("choices", [1, 3])
def test_time_per_output_token_is_per_sequence_whatever_the_choices(monkeypatch, choices) -> None:
    """Rounds of `choices` choices interleaved, 2 tokens each, one a second: the first
    choice's 4 tokens after its first round took 2 s, 0.5 s a token, however many choices
    (summing every choice's tokens would give 0.5 / choices)."""
    now = [100.0]
    monkeypatch.setattr("kenspec.server.serving.time.perf_counter", lambda: now[0])
    metrics = Metrics("m")
    record = RequestRecord(metrics, "grpc")
    for index in range(3):
        now[0] += 1.0
        for choice in range(choices):
            last = index == 2
            record.observe(
                Round(
                    index=index,
                    token_ids=(1, 2),
                    text="ab",
                    drafted=0,
                    accepted=0,
                    mode=Mode.AUTOREGRESSIVE,
                    breaker_state=BreakerState.CLOSED,
                    window_acceptance=0.0,
                    finish_reason=FinishReason.LENGTH if last and choice == choices - 1 else None,
                    choice=choice,
                )
            )
    record.code = grpc.StatusCode.OK
    record.close()
    seconds = metrics.registry.get_sample_value(
        "kenspec_time_per_output_token_seconds_sum", {"model_name": "m"}
    )
    assert seconds == pytest.approx(0.5)
