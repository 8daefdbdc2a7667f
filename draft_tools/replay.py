"""Held-out acceptance of a draft, by replaying the target's own greedy answers.

At temperature 0 the target's output for a prompt is fixed, and speculative decoding reproduces
it exactly, so a draft's rounds can be simulated without running the target: at each point of
the answer the draft proposes k tokens, the round accepts the prefix that matches the answer and
then emits one target token. Tokens per round and per-position acceptance come out exactly as a
live greedy run would give them (in float32), in microseconds per round instead of a forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kenspec.server.engine.draft import Draft
from kenspec.server.engine.params import SpeculationParams
from kenspec.server.engine.sampling import walk
from kenspec.server.engine.speculator import AcceptanceStats, Speculator


@dataclass(frozen=True, slots=True)
class ReplayStats:
    answers: int
    tokens: int
    rounds: int
    speculative_rounds: int  # rounds that drafted at least one token
    drafted: int
    accepted: int
    drafted_at: tuple[int, ...]  # rounds that drafted a token at position j (1-based: index j-1)
    accepted_at: tuple[int, ...]  # ... and had it accepted
    draft_seconds: float

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def estimated_speedup(self, step_cost: float, verify_cost: float) -> float:
        """Tokens/s over plain decoding if a round costs verify_cost when it drafts and
        step_cost when it does not (costs measured on the target; the draft's time ignored)."""
        plain = self.rounds - self.speculative_rounds
        seconds = plain * step_cost + self.speculative_rounds * verify_cost
        return self.tokens * step_cost / seconds if seconds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def microseconds_per_drafted_token(self) -> float:
        return 1e6 * self.draft_seconds / self.drafted if self.drafted else 0.0


def replay(
    draft: Draft,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    params: SpeculationParams,
    learn: Callable[[Sequence[int], Sequence[int]], None] | None = None,
    on_round: Callable[[int, int, int], None] | None = None,
    tree_budget: int = 1,
) -> ReplayStats:
    """Simulate greedy speculative rounds of `draft` over each (prompt, answer) pair, in order;
    `learn(answer, prompt)` follows each answer once replayed (a suffix index learning as a
    server would);
    `on_round(answer index, position, emitted)` follows every round (the target's rows a live
    pass would have read: answer[position - 1 .. position + emitted - 2] after the prompt);
    tree_budget > 1 drafts token trees of that many nodes (the walk follows the answer, as a
    greedy target would; every node is verified, no cost model cuts any)."""
    k_max = params.k
    drafted_at, accepted_at = [0] * k_max, [0] * k_max
    rounds = speculative = drafted = accepted = tokens = 0
    seconds = 0.0
    shared = AcceptanceStats()  # every answer's, per source: the prior, as a server keeps it
    for number, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        speculator = Speculator(draft.start(prompt), params, shared=shared, tree_budget=tree_budget)
        position = 0
        while position < len(answer):
            started = time.perf_counter()
            proposal = speculator.propose(limit=len(answer) - position - 1)
            tree = proposal.tree
            seconds += time.perf_counter() - started
            emitted, path = walk(tree.tokens, tree.parents, _Follow(answer, position))
            node_depths = tree.depths()
            while len(drafted_at) < max(node_depths, default=0):  # long chains, deep trees
                drafted_at.append(0)
                accepted_at.append(0)
            on_path = set(path)
            for node, depth in enumerate(node_depths):  # per depth (a chain: per position)
                drafted_at[depth - 1] += 1
                accepted_at[depth - 1] += node in on_path
            speculator.record(proposal, len(path), path)
            speculator.extend(emitted)
            if on_round is not None:
                on_round(number, position, len(emitted))
            position += len(emitted)
            rounds += 1
            speculative += len(tree) > 0
            drafted += len(tree)
            accepted += len(path)
        tokens += len(answer)
        if learn is not None:
            learn(answer, prompt)
    return ReplayStats(
        answers=len(answers),
        tokens=tokens,
        rounds=rounds,
        speculative_rounds=speculative,
        drafted=drafted,
        accepted=accepted,
        drafted_at=tuple(drafted_at),
        accepted_at=tuple(accepted_at),
        draft_seconds=seconds,
    )


class _Follow:
    """A replayed walk's choice at each depth: the answer's token there, as greedy chose."""

    def __init__(self, answer: Sequence[int], position: int) -> None:
        self._answer = answer
        self._position = position

    def __call__(self, _row: int, path: Sequence[int]) -> int:
        return self._answer[self._position + len(path)]
