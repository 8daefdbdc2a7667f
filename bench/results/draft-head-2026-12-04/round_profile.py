"""Where an engine round's time goes, in process, with and without the learned draft head:
the round's phases (round.RoundTimes) and the main functions inside them, ms per round.

    PYTHONPATH=. .venv/bin/python bench/results/draft-head-2026-12-04/round_profile.py 10 \
        auto:nohead,auto:head,auto:nohead,auto:head head 0.2 4

(`bench/results/speculation-defaults/round_profile.py` with the head: the engine is loaded
with --draft-head, the head's min_prob and max_tokens set, and each run takes the head away
or gives it back, alternating; each run is a tenant of its own, so no run drafts from another's
answers.) Prompts: prompts/dev.txt from line 31 (held out), greedy, 128 new tokens, one
request at a time through the engine's batch, the server's default settings.
"""

import collections
import functools
import importlib
import sys
import time

from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import REPO_ROOT, Settings

SECONDS: collections.Counter[str] = collections.Counter()
SEEN: list[str] = []
TIMED = [
    (
        "kenspec.server.engine.breaker",
        "DraftFaultBreaker.call",
    ),  # drafting, with the thread hand-off
    ("kenspec.server.engine.speculator", "Speculator._draft"),
    ("kenspec.server.engine.context_draft", "ContextSession.observe"),
    ("kenspec.server.engine.context_draft", "ContextSession.propose"),
    ("kenspec.server.engine.speculator", "build_tree"),
    ("kenspec.server.engine.forward.screened_head", "ScreenedHead.approximate"),
    ("kenspec.server.engine.forward.screened_head", "ScreenedHead.argmax"),
    ("kenspec.server.engine.recycled", "RecycledPredictions.record"),
    ("kenspec.server.engine.speculator", "Speculator.record"),
    ("kenspec.server.engine.generation", "Generation.accept"),
    ("kenspec.server.engine.batch", "Batch.relocate"),
    ("kenspec.server.engine.draft_choice", "DraftChoice.choose"),
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
    engine = load_runtime(
        Settings.of(calibration_cache="none", draft_head=sys.argv[3] == "head")
    ).engine
    if engine.context_draft.head is not None and len(sys.argv) > 4:
        engine.context_draft.head.min_prob = float(sys.argv[4])
        engine.context_draft.head.max_tokens = int(sys.argv[5])
        print("head", sys.argv[4:])
    if len(sys.argv) > 6 and sys.argv[6] == "discard":
        from kenspec.server.engine import context_draft as cd

        original = cd.ContextSession._head_chain

        def discarding(self, k):
            original(self, k)
            return None

        cd.ContextSession._head_chain = discarding
        print("discarding head chains")
    lines = (REPO_ROOT / "prompts" / "dev.txt").read_text().splitlines()[30:]
    prompts = [line.strip() for line in lines if line.strip()][: int(sys.argv[1])]
    head = engine.context_draft.head
    for run in sys.argv[2].split(","):
        mode, _, variant = run.partition(":")
        engine.context_draft.head = None if variant == "nohead" else head
        SECONDS.clear()
        SEEN.append(run)
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
                tenant=run + str(len(SEEN)),
            )
            for round_ in engine.batch.rounds(generation):
                tokens += len(round_.token_ids)
        seconds, rounds = time.perf_counter() - started, engine.batch.stats.rounds
        print(run, f"{tokens / seconds:.1f} tok/s, {seconds / rounds * 1000:.2f} ms a round,",
              f"{tokens / rounds:.2f} tokens a round")  # fmt: skip
        phases = engine.batch.stats.seconds.items()
        print("  phases, ms a round:", {k: round(v / rounds * 1000, 3) for k, v in phases})
        ranked = sorted(SECONDS.items(), key=lambda kv: -kv[1])
        print("  inside, ms a round:", {k: round(v / rounds * 1000, 3) for k, v in ranked})


if __name__ == "__main__":
    main()
