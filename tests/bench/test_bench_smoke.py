"""The benchmark harness end to end on the tiny model: every mode, the sweeps and the report."""

from __future__ import annotations

import json

from bench.__main__ import main


def test_bench_runs_every_mode_and_writes_the_report(tiny_model_dir, tiny_draft_path, tmp_path):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "dev.txt").write_text("The quick brown fox\nHello world\nover the\n")
    (prompts / "ood.txt").write_text("日本語\n1 2 3\n")
    (prompts / "grounded.txt").write_text("Repeat: the quick brown fox the quick brown fox\n")
    out = tmp_path / "out"
    code = main(
        [
            "--model",
            str(tiny_model_dir),
            "--draft",
            str(tiny_draft_path),
            "--prompts-dir",
            str(prompts),
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--dtypes",
            "float32",
            "--device",
            "cpu",
            "--k-sweep",
            "1",
            "4",
            "--k-sweep-limit",
            "1",
            "--concurrency",
            "1",
            "2",
            "--requests-per-stream",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["cases"]) == 4  # 2 sets x 2 temperatures
    greedy = results["cases"][0]
    assert set(greedy["summary"]) == {
        "hf_generate",
        "hf_prompt_lookup",
        "kenspec_ar",
        "kenspec_spec_fixed",
        "kenspec_spec_adaptive",
    }
    # float32 greedy: every mode reproduces transformers' own greedy output.
    assert all(share == 1.0 for share in greedy["greedy_agreement_with_hf"].values())
    assert greedy["summary"]["kenspec_spec_fixed"]["drafted"] > 0
    assert [row["k"] for row in results["k_sweep"]["float32"]] == [0, 1, 4]
    assert [row["streams"] for row in results["concurrency"]] == [1, 2]
    assert all(row["tokens"] > 0 for row in results["concurrency"])
    assert "grpc_ttft_overhead_ms" in results
    assert [case["prompt_set"] for case in results["drafts"]] == ["dev", "ood", "grounded"]
    assert set(results["drafts"][2]["summary"]) == {
        "kenspec_ar",
        "kenlm_only",
        "context_only",
        "kenlm+context",
        "hf_prompt_lookup",
    }
    k = results["args"]["k"]
    for case in results["drafts"]:  # replayed at fixed k: between 1 and k + 1 tokens a round
        assert set(case["replayed"]) == {"kenlm_only", "context_only", "kenlm+context"}
        assert all(1.0 <= value <= k + 1 for value in case["replayed"].values())
    for name in (
        "results.md",
        "speedup.png",
        "acceptance_by_position.png",
        "tokens_per_s_vs_k.png",
        "concurrency.png",
    ):
        assert (out / name).stat().st_size > 0
    report = (out / "results.md").read_text()
    assert "kenspec_spec_adaptive" in report
    assert f"Drafts replayed at fixed k={k}" in report
