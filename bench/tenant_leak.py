"""Does one tenant's traffic speed up another's drafts? Tenant A asks each prompt `--repeats`
times, then tenant B asks it once; B's tokens a round are compared with B's on a fresh server
(a new runtime) that only B has used. Isolated learned state gives the same figure; a leak
(shared recycled predictions, acceptance statistics, suffix index or prefix cache) a higher
one.

    .venv/bin/python -m bench.tenant_leak --dtype float32 --limit 4 \\
        --out bench/results/tenant-isolation/leak.json

In process, through the server's own runtime (load_runtime: the default flags, or any given
after --), greedy; tenants named as server.security.tenant_of names them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.suite import read_prompts
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.runtime import Runtime, load_runtime
from kenspec.server.settings import REPO_ROOT, parse_settings

TENANT_A, TENANT_B = "t" + "a" * 16, "t" + "b" * 16


def answer(runtime: Runtime, prompt: str, tenant: str, max_new_tokens: int) -> tuple[int, int]:
    """(tokens, rounds) of one greedy answer for `tenant`."""
    engine = runtime.engine
    generation = engine.start(
        engine.target.encode_chat([{"role": "user", "content": prompt}]),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        speculation=SpeculationParams(),
        request_id="leak",
        tenant=tenant,
    )
    tokens = rounds = 0
    for round_ in engine.batch.rounds(generation):
        tokens, rounds = tokens + len(round_.token_ids), rounds + 1
    return tokens, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default=str(REPO_ROOT / "prompts" / "dev.txt"))
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="server flags, after --")
    args = parser.parse_args()
    prompts = read_prompts(Path(args.prompts), 0)[args.skip : args.skip + args.limit]
    flags = ["--dtype", args.dtype, "--calibration-cache", "none", *args.server_args]
    rows = []
    for prompt in prompts:
        shared = load_runtime(parse_settings(flags))
        for _ in range(args.repeats):
            answer(shared, prompt, TENANT_A, args.max_new_tokens)
        after = answer(shared, prompt, TENANT_B, args.max_new_tokens)
        fresh = answer(load_runtime(parse_settings(flags)), prompt, TENANT_B, args.max_new_tokens)
        own = answer(shared, prompt, TENANT_A, args.max_new_tokens)  # a's own repeat: learns
        row = {
            "prompt": prompt[:60],
            "b_after_a": after[0] / after[1],
            "b_fresh": fresh[0] / fresh[1],
            "a_repeat": own[0] / own[1],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    ratios = [row["b_after_a"] / row["b_fresh"] for row in rows]
    summary = {
        "flags": flags,
        "rows": rows,
        "b_after_a_over_fresh": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
    }
    print(json.dumps(summary["b_after_a_over_fresh"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
