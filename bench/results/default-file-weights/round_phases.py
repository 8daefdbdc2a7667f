"""AUTO and OFF interleaved prompt by prompt in one process, where plain rounds' time goes.

    PYTHONPATH=. MODEL=FILE PROMPTS=dev.txt SKIP=30 N=20 MODES=thread,off \\
        .venv/bin/python bench/results/default-file-weights/round_phases.py

Each prompt runs once per mode, the order rotating prompt by prompt, so the VM's drift (2x
over minutes on the benchmark VM) falls on every mode alike: compare modes within a run.
Modes: `thread` (AUTO, drafts on the fault breaker's draft thread, as served), `inline` (AUTO,
drafts called on the engine thread: the hand-off's cost), `off` (plain decoding). Each mode
learns into its own tenant (no mode copies another's answers). Greedy, 128 new tokens, one
request at a time through the engine's batch, the server's default settings (MODEL unset:
the default model). Prints tokens/s per mode, rounds, and the forward and own-work times of
plain rounds (round.RoundTimes; a request's first round, its prefill, left out).
"""

import collections
import os
import statistics
import time

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
threaded = breaker_module.DraftFaultBreaker._timed


def inline(self, draft):  # type: ignore[no-untyped-def]
    return draft()


def main() -> None:
    flags: dict[str, object] = {"calibration_cache": "none"}
    if os.environ.get("MODEL"):
        flags["model"] = os.environ["MODEL"]
    engine = load_runtime(Settings.of(**flags)).engine
    skip = int(os.environ.get("SKIP", "30"))
    lines = (REPO_ROOT / "prompts" / os.environ.get("PROMPTS", "dev.txt")).read_text()
    prompts = [line.strip() for line in lines.splitlines()[skip:] if line.strip()]
    prompts = prompts[: int(os.environ.get("N", "10"))]
    modes = os.environ.get("MODES", "thread,inline,off").split(",")
    rounds, drafted, tokens = collections.Counter(), collections.Counter(), collections.Counter()
    seconds = collections.Counter()
    forward, own = collections.defaultdict(list), collections.defaultdict(list)
    phases = collections.defaultdict(lambda: collections.defaultdict(list))
    for i, prompt in enumerate(prompts):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            breaker_module.DraftFaultBreaker._timed = inline if mode == "inline" else threaded
            ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
            generation = engine.start(
                ids,
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=128),
                speculation=SpeculationParams(enabled=mode != "off"),
                request_id=mode,
                tenant=mode,
            )
            TIMES.clear()
            started = time.perf_counter()
            for round_ in engine.batch.rounds(generation):
                tokens[mode] += len(round_.token_ids)
            seconds[mode] += time.perf_counter() - started
            times = [t for t in TIMES if t is not None]
            rounds[mode] += len(times)
            drafted[mode] += sum(t.drafted for t in times)
            for t in times[1:]:
                if not t.drafted:
                    forward[mode].append(t.forward * 1e3)
                    own[mode].append(t.overhead * 1e3)
                    for k, v in t.phases().items():
                        phases[mode][k].append(v * 1e3)
    for mode in modes:
        print(
            f"{mode:7s} tok/s {tokens[mode] / seconds[mode]:.1f} rounds {rounds[mode]} drafted"
            f" {drafted[mode]} tokens {tokens[mode]}  plain rounds {len(forward[mode])} forward"
            f" med {statistics.median(forward[mode]):.3f} mean {statistics.fmean(forward[mode]):.3f}"
            f"  own med {statistics.median(own[mode]):.3f} mean {statistics.fmean(own[mode]):.3f}"
        )

    for mode in modes:
        print(mode, {k: round(statistics.median(v), 3) for k, v in phases[mode].items()})


if __name__ == "__main__":
    main()
