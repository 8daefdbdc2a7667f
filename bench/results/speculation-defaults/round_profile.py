"""Where an engine round's time goes, in process: the round's phases (round.RoundTimes, as the
batch's stats add them) and the main functions inside them, ms per round, for AUTO and OFF.

    PYTHONPATH=. .venv/bin/python bench/results/speculation-defaults/round_profile.py 10 auto,off

Prompts: prompts/dev.txt from line 31 (held out: not tuned on), greedy, 128 new tokens, one
request at a time through the engine's batch, the server's default settings.
"""

import collections
import functools
import importlib
import sys
import time

from server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from server.runtime import load_runtime
from server.settings import REPO_ROOT, Settings

SECONDS: collections.Counter[str] = collections.Counter()
TIMED = [
    ("server.engine.breaker", "DraftFaultBreaker.call"),  # drafting, with the thread hand-off
    ("server.engine.speculator", "Speculator._draft"),
    ("server.engine.context_draft", "ContextSession.propose"),
    ("server.engine.speculator", "build_tree"),
    ("server.engine.forward.screened_head", "ScreenedHead.approximate"),
    ("server.engine.forward.screened_head", "ScreenedHead.argmax"),
    ("server.engine.recycled", "RecycledPredictions.record"),
    ("server.engine.speculator", "Speculator.record"),
    ("server.engine.generation", "Generation.accept"),
    ("server.engine.batch", "Batch.relocate"),
    ("server.engine.draft_choice", "DraftChoice.choose"),
]


def timed(module: str, name: str) -> None:
    owner = importlib.import_module(module)
    *path, attribute = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    function = getattr(owner, attribute)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - started

    setattr(owner, attribute, wrapper)


def main() -> None:
    for module, name in TIMED:
        timed(module, name)
    engine = load_runtime(Settings.of(calibration_cache="none")).engine
    lines = (REPO_ROOT / "prompts" / "dev.txt").read_text().splitlines()[30:]
    prompts = [line.strip() for line in lines if line.strip()][: int(sys.argv[1])]
    for mode in sys.argv[2].split(","):
        SECONDS.clear()
        engine.batch.stats.seconds.clear()
        engine.batch.stats.rounds = 0
        tokens, started = 0, time.perf_counter()
        for prompt in prompts:
            ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
            generation = engine.start(
                ids,
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=128),
                speculation=SpeculationParams(enabled=mode == "auto"),
                request_id="profile",
            )
            for round_ in engine.batch.rounds(generation):
                tokens += len(round_.token_ids)
        seconds, rounds = time.perf_counter() - started, engine.batch.stats.rounds
        print(mode, f"{tokens / seconds:.1f} tok/s, {seconds / rounds * 1000:.2f} ms a round,",
              f"{tokens / rounds:.2f} tokens a round")  # fmt: skip
        phases = engine.batch.stats.seconds.items()
        print("  phases, ms a round:", {k: round(v / rounds * 1000, 3) for k, v in phases})
        ranked = sorted(SECONDS.items(), key=lambda kv: -kv[1])
        print("  inside, ms a round:", {k: round(v / rounds * 1000, 3) for k, v in ranked})


if __name__ == "__main__":
    main()
