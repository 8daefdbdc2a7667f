"""The concurrency sweep's workload: which prompts its requests send."""

from __future__ import annotations

import time

from bench import concurrency


class _NoClient:
    def __init__(self, address: str) -> None:
        self.address = address

    async def __aenter__(self) -> _NoClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None


async def _sent(monkeypatch, tag: str) -> list[str]:
    sent: list[str] = []

    async def one_stream(client, prompt: str, max_new_tokens: int) -> dict:
        sent.append(prompt)
        return {"tokens": 1, "times": [0.01], "arrivals": [(time.perf_counter(), 1)]}

    monkeypatch.setattr(concurrency, "AsyncClient", _NoClient)
    monkeypatch.setattr(concurrency, "_one_stream", one_stream)
    result = await concurrency.sweep_level("unused", ["a", "b", "c"], 2, 2, 4, tag)
    assert result["requests"] == 4
    return sent


async def test_every_prompt_at_least_once_and_repeats_without_a_tag(monkeypatch) -> None:
    assert sorted(await _sent(monkeypatch, "")) == ["a", "a", "b", "c"]


async def test_a_tag_makes_every_request_distinct(monkeypatch) -> None:
    sent = await _sent(monkeypatch, "1.2")
    assert sorted(sent) == ["(1.2-0) a", "(1.2-1) b", "(1.2-2) c", "(1.2-3) a"]
