"""`python -m bench.workloads`: speculation on against off, request by request, through gRPC.

Workloads, each served in order by one `python -m server` (so drafts that learn from earlier
answers, the suffix index, learn as they would in service):
- `sequence`: the prompts of --prompts once each;
- `repeat`: the prompts once (to learn them), then again: the second pass is measured;
- `templated`: prompts/templated.txt, a few task templates with different parameters; the
  first --warm prompts are served (learned) unmeasured, the rest measured.

Each measured prompt is sent with speculation on (server defaults) and then off, greedy, so
both give the same answer; the figures are per prompt (tokens/s, tokens per round) and their
medians, with the ratio on/off per prompt. Extra arguments after `--` go to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.suite import read_prompts
from client import AsyncClient
from harness.server_process import REPO, ServerProcess


async def _one(client: AsyncClient, prompt: str, max_new_tokens: int, speculation: str) -> dict:
    started = time.perf_counter()
    rounds = tokens = drafted = accepted = 0
    async for round_ in client.generate(
        messages=[("user", prompt)],
        max_new_tokens=max_new_tokens,
        speculation=speculation,
        timeout=600,
    ):
        rounds += 1
        tokens += len(round_.token_ids)
        drafted += round_.drafted
        accepted += round_.accepted
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_round": tokens / rounds if rounds else 0.0,
    }


async def run_workload(
    address: str, warm: Sequence[str], measured: Sequence[str], max_new_tokens: int
) -> list[dict]:
    """Serve `warm` (speculation on, unmeasured), then each of `measured` on and off."""
    async with AsyncClient(address) as client:
        for prompt in warm:
            await _one(client, prompt, max_new_tokens, "auto")
        results = []
        for prompt in measured:
            on = await _one(client, prompt, max_new_tokens, "auto")
            off = await _one(client, prompt, max_new_tokens, "off")
            results.append({"prompt": prompt, "on": on, "off": off})
        return results


def summarize(results: list[dict]) -> dict:
    ratios = [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in results]
    return {
        "prompts": len(results),
        "tokens_per_round_median": statistics.median(r["on"]["tokens_per_round"] for r in results),
        "on_tokens_per_s_median": statistics.median(r["on"]["tokens_per_s"] for r in results),
        "off_tokens_per_s_median": statistics.median(r["off"]["tokens_per_s"] for r in results),
        "speedup_median": statistics.median(ratios),
        "below_1_2x": sum(ratio < 1.2 for ratio in ratios) / len(ratios),
        "same_tokens": all(r["on"]["tokens"] == r["off"]["tokens"] for r in results),
    }


def plan(workload: str, prompts: list[str], warm: int) -> tuple[list[str], list[str]]:
    """(warm-up prompts, measured prompts) of a workload."""
    if workload == "repeat":
        return prompts, prompts
    if workload == "templated":
        return prompts[:warm], prompts[warm:]
    return [], prompts


def main(argv: Sequence[str] | None = None) -> int:
    from server.settings import DEFAULT_DRAFT, DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__)
    parser.add_argument("--workload", choices=["sequence", "repeat", "templated"], required=True)
    parser.add_argument("--prompts", type=Path, help="default: dev.txt, or templated.txt")
    parser.add_argument("--limit", type=int, default=12, help="prompts read (0: all)")
    parser.add_argument("--warm", type=int, default=12, help="templated: unmeasured first ones")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--label", default="kenspec")
    parser.add_argument("--out", type=Path, help="append the result as one JSON line here")
    parser.add_argument("server_args", nargs="*", help="after --: arguments for the server")
    args = parser.parse_args(argv)
    default = "templated.txt" if args.workload == "templated" else "dev.txt"
    prompts = read_prompts(args.prompts or REPO / "prompts" / default, args.limit)
    warm, measured = plan(args.workload, prompts, args.warm)
    server_args = ["--model", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT)]
    server = ServerProcess([*server_args, *args.server_args])
    try:
        calibrated = server.logged("calibrated")
        print(f"server calibrated: {json.dumps(calibrated)}", file=sys.stderr, flush=True)
        results = asyncio.run(run_workload(server.address, warm, measured, args.max_new_tokens))
    finally:
        server.stop()
    summary = summarize(results)
    print(
        f"{args.label} {args.workload}: " + json.dumps({k: _round(v) for k, v in summary.items()})
    )
    if args.out is not None:
        record = {
            "label": args.label,
            "workload": args.workload,
            "machine": machine(),
            "server_args": [*server_args, *args.server_args],
            "calibrated": calibrated,
            "summary": summary,
            "results": results,
        }
        with args.out.open("a") as file:
            file.write(json.dumps(record) + "\n")
    return 0


def _round(value: object) -> object:
    return round(value, 3) if isinstance(value, float) else value


if __name__ == "__main__":
    raise SystemExit(main())
