"""What a target's passes cost by width, under several execution plans, in one process.

Each plan loads the model once; passes of every width (a one-row verify pass of that many
tokens after a prefilled context) are timed round-robin over the plans and widths, so the
VM's drift hits each alike; each cell is the median of its repeats, and its ratio to the same
plan's one-token pass is what a verify pass costs in steps.

    python -m bench.pass_costs --threads 2 --plans measured packed --widths 1 2 4 8 12 17
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.machine import machine
from kenspec.server.engine.forward.plan import ExecutionOptions, Kernel, LeanMode, RowPlan
from kenspec.server.engine.params import AttentionMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from kenspec.server.settings import DEFAULT_MODEL

PLANS = {  # name: the options a target of that plan loads with
    "measured": ExecutionOptions(lean=LeanMode.AUTO, attention=AttentionMode.AUTO),
    "gemv": ExecutionOptions(
        lean=LeanMode.AUTO,
        decoder=RowPlan.every(Kernel.GEMV),
        head_kernels=RowPlan.every(Kernel.GEMV),
    ),
    "amx": ExecutionOptions(
        lean=LeanMode.AUTO,
        decoder=RowPlan.every(Kernel.AMX),
        head_kernels=RowPlan.every(Kernel.GEMV),
    ),
    "packed": ExecutionOptions(
        lean=LeanMode.AUTO,
        decoder=RowPlan.every(Kernel.PACKED),
        head_kernels=RowPlan.every(Kernel.PACKED),
    ),
    "eager": ExecutionOptions(),
}


def time_passes(
    targets: dict[str, TargetModel], widths: Sequence[int], context: int, repeats: int
) -> dict[str, dict[int, float]]:
    """{plan: {width: median seconds}} of one-row passes, round-robin over plans and widths."""
    caches = {}
    vocab = min(next(iter(targets.values())).vocab_size, 40_000)
    prompt = [(7 + 31 * i) % vocab for i in range(context + max(widths))]
    for name, target in targets.items():
        caches[name] = target.new_cache(1)
        target.prefill(caches[name], 0, 0, prompt[:context])
    samples: dict[str, dict[int, list[float]]] = {n: {w: [] for w in widths} for n in targets}
    for repeat in range(repeats + 1):  # the first round warms up and is dropped
        order = list(targets) if repeat % 2 else list(reversed(targets))
        for width in widths:
            for name in order:
                passed = VerifyPass.sequences([context], [prompt[context : context + width]])
                started = time.perf_counter()
                targets[name].forward(caches[name], passed)[0].argmax(0)
                if repeat:
                    samples[name][width].append(time.perf_counter() - started)
    return {n: {w: statistics.median(s) for w, s in by.items()} for n, by in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--plans", nargs="+", default=["measured", "packed"], choices=PLANS)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 17])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file of the results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    targets = {
        name: TargetModel.load(args.model, device="cpu", dtype=args.dtype, execution=PLANS[name])
        for name in args.plans
    }
    seconds = time_passes(targets, args.widths, args.context, args.repeats)
    for name, by_width in seconds.items():
        one = by_width[min(by_width)]
        cells = "  ".join(f"{w}:{s * 1000:.2f}ms({s / one:.2f})" for w, s in by_width.items())
        print(f"{name:9s} {cells}")
        print(f"          plan: {targets[name].plan.describe()}")
    report = {
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "plans": {name: target.plan.describe() for name, target in targets.items()},
        "ms": {n: {w: round(s * 1000, 3) for w, s in by.items()} for n, by in seconds.items()},
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
