"""`python -m bench.exactness`: is greedy output the same with speculation on, off and in a
batch, and what does batch-invariant mode cost?

For each server configuration (`--configs`: `default` and `invariant`, i.e. the server's
defaults without and with --batch-invariant; extra server flags after `--`), `--starts` fresh
`kenspec serve` processes (the last `--busy` of them beside a process that keeps a core
busy) each answer the chat prompts of --prompts, greedy:

1. each prompt alone with speculation on (AUTO), then each alone with speculation OFF;
2. all of them at once, `--streams` at a time, speculation on: continuous batching;
3. with `--repeats R`, the first prompts' same request R times with speculation on and R times
   off, one after another (the first with the prefix cache cold, the others warm; the suffix
   index learning the answer between them).

It reports how many answers of AUTO and of the batch are identical to OFF's, how many distinct
answers each repeated request got (1: one output), the median tokens/s of one stream (AUTO
and OFF), the aggregate tokens/s of the batch, and the server's `calibrated` and
`execution_plan` lines; JSON with --out.

    python -m bench.exactness --limit 10 --out bench/results/batch-invariance/exactness.json
    python -m bench.exactness --limit 20 --configs default --starts 3 --busy 1 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import machine
from bench.suite import read_prompts
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient

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


async def _serve(
    address: str, prompts: Sequence[str], max_new_tokens: int, streams: int, repeats: int = 0
) -> dict:
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
        repeated = []  # per repeated prompt: its distinct answers over every repeat
        for prompt in prompts[:REPEATED_PROMPTS] if repeats else ():
            texts = [
                (await _answer(client, prompt, max_new_tokens, mode))["text"]
                for mode in ("auto", "off")
                for _ in range(repeats)
            ]
            repeated.append(len(set(texts)))

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
        "repeats": repeats,
        "distinct_answers_repeated": repeated,  # 1 each: one output whatever the repeat
    }


REPEATED_PROMPTS = 4  # prompts whose request is repeated (--repeats times each way)


class Busy:
    """A process that keeps one core busy (a neighbour's load) while it lives."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts" / "dev.txt")
    parser.add_argument("--skip", type=int, default=0, help="prompts skipped before --limit")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--starts", type=int, default=1, help="fresh servers per configuration")
    parser.add_argument("--busy", type=int, default=0, help="the last starts beside a busy core")
    parser.add_argument("--repeats", type=int, default=0, help="the same request, each way")
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="after --: flags for every server")
    args = parser.parse_args(argv)
    prompts = read_prompts(args.prompts, args.skip + args.limit)[args.skip :]
    results = {"machine": machine(), "prompts_file": str(args.prompts), "runs": {}}
    for name in args.configs:
        for start in range(args.starts):
            busy = Busy() if start >= args.starts - args.busy else None
            label = name if args.starts == 1 else f"{name}-{start + 1}" + ("-busy" if busy else "")
            try:
                server = ServerProcess([*CONFIGS[name], *args.server_args])
                try:
                    run = asyncio.run(
                        _serve(server.address, prompts, args.max_new_tokens, args.streams,
                               args.repeats)
                    )  # fmt: skip
                finally:
                    server.stop()
            finally:
                if busy is not None:
                    busy.stop()
            run["busy_neighbour"] = busy is not None
            for event in ("calibrated", "model_loaded", "execution_plan"):
                run[event] = server.logged(event)
            results["runs"][label] = run
            shown = {k: v for k, v in run.items() if k not in ("calibrated", "execution_plan")}
            print(label, json.dumps(shown))
            print("  calibrated", json.dumps(run["calibrated"]))
            print("  plan", (run["execution_plan"] or {}).get("plan"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
