"""What each AUTO round's propose phase did and cost, in process.

    PYTHONPATH=. MODEL=FILE .venv/bin/python bench/results/round-work-2026-12-07/proposals.py

Ten held-out chats (prompts/dev.txt from line 31), greedy, 128 new tokens, one request at a
time, default settings. Each round's proposal is classified by (rested, copied, drafted
anything, probe) with the count, mean and median milliseconds of Speculator.propose; then how
often the session said a copy may follow (`may_copy`, by past_answers) and the rest lengths
seen. Runs on the code before `may_copy` too (those lines then stay empty).
"""

import collections
import os
import statistics
import time

import kenspec.server.engine.context_draft as context_draft
import kenspec.server.engine.speculator as speculator_module
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import REPO_ROOT, Settings

LOG = []
MAY = collections.Counter()
propose = speculator_module.Speculator.propose


def timed_propose(self, limit, constraint=None):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    proposal = propose(self, limit, constraint)
    kind = (proposal.rested, proposal.copied, proposal.proposed > 0, proposal.probe)
    LOG.append((kind, time.perf_counter() - started, getattr(self, "_rest_every", 0)))
    return proposal


speculator_module.Speculator.propose = timed_propose
may_copy = getattr(context_draft.ContextSession, "may_copy", None)
if may_copy is not None:

    def counted(self, min_match, past_answers=True):  # type: ignore[no-untyped-def]
        may = may_copy(self, min_match, past_answers)
        MAY[past_answers, may] += 1
        return may

    context_draft.ContextSession.may_copy = counted


def main() -> None:
    flags: dict[str, object] = {"calibration_cache": "none"}
    if os.environ.get("MODEL"):
        flags["model"] = os.environ["MODEL"]
    engine = load_runtime(Settings.of(**flags)).engine
    lines = (REPO_ROOT / "prompts" / "dev.txt").read_text().splitlines()[30:]
    for prompt in [line.strip() for line in lines if line.strip()][:10]:
        ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
        generation = engine.start(
            ids,
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=128),
            speculation=SpeculationParams(enabled=True),
            request_id="trace",
        )
        for _ in engine.batch.rounds(generation):
            pass
    kinds = collections.defaultdict(list)
    for kind, seconds, _ in LOG:
        kinds[kind].append(seconds * 1e3)
    print(f"{len(LOG)} rounds; (rested, copied, drafted, probe): rounds, mean ms, median ms")
    for kind, times in sorted(kinds.items(), key=lambda item: -len(item[1])):
        print(
            kind, len(times), round(statistics.fmean(times), 3), round(statistics.median(times), 3)
        )
    print("may_copy (past_answers, may):", dict(MAY))
    print("rest lengths seen:", dict(collections.Counter(every for *_, every in LOG)))


if __name__ == "__main__":
    main()
