"""Continuous batching: every active generation's round verified in one forward pass.

One iteration (Orca-style, iteration-level scheduling):
1. admit: take new generations and cancellations; a cancelled or finished one leaves at once
   and its cache row goes to the next one;
2. join: new prompts whose tokens fit the pass's prompt budget start decoding at once, each
   prefilled in its first round's pass (see `_join`); a longer one is prefilled a chunk per
   iteration first, in a pass of its own, so it never stalls running streams by more than a
   chunk (larger chunks while none is running);
3. verify: every prefilled generation drafts (its own k, breakers, sampling parameters; an
   open breaker means a draft of length 0), the drafts worth their cost are chosen for the
   whole pass (see `choose_drafts`), one packed forward pass scores all rows, each with its
   own number of tokens (see SlotCache), and each row accepts on its own logits.

A Batch is driven by one thread (`run_until_idle`); `add` and `cancel` may be called from any.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from server.engine.generation import Generation, Round
from server.engine.prefix_cache import Prefix, PrefixCache
from server.engine.sampling import LogitRows
from server.engine.target import TargetModel

log = structlog.get_logger("kenspec.batch")

Deliver = Callable[[Round | BaseException], None]


@dataclass(frozen=True, slots=True)
class PassCosts:
    """Measured seconds of a packed forward pass by (rows, tokens), to choose drafts by.

    Token counts and row counts between the measured ones are interpolated linearly; passes
    of more tokens than measured are extrapolated in proportion to the most measured.
    """

    seconds: dict[tuple[int, int], float]  # (rows, tokens in the pass) -> seconds

    def cost(self, rows: int, tokens: int) -> float:
        measured_rows = sorted({r for r, _ in self.seconds})
        below = max((r for r in measured_rows if r <= rows), default=measured_rows[0])
        above = min((r for r in measured_rows if r >= rows), default=measured_rows[-1])
        low, high = self._at(below, tokens), self._at(above, tokens)
        if above == below:
            return low
        return low + (high - low) * (rows - below) / (above - below)

    def _at(self, rows: int, tokens: int) -> float:
        counts = sorted(t for r, t in self.seconds if r == rows)
        lower = max((t for t in counts if t <= tokens), default=counts[0])
        upper = min((t for t in counts if t >= tokens), default=None)
        if upper is None:
            return self.seconds[rows, lower] * tokens / lower
        if upper == lower:
            return self.seconds[rows, lower]
        low, high = self.seconds[rows, lower], self.seconds[rows, upper]
        return low + (high - low) * (tokens - lower) / (upper - lower)

    def pass_tokens(self, tokens: int, limit: int) -> int:
        """For a one-row pass, the cheapest measured token count >= tokens (and <= limit):
        padding can make a pass cheaper (small GEMMs are not monotonic in M on every CPU)."""
        candidates = [t for r, t in self.seconds if r == 1 and tokens <= t <= limit] or [tokens]
        return min(candidates, key=lambda t: (self._at(1, t), t))


def choose_drafts(
    proposed: Sequence[int],
    acceptance: Sequence[float],
    costs: PassCosts | None,
    base_tokens: int | None = None,
) -> list[int]:
    """How many of its proposed drafts each row verifies, to maximise the pass's expected
    tokens per second.

    A packed pass costs cost(rows, tokens), every row paying only for its own tokens. Row r's
    j-th draft adds a_r^j expected tokens (E(a, j) - E(a, j - 1), Leviathan et al. 2023,
    eq. 1), so for any token budget the best drafts are the budget's highest gains over all
    rows; the budget chosen is the one with the best (rows + gains) / cost. base_tokens: the
    pass's tokens without drafts (one per row, plus prompt tails prefilled in it).

    Example (cost 1.0 for 1 token, 2.0 for 7): one row, k=6, a=0.8 -> 6 drafts (3.6 tokens
    per 2.0 s beats 1 per 1.0 s); eight rows where only one speculates well -> that row's
    drafts, the others' none.
    """
    rows = len(proposed)
    if costs is None or not any(proposed):
        return list(proposed)
    base = rows if base_tokens is None else base_tokens
    # Gains in order, a row's j-th draft before its (j + 1)-th (equal gains when a = 1).
    pairs = enumerate(zip(proposed, acceptance, strict=True))
    gains = sorted(
        ((alpha**j, -j, row) for row, (k, alpha) in pairs for j in range(1, k + 1)), reverse=True
    )
    best, best_rate, expected = 0, rows / costs.cost(rows, base), float(rows)
    for taken, (gain, _, _) in enumerate(gains, start=1):
        expected += gain
        rate = expected / costs.cost(rows, base + taken)
        if rate > best_rate:
            best, best_rate = taken, rate
    counts = [0] * rows
    for _, _, row in gains[:best]:
        counts[row] += 1
    return counts


@dataclass(slots=True)
class _Entry:
    generation: Generation
    deliver: Deliver
    cancelled: bool = False
    reuse: Prefix | None = None  # a stored prompt whose first `reused` positions it shares
    reused: int = 0

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to compute (once the shared prefix is copied in)."""
        return self.generation.prefill_remaining - self.reused


