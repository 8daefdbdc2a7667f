"""bench.workloads: which prompts are warm-up and which are measured, the summary, and one
real run through a tiny-model server."""

from __future__ import annotations

import asyncio
import json

from bench import workloads


def test_plans_warm_up_and_measured_prompts() -> None:
    prompts = [f"p{i}" for i in range(5)]
    assert workloads.plan("sequence", prompts, 2) == ([], prompts)
    assert workloads.plan("repeat", prompts, 2) == (prompts, prompts)
    assert workloads.plan("templated", prompts, 2) == (prompts[:2], prompts[2:])


def test_summary_takes_medians_and_counts_slow_prompts() -> None:
    def run(tokens_per_s: float, rounds: int) -> dict:
        return {"tokens": 12, "tokens_per_s": tokens_per_s, "tokens_per_round": 12 / rounds}

    results = [
        {"on": run(30.0, 4), "off": run(10.0, 12)},  # 3x
        {"on": run(11.0, 10), "off": run(10.0, 12)},  # 1.1x: below 1.2x
        {"on": run(20.0, 6), "off": run(10.0, 12)},  # 2x
    ]
    summary = workloads.summarize(results)
    assert summary["speedup_median"] == 2.0
    assert summary["tokens_per_round_median"] == 2.0
    assert abs(summary["below_1_2x"] - 1 / 3) < 1e-9
    assert summary["same_tokens"]


def test_repeat_workload_through_a_server(tmp_path, tiny_model_dir) -> None:
    """Without a KenLM draft, the second pass of `repeat` drafts from the answers the suffix
    index learned in the first: far fewer rounds than with the index off."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nOnce upon a time\n")
    server = ["--model", str(tiny_model_dir), "--draft", "none", "--device", "cpu"]
    server += ["--dtype", "float32", "--max-batch-size", "2", "--breaker-threshold", "0"]
    server += ["--threads", "1"]  # as tiny_server: a busy neighbour cannot stall a thread pool
    server += ["--no-live-costs"]  # as tiny_server: drafts priced by the start-up table
    argv = ["--workload", "repeat", "--prompts", str(prompts), "--max-new-tokens", "16"]
    rounds = {}
    for label, extra in (("learning", []), ("off", ["--no-suffix-index"])):
        out = tmp_path / f"{label}.jsonl"
        assert workloads.main([*argv, "--out", str(out), "--", *server, *extra]) == 0
        record = json.loads(out.read_text())
        assert [r["prompt"] for r in record["results"]] == [
            "The quick brown fox",
            "Once upon a time",
        ]
        assert record["summary"]["same_tokens"]  # greedy: on and off give the same answers
        assert all(r["off"]["rounds"] == r["off"]["tokens"] for r in record["results"])
        rounds[label] = sum(r["on"]["rounds"] for r in record["results"])
        # The bench asks the server for each round's draft source (--report-draft-source).
        assert set(record["summary"]["sources"]) - {"none"}
    assert rounds["learning"] < rounds["off"]


def test_raw_sends_the_prompt_as_it_is_and_chat_as_a_user_message() -> None:
    """A base model (no chat template) is measured on raw prompts (`--raw`)."""
    sent: list[dict] = []

    class Client:
        async def generate(self, **request):
            sent.append(request)
            return
            yield

    for raw in (True, False):
        asyncio.run(workloads.measure_request(Client(), "Once upon", 8, "off", raw=raw))
    assert [{k: v for k, v in r.items() if k in ("prompt", "messages")} for r in sent] == [
        {"prompt": "Once upon"},
        {"messages": [("user", "Once upon")]},
    ]
