"""`python -m bench.recovery`: a server started under load, then left quiet, finds its way back.

1. Quiet: a server starts on an idle machine; its `calibrated` line is the reference, and it
   serves the prompts --passes times over (greedy, speculation on): tokens per round and
   tokens/s per prompt; its live costs at shutdown are the reference.
2. Loaded: --burners busy processes spin on the CPU while a second server starts (its
   calibration measures a loaded machine), then they stop, and the server serves the prompts
   --passes times over. Its `pass_costs` log lines (engine.live_costs: the live one-row costs
   in steps and the breaker threshold, logged as they move) show when it is back.

Recovered: the first `pass_costs` line from which on the live step is within
--steps-tolerance of the quiet server's, the threshold within --threshold-tolerance, and the
one-row widths' costs in steps within --steps-tolerance in the median over widths. The
report gives that line's pass count and time, and the loaded server's tokens per round and
tokens/s on each pass over the prompts beside the quiet server's. Extra arguments after `--`
go to both servers.
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
from datetime import datetime
from pathlib import Path

from bench.machine import machine
from bench.suite import read_prompts
from bench.workloads import _one
from harness.server_process import REPO, ServerProcess
from kenspec.client import AsyncClient

BURN = "while True: pass"


async def serve_prompts(address: str, prompts: Sequence[str], max_new_tokens: int) -> list[dict]:
    async with AsyncClient(address) as client:
        return [await _one(client, prompt, max_new_tokens, "auto") for prompt in prompts]


def recovered_at(
    lines: Sequence[dict], quiet: dict, threshold_tolerance: float, steps_tolerance: float
) -> dict | None:
    """The first pass_costs line from which on every line agrees with `quiet` (a pass_costs-
    shaped dict): a step within steps_tolerance of its step, the threshold within
    threshold_tolerance, and the one-row widths in steps off by at most steps_tolerance in
    the median over widths (single buckets of either table are noisy: 10-20%)."""

    def agrees(line: dict) -> bool:
        if abs(line["threshold"] - quiet["threshold"]) > threshold_tolerance:
            return False
        if abs(line["step_ms"] / quiet["step_ms"] - 1) > steps_tolerance:
            return False
        steps, reference = line["steps"], quiet["steps"]
        off = [
            abs(float(steps[width]) / float(value) - 1)
            for width, value in reference.items()
            if width in steps and int(width) > 1
        ]
        return statistics.median(off) <= steps_tolerance

    found = None
    for line in lines:
        found = (found or line) if agrees(line) else None
    return found


def serve_passes(address: str, prompts: Sequence[str], args: argparse.Namespace) -> list[dict]:
    """The prompts, --passes times over (the suffix index learns them: both servers alike)."""
    passes = []
    for _ in range(args.passes):
        runs = asyncio.run(serve_prompts(address, prompts, args.max_new_tokens))
        passes.append({"runs": runs, **_summary(runs)})
    return passes


def _summary(runs: Sequence[dict]) -> dict:
    return {
        "tokens_per_round_median": round(statistics.median(r["tokens_per_round"] for r in runs), 3),
        "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in runs), 2),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__)
    parser.add_argument("--prompts", type=Path, default=REPO / "prompts" / "dev.txt")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--passes", type=int, default=3, help="times the loaded server serves")
    parser.add_argument("--burners", type=int, default=2, help="busy processes during start-up")
    parser.add_argument("--threshold-tolerance", type=float, default=0.05)
    parser.add_argument("--steps-tolerance", type=float, default=0.2)
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("server_args", nargs="*", help="after --: flags for both servers")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts, args.limit)
    result: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}

    server = ServerProcess(args.server_args)
    try:
        result["quiet_calibrated"] = server.logged("calibrated")
        quiet_passes = serve_passes(server.address, prompts, args)
    finally:
        server.stop()
    quiet_lines = [e for e in server.events if e.get("event") == "pass_costs"]
    quiet = quiet_lines[-1]  # its live costs at shutdown: start-up's, corrected by its passes
    result["quiet"] = {"passes": quiet_passes, "pass_costs": quiet_lines}

    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    started = time.monotonic()
    try:
        server = ServerProcess(args.server_args)
    finally:
        ready_s = time.monotonic() - started
        for burner in burners:
            burner.kill()
            burner.wait()
    quiet_from = time.time()
    try:
        result["loaded_calibrated"] = server.logged("calibrated")
        passes = serve_passes(server.address, prompts, args)
    finally:
        server.stop()
    lines = [e for e in server.events if e.get("event") == "pass_costs"]
    back = recovered_at(lines, quiet, args.threshold_tolerance, args.steps_tolerance)
    result["loaded"] = {
        "ready_s": round(ready_s, 1),
        "passes": passes,
        "pass_costs": lines,
        "recovered": back,
        "quiet_from": datetime.fromtimestamp(quiet_from).astimezone().isoformat(),
        "recovered_after_s": round(_seconds(back) - quiet_from, 1) if back else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    brief = {
        "quiet_calibrated": _brief(result["quiet_calibrated"]),
        "loaded_calibrated": _brief(result["loaded_calibrated"]),
        "loaded_ready_s": result["loaded"]["ready_s"],
        "quiet_live_at_shutdown": _live(quiet),
        "loaded_live_at_shutdown": _live(lines[-1]),
        "quiet_passes": [_summary(p["runs"]) for p in quiet_passes],
        "loaded_passes": [_summary(p["runs"]) for p in passes],
        "recovered_at_pass": back["passes"] if back else None,
        "recovered_after_s": result["loaded"]["recovered_after_s"],
        "loaded_lines": [_live(line) for line in lines],
    }
    print(json.dumps(brief, indent=1))
    return 0


def _live(line: dict) -> dict:
    keys = ("passes", "explorations", "step_ms", "steps", "threshold")
    return {key: line.get(key) for key in keys}


def _brief(calibrated: dict | None) -> dict | None:
    if calibrated is None:
        return None
    keys = ("step_ms", "verify_ms", "cost_ratio", "break_even_acceptance", "wide_steps", "seconds")
    return {key: calibrated.get(key) for key in keys}


def _seconds(line: dict) -> float:
    """A log line's time, in seconds since the epoch (its ISO timestamp)."""
    return datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":
    sys.exit(main())
