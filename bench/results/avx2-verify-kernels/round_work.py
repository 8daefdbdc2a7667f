"""Where drafting and plain rounds' own work goes, AUTO only, in one process.

    PYTHONPATH=. INLINE=1 N=10 .venv/bin/python bench/results/avx2-verify-kernels/round_work.py

Greedy, 128 new tokens, one request at a time through the engine's batch, `prompts/dev.txt`
lines 31-40 (held out), the server's default settings. INLINE=1 calls drafts on the engine
thread (no hand-off to the draft thread: the drafting itself). Prints, for plain rounds and
rounds that verified drafts, the percentiles of their own work (round.RoundTimes.overhead)
and the medians of its phases, and the time Python's garbage collector took.
"""

import collections
import gc
import os
import time

import numpy as np

import kenspec.server.engine.batch as batch_module
import kenspec.server.engine.breaker as breaker_module
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import REPO_ROOT, Settings

TIMES = []
run_round = batch_module.run_round


def timed_round(*args, **kwargs):  # type: ignore[no-untyped-def]
    times = run_round(*args, **kwargs)
    TIMES.append(times)
    return times


batch_module.run_round = timed_round
COLLECTIONS: list[tuple[int, float]] = []
_started: dict[str, float] = {}


def on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started["t"] = time.perf_counter()
    else:
        COLLECTIONS.append((info["generation"], time.perf_counter() - _started["t"]))


def main() -> None:
    gc.callbacks.append(on_gc)
    if os.environ.get("INLINE"):
        breaker_module.DraftFaultBreaker._timed = lambda self, draft: draft()  # type: ignore[method-assign]
    engine = load_runtime(Settings.of(calibration_cache="none")).engine
    lines = (REPO_ROOT / "prompts" / "dev.txt").read_text().splitlines()[30:]
    prompts = [line.strip() for line in lines if line.strip()][: int(os.environ.get("N", "10"))]
    COLLECTIONS.clear()
    tokens, started = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
        generation = engine.start(
            ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=128),
            speculation=SpeculationParams(enabled=True),
            request_id=str(i),
            tenant="t",
        )
        for round_ in engine.batch.rounds(generation):
            tokens += len(round_.token_ids)
    elapsed = time.perf_counter() - started
    rounds = [t for t in TIMES if t is not None]
    for drafted in (False, True):
        chosen = [t for t in rounds if t.drafted == drafted]
        if not chosen:
            continue
        own = np.array([t.overhead for t in chosen]) * 1e3
        p50, p90, p99 = np.percentile(own, [50, 90, 99])
        print(
            f"{'drafted' if drafted else 'plain'} rounds {len(chosen)} own ms p50 {p50:.3f}"
            f" p90 {p90:.3f} p99 {p99:.3f} mean {own.mean():.3f}"
        )
        for phase in ("propose", "choose", "walk", "deliver"):
            values = np.array([getattr(t, phase) for t in chosen]) * 1e3
            print(f"    {phase} median {np.median(values):.3f} mean {values.mean():.3f}")
    by_generation = collections.Counter(generation for generation, _ in COLLECTIONS)
    collected = sum(seconds for _, seconds in COLLECTIONS) * 1e3
    print(f"tok/s {tokens / elapsed:.1f}  gc {dict(by_generation)} {collected:.1f} ms in all")


if __name__ == "__main__":
    main()
