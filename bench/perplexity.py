"""`python -m bench.perplexity`: what int8 and int4 weights cost in quality, on held-out text.

Each mode loads the target as the server does (`--dtype`, `--weights`) and scores every
line of the text files as its own sequence through the target's own passes (the fast step
with its kernels measured at start-up where the server would use it): perplexity over every
token after a line's first, and top-1 agreement, position by position, with the other modes.

    python -m bench.perplexity --out bench/results/int8-weights/perplexity.json
    python -m bench.perplexity --model FILE.gguf --modes fp32,bf16,gguf,gguf-fp32 --out ...

Modes: fp32 (--dtype float32), bf16 (--dtype bfloat16), int8 (--dtype bfloat16 --weights
int8), int8-fp32 (--dtype float32 --weights int8), int4, int4-fp32, gguf and gguf-fp32 (a
GGUF --model served in its own quantization) likewise; with a GGUF --model, fp32 and bf16 are
the file dequantized. The default
text is the evaluation prompts (prompts/dev, ood, grounded, templated: not the draft's training
prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.machine import machine
from kenspec.server.engine.forward.plan import ExecutionOptions, LeanMode
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass
from kenspec.server.settings import DEFAULT_MODEL, REPO_ROOT

MODES = {  # name: (--dtype, --weights)
    "fp32": ("float32", "bf16"),
    "bf16": ("bfloat16", "bf16"),
    "int8": ("bfloat16", "int8"),
    "int8-fp32": ("float32", "int8"),
    "int4": ("bfloat16", "int4"),
    "int4-fp32": ("float32", "int4"),
    "gguf": ("bfloat16", "gguf"),  # a GGUF file's own quantization (engine.gguf_weights)
    "gguf-fp32": ("float32", "gguf"),
}
TEXTS = [REPO_ROOT / "prompts" / f"{name}.txt" for name in ("dev", "ood", "grounded", "templated")]


def load(model: str, mode: str) -> TargetModel:
    """The target as the server loads it in `mode` (its lean forward where the server's
    defaults would choose it)."""
    dtype, weights = MODES[mode]
    return TargetModel.load(
        model,
        device="cpu",
        dtype=dtype,
        weights=weights,
        execution=ExecutionOptions(lean=LeanMode.AUTO),
    )


def score(target: TargetModel, ids: Sequence[int]) -> tuple[list[float], list[int]]:
    """Per scored token (ids[1:]) its negative log-likelihood, and each position's top-1."""
    cache = target.new_cache(1)
    logits = target.forward(cache, VerifyPass.sequences([0], [list(ids)]))[0]
    rows = torch.stack([logits[i] for i in range(len(ids) - 1)])  # predicting ids[1:]
    logprobs = torch.log_softmax(rows.double(), dim=-1)
    nll = (-logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).tolist()
    return nll, rows.argmax(dim=-1).tolist()


def run(model: str, modes: Sequence[str], lines: Sequence[str]) -> dict:
    """{mode: {perplexity, tokens, seconds}} and the top-1 agreement of every pair of modes."""
    results: dict = {"modes": {}, "top1_agreement": {}}
    top1: dict[str, list[int]] = {}
    for mode in modes:
        started = time.perf_counter()
        target = load(model, mode)
        nll: list[float] = []
        top1[mode] = []
        for line in lines:
            ids = target.encode_prompt(line)
            if len(ids) < 2:
                continue
            line_nll, line_top1 = score(target, ids)
            nll += line_nll
            top1[mode] += line_top1
        results["modes"][mode] = {
            "perplexity": round(math.exp(sum(nll) / len(nll)), 3),
            "tokens": len(nll),
            "plan": target.plan.describe(),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(mode, results["modes"][mode], flush=True)
    for i, first in enumerate(modes):
        for second in modes[i + 1 :]:
            same = sum(a == b for a, b in zip(top1[first], top1[second], strict=True))
            results["top1_agreement"][f"{second} vs {first}"] = round(same / len(top1[first]), 4)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--text", nargs="+", type=Path, default=TEXTS, help="files, a line each")
    parser.add_argument("--modes", default="fp32,bf16,int8,int8-fp32", help=", ".join(MODES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [mode for mode in modes if mode not in MODES]:
        parser.error(f"--modes: unknown {unknown} (known: {', '.join(MODES)})")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    lines = [line for path in args.text for line in path.read_text().splitlines() if line.strip()]
    results = {
        "model": args.model,
        "text": [str(path) for path in args.text],
        "lines": len(lines),
        "machine": machine(),
        **run(args.model, modes, lines),
    }
    for pair, share in results["top1_agreement"].items():
        print(f"top-1 {pair}: {share:.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
