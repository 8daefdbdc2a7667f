"""bench.replicas end to end on the tiny model: two replicas and one, sharing off and on, the
chats through real nginx with deploy/nginx.conf, and Redis killed and restarted under load;
its output files and the fields they hold."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench import outage, replicas, routing


def test_round_robin_sends_a_repeat_to_another_replica() -> None:
    balancer = replicas.RoundRobin(2)
    assert [balancer.pick(p) for p in ["a", "b", "a", "b"]] == [0, 1, 1, 0]
    balancer = replicas.RoundRobin(2)
    assert [balancer.pick(p) for p in ["a", "b", "c", "a", "b", "c"]] == [0, 1, 0, 1, 0, 1]
    single = replicas.RoundRobin(1)
    assert [single.pick(p) for p in ["a", "a"]] == [0, 0]


def test_answer_counts_compare_each_answer_with_the_warm_up_and_off() -> None:
    def run(answer: str, tokens: int, rounds: int) -> dict:
        return {"answer": answer, "tokens": tokens, "rounds": rounds}

    warm = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    results = [
        {"prompt": "a", "on": run("1", 30, 3), "off": run("1", 30, 30)},  # recalled
        {"prompt": "b", "on": run("3", 10, 7), "off": run("4", 10, 10)},  # changed twice
        {"prompt": "c", "on": run("5", 20, 10), "off": run("5", 20, 20)},  # not repeated
    ]
    counts = replicas.answer_counts(warm, results)
    assert counts == {
        "tokens_per_round_all": 3.0,  # 60 tokens in 20 rounds, not a median over prompts
        "repeated": 2,
        "same_as_warm": 1,
        "same_as_off": 2,
    }


def test_routing_plan_alternates_and_tags_every_conversation() -> None:
    entries = routing.plan(["x", "y"])
    assert [(config, session) for config, _, session in entries] == [
        ("routed", "routed-0"),
        ("spread", None),
        ("spread", None),
        ("routed", "routed-1"),
    ]
    assert len({first for _, first, _ in entries}) == 4  # no two share a first message


def tiny_argv(tiny_model_dir, tmp_path) -> list[str]:
    """Every run's arguments: the tiny model on the CPU, two prompts, few tokens."""
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "dev.txt").write_text("The quick brown fox\nOnce upon a time\n")
    argv = ["--replicas", "2", "--workloads", "repeat", "--limit", "2"]
    argv += ["--prompts-dir", str(prompts), "--max-new-tokens", "4", "--conversations", "2"]
    argv += ["--model", str(tiny_model_dir), "--draft", "none", "--start-together"]
    argv += ["--out", str(tmp_path / "out"), "--", "--device", "cpu", "--dtype", "float32"]
    # Drafts priced by the start-up table: on a tiny model a round's Python work is a step's
    # worth, and measured costs would rightly cut the suffix drafts these runs look for.
    return [*argv, "--threads", "1", "--breaker-threshold", "0", "--no-live-costs"]


