"""bench.request_fields end to end on the tiny model: the exactness checks pass and the speed
run covers every mode."""

from __future__ import annotations

import json

from bench.request_fields import main


def test_exact_and_speed_on_the_tiny_model(tiny_model_dir, tiny_draft_path, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\nHello world\nover the\n")
    flags = ["--", "--model", str(tiny_model_dir), "--draft", str(tiny_draft_path)]
    flags += ["--min-draft-prob", "0", "--threads", "1"]
    common = ["--prompts", str(prompts), "--limit", "3", "--max-new-tokens", "12"]
    exact = tmp_path / "exact.json"
    assert main(["exact", *common, "--out", str(exact), *flags]) == 0
    checked = json.loads(exact.read_text())
    assert checked["prompts"] == 3 and checked["logprob_tokens"] == 36
    assert checked["logprob_max_abs_diff"] <= 1e-4
    assert checked["penalties_on_equals_off"] == checked["prompts"]
    assert checked["repetition_and_bias_equal_transformers"] == checked["prompts"]
    speed = tmp_path / "speed.json"
    assert main(["speed", *common, "--out", str(speed), *flags]) == 0
    measured = json.loads(speed.read_text())
    assert set(measured["tokens_per_s"]) == {"plain", "logprobs", "penalties", "n4", "n4_singles"}
    assert measured["prefill_tokens"]["n4"] < measured["prefill_tokens"]["n4_singles"]
