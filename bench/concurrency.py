"""Concurrency sweep through a real `kenspec serve` process and the bundled async client."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.suite import percentile, read_prompts
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient


async def _one_stream(client: AsyncClient, prompt: str, max_new_tokens: int) -> dict:
    started = time.perf_counter()
    times, arrivals, tokens = [], [], 0
    async for round_ in client.generate(
        messages=[("user", prompt)], max_new_tokens=max_new_tokens, timeout=600
    ):
        now = time.perf_counter()
        times.append(now - started)
        arrivals.append((now, len(round_.token_ids)))
        tokens += len(round_.token_ids)
    return {"tokens": tokens, "times": times, "arrivals": arrivals}


async def sweep_level(
    address: str,
    prompts: Sequence[str],
    streams: int,
    requests_per_stream: int,
    max_new_tokens: int,
    tag: str = "",
) -> dict:
    """`streams` concurrent workers share the requests, every prompt at least once, so the
    single-stream level is comparable with the engine alone on the same prompts.

    tag: put "(tag-n) " before request n's prompt, so that no request repeats an earlier
    prompt (the server's prefix cache then reuses only what prompts really share)."""
    async with AsyncClient(address) as client:
        total = max(streams * requests_per_stream, len(prompts))
        queue = [prompts[i % len(prompts)] for i in range(total)]
        if tag:
            queue = [f"({tag}-{i}) {prompt}" for i, prompt in enumerate(queue)]

        finished: list[float] = []

        async def worker(offset: int) -> list[dict]:
            runs = [
                await _one_stream(client, queue[i], max_new_tokens)
                for i in range(offset, len(queue), streams)
            ]
            finished.append(time.perf_counter())
            return runs

        started = time.perf_counter()
        done = await asyncio.gather(*(worker(i) for i in range(streams)))
        wall = time.perf_counter() - started
    # While every worker still had requests: the server at `streams` concurrent streams, without
    # the drain at the end, when workers with shorter answers have finished and fewer remain.
    all_busy = min(finished)
    busy_tokens = sum(
        count for group in done for run in group for at, count in run["arrivals"] if at <= all_busy
    )
    runs = [run for group in done for run in group]
    ttft = [run["times"][0] for run in runs if run["times"]]
    gaps = [b - a for run in runs for a, b in itertools.pairwise(run["times"])]
    tokens = sum(run["tokens"] for run in runs)
    return {
        "streams": streams,
        "requests": len(runs),
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "all_busy_tokens_per_s": busy_tokens / (all_busy - started),
        "ttft_ms_p50": 1000 * percentile(ttft, 0.5),
        "ttft_ms_p95": 1000 * percentile(ttft, 0.95),
        "inter_round_ms_p50": 1000 * percentile(gaps, 0.5),
        "inter_round_ms_p95": 1000 * percentile(gaps, 0.95),
    }


def concurrency_sweep(
    server_args: Sequence[str],
    prompts: Sequence[str],
    levels: Sequence[int],
    *,
    requests_per_stream: int,
    max_new_tokens: int,
    repeats: int = 1,
    distinct: bool = False,
) -> list[dict]:
    """Each level `repeats` times, the levels alternating (1, 8, 1, 8, ...) so that machine
    drift hits every level alike; per level the median of each figure over the repeats, and
    the server's `calibrated` log event (what its start-up measured a pass to cost).
    distinct: no request repeats an earlier one's prompt (see sweep_level's tag)."""
    server = ServerProcess(server_args)
    calibrated = server.logged("calibrated")
    print(f"server calibrated: {json.dumps(calibrated)}", file=sys.stderr, flush=True)
    try:
        runs: dict[int, list[dict]] = {level: [] for level in levels}
        for repeat in range(repeats):
            for level in levels:
                tag = f"{repeat}.{level}" if distinct else ""
                result = asyncio.run(
                    sweep_level(
                        server.address, prompts, level, requests_per_stream, max_new_tokens, tag
                    )
                )
                runs[level].append(result)
        return [{**_median_of(runs[level]), "calibrated": calibrated} for level in levels]
    finally:
        server.stop()


def _median_of(results: list[dict]) -> dict:
    merged = {key: statistics.median(r[key] for r in results) for key in results[0]}
    merged["repeats"] = len(results)
    merged["aggregate_tokens_per_s_runs"] = [r["aggregate_tokens_per_s"] for r in results]
    merged["all_busy_tokens_per_s_runs"] = [r["all_busy_tokens_per_s"] for r in results]
    merged["inter_round_ms_p95_runs"] = [r["inter_round_ms_p95"] for r in results]
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.concurrency`: the concurrency sweep alone, for before/after comparisons.

    Extra arguments after `--` go to the server, e.g. `-- --max-batch-size 1`.
    """
    import argparse

    from kenspec.server.settings import DEFAULT_DRAFT, DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="python -m bench.concurrency", description=main.__doc__)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts" / "dev.txt")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs per level")
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="tag every request's prompt so none repeats an earlier one: the server's prefix "
        "cache then reuses only the chat template and system prompt (without it, prompts recur "
        "across levels and repeats, and are reused whole)",
    )
    parser.add_argument("--label", default="kenspec")
    parser.add_argument("--out", type=Path, help="append the result as one JSON line here")
    parser.add_argument("server_args", nargs="*", help="after --: arguments for the server")
    args = parser.parse_args(argv)
    server_args = ["--model", str(DEFAULT_MODEL), "--draft", str(DEFAULT_DRAFT)]
    server_args += ["--max-concurrent-streams", str(max(args.levels)), *args.server_args]
    levels = concurrency_sweep(
        server_args,
        read_prompts(args.prompts, args.limit),
        args.levels,
        requests_per_stream=args.requests_per_stream,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        distinct=args.distinct,
    )
    print(
        f"| {args.label} | streams | agg tok/s | x 1 stream | all-busy tok/s | x 1 stream "
        "| round p50 ms | p95 ms | TTFT p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    single = levels[0]
    for level in levels:
        print(
            f"| {args.label} | {level['streams']} | {level['aggregate_tokens_per_s']:.1f} "
            f"| {level['aggregate_tokens_per_s'] / single['aggregate_tokens_per_s']:.2f} "
            f"| {level['all_busy_tokens_per_s']:.1f} "
            f"| {level['all_busy_tokens_per_s'] / single['all_busy_tokens_per_s']:.2f} "
            f"| {level['inter_round_ms_p50']:.0f} | {level['inter_round_ms_p95']:.0f} "
            f"| {level['ttft_ms_p50']:.0f} |"
        )
    if args.out is not None:
        record = {
            "label": args.label,
            "machine": machine(),
            "server_args": server_args,
            "distinct": args.distinct,
        }
        with args.out.open("a") as file:
            file.write(json.dumps({**record, "levels": levels}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
