"""results.json -> results.md (tables) and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

MODE_ORDER = [
    "hf_generate",
    "hf_prompt_lookup",
    "kenspec_ar",
    "kenspec_spec_fixed",
    "kenspec_spec_adaptive",
]

DRAFT_ORDER = ["kenspec_ar", "kenlm_only", "context_only", "kenlm+context", "hf_prompt_lookup"]


def write_report(results: dict, out: Path) -> None:
    (out / "results.md").write_text(markdown(results))
    plot_speedups(results, out / "speedup.png")
    plot_acceptance(results, out / "acceptance_by_position.png")
    if results.get("k_sweep"):
        plot_k_sweep(results, out / "tokens_per_s_vs_k.png")
    if results.get("concurrency"):
        plot_concurrency(results, out / "concurrency.png")


def markdown(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"Machine: {machine['cpu']}, {machine['cores']} threads, CUDA: {machine['cuda']}; "
        f"torch {machine['torch']}; {machine['date']}.",
        f"Model: `{results['args']['model']}`; draft: `{results['args']['draft']}`; "
        f"k = {results['args']['k']}; {results['args']['max_new_tokens']} new tokens; "
        f"medians over prompts.",
        "",
        "| set | temp | dtype | mode | tok/s | × AR | × HF | tok/round | TTFT ms | "
        "round ms p50 / p95 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        summary = case["summary"]
        ar = summary["kenspec_ar"]["tokens_per_s_median"]
        hf = summary["hf_generate"]["tokens_per_s_median"]
        for mode in MODE_ORDER:
            row = summary[mode]
            rate = row["tokens_per_s_median"]
            lines.append(
                f"| {case['prompt_set']} | {case['temperature']} | {case['dtype']} | {mode} | "
                f"{rate:.1f} | {rate / ar:.2f} | {rate / hf:.2f} | {row['tokens_per_round']:.2f} | "
                f"{row['ttft_ms_median']:.0f} | {row['inter_round_ms_p50']:.0f} / "
                f"{row['inter_round_ms_p95']:.0f} |"
            )
    agreement = [
        f"- {c['prompt_set']} {c['dtype']}: "
        + ", ".join(f"{m} {v:.0%}" for m, v in sorted(c["greedy_agreement_with_hf"].items()))
        for c in results["cases"]
        if "greedy_agreement_with_hf" in c
    ]
    if agreement:
        lines += ["", "Greedy outputs identical to transformers `generate` (share of prompts):"]
        lines += agreement
    if results.get("drafts"):
        lines += [
            "",
            "Drafts (greedy, adaptive k): tokens/round, tokens per round that verified drafts, "
            "and tokens/s",
            "",
            "| set | dtype | " + " | ".join(DRAFT_ORDER) + " |",
            "|---|---|" + "---|" * len(DRAFT_ORDER),
        ]
        for case in results["drafts"]:
            cells = [
                f"{case['summary'][m]['tokens_per_round']:.2f} / "
                f"{case['summary'][m].get('tokens_per_speculative_round', 0.0):.2f} / "
                f"{case['summary'][m]['tokens_per_s_median']:.1f}"
                for m in DRAFT_ORDER
            ]
            lines.append(f"| {case['prompt_set']} | {case['dtype']} | " + " | ".join(cells) + " |")
        replayed = [case for case in results["drafts"] if case.get("replayed")]
        if replayed:
            names = list(replayed[0]["replayed"])
            lines += [
                "",
                f"Drafts replayed at fixed k={results['args']['k']}, every round speculating "
                "(no breaker, no width choice): tokens/round against the target's greedy answers",
                "",
                "| set | dtype | " + " | ".join(names) + " |",
                "|---|---|" + "---|" * len(names),
            ]
            for case in replayed:
                cells = [f"{case['replayed'][name]:.2f}" for name in names]
                lines.append(
                    f"| {case['prompt_set']} | {case['dtype']} | " + " | ".join(cells) + " |"
                )
    if results.get("k_sweep"):
        lines += ["", "| dtype | k | tok/s | tok/round |", "|---|---|---|---|"]
        for dtype, rows in results["k_sweep"].items():
            lines += [
                f"| {dtype} | {row['mode']} | {row['tokens_per_s_median']:.1f} | "
                f"{row['tokens_per_round']:.2f} |"
                for row in rows
            ]
    if results.get("concurrency"):
        lines += [
            "",
            "| streams | aggregate tok/s | all-busy tok/s | TTFT ms p50 / p95 "
            "| round ms p50 / p95 |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {row['streams']} | {row['aggregate_tokens_per_s']:.1f} | "
            f"{row.get('all_busy_tokens_per_s', float('nan')):.1f} | "
            f"{row['ttft_ms_p50']:.0f} / {row['ttft_ms_p95']:.0f} | "
            f"{row['inter_round_ms_p50']:.0f} / {row['inter_round_ms_p95']:.0f} |"
            for row in results["concurrency"]
        ]
    if "grpc_ttft_overhead_ms" in results:
        lines += [
            "",
            f"gRPC TTFT overhead over the engine: {results['grpc_ttft_overhead_ms']:.1f} ms",
        ]
    return "\n".join(lines) + "\n"


def plot_speedups(results: dict, path: Path) -> None:
    cases = results["cases"]
    figure, axis = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(MODE_ORDER)
    for offset, mode in enumerate(MODE_ORDER):
        values = [
            c["summary"][mode]["tokens_per_s_median"]
            / c["summary"]["kenspec_ar"]["tokens_per_s_median"]
            for c in cases
        ]
        axis.bar([i + offset * width for i in range(len(cases))], values, width, label=mode)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    axis.set_xticklabels([f"{c['prompt_set']}\nT={c['temperature']}\n{c['dtype']}" for c in cases])
    axis.set_ylabel("tokens/s relative to kenspec AR")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_acceptance(results: dict, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    for case in results["cases"]:
        if case["temperature"] != 0:
            continue
        values = case["summary"]["kenspec_spec_fixed"]["acceptance_by_position"]
        points = [(i + 1, v) for i, v in enumerate(values) if v is not None]
        if points:
            axis.plot(
                *zip(*points, strict=True),
                marker="o",
                label=f"{case['prompt_set']} {case['dtype']}",
            )
    axis.set_xlabel("draft position")
    axis.set_ylabel("P(accepted | drafted)")
    axis.set_ylim(0, 1)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_k_sweep(results: dict, path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    for dtype, rows in results["k_sweep"].items():
        axis.plot(
            [r["k"] for r in rows],
            [r["tokens_per_s_median"] for r in rows],
            marker="o",
            label=dtype,
        )
    axis.set_xlabel("k (0 = autoregressive)")
    axis.set_ylabel("tokens/s (median)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_concurrency(results: dict, path: Path) -> None:
    rows = results["concurrency"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    streams = [r["streams"] for r in rows]
    left.plot(streams, [r["aggregate_tokens_per_s"] for r in rows], marker="o")
    left.set_xlabel("concurrent streams")
    left.set_ylabel("aggregate tokens/s")
    right.plot(streams, [r["inter_round_ms_p50"] for r in rows], marker="o", label="round p50")
    right.plot(streams, [r["inter_round_ms_p95"] for r in rows], marker="o", label="round p95")
    right.plot(streams, [r["ttft_ms_p50"] for r in rows], marker="s", label="TTFT p50")
    right.set_xlabel("concurrent streams")
    right.set_ylabel("ms")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
