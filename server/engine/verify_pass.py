"""The verify pass: the one thing the target's forward takes (with the cache).

A pass holds one `PassRow` per cache row it writes, rows `first_row`, `first_row + 1`, ...
in order. A row feeds `[*prompt_tail, pending, *drafts]` after its first `cache_length`
positions: the prompt tokens still to prefill (a prompt prefilled in its first round's pass;
their logits are not needed), the pending token (the last one accepted, whose keys are not yet
in the cache) and the drafts, a token tree over the pending token. The pass scores the pending
token and every draft: row i of a row's logits is the target's next-token distribution after
its i-th scored token (0: after the pending token, i: after draft i - 1).

Example: a row of 40 cached positions, pending token 9 and the chain [5, 7]:

    PassRow(cache_length=40, pending=9, drafts=(5, 7))

feeds [9, 5, 7] at positions 40, 41, 42 and gets three logits rows (after 9, 5 and 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kenspec.server.engine.draft_tree import chain_parents, depths


@dataclass(frozen=True, slots=True)
class PassRow:
    """One cache row's tokens in a pass (see the module doc).

    parents: the drafts' tree (node i's parent, -1: the pending token), or None for a chain,
    which the pass lays out as a sequence. A tree cut to a prefix that happens to be a chain
    keeps its parents: it is laid out as the tree it was proposed as.
    """

    cache_length: int
    pending: int
    drafts: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    prompt_tail: tuple[int, ...] = ()

    @classmethod
    def sequence(cls, cache_length: int, tokens: Sequence[int]) -> PassRow:
        """A row scoring every one of `tokens` (e.g. a prompt, or a calibration pass)."""
        return cls(cache_length, tokens[0], tuple(tokens[1:]))

    def prefix(self, count: int) -> PassRow:
        """The row with its first `count` drafts only (a tree's first nodes are a tree)."""
        if count >= len(self.drafts):
            return self
        parents = self.parents[:count] if self.parents is not None else None
        return replace(self, drafts=self.drafts[:count], parents=parents)

    @property
    def tokens(self) -> list[int]:
        """What the row feeds: the prompt tail, the pending token, the drafts."""
        return [*self.prompt_tail, self.pending, *self.drafts]

    @property
    def scored(self) -> int:
        """Logits rows the row gets: one after the pending token and after each draft."""
        return 1 + len(self.drafts)

    @property
    def pending_position(self) -> int:
        """The pending token's position in its row: its drafts' slots follow it."""
        return self.cache_length + len(self.prompt_tail)

    def draft_parents(self) -> tuple[int, ...]:
        """The drafts' parents, a chain's included."""
        return self.parents if self.parents is not None else chain_parents(len(self.drafts))

    def feed_parents(self) -> list[int] | None:
        """The tree over everything the row feeds (None: a sequence): the prompt tail and the
        pending token each follow the one before, a draft its parent."""
        if self.parents is None:
            return None
        pending = len(self.prompt_tail)  # the pending token's index in the feed
        return [*range(-1, pending), *(pending + 1 + parent for parent in self.parents)]

    def nodes_in_key_blocks(self, block: int) -> int:
        """How many of the first drafts have their cache slot in the same block of `block`
        keys as their position (batch invariance sums keys a block at a time): a tree's node
        i is written at pending + 1 + i and is at pending + its depth (a chain's, at both).

        Example: pending at 190, block 192, parents (-1, -1, 0): node 1 is written at 192
        (block 1) but is at 191 (block 0), so 1 node is kept."""
        if self.parents is None:
            return len(self.drafts)
        pending = self.pending_position
        for node, depth in enumerate(depths(self.parents)):
            if (pending + 1 + node) // block != (pending + depth) // block:
                return node
        return len(self.parents)


@dataclass(frozen=True, slots=True)
class VerifyPass:
    """The rows of one packed pass, written to cache rows first_row, first_row + 1, ...;
    padded to `width` tokens when that is more than they hold (the padding repeats the last
    row's last token: scored, never read)."""

    rows: tuple[PassRow, ...]
    first_row: int = 0
    width: int = 0
    # every row's reader wants only greedy tokens (no whole rows: no sampling, logprobs or
    # processors), so the target may screen them (engine.screened_head)
    argmax_only: bool = False

    @classmethod
    def sequences(
        cls, lengths: Sequence[int], token_rows: Sequence[Sequence[int]], *, width: int = 0
    ) -> VerifyPass:
        """A pass scoring every token of each row (rows after `lengths` cached positions)."""
        rows = (PassRow.sequence(n, t) for n, t in zip(lengths, token_rows, strict=True))
        return cls(tuple(rows), width=width)

    @property
    def tokens(self) -> int:
        """Tokens the rows feed (the padding not counted)."""
        return sum(len(row.tokens) for row in self.rows)

    @property
    def prefills(self) -> bool:
        """Whether any row prefills a prompt tail (such a pass is not a priced shape)."""
        return any(row.prompt_tail for row in self.rows)
