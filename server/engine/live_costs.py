"""Pass costs that follow the machine: start-up's table, corrected by the timing of every pass.

Start-up calibration (`calibration.calibrate`) is a first estimate. Taken while another process was
busy, it measured a step 6x too slow and a 7-token pass 2.4 steps instead of 1.1; kept for the
process's life, those numbers set the breaker's threshold to 0.45 and cut almost every draft.
Here every verify pass updates the bucket it falls in:

- Bucket: one of the calibrated (rows, tokens) shapes. A pass of other tokens counts for the
  nearest measured token count of its row count, scaled by the table's own ratio between the
  two; passes with rows the table has no entry for, or with prompt tokens in them, are not used.
- Update: a decayed average in log space of the median of the bucket's last three samples,
  est *= clamp(median / est, 1/DAMP, DAMP) ** decay, decay DECAY when the median is off by more
  than UNSETTLED, else SETTLED_DECAY. One outlier (a page fault, a neighbour's burst) does not
  move the median; a lasting change moves it from the second sample on, and a change of 6x is
  followed within about five passes of that shape; the noise of real passes (10-20%) is
  averaged over about ten.
- Exploration: widths the draft choice avoids are never measured, so a bucket priced too high
  would stay so. Every EXPLORE_EVERY passes, the stalest bucket of the pass's row count is
  asked for if it was not seen for STALE_PASSES passes, or for EXPLORE_EVERY while unsettled
  (since its own last sample was off its estimate by more than UNSETTLED, or any bucket's by
  more than SHIFTED; until its own next sample agrees): the batch verifies only as many drafts
  or, in a one-row pass, pads it to that many tokens (padding is scored, never read). Its price
  is a wider or narrower pass now and then, and it is capped: explorations may add at most
  EXPLORE_BUDGET of the time passes take (each charged its seconds past the cheapest pass of
  its rows). Where wide passes cost several steps (a CPU bound by its multiply-adds) and the
  machine's noise keeps unsettling buckets, uncapped exploration padded one pass in 16 to up
  to 17 tokens at 4-6 steps each: speculation served slower than plain decoding.
- The round's own work: every round's time outside its forward call (drafting, choosing, the
  walk with the rows of logits it reads, learning, delivery; round.RoundTimes) is averaged per
  row, apart for rows that verified drafts and rows that did not (`observe_round`: a batch's
  plain rows are charged the plain average, its drafting rows the rest, less a plain row's work
  for each token past one they emitted: reading a row of logits is a token's work, not
  drafting's; averaged raw, long accepted runs priced drafting at 12 ms a round on a 13 ms
  step). A pass is priced with
  the plain rows' work added (what every round pays besides its pass), and the breaker's
  threshold with each kind's own (drafting rows' once one was seen, the plain rows' before):
  speculation must pay for its drafting too, as measured, not only for its wider pass.
- The breaker's threshold (`costs.lowest_break_even`) is recomputed from the current one-row
  costs, so requests judge acceptance against what a round costs now.

Driven from the engine thread only (the batch's), like the batch itself.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping

from kenspec.server.engine.costs import PassCosts, lowest_break_even, one_row_steps

DECAY = 0.5  # weight of a new sample, in log space, when the median is off by UNSETTLED
SETTLED_DECAY = 0.1  # and when it is nearer: real passes vary by 10-20% (the event loop,
# the allocator), and the threshold rests on ratios of two buckets
DAMP = 4.0  # a sample counts as at most this many times above or below the estimate
RECENT = 3  # samples per bucket the median is taken over
EXPLORE_EVERY = 8  # passes between two explorations, at most
STALE_PASSES = 512  # a bucket not seen for this many passes is measured again
UNSETTLED = 1.25  # a bucket whose last sample was off by more than this is re-measured soon
SHIFTED = 1.6  # a sample off by more than this has every bucket re-measured soon
ROUND_DECAY = 0.05  # weight of a round in the average of rounds' own work (about 20 rounds)
EXPLORE_BUDGET = 0.02  # share of the passes' time explorations may add


class LiveCosts:
    """Costs whose seconds follow the timings of real passes (see the module docstring)."""

    def __init__(
        self,
        seconds: Mapping[tuple[int, int], float],
        *,
        k: int,
        fixed_threshold: float | None = None,
        explore: bool = True,
    ) -> None:
        self.table = PassCosts(dict(seconds))
        self.k = k  # the threshold is judged over one row's widths 1 .. k + 1, as calibrated
        self.passes = 0  # passes observed (explorations included)
        self.explorations = 0
        self._explore = explore
        self._fixed_threshold = fixed_threshold
        self._seen = dict.fromkeys(self.table.seconds, 0)  # bucket -> pass count when last seen
        self._recent: dict[tuple[int, int], deque[float]] = {
            bucket: deque([s] * (RECENT - 1), maxlen=RECENT) for bucket, s in seconds.items()
        }
        self._unsettled: set[tuple[int, int]] = set()
        self._threshold: float | None = None
        # exploration's budget: every observed pass's seconds, what explorations added
        self._pass_seconds = 0.0
        self._explored_seconds = 0.0
        self._exploring = False  # the next observed pass is one explore() asked for
        # a round's own work per row, by whether it verified drafts (observe_round)
        self._round_work: dict[bool, float] = {False: 0.0, True: 0.0}
        self._rounds_seen: dict[bool, int] = {False: 0, True: 0}

    # -- costs.Costs, for the batch's draft choice -----------------------------------------

    def cost(self, rows: int, tokens: int) -> float:
        """A pass's seconds plus the work every round does besides it (plain rounds')."""
        return self.table.cost(rows, tokens) + rows * self._round_work[False]

    def pass_tokens(self, tokens: int, limit: int) -> int:
        return self.table.pass_tokens(tokens, limit)

    # -- learning ------------------------------------------------------------------------

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify pass of `rows` rows and `tokens` tokens in all took `seconds`."""
        self.passes += 1
        exploring, self._exploring = self._exploring, False
        bucket = self._bucket(rows, tokens)
        if bucket is None or not math.isfinite(seconds) or seconds <= 0:
            return
        self._pass_seconds += seconds
        if exploring:  # charged what it took past the cheapest pass of its rows
            self._explored_seconds += max(0.0, seconds - self.table.cost(rows, rows))
        # The sample, moved to the bucket's shape by the table's own ratio between the two.
        sample = seconds * self.table.cost(*bucket) / self.table.cost(rows, tokens)
        recent = self._recent[bucket]
        recent.append(sample)
        estimate = self.table.seconds[bucket]
        ratio = min(max(statistics.median(recent) / estimate, 1 / DAMP), DAMP)
        # A median near the estimate is noise to average out; one far off, a change to follow.
        decay = DECAY if max(ratio, 1 / ratio) > UNSETTLED else SETTLED_DECAY
        self.table.seconds[bucket] = estimate * ratio**decay
        self._seen[bucket] = self.passes
        # A sample that disagrees (an outlier, or the first of a change) is checked again soon;
        # one far off unsettles every bucket: what changed one shape's cost (a neighbour's load
        # coming or going) has likely changed all of them, and the widths the draft choice
        # avoids would otherwise wait STALE_PASSES to be seen.
        off = max(sample / estimate, estimate / sample)
        if off > SHIFTED:
            self._unsettled.update(self.table.seconds)
        elif off > UNSETTLED:
            self._unsettled.add(bucket)
        else:
            self._unsettled.discard(bucket)
        if bucket[0] == 1:
            self._threshold = None  # one row's costs set the breaker's threshold

    def observe_round(
        self, rows: int, drafted_rows: int, seconds: float, drafted_tokens: int | None = None
    ) -> None:
        """A round of `rows` rows, `drafted_rows` of which verified drafts, spent `seconds`
        outside its pass: its plain rows are charged the plain rows' average, its drafting
        rows share the rest. `drafted_tokens`, the tokens the drafting rows emitted: a token
        past one a row costs the walk what a plain row's round does (its row of logits read,
        delivered), so that much is taken off, leaving what drafting itself costs a row."""
        if not 0 <= drafted_rows <= rows or rows <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        drafted = drafted_rows > 0
        plain = self._round_work[False]
        per_row = (
            max(plain, (seconds - (rows - drafted_rows) * plain) / drafted_rows)
            if drafted
            else seconds / rows
        )
        if drafted and drafted_tokens is not None:
            per_row = max(plain, per_row - max(0.0, drafted_tokens / drafted_rows - 1) * plain)
        seen = self._rounds_seen[drafted]
        weight = max(ROUND_DECAY, 1.0 / (seen + 1))  # the first rounds' plain mean, then decayed
        self._round_work[drafted] += weight * (per_row - self._round_work[drafted])
        self._rounds_seen[drafted] = seen + 1
        self._threshold = None

    @property
    def drafting_work(self) -> float:
        """Seconds a drafting row's round takes past a plain row's (0 before both were seen)."""
        if not (self._rounds_seen[True] and self._rounds_seen[False]):
            return 0.0
        return max(0.0, self._round_work[True] - self._round_work[False])

    @property
    def token_work(self) -> float:
        """Seconds of a round's own work a token costs: a plain row's (its row of logits read,
        the token delivered)."""
        return self._round_work[False]

    @property
    def paces(self) -> bool:
        """Whether requests' breakers judge their rounds by time (`pace`): unless the operator
        fixed an acceptance threshold."""
        return self._fixed_threshold is None

    def pace(self, rows: int, drafted_rows: int, seconds: float) -> tuple[float, float] | None:
        """A round of `rows` rows, `drafted_rows` of which verified drafts, that took `seconds`
        in all (its pass and its own work): the seconds each drafting row added past a plain
        round of as many rows, and what a token costs in such a plain round (its seconds a
        row). None when rounds are not judged by time (`paces`) or this one cannot be: no
        drafting row, or not a finite time."""
        if not self.paces or not 0 < drafted_rows <= rows or not math.isfinite(seconds):
            return None
        plain = self.cost(rows, rows)
        return (seconds - plain) / drafted_rows, plain / rows

    @property
    def round_work(self) -> dict[str, float]:
        """A round's own work per row, seconds: plain rounds' and drafting rounds'."""
        return {"plain": self._round_work[False], "draft": self._round_work[True]}

    def explore(self, rows: int, most_tokens: int | None = None) -> int | None:
        """Tokens this pass of `rows` rows should have, to measure a stale bucket; None: as
        the draft choice decides. Asked once per pass, before the drafts are cut; most_tokens:
        the widest the pass can be without padding (None: it can be padded)."""
        if (
            not self._explore
            or self.passes % EXPLORE_EVERY
            or rows not in self.table.tokens_by_rows
            or self._explored_seconds > EXPLORE_BUDGET * self._pass_seconds
        ):
            return None
        age = {
            (rows, tokens): self.passes - self._seen[rows, tokens]
            for tokens in self.table.tokens_by_rows[rows]
            if most_tokens is None or tokens <= most_tokens
        }
        due = [
            bucket
            for bucket, passes in age.items()
            if passes >= STALE_PASSES or (bucket in self._unsettled and passes >= EXPLORE_EVERY)
        ]
        if not due:
            return None
        self.explorations += 1
        self._exploring = True
        return max(due, key=lambda bucket: (age[bucket], -bucket[1]))[1]

    def threshold(self) -> float:
        """The breaker's threshold: fixed if the operator set one, else the lowest break-even
        acceptance over one row's draft lengths at today's costs."""
        if self._fixed_threshold is not None:
            return self._fixed_threshold
        if self._threshold is None:
            plain = self._round_work[False]
            drafting = self._round_work[True] if self._rounds_seen[True] else plain
            self._threshold = lowest_break_even(
                {
                    t: s + (drafting if t > 1 else plain)
                    for (r, t), s in self.table.seconds.items()
                    if r == 1 and t <= self.k + 1
                }
            )
        return self._threshold

    def moved(self, before: Mapping[str, object]) -> bool:
        """Whether the threshold moved by 0.02 or a one-row width's cost in steps by 10% since
        `before` (an earlier summary): what the `pass_costs` log line reports."""
        now = self.summary()
        if abs(now["threshold"] - before["threshold"]) >= 0.02:  # type: ignore[operator]
            return True
        old_steps: Mapping[int, float] = before["steps"]  # type: ignore[assignment]
        new_steps: Mapping[int, float] = now["steps"]  # type: ignore[assignment]
        return any(abs(new_steps[t] / old_steps[t] - 1) >= 0.1 for t in old_steps if t in new_steps)

    def summary(self) -> dict[str, object]:
        """For the log: one step's cost, every one-row width in steps, the threshold."""
        step = self.table.seconds.get((1, 1))
        return {
            "passes": self.passes,
            "explorations": self.explorations,
            "explored_share": round(self._explored_seconds / max(self._pass_seconds, 1e-9), 4),
            "step_ms": round(step * 1000, 2) if step else None,
            "steps": one_row_steps(self.table.seconds),
            "round_work_ms": {k: round(v * 1000, 3) for k, v in self.round_work.items()},
            "threshold": round(self.threshold(), 3),
        }

    def _bucket(self, rows: int, tokens: int) -> tuple[int, int] | None:
        counts = self.table.tokens_by_rows.get(rows)
        if not counts:
            return None
        return rows, min(counts, key=lambda t: (abs(t - tokens), t))
