"""Drafting configurations interleaved in one process, each prompt under every one in turn.

    PYTHONPATH=. PROMPTS=dev.txt SKIP=30 N=31 .venv/bin/python \
        bench/results/draft-head-c-chain/interleaved.py

Greedy, 128 new tokens, one request at a time through the engine's batch, the server's default
settings with --draft-head; each configuration its own tenant (its own learned answers), the
order rotating by prompt. Configurations:
  off     plain decoding
  nohead  the default drafts (the head's chain never offered)
  only3   the head's chain (up to 3 tokens) and matched copies (context, suffix index) alone
  only3k  the same and the KenLM chain, no tree branching
The engine's live costs and gain calibration are shared by all four (one process), so this
ranks configurations roughly; the served runs (peers-*/) are the measurement.
"""

import collections
import os
import time

import kenspec.server.engine.context_draft as context_draft
from kenspec.server.engine import draft_head
from kenspec.server.engine.params import SamplingParams, SpeculationParams, StoppingParams
from kenspec.server.runtime import load_runtime
from kenspec.server.settings import REPO_ROOT, Settings

HEADS: list[draft_head.DraftHead] = []
MODE = {"name": "nohead"}
_init = draft_head.DraftHead.__init__
_propose = context_draft.ContextSession.propose
_branching = context_draft.ContextSession.branching
_observe = context_draft.ContextSession.observe
STOCK = ("off", "nohead")


def _kept(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    _init(self, *args, **kwargs)
    HEADS.append(self)


def propose(self, k):  # type: ignore[no-untyped-def]
    if MODE["name"] in STOCK:
        return _propose(self, k)
    chains = self._matched_chains(k)
    chains += [(0, chain) for chain in self._head_chains(k)[:1]]
    if MODE["name"] == "only3k" and self._static is not None:
        chains.append((0, self._static_chain(k)))
    chains.sort(key=lambda pair: -pair[0])
    found = tuple(chain for _, chain in chains if len(chain))
    return found or (context_draft.Chain(source=context_draft._source("context", 0)),)


def branching(self):  # type: ignore[no-untyped-def]
    return _branching(self) if MODE["name"] in STOCK else None


def observe(self, feature):  # type: ignore[no-untyped-def]
    if MODE["name"] in STOCK:
        self._head_found = None
        return None
    return _observe(self, feature)


def main() -> None:
    draft_head.DraftHead.__init__ = _kept  # type: ignore[method-assign]
    context_draft.ContextSession.propose = propose  # type: ignore[method-assign]
    context_draft.ContextSession.branching = branching  # type: ignore[method-assign]
    context_draft.ContextSession.observe = observe  # type: ignore[method-assign]
    engine = load_runtime(Settings.of(calibration_cache="none", draft_head=True)).engine
    HEADS[0].max_tokens = 3
    lines = (REPO_ROOT / "prompts" / os.environ.get("PROMPTS", "dev.txt")).read_text()
    skipped = lines.splitlines()[int(os.environ.get("SKIP", "30")) :]
    prompts = [line.strip() for line in skipped if line.strip()][: int(os.environ.get("N", "10"))]
    names = ["off", "nohead", "only3", "only3k"]
    seconds: collections.Counter[str] = collections.Counter()
    tokens: collections.Counter[str] = collections.Counter()
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            MODE["name"] = name
            ids = engine.target.encode_chat([{"role": "user", "content": prompt}])
            generation = engine.start(
                ids,
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=128),
                speculation=SpeculationParams(enabled=name != "off"),
                request_id=f"{name}-{i}",
                tenant=name,
            )
            started = time.perf_counter()
            for round_ in engine.batch.rounds(generation):
                tokens[name] += len(round_.token_ids)
            seconds[name] += time.perf_counter() - started
    for name in names:
        rate = tokens[name] / seconds[name]
        print(f"{name:7s} {rate:6.1f} tok/s  {rate / (tokens['off'] / seconds['off']):.3f} x off")


if __name__ == "__main__":
    main()
