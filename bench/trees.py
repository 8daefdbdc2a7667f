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
    python -m bench.trees exact --prompts prompts/dev.txt prompts/ood.txt --limit 12
    python -m bench.trees exact --prompts prompts/dev.txt --limit 6 -- \\
        --model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf --draft none

- `exact`: the default server's engine in float32 (default flags otherwise: trees, every
  source) against transformers' own greedy `generate`, prompt by prompt: the token ids must be
  identical; prints each set's count and exits 1 on any difference.
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
    from kenspec.draft_tools.train import evaluate

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


def plot(replayed: list[dict], served: list[dict], png: Path, default_budget: int = 16) -> None:
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
    for record in served:  # dev runs labelled budget=N, and the first "default" sequence (dev)
        label = record.get("label", "")
        sequence = record.get("workload") == "sequence"
        if label.startswith("budget=") and label[7:].isdigit():
            by_budget[int(label[7:])] = record["summary"]
        elif label == "default" and sequence and default_budget not in by_budget:
            by_budget[default_budget] = record["summary"]
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


def check_exact(
    prompt_files: Sequence[Path], limit: int, max_new_tokens: int, flags: Sequence[str] = ()
) -> dict:
    """Engine (float32, default flags, then `flags`) against transformers' greedy generate,
    per prompt: in the chat template, or as a raw prompt for a model without one (a base
    model such as Gemma 3 270M)."""
    import torch

    from bench.suite import read_prompts
    from kenspec.server.engine.params import SamplingParams, StoppingParams
    from kenspec.server.runtime import load_runtime
    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL, parse_settings

    settings = parse_settings(
        [
            *("--model", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT)),
            *("--dtype", "float32", "--calibration-cache", "none"),
            *flags,
        ]
    )
    engine = load_runtime(settings).engine
    model = engine.target.model
    chat = bool(engine.target.tokenizer.chat_template)
    result: dict[str, dict] = {}
    for path in prompt_files:
        same = drafted = accepted = rounds = 0
        prompts = read_prompts(path, limit)
        for prompt in prompts:
            if chat:
                ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
            else:
                ids = engine.target.encode_prompt(prompt)
            generation = engine.start(
                ids,
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=max_new_tokens),
                speculation=settings.speculation.request_defaults,
            )
            served = list(engine.batch.rounds(generation))
            with torch.inference_mode():
                plain = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                )[0, len(ids) :].tolist()
            same += generation.output_ids == plain
            drafted += sum(r.drafted for r in served)
            accepted += sum(r.accepted for r in served)
            rounds += len(served)
        result[path.stem] = {
            "chat": chat,
            "prompts": len(prompts),
            "identical": same,
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
        }
        print(json.dumps({path.stem: result[path.stem]}), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL

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
    exact = commands.add_parser("exact", help="float32 greedy output against transformers")
    exact.add_argument("--prompts", type=Path, nargs="+", required=True)
    exact.add_argument("--limit", type=int, default=12)
    exact.add_argument("--max-new-tokens", type=int, default=96)
    exact.add_argument(
        "flags", nargs="*", help="server flags after --, e.g. -- --model x.gguf --draft none"
    )
    args = parser.parse_args(argv)
    if args.command == "exact":
        checked = check_exact(args.prompts, args.limit, args.max_new_tokens, args.flags)
        return 0 if all(c["identical"] == c["prompts"] for c in checked.values()) else 1
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