@dataclass(frozen=True, slots=True)
class BatchSettings:
    max_rows: int = 8  # generations verified together; more wait for a row
    prefill_chunk: int = 64  # prompt tokens per iteration while others decode
    prefill_chunk_alone: int = 512  # ... while none decodes, or for a burst (see _join)
    pad_passes: bool = True  # pad a one-row pass to more tokens when measured to be cheaper
    prefix_cache_bytes: int = 128 << 20  # keys/values of recent prompts kept for reuse (0: none)


@dataclass(slots=True)
class BatchStats:
    iterations: int = 0
    passes: int = 0
    rows_verified: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0  # prompt positions copied from the prefix cache, not computed
    by_width: dict[int, int] = field(default_factory=dict)  # passes by their longest row
    seconds: dict[str, float] = field(default_factory=dict)  # prefill, plan, forward, accept

    def timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - started
        return now


def _fitting(entries: Sequence[_Entry], budget: int) -> int:
    """How many of entries, in order, have prompt tokens left that fit in budget together."""
    taken = 0
    for entry in entries:
        budget -= entry.to_prefill
        if budget < 0:
            break
        taken += 1
    return taken


class Batch:
    """Rows 0..d-1 of the cache hold decoding generations; row d the one being prefilled."""

    def __init__(
        self,
        target: TargetModel,
        settings: BatchSettings | None = None,
        *,
        costs: PassCosts | None = None,
    ) -> None:
        self.settings = settings or BatchSettings()
        self.target = target
        self.costs = costs
        self.stats = BatchStats()
        self.on_pass: Callable[[int, int], None] | None = None  # (rows, tokens), e.g. metrics
        self.on_iteration_end: Callable[[], None] | None = None  # e.g. flush deliveries
        self.on_reuse: Callable[[int], None] | None = None  # prompt tokens copied, e.g. metrics
        self._cache = target.new_cache(self.settings.max_rows)
        budget = self.settings.prefix_cache_bytes
        self.prefixes = PrefixCache(budget) if budget > 0 else None
        self._decoding: list[_Entry] = []
        self._prefilling: _Entry | None = None
        self._waiting: deque[_Entry] = deque()
        self._lock = threading.Lock()
        self._inbox: list[_Entry] = []
        self._entries: dict[int, _Entry] = {}  # id(generation) -> entry, for cancel()
        self._running = False

    # -- any thread ---------------------------------------------------------------------

    def add(self, generation: Generation, deliver: Deliver) -> bool:
        """Queue a generation; deliver gets each Round (on the driving thread) or an error.

        True when the batch was idle: the caller must then start `run_until_idle` on its
        engine thread.
        """
        entry = _Entry(generation, deliver)
        with self._lock:
            self._inbox.append(entry)
            self._entries[id(generation)] = entry
            start, self._running = not self._running, True
        return start

    def cancel(self, generation: Generation) -> None:
        """Drop a generation at the next iteration (a pass in flight is not interrupted)."""
        with self._lock:
            entry = self._entries.get(id(generation))
            if entry is not None:
                entry.cancelled = True

    @property
    def active(self) -> int:
        return len(self._decoding) + (self._prefilling is not None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the driving thread -------------------------------------------------------------

    def run_until_idle(self) -> None:
        while True:
            with self._lock:
                if not (self._inbox or self._decoding or self._prefilling or self._waiting):
                    self._running = False
                    log.debug("batch_idle", **self._summary())
                    return
            try:
                self.iterate()
            except Exception as error:  # a bug, not a request's fault: fail everyone, go on
                log.exception("batch_iteration_failed")
                for entry in [*self._decoding, self._prefilling, *self._waiting]:
                    if entry is not None:
                        self._finish(entry, error)
                self._decoding, self._prefilling = [], None
                self._waiting.clear()
            finally:
                if self.on_iteration_end is not None:
                    self.on_iteration_end()

    def iterate(self) -> None:
        self.stats.iterations += 1
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        self._drop_cancelled()
        self._prefill_chunk()
        if self._decoding:
            self._verify()

    def _summary(self) -> dict[str, object]:
        stats = self.stats
        return {
            "iterations": stats.iterations,
            "passes": stats.passes,
            "rows_per_pass": round(stats.rows_verified / max(1, stats.passes), 2),
            "widths": dict(sorted(stats.by_width.items())),
            "prefill_tokens": stats.prefill_tokens,
            "reused_tokens": stats.reused_tokens,
            "seconds": {phase: round(s, 2) for phase, s in stats.seconds.items()},
        }

    def _drop_cancelled(self) -> None:
        for index in reversed(range(len(self._decoding))):
            if self._decoding[index].cancelled:
                self._remove(index)
        if self._prefilling is not None and self._prefilling.cancelled:
            self._forget(self._prefilling)
            self._prefilling = None
        for entry in [e for e in self._waiting if e.cancelled]:
            self._waiting.remove(entry)
            self._forget(entry)

    def _prefill_chunk(self) -> None:
        if self._join():
            return
        if self._prefilling is None:
            if not self._waiting or len(self._decoding) >= self.settings.max_rows:
                return
            self._prefilling = self._waiting.popleft()
            self._reuse_prefix(self._prefilling, len(self._decoding))
        entry, row = self._prefilling, len(self._decoding)
        generation = entry.generation
        # Chunks keep running streams moving; alone, fewer and larger chunks are faster
        # (a 190-token prompt: 480 ms in 64-token chunks, 390 ms in one pass, measured).
        # The prompt's last `budget` tokens are left to its first round's pass (`_join`).
        budget = self._prompt_budget()
        chunk = min(budget, generation.prefill_remaining - budget)
        if chunk <= 0:  # what the copied prefix left joins the next pass
            return
        start, tokens = generation.next_prefill(chunk)
        started = time.perf_counter()
        try:
            self.target.prefill(self._cache, row, start, tokens)
        except Exception as error:
            log.exception("prefill_failed")
            self._prefilling = None
            self._finish(entry, error)
            return
        self.stats.timed("prefill", started)
        generation.prefilled(len(tokens))
        self.stats.prefill_tokens += len(tokens)

    def _prompt_budget(self) -> int:
        settings = self.settings
        return settings.prefill_chunk if self._decoding else settings.prefill_chunk_alone

    def _join(self) -> bool:
        """New prompts start decoding at once, each prefilled in its first round's pass, as
        many as fit the prompt budget together: `prefill_chunk_alone` tokens when they are at
        least as many as the running streams (a lone request, a burst: better one pass than a
        wait each), else `prefill_chunk`. A pass is packed, so the running rows pay only for
        the prompt tokens, not for padding to them. False when the next prompt does not fit
        (it is then prefilled in chunks)."""
        candidates = [self._prefilling] if self._prefilling is not None else []
        candidates += self._waiting
        candidates = candidates[: self.settings.max_rows - len(self._decoding)]
        if self.prefixes is not None:  # matched now: prompts stored since they arrived count
            for entry in candidates:
                if entry is not self._prefilling:
                    entry.reuse, entry.reused = self.prefixes.match(entry.generation.prompt[:-1])
        taken = _fitting(candidates, self.settings.prefill_chunk_alone)
        if taken < len(self._decoding):
            taken = _fitting(candidates, self.settings.prefill_chunk)
        for entry in candidates[:taken]:  # a partly prefilled one first: its row is next
            if entry is self._prefilling:
                self._prefilling = None
            else:
                self._waiting.remove(entry)
                self._reuse_prefix(entry, len(self._decoding))
            self.stats.prefill_tokens += entry.generation.prefill_remaining
            self._decoding.append(entry)
        return taken > 0

    def _reuse_prefix(self, entry: _Entry, row: int) -> None:
        """Copy the stored prefix the entry's prompt begins with into its new cache row."""
        if entry.reuse is None:
            return
        length = entry.reused
        keys = [tensor[:, :length] for tensor in entry.reuse.keys]
        values = [tensor[:, :length] for tensor in entry.reuse.values]
        self._cache.write(row, keys, values)
        entry.generation.prefilled(length)
        self.stats.reused_tokens += length
        if self.on_reuse is not None:
            self.on_reuse(length)
        entry.reuse, entry.reused = None, 0

    def _store_prompts(self, entries: list[_Entry]) -> None:
        """Keep the prompts whose last tokens were in this pass (all but their pending token);
        called after the pass, before its rows are accepted (so their prompt tails still count
        as remaining)."""
        if self.prefixes is None:
            return
        for row, entry in enumerate(entries):
            if entry.generation.prefill_remaining:
                self.prefixes.store(self._cache, row, entry.generation.prompt[:-1])

    def _verify(self) -> None:
        started = time.perf_counter()
        tokens: dict[int, list[int]] = {}
        failed: list[tuple[_Entry, Exception]] = []
        for entry in self._decoding:
            try:
                tokens[id(entry)] = entry.generation.plan()
            except Exception as error:
                log.exception("plan_failed")
                failed.append((entry, error))
        for entry, error in failed:
            self._finish_row(entry, error)  # rows move: the pass is laid out after this
        if not self._decoding:
            return
        entries = list(self._decoding)  # entries[i] is in cache row i
        rows = self._cut_drafts(entries, [tokens[id(entry)] for entry in entries])
        started = self.stats.timed("plan", started)
        try:
            logits = self._forward(0, entries, rows)
        except Exception as error:
            if len(entries) == 1:
                log.exception("verify_pass_failed", rows=1)
                self._finish_row(entries[0], error)
                return
            # Which row broke the pass (a kernel fault, out of memory)? Rerun each alone, so
            # a failure fails only its own request. A failed pass commits nothing: it wrote
            # only past each row's valid length.
            log.exception("verify_pass_failed", rows=len(rows))
            self._verify_alone(entries, rows)
            return
        self._store_prompts(entries)
        started = self.stats.timed("forward", started)
        self._complete(list(zip(entries, logits, strict=True)))
        self.stats.timed("accept", started)

    def _verify_alone(self, entries: list[_Entry], rows: list[list[int]]) -> None:
        done = []
        for index, (entry, row) in enumerate(zip(entries, rows, strict=True)):
            try:
                done.append((entry, self._forward(index, [entry], [row])[0]))
            except Exception as error:
                log.exception("verify_row_failed")
                done.append((entry, error))
        self._complete(done)

    def _forward(self, first_row: int, entries: list[_Entry], rows: list[list[int]]) -> list:
        logits = self.target.forward(
            self._cache,
            [entry.generation.cache_length for entry in entries],
            rows,
            first_row=first_row,
            min_tokens=self._pass_tokens(entries, rows),
            skips=[entry.generation.prefill_remaining for entry in entries],  # prompt tails
        )
        self._count_pass(rows)
        return logits

    def _complete(self, results: list[tuple[_Entry, LogitRows | Exception]]) -> None:
        """Accept each row on its logits (or fail it), deliver, then free finished rows."""
        finished: list[tuple[_Entry, Exception | None]] = []
        for entry, logits in results:
            if isinstance(logits, Exception):
                finished.append((entry, logits))
                continue
            try:
                round_ = entry.generation.complete(logits)
            except Exception as error:
                log.exception("complete_failed")
                finished.append((entry, error))
                continue
            entry.deliver(round_)
            if round_.finish_reason is not None:
                finished.append((entry, None))
        for entry, error in finished:
            if error is None:
                self._store_sequence(entry)
            self._finish_row(entry, error)

    def _store_sequence(self, entry: _Entry) -> None:
        """Keep a finished stream's prompt and answer: a conversation's next turn re-sends them."""
        if self.prefixes is None:
            return
        generation = entry.generation
        tokens = (generation.prompt + generation.output_ids)[: generation.cache_length]
        self.prefixes.store(self._cache, self._decoding.index(entry), tokens)

    def _cut_drafts(self, entries: list[_Entry], planned: list[list[int]]) -> list[list[int]]:
        skips = [entry.generation.prefill_remaining for entry in entries]
        proposed = [len(tokens) - 1 - skip for tokens, skip in zip(planned, skips, strict=True)]
        acceptance = [entry.generation.speculator.acceptance_estimate() for entry in entries]
        counts = choose_drafts(proposed, acceptance, self.costs, len(entries) + sum(skips))
        return [
            entry.generation.truncate_drafts(count)
            for entry, count in zip(entries, counts, strict=True)
        ]

    def _pass_tokens(self, entries: list[_Entry], rows: list[list[int]]) -> int:
        """Pad a one-row pass to more tokens where that was measured cheaper (0: no padding)."""
        settings = self.settings
        if len(rows) > 1 or len(rows[0]) == 1 or self.costs is None or not settings.pad_passes:
            return 0
        room = self.target.max_context - entries[0].generation.cache_length
        return self.costs.pass_tokens(len(rows[0]), limit=max(len(rows[0]), room))

    def _count_pass(self, rows: list[list[int]]) -> None:
        stats, width = self.stats, max(len(row) for row in rows)
        stats.passes += 1
        stats.rows_verified += len(rows)
        stats.by_width[width] = stats.by_width.get(width, 0) + 1
        if self.on_pass is not None:
            self.on_pass(len(rows), sum(len(row) for row in rows))

    def _finish_row(self, entry: _Entry, error: BaseException | None) -> None:
        """Take a decoding generation out of the batch (delivering error, if any)."""
        self._remove(self._decoding.index(entry))
        if error is not None:
            entry.deliver(error)

    def _finish(self, entry: _Entry, error: BaseException) -> None:
        self._forget(entry)
        entry.deliver(error)

    def _remove(self, index: int) -> None:
        """Free decoding row `index`: the last decoding row moves in, the prefilling one follows."""
        last = len(self._decoding) - 1
        moved = self._decoding[last]
        self._cache.move(last, index, moved.generation.cache_length)
        self._forget(self._decoding[index])
        self._decoding[index] = moved
        self._decoding.pop()
        if self._prefilling is not None:
            self._cache.move(last + 1, last, self._prefilling.generation.cache_length)

    def _forget(self, entry: _Entry) -> None:
        with self._lock:
            self._entries.pop(id(entry.generation), None)
