"""Which drafts a verify pass holds, and how wide it is, by what passes are measured to cost.

Every row's drafts are ranked by their gains (expected accepted tokens) and the pass keeps the
drafts worth their share of its cost (`costs.choose_drafts`). Live costs may instead ask for a
stale shape to be measured: the pass then verifies that many tokens (fewer drafts) or, in a
one-row pass with padding on, is padded to them. A one-row pass may also be padded to a width
measured cheaper (small GEMMs are not monotonic in the row count on every CPU). Passes of
drafts and pending tokens only are timed for live costs: prompt chunks are not the shapes
priced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from kenspec.server.engine.costs import Costs, choose_drafts
from kenspec.server.engine.live_costs import LiveCosts
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import PassRow, VerifyPass

log = structlog.get_logger("kenspec.batch")


@dataclass(frozen=True, slots=True)
class Chosen:
    """The drafts each row keeps, and the tokens live costs asked the pass to hold (None:
    whatever the drafts kept make it)."""

    counts: list[int]
    explore: int | None = None


class DraftChoice:
    """Prices passes with `costs` and, where they are live, teaches them each timed pass."""

    def __init__(self, costs: Costs | None, target: TargetModel, *, pad_passes: bool) -> None:
        self.costs = costs
        self.live = costs if isinstance(costs, LiveCosts) else None
        self._target = target  # its context, and (batch invariance) its block of summed keys
        self._pad_passes = pad_passes
        self._logged: dict[str, object] = {}

    def choose(self, rows: Sequence[PassRow], gains: Sequence[Sequence[float]]) -> Chosen:
        """How many of its drafts each row keeps (gains[r][i]: what draft i of row r adds)."""
        block = self._target.tree_key_block
        if block:  # batch invariance: keys summed in order (attention.invariant_attention)
            gains = [
                g[: row.nodes_in_key_blocks(block)] for g, row in zip(gains, rows, strict=True)
            ]
        prefills = any(row.prompt_tail for row in rows)
        base = len(rows) + sum(len(row.prompt_tail) for row in rows)
        explore = None
        if self.live is not None and not prefills:
            # A stale shape is reached by verifying fewer drafts, or, in a one-row pass where
            # padding is on, by padding (padding several rows' pass would lay it out wider).
            can_pad = len(rows) == 1 and self._pad_passes
            most = None if can_pad else base + sum(len(g) for g in gains)
            explore = self.live.explore(len(rows), most_tokens=most)
        return Chosen(choose_drafts(gains, self.costs, base, tokens=explore), explore)

    def width(self, rows: Sequence[PassRow], explore: int | None = None) -> int:
        """The tokens to pad a pass of `rows` to: at least what they hold, more for a stale
        shape live costs asked for or a one-row pass's width measured cheaper. The padding
        goes after the last row."""
        tokens = sum(len(row.tokens) for row in rows)
        room = self._target.max_context - rows[-1].cache_length - len(rows[-1].tokens)
        if explore is not None and len(rows) == 1:
            return max(tokens, min(explore, tokens + room))
        if len(rows) > 1 or tokens == 1 or self.costs is None or not self._pad_passes:
            return tokens
        return max(tokens, self.costs.pass_tokens(tokens, limit=tokens + room))

    def observe_round(self, rows: int, drafted_rows: int, seconds: float) -> None:
        """A round's own work (`seconds` outside its pass; `drafted_rows` of its `rows`
        verified drafts) teaches live costs."""
        if self.live is not None:
            self.live.observe_round(rows, drafted_rows, seconds)

    def timed(self, verify: VerifyPass) -> bool:
        """Whether the pass's time teaches live costs: a whole pass without prompt tokens."""
        return self.live is not None and verify.first_row == 0 and not verify.prefills

    def observe(self, verify: VerifyPass, seconds: float) -> None:
        """A timed pass took `seconds`; log the live costs (every 64 passes at most) when they
        moved since the last line."""
        assert self.live is not None
        self.live.observe(len(verify.rows), max(verify.width, verify.tokens), seconds)
        if self.live.passes % 64 or (self._logged and not self.live.moved(self._logged)):
            return
        self._logged = self.live.summary()
        log.info("pass_costs", **self._logged)
