"""One round for every decoding row: propose, choose, cut, build the pass, forward, walk, commit.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from kenspec.server.engine.draft_choice import DraftChoice, GainCalibration
from kenspec.server.engine.generation import Round
from kenspec.server.engine.intake import Entry
from kenspec.server.engine.params import InvalidParameter
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.sampling import walk
from kenspec.server.engine.speculator import Proposal
from kenspec.server.engine.verify_pass import PassRow, VerifyPass

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


@dataclass(frozen=True, slots=True)
class RoundTimes:
    """Where one round's time went, in seconds, by phase: everything but `forward` is the
    round's own work (drafting, choosing, laying out the pass, walking, learning, delivery)."""

    rows: int
    drafted_rows: int  # rows whose pass verified drafts
    propose: float
    choose: float
    forward: float
    walk: float
    deliver: float
    drafted_tokens: int = 0  # the tokens the drafting rows emitted

    @property
    def drafted(self) -> bool:
        """Whether its pass verified any draft."""
        return self.drafted_rows > 0

    @property
    def overhead(self) -> float:
        """The round's time outside the forward pass."""
        return self.propose + self.choose + self.walk + self.deliver

    def phases(self) -> dict[str, float]:
        return {
            "propose": self.propose,
            "choose": self.choose,
            "forward": self.forward,
            "walk": self.walk,
            "deliver": self.deliver,
        }


def run_round(
    rows: BatchRows, choice: DraftChoice, timer: Callable[[], float] = time.perf_counter
) -> RoundTimes | None:
    """One round for every decoding row; where its time went, by `timer` (None: no row was
    left to verify once the drafts were proposed)."""
    clock = _Clock(timer)
    # 1. Propose: every row's Proposal, its drafts with their gains and sources (its own k,
    # breakers, sampling; an open breaker means none). A row whose draft raises leaves
    # before the pass is laid out.
    proposed = _propose(rows)
    entries = list(rows.entries)
    if not entries:
        return None
    propose = clock.lap()
    proposals = [proposed[id(entry)] for entry in entries]
    offered = [
        entry.generation.pass_row(proposal)
        for entry, proposal in zip(entries, proposals, strict=True)
    ]
    # 2. Choose what to verify by measured cost: the drafts worth their share of the pass.
    chosen = choice.choose(offered, proposals)
    # 3. Cut: each row keeps the drafts chosen, its proposal and its pass row alike.
    kept = [p.cut(count) for p, count in zip(proposals, chosen.counts, strict=True)]
    kept_rows = [row.prefix(count) for row, count in zip(offered, chosen.counts, strict=True)]
    # 4. Build the pass: one packed sequence of every row's tokens, padded where it pays.
    verify = VerifyPass(
        tuple(kept_rows),
        width=choice.width(kept_rows, chosen.explore),
        argmax_only=all(entry.generation.argmax_only for entry in entries),
    )
    choose = clock.lap()
    # 5. Forward (the batch reruns a failed pass row by row).
    results = rows.forward(verify)
    forward = clock.lap()
    # 6-7. Walk each tree, record and commit what it accepted; deliver; finished rows leave.
    finished: Finished = []
    walk = deliver = 0.0
    drafting: list[tuple[Entry, int]] = []  # rows that verified drafts, with their tokens
    rounds = zip(entries, kept, kept_rows, results, strict=True)
    for index, (entry, proposal, row, logits) in enumerate(rounds):
        if isinstance(logits, Exception):
            finished.append((entry, logits))
            continue
        try:
            round_ = _walk_and_commit(rows, index, entry, proposal, row, logits, choice.calibration)
        except InvalidParameter as error:  # the request's own grammar led nowhere: its 400
            log.info("request_refused_mid_answer", field=error.field, reason=error.message)
            finished.append((entry, error))
            continue
        except Exception as error:
            log.exception("complete_failed")
            finished.append((entry, error))
            continue
        walk += clock.lap()
        if row.drafts:
            drafting.append((entry, len(round_.token_ids)))
        entry.deliver(round_)
        if round_.finish_reason is not None:
            finished.append((entry, None))
        deliver += clock.lap()
    rows.finish(finished)
    deliver += clock.lap()
    drafted = sum(1 for row in kept_rows if row.drafts)
    emitted = sum(tokens for _, tokens in drafting)
    times = RoundTimes(len(entries), drafted, propose, choose, forward, walk, deliver, emitted)
    # 8. Speculation's pace: each drafting row's breaker weighs the time its drafts added
    # against the tokens they gave. Not a pass with prompt tokens, nor one laid out to measure
    # a stale width: neither is the drafts' doing.
    if drafting and not verify.prefills and chosen.explore is None:
        price = choice.pace(times.rows, drafted, forward + times.overhead)
        if price is not None:
            extra, per_token = price
            for entry, tokens in drafting:
                entry.generation.speculator.charge(extra, (tokens - 1) * per_token)
    return times


class _Clock:
    """Seconds since the last lap (or since it was made)."""

    def __init__(self, timer: Callable[[], float]) -> None:
        self._timer = timer
        self._last = timer()

    def lap(self) -> float:
        now = self._timer()
        elapsed, self._last = now - self._last, now
        return elapsed


def _propose(rows: BatchRows) -> dict[int, Proposal]:
    """Each row's proposal, by id(entry); a row whose draft raises is failed and gone."""
    proposals: dict[int, Proposal] = {}
    for entry in list(rows.entries):
        try:
            proposals[id(entry)] = entry.generation.propose()
        except InvalidParameter as error:  # (its grammar, as above)
            log.info("request_refused_mid_answer", field=error.field, reason=error.message)
            rows.fail(entry, error)
        except Exception as error:
            log.exception("plan_failed")
            rows.fail(entry, error)  # rows move: the pass is laid out after this
    return proposals


def _walk_and_commit(
    rows: BatchRows,
    index: int,
    entry: Entry,
    proposal: Proposal,
    row: PassRow,
    logits: Logits,
    calibration: GainCalibration,
) -> Round:
    """Walk `row`'s drafts (`proposal`, as the batch cut it) on `logits`, learn (the request's
    speculator, the choice's `calibration` of gains) and emit."""
    generation = entry.generation
    # Walk the tree (the accept rule above): what the target emits, and the accepted nodes.
    choice = generation.token_choice(logits)
    emitted, path = walk(row.drafts, row.draft_parents(), choice)
    if generation.recycled is not None:  # the rows the pass computed, kept as drafts
        generation.recycled.record([row.pending, *row.drafts], logits.computed(row.scored))
    # Breakers and adaptive k learn what was accepted, per draft source.
    generation.speculator.record(proposal, len(emitted) - 1, path)
    calibration.learn(proposal, path)
    # The stream: its prompt tail is cached now, its output grows, stops are checked.
    round_ = generation.accept(proposal, row, emitted, path, choice.logprobs)
    # A learned draft head drafts the next round from the hidden state of the row that chose
    # the last emitted token (row 0: after the pending token; row i + 1: after node i).
    wanted = round_.finish_reason is None and generation.speculator.wants_features
    if logits.features is not None and wanted:
        generation.speculator.observe(logits.features[path[-1] + 1 if path else 0])
    # Cache moves: a tree's accepted nodes were written at their slots, not their positions.
    rows.relocate(index, generation.kv_moves)
    return round_
