"""One round for every decoding row: propose, choose, build the pass, forward, walk, commit.

The accept rule (docs/design.md, "Verification"). A row feeds [pending, d_1 .. d_k] and the
pass gives a next-token distribution p_i after each. Walking the draft tree from the pending
token: y = the target's choice at the current node (argmax p when greedy, a draw from p when
sampling); if a child of the node is y, move to it and repeat, else emit y and stop (at a leaf
y is the bonus token). Every emitted token is the target's own choice given the tokens before
it, so greedy output is exactly plain greedy decoding, and sampled output is distributed
exactly as plain sampling (with a one-hot draft, Leviathan et al. 2023's min(1, p/q) rule is
"draw y ~ p, accept while y is a draft"). Drafts only decide how many choices one pass checks.
Token t of an output is drawn with a generator seeded by (seed, t), so a seeded request's
text does not depend on its rounds.

Example: drafts [5, 7, 9], target argmaxes [5, 7, 2, 4] -> emit [5, 7, 2] (2 accepted + 1 own).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import structlog

from server.engine.draft_choice import DraftChoice
from server.engine.draft_tree import DraftTree
from server.engine.generation import Round
from server.engine.intake import BatchStats, Entry
from server.engine.pass_logits import Logits
from server.engine.sampling import walk
from server.engine.verify_pass import PassRow, VerifyPass

log = structlog.get_logger("kenspec.batch")

Finished = list[tuple[Entry, Exception | None]]  # rows to take out, with their error if any


class BatchRows(Protocol):
    """What a round needs of the batch's row bookkeeping (see Batch)."""

    @property
    def entries(self) -> Sequence[Entry]:
        """The decoding rows: entries[i] is in cache row i."""

    def fail(self, entry: Entry, error: BaseException) -> None:
        """Take a row out now (the rows after it move) and fail its request."""

    def forward(self, verify: VerifyPass) -> list[Logits | Exception]:
        """Run the pass; if it fails, each row alone, so a failure fails only its row."""

    def relocate(self, row: int, moves: Sequence[tuple[int, int]]) -> None:
        """Copy cache positions of a row (source, destination)."""

    def finish(self, finished: Finished) -> None:
        """Take finished or failed rows out after a round."""


def run_round(rows: BatchRows, choice: DraftChoice, stats: BatchStats) -> None:
    started = time.perf_counter()
    # 1. Propose: every row drafts a tree (its own k, breakers, sampling; an open breaker
    # means none). A row whose draft raises leaves before the pass is laid out.
    trees = _propose(rows)
    entries = list(rows.entries)
    if not entries:
        return
    # 2. Choose what to verify by measured cost: the drafts worth their share of the pass.
    proposed = [entry.generation.pass_row(trees[id(entry)]) for entry in entries]
    gains = [entry.generation.speculator.gains() for entry in entries]
    chosen = choice.choose(proposed, gains)
    kept = [row.prefix(count) for row, count in zip(proposed, chosen.counts, strict=True)]
    for entry, row, verified in zip(entries, proposed, kept, strict=True):
        entry.generation.speculator.cut(len(row.drafts), len(verified.drafts))
    # 3. Build the pass: one packed sequence of every row's tokens, padded where it pays.
    verify = VerifyPass(
        tuple(kept),
        width=choice.width(kept, chosen.explore),
        argmax_only=all(entry.generation.argmax_only for entry in entries),
    )
    started = stats.timed("plan", started)
    # 4. Forward (the batch reruns a failed pass row by row).
    results = rows.forward(verify)
    started = stats.timed("forward", started)
    # 5-6. Walk each tree and commit what it accepted; deliver; finished rows leave.
    finished: Finished = []
    for index, (entry, row, logits) in enumerate(zip(entries, kept, results, strict=True)):
        if isinstance(logits, Exception):
            finished.append((entry, logits))
            continue
        try:
            round_ = _walk_and_commit(rows, index, entry, row, logits)
        except Exception as error:
            log.exception("complete_failed")
            finished.append((entry, error))
            continue
        entry.deliver(round_)
        if round_.finish_reason is not None:
            finished.append((entry, None))
    rows.finish(finished)
    stats.timed("accept", started)


def _propose(rows: BatchRows) -> dict[int, DraftTree]:
    """Each row's draft tree, by id(entry); a row whose draft raises is failed and gone."""
    trees: dict[int, DraftTree] = {}
    for entry in list(rows.entries):
        try:
            trees[id(entry)] = entry.generation.propose()
        except Exception as error:
            log.exception("plan_failed")
            rows.fail(entry, error)  # rows move: the pass is laid out after this
    return trees


def _walk_and_commit(
    rows: BatchRows, index: int, entry: Entry, row: PassRow, logits: Logits
) -> Round:
    generation = entry.generation
    # Walk the tree (the accept rule above): what the target emits, and the accepted nodes.
    choice = generation.token_choice(logits)
    emitted, path = walk(row.drafts, row.draft_parents(), choice)
    if generation.recycled is not None:  # the rows the pass computed, kept as drafts
        generation.recycled.record([row.pending, *row.drafts], logits.computed(row.scored))
    # Breakers and adaptive k learn what was accepted, per draft source.
    generation.speculator.record(len(row.drafts), len(emitted) - 1, path)
    # The stream: its prompt tail is cached now, its output grows, stops are checked.
    round_ = generation.accept(row, emitted, path, choice.logprobs)
    # Cache moves: a tree's accepted nodes were written at their slots, not their positions.
    rows.relocate(index, generation.kv_moves)
    return round_