def test_bench_replicas_writes_its_record(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "out"
    argv = tiny_argv(tiny_model_dir, tmp_path)
    assert replicas.main(["--parts", "sharing,routing", *argv]) == 0
    for name in ("replicas.json", "summary.md", "replicas.png"):
        assert (out / name).stat().st_size > 0
    record = json.loads((out / "replicas.json").read_text())
    assert {"cpu", "cpu_flags"} <= set(record["machine"])
    assert {"avx512_bf16", "amx_bf16"} <= set(record["machine"]["cpu_flags"])  # True or False
    check_sharing(record["sharing"])
    check_routing(record["routing"])
    summary = (out / "summary.md").read_text()
    assert "2 replicas, no stream" in summary and "2 replicas, x-session-id" in summary


def check_sharing(runs: list[dict]) -> None:
    assert [(r["workload"], r["config"], r["replicas"]) for r in runs] == [
        ("repeat", "one", 1),
        ("repeat", "unshared", 2),
        ("repeat", "shared", 2),
    ]
    for run in runs:
        assert len(run["replica_logs"]) == run["replicas"]
        assert all("step_ms" in (log["calibrated"] or {}) for log in run["replica_logs"])
        summary = run["summary"]
        assert summary["prompts"] == 2 and summary["same_tokens"]  # greedy float32
        assert summary["tokens_per_round_median"] >= 1
        assert summary["tokens_per_round_all"] >= 1
        # float32: each repeat's answer is its warm-up's and its answer with speculation off
        assert summary["repeated"] == 2 and summary["same_as_warm"] == 2
        assert summary["same_as_off"] == 2
        assert summary["speedup_median"] > 0 and summary["speedup_median_vs_one"] > 0
        served = [r["replica"] for r in [*run["warm"], *run["results"]]]
        assert set(served) == set(range(run["replicas"]))
        assert all(r["on"]["tokens_per_round"] >= 1 for r in run["results"])
        assert all(r["off"]["rounds"] == r["off"]["tokens"] for r in run["results"])
    for fleet in runs[1:]:
        first = {w["prompt"]: w["replica"] for w in fleet["warm"]}
        assert all(r["replica"] != first[r["prompt"]] for r in fleet["results"])  # it moves


def check_routing(runs: list[dict]) -> None:
    configs = [(r["config"], r["replicas"], r["session_header"]) for r in runs]
    assert configs == [("single", 1, True), ("routed", 2, True), ("spread", 2, False)]
    for run in runs:
        summary = run["summary"]
        assert set(summary["ttft_ms_median_by_turn"]) == {"2", "3", "4", "5"}
        assert all(ms > 0 for ms in summary["ttft_ms_median_by_turn"].values())
        assert summary["ttft_ms_median"] > 0 and summary["ttft_vs_single"] > 0
        assert len(run["conversations"]) == 2
        if run["config"] == "routed":  # nginx's hash keeps a conversation on one replica
            assert summary["replicas_per_conversation_max"] == 1
        for chat in run["conversations"]:
            assert [t["turn"] for t in chat["turns"]] == [1, 2, 3, 4, 5]
            assert [t["prompt_messages"] for t in chat["turns"]] == [1, 3, 5, 7, 9]
            assert all(t["replica"] in range(run["replicas"]) for t in chat["turns"])
            assert all(t["tokens"] >= 1 and t["ttft_s"] > 0 for t in chat["turns"])


def test_bench_replicas_outage_loses_no_request_and_catches_up(tiny_model_dir, tmp_path) -> None:
    """Redis killed at 1/3 of a short mixed run and restarted at 2/3: no request failed in
    any phase, no error in the replicas' logs besides the answer stream's warnings, and B's
    index caught up on what A answered after the restart."""
    argv = ["--parts", "outage", "--outage-seconds", "6", *tiny_argv(tiny_model_dir, tmp_path)]
    assert replicas.main(argv) == 0
    record = json.loads((tmp_path / "out" / "replicas.json").read_text())
    run = record["outage"]
    assert run["killed_at_s"] < run["restarted_at_s"]
    assert set(run["phases"]) == {"before", "down", "after"}
    assert all(p["requests"] >= 1 for p in run["phases"].values()), run["phases"]
    assert {r["api"] for r in run["request_log"]} == {"grpc", "http_stream", "http_whole"}
    assert {r["replica"] for r in run["request_log"]} == {0, 1}
    assert run["failed"] == 0, [r for r in run["request_log"] if not r["ok"]]
    assert run["request_errors"] == 0, [log["first_request_errors"] for log in run["replica_logs"]]
    assert all(log["stream_warnings"] for log in run["replica_logs"])  # the outage was seen
    assert run["caught_up"] is True, run["catch_up"]
    assert run["catch_up"]["seconds"] >= 0
    for metrics in run["metrics"]:
        assert metrics["kenspec_shared_answers_published_total"] >= 1
        assert metrics['kenspec_shared_answers_connected{link="read"}'] == 1
    assert "caught up: True" in (tmp_path / "out" / "summary.md").read_text()


def test_outage_log_troubles_keep_slow_drafts_apart_from_request_errors() -> None:
    """A slow draft (a busy machine's, its answer used) is counted, not taken for an error."""
    events = [
        {"level": "warning", "event": "shared_answers_unreachable", "link": "read"},
        {"level": "warning", "event": "draft_slow", "error": "draft took 199.7 ms"},
        {"level": "warning", "event": "draft_fault", "error": "RuntimeError()"},
        {"level": "error", "event": "generate_failed"},
        {"level": "info", "event": "request_done"},
    ]
    troubles = outage.log_troubles(SimpleNamespace(events=events))
    assert troubles["stream_warnings"] == [("shared_answers_unreachable", "read")]
    assert troubles["slow_drafts"] == 1
    assert troubles["request_errors"] == 2
    errors = [e["event"] for e in troubles["first_request_errors"]]
    assert errors == ["draft_fault", "generate_failed"]
