"""The learned draft head, side by side: the default draft with and without it, and KenLM alone.

    python -m bench.heads --prompts prompts/dev.txt --skip 30 --limit 10 --starts 3 \\
        --out bench/results/draft-head

Each start runs, in turn, a fresh server for each variant (--draft-head; the default flags,
without it; --no-draft-context, which leaves KenLM alone), and through each the prompts greedy with
speculation on (AUTO) and off (OFF), one request at a time, at the defaults' threads. Reported
per variant and start: median decode tokens/s of AUTO and OFF, their ratio, tokens a round
(completion tokens over streamed chunks, one chunk a round), the `calibrated` and `draft_head`
lines; `--llama-python` adds llama.cpp on the BF16 copy of the default GGUF once a start.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.peers import REPO, KenspecServer, chat_stream, llama_cpp
from bench.suite import read_prompts

VARIANTS = {
    "head": ["--draft-head"],  # KenLM, context, suffix index, recycled predictions, the head
    "no head (default)": [],
    "KenLM alone": ["--no-draft-context"],
}


def run_variant(flags: Sequence[str], prompts: Sequence[str], args: argparse.Namespace) -> dict:
    server = KenspecServer([*flags, *args.server_flags], args.port)
    runs: dict[str, list[dict]] = {"auto": [], "off": []}
    try:
        chat_stream(server.url, "Say hello.", 8)  # a warm-up, not counted
        for prompt in prompts:
            for mode in ("auto", "off"):
                runs[mode].append(
                    chat_stream(server.url, prompt, args.max_new_tokens, {"speculation": mode})
                )
    finally:
        lines = {name: server.line(name) for name in ("calibrated", "draft_head", "round_costs")}
        server.stop()
    auto = statistics.median(r["decode_tok_s"] for r in runs["auto"] if r["decode_tok_s"])
    off = statistics.median(r["decode_tok_s"] for r in runs["off"] if r["decode_tok_s"])
    per_round = sum(r["completion_tokens"] for r in runs["auto"]) / sum(
        max(1, r["events"]) for r in runs["auto"]
    )
    return {"auto": auto, "off": off, "ratio": auto / off, "tokens_per_round": per_round,
            "lines": lines, "runs": runs}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts/dev.txt")
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python")
    parser.add_argument("--llama-gguf", type=Path, help="the BF16 GGUF llama.cpp runs")
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/draft-head")
    parser.add_argument("server_flags", nargs="*", help="kenspec server flags for every variant")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts, args.skip + args.limit)[args.skip :]
    args.out.mkdir(parents=True, exist_ok=True)
    starts = []
    for number in range(args.starts):
        start: dict = {}
        for name, flags in VARIANTS.items():
            start[name] = run_variant(flags, prompts, args)
            print(f"start {number + 1} {name}: AUTO {start[name]['auto']:.1f} OFF "
                  f"{start[name]['off']:.1f} ({start[name]['ratio']:.2f}x), "
                  f"{start[name]['tokens_per_round']:.2f} tokens a round", flush=True)  # fmt: skip
        if args.llama_python and args.llama_gguf:
            job = {
                "model": str(args.llama_gguf), "prompts": list(prompts), "lookup": 0,
                "threads": args.threads, "max_tokens": args.max_new_tokens,
            }  # fmt: skip
            rates = [r["decode_tok_s"] for r in llama_cpp(args.llama_python, job)]
            start["llama.cpp BF16"] = {"decode": statistics.median(r for r in rates if r)}
            print(f"start {number + 1} llama.cpp BF16: {start['llama.cpp BF16']['decode']:.1f}")
        starts.append(start)
    report = {"machine": machine(), "prompts": str(args.prompts), "skip": args.skip,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "server_flags": args.server_flags, "starts": starts}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(_markdown(starts))
    return 0


def _markdown(starts: Sequence[dict]) -> str:
    lines = ["| variant | start | AUTO tok/s | OFF tok/s | AUTO/OFF | tokens a round |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name in VARIANTS:
        for number, start in enumerate(starts, 1):
            row = start[name]
            lines.append(f"| {name} | {number} | {row['auto']:.1f} | {row['off']:.1f} | "
                         f"{row['ratio']:.2f} | {row['tokens_per_round']:.2f} |")  # fmt: skip
    llama = [s["llama.cpp BF16"]["decode"] for s in starts if "llama.cpp BF16" in s]
    if llama:
        lines.append("")
        lines.append("llama.cpp BF16 per start: " + ", ".join(f"{x:.1f}" for x in llama))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
