"""bench.replica_state on the tiny model: one engine, two that share nothing, two that share
their answers; what each configuration's record holds."""

from __future__ import annotations

import json

import pytest

from bench import replica_state


def test_configs_name_the_state_they_share() -> None:
    assert replica_state.parse_configs("one,none,answers+prefixes") == [
        ("one", set()),
        ("none", set()),
        ("answers+prefixes", {"answers", "prefixes"}),
    ]
    with pytest.raises(SystemExit, match="unknown state"):
        replica_state.parse_configs("answers+index")


def test_replay_drafts_a_shared_answer_on_another_engine(tiny_model_dir, tmp_path) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "dev.txt").write_text("The quick brown fox\nOnce upon a time\n")
    out = tmp_path / "replay.jsonl"
    argv = ["--workload", "repeat", "--limit", "2", "--max-new-tokens", "8", "--replicas", "2"]
    argv += ["--prompts-dir", str(prompts), "--model", str(tiny_model_dir), "--draft", "none"]
    argv += ["--configs", "one,none,answers", "--out", str(out), "--", "--device", "cpu"]
    argv += ["--dtype", "float32", "--threads", "1", "--breaker-threshold", "0", "--no-live-costs"]
    argv += ["--tree-budget", "1", "--prefix-cache-mb", "16"]
    assert replica_state.main(argv) == 0
    one, none, answers = (json.loads(line) for line in out.read_text().splitlines())
    assert [(r["config"], r["replicas"]) for r in (one, none, answers)] == [
        ("one", 1),
        ("none", 2),
        ("answers", 2),
    ]
    for record in (none, answers):  # each repeat meets the engine that did not answer it
        assert [r["engine"] for r in record["results"]] == [1, 0]
    for record in (one, none, answers):
        assert record["summary"]["reproduced"] == 2  # float32, greedy: the same answers
        assert record["summary"]["same_as_off"] == 2
    # Drafted from the first round on: the engine that answered, or the one it shared with;
    # the tiny model's answers look alike, so one without the answer still finds matches.
    first = {
        r["config"]: [x["on"]["first_source"] for x in r["results"]] for r in (one, none, answers)
    }
    assert all(source.startswith("suffix") for source in first["one"] + first["answers"])
    assert answers["summary"]["tokens_per_round_total"] > none["summary"]["tokens_per_round_total"]
