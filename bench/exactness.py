"""`python -m bench.exactness`: is greedy output the same with speculation on, off and in a
batch, and what does batch-invariant mode cost?

For each server configuration (`--configs`: `default` and `invariant`, i.e. the server's
defaults without and with --batch-invariant; extra server flags after `--`), one
`python -m server` answers the chat prompts of --prompts, greedy:

1. each prompt alone with speculation on (AUTO), then each alone with speculation OFF;
2. all of them at once, `--streams` at a time, speculation on: continuous batching.

It reports how many answers of AUTO and of the batch are identical to OFF's, the median
tokens/s of one stream (AUTO and OFF), the aggregate tokens/s of the batch, and the server's
`calibrated` line; JSON with --out.

    python -m bench.exactness --limit 10 --out bench/results/batch-invariance/exactness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.suite import read_prompts
from client import AsyncClient
from harness.server_process import REPO, ServerProcess

CONFIGS = {"default": [], "invariant": ["--batch-invariant"]}


async def _answer(client: AsyncClient, prompt: str, max_new_tokens: int, speculation: str):
    started = time.perf_counter()
    completion = await client.generate_text(
        messages=[("user", prompt)],
        max_new_tokens=max_new_tokens,
        speculation=speculation,
        temperature=0.0,
        timeout=900,
    )
    seconds = time.perf_counter() - started
    tokens = completion.usage.completion_tokens
    return {"text": completion.text, "tokens": tokens, "seconds": seconds}


async def _serve(address: str, prompts: Sequence[str], max_new_tokens: int, streams: int) -> dict:
    async with AsyncClient(address) as client:
        # on first: later passes over the same prompts draft from the answers already served
        on = [await _answer(client, p, max_new_tokens, "auto") for p in prompts]
        off = [await _answer(client, p, max_new_tokens, "off") for p in prompts]
        slots = asyncio.Semaphore(streams)

        async def batched(prompt: str) -> dict:
            async with slots:
                return await _answer(client, prompt, max_new_tokens, "auto")

        started = time.perf_counter()
        batch = await asyncio.gather(*(batched(p) for p in prompts))
        batch_seconds = time.perf_counter() - started

    def rate(answers: list[dict]) -> float:
        return statistics.median(a["tokens"] / a["seconds"] for a in answers)

    return {
        "prompts": len(prompts),
        "identical_on_off": sum(a["text"] == b["text"] for a, b in zip(on, off, strict=True)),
        "identical_batch_off": sum(a["text"] == b["text"] for a, b in zip(batch, off, strict=True)),
        "differing_prompts": [
            i
            for i, (a, b, c) in enumerate(zip(on, batch, off, strict=True))
            if not a["text"] == b["text"] == c["text"]
        ],
        "one_stream_tokens_per_s_on": rate(on),
        "one_stream_tokens_per_s_off": rate(off),
        "batch_tokens_per_s": sum(a["tokens"] for a in batch) / batch_seconds,
        "streams": streams,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts" / "dev.txt")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="after --: flags for every server")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts, args.limit)
    results = {"machine": machine(), "prompts_file": str(args.prompts), "runs": {}}
    for name in args.configs:
        server = ServerProcess([*CONFIGS[name], *args.server_args])
        try:
            calibrated = server.logged("calibrated")
            run = asyncio.run(_serve(server.address, prompts, args.max_new_tokens, args.streams))
        finally:
            server.stop()
        run["calibrated"] = calibrated
        run["model_loaded"] = server.logged("model_loaded")
        results["runs"][name] = run
        print(name, json.dumps({k: v for k, v in run.items() if k != "calibrated"}))
        print("  calibrated", json.dumps(calibrated))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
