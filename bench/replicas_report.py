"""`bench.replicas`' tables and plot, from its record (replicas.json)."""

from __future__ import annotations

from pathlib import Path

CONFIG_LABELS = {
    "one": "1 replica",
    "unshared": "{n} replicas, no stream",
    "shared": "{n} replicas, shared stream",
    "single": "1 replica",
    "routed": "{n} replicas, x-session-id",
    "spread": "{n} replicas, no session id",
}


def label(run: dict) -> str:
    return CONFIG_LABELS[run["config"]].format(n=run["replicas"])


def compare_to_one(record: dict) -> None:
    """Each configuration's figures against the one-replica run of the same workload (sharing)
    or of the chats (routing), added to its summary."""
    for run in record["sharing"]:
        (one,) = [
            r for r in record["sharing"] if r["workload"] == run["workload"] and r["replicas"] == 1
        ]
        for key in ("speedup_median", "tokens_per_round_median"):
            run["summary"][f"{key}_vs_one"] = run["summary"][key] / one["summary"][key]
    singles = [r for r in record["routing"] if r["replicas"] == 1]
    for run in record["routing"]:
        ttft, single = run["summary"]["ttft_ms_median"], singles[0]["summary"]["ttft_ms_median"]
        run["summary"]["ttft_vs_single"] = ttft / single if ttft and single else None


def tables(record: dict) -> str:
    lines = [f"machine: {record['machine']['cpu']}, flags {record['machine']['cpu_flags']}", ""]
    if record["sharing"]:
        lines += [
            "| workload | configuration | tokens/round | all rounds | tok/s on | tok/s off "
            "| speed-up | speed-up / 1 replica's | prompts below 1.2x "
            "| answer as warm-up / as off |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for run in record["sharing"]:
            s = run["summary"]
            lines.append(
                f"| {run['workload']} ({s['prompts']}) | {label(run)} "
                f"| {s['tokens_per_round_median']:.2f} | {_all_rounds(s)} "
                f"| {s['on_tokens_per_s_median']:.1f} | {s['off_tokens_per_s_median']:.1f} "
                f"| {s['speedup_median']:.2f}x | {s['speedup_median_vs_one']:.2f} "
                f"| {s['below_1_2x']:.0%} | {_same_answers(s)} |"
            )
        lines.append("")
    if record["routing"]:
        turns = sorted(record["routing"][0]["summary"]["ttft_ms_median_by_turn"], key=int)
        lines += [
            "| chat | TTFT turns 2.. p50 ms | / 1 replica's | "
            + " | ".join(f"turn {t}" for t in turns)
            + " | turn 1 | replicas per chat (max) |",
            "|---|---|---|" + "---|" * len(turns) + "---|---|",
        ]
        for run in record["routing"]:
            s = run["summary"]
            by_turn = " | ".join(f"{s['ttft_ms_median_by_turn'][t]:.0f}" for t in turns)
            lines.append(
                f"| {label(run)} ({s['conversations']}) | {s['ttft_ms_median']:.0f} "
                f"| {s['ttft_vs_single']:.2f} | {by_turn} | {s['turn1_ttft_ms_median']:.0f} "
                f"| {s['replicas_per_conversation_max']} |"
            )
        lines.append("")
    if record.get("outage"):
        lines += outage_table(record["outage"])
    return "\n".join(lines)


def _all_rounds(summary: dict) -> str:
    """Tokens per round over every measured round (older records: -)."""
    value = summary.get("tokens_per_round_all")
    return "-" if value is None else f"{value:.2f}"


def _same_answers(summary: dict) -> str:
    """Measured answers equal to the warm-up's (repeat only) and to speculation off's."""
    if "same_as_off" not in summary:
        return "-"
    warm = f"{summary['same_as_warm']}/{summary['repeated']}" if summary["repeated"] else "-"
    return f"{warm} / {summary['same_as_off']}/{summary['prompts']}"


def outage_table(run: dict) -> list[str]:
    """Requests and failures per phase; the log lines; the catch-up after the restart."""
    catch = run["catch_up"]
    seconds = f"{catch['seconds']:.1f} s" if catch["seconds"] is not None else "-"
    warnings = sum(len(log["stream_warnings"]) for log in run["replica_logs"])
    lines = [
        f"Outage: {run['seconds']:g} s mixed run, Redis killed at {run['killed_at_s']:.0f} s, "
        f"back at {run['restarted_at_s']:.0f} s",
        "",
        "| phase | requests | failed | statuses |",
        "|---|---|---|---|",
    ]
    for phase, p in run["phases"].items():
        lines.append(f"| {phase} | {p['requests']} | {p['failed']} | {p['statuses'] or '-'} |")
    lines += [
        "",
        f"failed requests: {run['failed']}; request error log lines: {run['request_errors']}; "
        f"answer stream warnings: {warnings}; slow drafts: {run.get('slow_drafts', 0)}; "
        f"caught up: {run['caught_up']} ({seconds} after "
        f"the restart, reconnected in {catch['reconnect_s']:.1f} s; B's first round: "
        f"{catch['b_first_round_source'] or '-'})",
        "",
    ]
    return lines


def plot(record: dict, path: Path) -> None:
    """Speed-up per workload and configuration; TTFT by turn per routing configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    workloads = list(dict.fromkeys(run["workload"] for run in record["sharing"]))
    configs = list(dict.fromkeys(label(run) for run in record["sharing"]))
    width = 0.8 / max(len(configs), 1)
    for index, config in enumerate(configs):
        runs = {r["workload"]: r for r in record["sharing"] if label(r) == config}
        xs = [w + index * width for w in range(len(workloads)) if workloads[w] in runs]
        ys = [runs[w]["summary"]["speedup_median"] for w in workloads if w in runs]
        left.bar(xs, ys, width, label=config)
    left.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
    left.axhline(1.0, color="grey", linewidth=0.5)
    left.set_ylabel("speed-up on/off (median over prompts)")
    left.set_title("Sharing: round-robin over replicas")
    if configs:
        left.legend(fontsize=8)
    for run in record["routing"]:
        by_turn = run["summary"]["ttft_ms_median_by_turn"]
        turns = sorted(by_turn, key=int)
        right.plot(
            [int(t) for t in turns], [by_turn[t] for t in turns], marker="o", label=label(run)
        )
    if record["routing"]:
        right.set_xticks(
            [int(t) for t in record["routing"][0]["summary"]["ttft_ms_median_by_turn"]]
        )
    right.set_xlabel("turn")
    right.set_ylabel("time to first token, ms (median)")
    right.set_title("Routing: multi-turn chat through nginx")
    if record["routing"]:
        right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
