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
from kenspec.server.engine.speculator import Proposal
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import PassRow, VerifyPass

log = structlog.get_logger("kenspec.batch")


GAIN_BINS = 5  # gains are calibrated in bins of 0.2 of predicted probability
GAIN_DECAY = 0.98  # weight of the past in a bin, per draft node verified (~50 nodes)
GAIN_PRIOR = 2.0  # draft tokens' worth of "as predicted" each bin starts from


class GainCalibration:
    """What verification accepted of draft nodes against what their gains predicted, over the
    recent drafting rows of every request, in bins of predicted probability: the ratios the
    draft choice scales learned gains by.

    A node's gain is its path probability as drafting estimates it (per-source acceptance,
    multiplied along the tree's paths). Measured on held-out chat, those predictions ran about
    twice what was accepted (1.61 tokens predicted a round, 0.78 accepted), and the choice,
    taking them at their word, verified drafts that did not pay for their pass. The error is
    not the same at every level (a long context match is about as sure as it says; a guess is
    not), so each bin of predicted probability keeps its own accepted / predicted, and a row's
    calibrated gains are kept non-increasing (the choice takes a row's first drafts). Probes
    and grammar-forced tokens are not scaled (a probe is a deliberate measurement; a forced
    token is certain), but a probe's own predictions are learned from like any other.
    """

    def __init__(
        self, decay: float = GAIN_DECAY, prior: float = GAIN_PRIOR, bins: int = GAIN_BINS
    ) -> None:
        self.decay = decay
        self._predicted = [prior * (index + 0.5) / bins for index in range(bins)]
        self._accepted = list(self._predicted)

    def _bin(self, gain: float) -> int:
        return min(max(int(gain * len(self._predicted)), 0), len(self._predicted) - 1)

    @property
    def ratios(self) -> list[float]:
        """Accepted per predicted, decayed, by bin of predicted probability (1 at first)."""
        return [a / p for a, p in zip(self._accepted, self._predicted, strict=True)]

    def ratio(self, gain: float) -> float:
        """Accepted per predicted for nodes predicted at `gain`."""
        index = self._bin(gain)
        return self._accepted[index] / self._predicted[index]

    def observe(self, gain: float, accepted: bool) -> None:
        """A draft node predicted at `gain` was verified, and accepted or not."""
        if gain <= 0:
            return
        index = self._bin(gain)
        self._predicted[index] = self._predicted[index] * self.decay + gain
        self._accepted[index] = self._accepted[index] * self.decay + accepted

    def gains(self, proposal: Proposal) -> list[float]:
        """The proposal's gains for the choice: learned ones scaled by their bin's ratio,
        non-increasing."""
        gains = proposal.gains
        if proposal.probe or not gains:
            return gains
        forced = proposal.forced
        scaled = gains[:forced]
        for gain in gains[forced:]:
            calibrated = gain * self.ratio(gain)
            scaled.append(min(calibrated, scaled[-1]) if len(scaled) > forced else calibrated)
        return scaled

    def learn(self, proposal: Proposal, path: Sequence[int]) -> None:
        """A row's round verified `proposal` (as cut) and accepted the nodes `path`: each
        learned node counts, accepted or not (a node below a refused one was predicted with
        its parent's chance in its path probability), if the walk passed every forced token.
        Not a copy's (drafted while its request's breaker was open: chosen for being sure)."""
        forced = proposal.forced
        if len(path) < forced or proposal.copied:
            return
        accepted = set(path)
        for node in range(forced, len(proposal.tree)):
            self.observe(proposal.tree.probs[node], node in accepted)


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
        self.calibration = GainCalibration()

    def choose(self, rows: Sequence[PassRow], proposals: Sequence[Proposal]) -> Chosen:
        """How many of its drafts each row keeps, by what each is expected to add: its gain,
        calibrated by what verification accepted where costs are live (with the start-up table
        alone, as drafting estimated it)."""
        if self.live is not None:
            gains = [self.calibration.gains(proposal) for proposal in proposals]
        else:
            gains = [proposal.gains for proposal in proposals]
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
        live = self.live
        counts = choose_drafts(
            gains,
            self.costs,
            base,
            tokens=explore,
            row_work=live.drafting_work if live is not None else 0.0,
            token_work=live.token_work if live is not None else 0.0,
        )
        return Chosen(counts, explore)

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

    def observe_round(
        self, rows: int, drafted_rows: int, seconds: float, drafted_tokens: int | None = None
    ) -> None:
        """A round's own work (`seconds` outside its pass; `drafted_rows` of its `rows`
        verified drafts) teaches live costs."""
        if self.live is not None:
            self.live.observe_round(rows, drafted_rows, seconds, drafted_tokens)

    def pace(self, rows: int, drafted_rows: int, seconds: float) -> tuple[float, float] | None:
        """For requests' paced breakers (LiveCosts.pace): each drafting row's seconds past a
        plain round, and a plain token's seconds; None without live costs that pace."""
        return None if self.live is None else self.live.pace(rows, drafted_rows, seconds)

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
        ratios = [round(ratio, 2) for ratio in self.calibration.ratios]
        log.info("pass_costs", **self._logged, gain_ratios=ratios)
