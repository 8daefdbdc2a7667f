"""`python -m bench.trees`: token trees by node budget, replayed per prompt set and served.

- `replay`: for each answers file (a `draft_tools.distill` corpus of the target's float32 greedy
  answers) and each node budget, the tokens per round `draft_tools.train eval` replays with
  every source on (KenLM, context, suffix index learning as it goes, recycled predictions;
  budget 1 is one chain per round). Exact for greedy; no cost model cuts nodes.
- `plot`: tokens per round by budget (replayed) and, from `bench.workloads` JSON lines labelled
  `budget=N`, served tokens/s on and off by budget, into one PNG.

    python -m bench.trees replay --answers dev=dev.ids ood=ood.ids --budgets 1 2 4 8 16 \\
        --out trees.jsonl
    for n in 1 2 4 8 16; do python -m bench.workloads --workload sequence --limit 12 \\
        --label budget=$n --out workloads.jsonl -- --tree-budget $n; done
    python -m bench.trees plot --replay trees.jsonl --served workloads.jsonl --png trees.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine


def replay_budgets(
    model: Path, draft: Path, answers: dict[str, Path], budgets: Sequence[int]
) -> list[dict]:
    from draft_tools.train import evaluate

    rows = []
    for name, path in answers.items():
        for budget in budgets:
            stats = evaluate(
                model,
                draft,
                path,
                k=6,
                adaptive=False,
                min_draft_prob=0.4,
                context=True,
                min_match=1,
                suffix=True,
                learn=True,
                recycled=True,
                tree_budget=budget,
            )
            row = {
                "set": name,
                "budget": budget,
                "answers": stats.answers,
                "tokens": stats.tokens,
                "tokens_per_round": stats.tokens_per_round,
                "nodes_per_round": stats.drafted / max(1, stats.rounds),
                "draft_us_per_node": stats.microseconds_per_drafted_token,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def plot(replayed: list[dict], served: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in sorted({row["set"] for row in replayed}):
        points = sorted((r["budget"], r["tokens_per_round"]) for r in replayed if r["set"] == name)
        left.plot(*zip(*points, strict=True), marker="o", label=name)
    left.set(xscale="log", xlabel="node budget (1: a chain)", ylabel="tokens per round")
    left.set_title("replayed (greedy, exact)")
    left.legend()
    by_budget = {}
    for record in served:
        label = record.get("label", "")
        if label.startswith("budget="):
            by_budget[int(label.split("=", 1)[1])] = record["summary"]
    if by_budget:
        budgets = sorted(by_budget)
        on = [by_budget[b]["on_tokens_per_s_median"] for b in budgets]
        off = [by_budget[b]["off_tokens_per_s_median"] for b in budgets]
        right.plot(budgets, on, marker="o", label="speculation on")
        right.plot(budgets, off, marker="s", label="off")
        for budget, summary in zip(budgets, (by_budget[b] for b in budgets), strict=True):
            right.annotate(
                f"{summary['speedup_median']:.2f}x", (budget, summary["on_tokens_per_s_median"])
            )
        right.set(xscale="log", xlabel="node budget", ylabel="tokens/s (median over prompts)")
        right.set_title("served, dev (gRPC)")
        right.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    from server.settings import DEFAULT_DRAFT, DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m bench.trees", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("replay", help="tokens per round by node budget, replayed")
    run.add_argument("--answers", nargs="+", required=True, help="NAME=corpus.ids, one per set")
    run.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    run.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    run.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    run.add_argument("--out", type=Path, help="append the rows as JSON lines here")
    draw = commands.add_parser("plot", help="one PNG from replay and workloads JSON lines")
    draw.add_argument("--replay", type=Path, required=True)
    draw.add_argument("--served", type=Path)
    draw.add_argument("--png", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "replay":
        answers = dict(item.split("=", 1) for item in args.answers)
        paths = {name: Path(path) for name, path in answers.items()}
        rows = replay_budgets(args.model, args.draft, paths, args.budgets)
        if args.out is not None:
            with args.out.open("a") as file:
                for row in rows:
                    file.write(json.dumps({**row, "machine": machine()}) + "\n")
    else:
        replayed = [json.loads(line) for line in args.replay.open()]
        served = [json.loads(line) for line in args.served.open()] if args.served else []
        plot(replayed, served, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
