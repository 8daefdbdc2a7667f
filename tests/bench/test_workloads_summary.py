"""bench.workloads without a server: rounds split by draft source as `_one` records them, and the
per-source and prompt-lookup figures of `summarize`, checked against hand-computed numbers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bench import workloads


def _sources(**families: tuple[int, int, int, int, float]) -> dict[str, dict]:
    names = ("rounds", "tokens", "drafted", "accepted", "seconds")
    return {family: dict(zip(names, counts, strict=True)) for family, counts in families.items()}


def _run(tokens_per_s: float, sources: dict[str, dict] | None = None) -> dict:
    run = {"tokens": 16, "tokens_per_s": tokens_per_s, "tokens_per_round": 2.0}
    if sources is not None:
        run["sources"] = sources
    return run


def test_source_family_drops_the_bucket_and_names_undrafted_rounds() -> None:
    assert workloads.source_family("context:8") == "context"
    assert workloads.source_family("suffix:16") == "suffix"
    assert workloads.source_family("kenlm") == "kenlm"
    assert workloads.source_family("") == "none"


def test_summary_per_source_family_over_all_prompts() -> None:
    # The off runs' rounds must not count: they would change every share below.
    off = _run(10.0, _sources(none=(16, 16, 0, 0, 1.6)))
    results = [
        {
            "on": _run(20.0, _sources(kenlm=(4, 10, 12, 6, 0.5), none=(2, 2, 0, 0, 0.2))),
            "off": off,
        },
        {
            "on": _run(30.0, _sources(kenlm=(2, 4, 6, 2, 0.5), suffix=(4, 24, 24, 20, 1.0))),
            "off": off,
        },
    ]
    summary = workloads.summarize(results)
    sources = summary["sources"]
    assert list(sources) == ["kenlm", "none", "suffix"]
    kenlm, none, suffix = sources["kenlm"], sources["none"], sources["suffix"]
    assert kenlm["share_of_rounds"] == pytest.approx(6 / 12)
    assert kenlm["tokens_per_round"] == pytest.approx(14 / 6)
    assert kenlm["acceptance"] == pytest.approx(8 / 18)
    assert kenlm["tokens_per_s"] == pytest.approx(14 / 1.0)
    assert none["share_of_rounds"] == pytest.approx(2 / 12)
    assert none["tokens_per_round"] == pytest.approx(1.0)
    assert none["acceptance"] is None  # drafted nothing
    assert none["tokens_per_s"] == pytest.approx(2 / 0.2)
    assert suffix["share_of_rounds"] == pytest.approx(4 / 12)
    assert suffix["tokens_per_round"] == pytest.approx(6.0)
    assert suffix["acceptance"] == pytest.approx(20 / 24)
    assert suffix["tokens_per_s"] == pytest.approx(24.0)
    # The keys that were there before are unchanged, and no prompt-lookup figures without it.
    assert summary["speedup_median"] == pytest.approx(2.5)
    assert summary["on_tokens_per_s_median"] == pytest.approx(25.0)
    assert "prompt_lookup_speedup_median" not in summary


def test_summary_prompt_lookup_medians_and_per_prompt_ratio() -> None:
    def column(tokens_per_s: float) -> dict:
        return {"tokens": 16, "seconds": 16 / tokens_per_s, "tokens_per_s": tokens_per_s}

    results = [
        {
            "on": _run(20.0),
            "off": _run(10.0),
            "prompt_lookup": column(30.0),
            "hf_plain": column(10.0),
        },
        {
            "on": _run(20.0),
            "off": _run(10.0),
            "prompt_lookup": column(12.0),
            "hf_plain": column(8.0),
        },
        {
            "on": _run(20.0),
            "off": _run(10.0),
            "prompt_lookup": column(9.0),
            "hf_plain": column(9.0),
        },
    ]
    summary = workloads.summarize(results)
    assert summary["prompt_lookup_tokens_per_s_median"] == pytest.approx(12.0)
    assert summary["hf_plain_tokens_per_s_median"] == pytest.approx(9.0)
    # The median of per-prompt ratios (3, 1.5, 1), not the ratio of the medians (12 / 9).
    assert summary["prompt_lookup_speedup_median"] == pytest.approx(1.5)
    assert summary["sources"] == {}  # results without per-source data


def test_one_records_each_round_under_its_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round times run from the previous round's arrival, the first from the request's start."""
    now = [100.0]
    monkeypatch.setattr(workloads, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    rounds = [  # (seconds before it arrives, tokens, drafted, accepted, draft_source)
        (0.5, 1, 0, 0, ""),
        (0.1, 4, 4, 3, "context:8"),
        (0.2, 2, 4, 1, "kenlm"),
        (0.1, 5, 6, 4, "context:16"),
    ]

    class FakeClient:
        async def generate(self, **kwargs):
            assert kwargs["speculation"] == "auto"
            for wait, tokens, drafted, accepted, source in rounds:
                now[0] += wait
                yield SimpleNamespace(
                    token_ids=tuple(range(tokens)),
                    drafted=drafted,
                    accepted=accepted,
                    draft_source=source,
                )
            now[0] += 0.1  # after the last round, before the stream ends: in no round

    run = asyncio.run(workloads._one(FakeClient(), "p", 16, "auto"))
    assert run["tokens"] == 12 and run["rounds"] == 4
    assert run["seconds"] == pytest.approx(1.0)
    sources = run["sources"]
    assert set(sources) == {"none", "context", "kenlm"}
    assert sources["none"] == pytest.approx(
        {"rounds": 1, "tokens": 1, "drafted": 0, "accepted": 0, "seconds": 0.5}
    )
    assert sources["context"] == pytest.approx(
        {"rounds": 2, "tokens": 9, "drafted": 10, "accepted": 7, "seconds": 0.2}
    )
    assert sources["kenlm"] == pytest.approx(
        {"rounds": 1, "tokens": 2, "drafted": 4, "accepted": 1, "seconds": 0.2}
    )


def test_one_digests_the_answer_not_its_rounds() -> None:
    """Two answers to one prompt compare by digest: the same ids however the rounds split them."""

    def client(*rounds: tuple[int, ...]):
        class FakeClient:
            async def generate(self, **kwargs):
                for ids in rounds:
                    yield SimpleNamespace(token_ids=ids, drafted=0, accepted=0, draft_source="")

        return FakeClient()

    def answer(*rounds: tuple[int, ...]) -> str:
        return asyncio.run(workloads._one(client(*rounds), "p", 16, "auto"))["answer"]

    assert answer((1, 2, 3), (4,)) == answer((1,), (2, 3, 4))
    assert answer((1, 2, 3), (4,)) != answer((1, 2, 3), (5,))
    assert answer((1, 2, 3)) != answer((1, 2, 3), (0,))
