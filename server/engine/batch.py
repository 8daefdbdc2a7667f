"""Continuous batching: every active generation's round verified in one forward pass.

One iteration (Orca-style, iteration-level scheduling):
1. admit: take new generations and cancellations; a cancelled or finished one leaves at once
   and its cache row goes to the next one;
2. prefill: new prompts at least as many as the running streams (a lone request, a burst)
   start at once, prefilled in their first round's pass (see `_start_together`); otherwise at
   most one chunk of one new prompt (chunked, so a long prompt never stalls the streams
   already running by more than one chunk; larger chunks while none is running);
3. verify: every prefilled generation drafts (its own k, breakers, sampling parameters; an
   open breaker means a draft of length 0), the pass width is chosen for the whole batch (see
   `choose_width`), one forward pass scores all rows, and each row accepts on its own logits.

A Batch is driven by one thread (`run_until_idle`); `add` and `cancel` may be called from any.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from server.engine.calibration import expected_tokens_per_round
from server.engine.generation import Generation
from server.engine.rounds import Round
from server.engine.sampling import LogitRows
from server.engine.target import TargetModel

log = structlog.get_logger("kenspec.batch")

Deliver = Callable[[Round | BaseException], None]


@dataclass(frozen=True, slots=True)
class PassCosts:
    """Measured seconds of a forward pass by (rows, width), for choosing a batch's width.

    Widths and row counts between the measured ones are interpolated linearly; wider passes
    than measured are extrapolated linearly from the widest.
    """

    seconds: dict[tuple[int, int], float]  # (rows, width) -> seconds

    def cost(self, rows: int, width: int) -> float:
        measured_rows = sorted({r for r, _ in self.seconds})
        below = max((r for r in measured_rows if r <= rows), default=measured_rows[0])
        above = min((r for r in measured_rows if r >= rows), default=measured_rows[-1])
        low, high = self._at(below, width), self._at(above, width)
        if above == below:
            return low
        return low + (high - low) * (rows - below) / (above - below)

    def _at(self, rows: int, width: int) -> float:
        widths = sorted(w for r, w in self.seconds if r == rows)
        lower = max((w for w in widths if w <= width), default=widths[0])
        upper = min((w for w in widths if w >= width), default=None)
        if upper is None:
            return self.seconds[rows, lower] * width / lower
        if upper == lower:
            return self.seconds[rows, lower]
        low, high = self.seconds[rows, lower], self.seconds[rows, upper]
        return low + (high - low) * (width - lower) / (upper - lower)

    def pass_width(self, rows: int, width: int, limit: int) -> int:
        """The cheapest measured width >= width (and <= limit): padding can make a pass cheaper."""
        candidates = [w for r, w in self.seconds if r == 1 and width <= w <= limit] or [width]
        return min(candidates, key=lambda w: (self.cost(rows, w), w))


def choose_width(
    proposed: Sequence[int], acceptance: Sequence[float], costs: PassCosts | None
) -> int:
    """The number of tokens per row (1 + drafts) that maximises the batch's expected tokens/s.

    Each row r with a proposal of k_r drafts and per-token acceptance a_r emits
    E(a_r, min(k_r, w - 1)) tokens at width w (Leviathan et al. 2023, eq. 1); the pass costs
    cost(rows, w) for every row. A lone row with good acceptance drafts fully; eight rows
    where two speculate well still pay for eight rows at the wider width, so their drafts are
    cut short, or dropped when plain decoding of all eight is worth more.

    Example (cost 1.0 at width 1, 2.0 at width 7): one row, k=6, a=0.8 -> width 7 (3.6 tokens
    per 2.0 s beats 1 per 1.0 s); eight rows of which one has k=6 -> width 1.
    """
    widest = 1 + max(proposed, default=0)
    if costs is None or widest == 1:
        return widest
    rows = len(proposed)

    def rate(width: int) -> float:
        tokens = sum(
            expected_tokens_per_round(alpha, min(k, width - 1))
            for k, alpha in zip(proposed, acceptance, strict=True)
        )
        return tokens / costs.cost(rows, width)

    return max(range(1, widest + 1), key=lambda width: (rate(width), -width))


@dataclass(slots=True)
class _Entry:
    generation: Generation
    deliver: Deliver
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class BatchSettings:
    max_rows: int = 8  # generations verified together; more wait for a row
    prefill_chunk: int = 64  # prompt tokens prefilled per iteration
    prefill_chunk_alone: int = 512  # tokens of a pass that starts prompts together (or chunk)
    pad_passes: bool = True  # pad a pass to a wider width when measured to be cheaper


@dataclass(slots=True)
class BatchStats:
    iterations: int = 0
    passes: int = 0
    rows_verified: int = 0
    prefill_tokens: int = 0
    by_width: dict[int, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # prefill, plan, forward, accept

    def timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - started
        return now


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
        self.on_pass: Callable[[int, int], None] | None = None  # (rows, width), e.g. metrics
        self.on_iteration_end: Callable[[], None] | None = None  # e.g. flush deliveries
        self._cache = target.new_cache(self.settings.max_rows)
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
        if self._start_together():
            return
        if self._prefilling is None:
            if not self._waiting or len(self._decoding) >= self.settings.max_rows:
                return
            self._prefilling = self._waiting.popleft()
        entry, row = self._prefilling, len(self._decoding)
        generation = entry.generation
        # Chunks keep running streams moving; alone, fewer and larger chunks are faster
        # (a 190-token prompt: 480 ms in 64-token chunks, 390 ms in one pass, measured).
        settings = self.settings
        chunk = settings.prefill_chunk if self._decoding else settings.prefill_chunk_alone
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
        if generation.prefill_remaining == 0:
            self._decoding.append(entry)  # row len(decoding) is exactly where it was filled
            self._prefilling = None

    def _start_together(self) -> bool:
        """New prompts start decoding at once, each prefilled in its first round's pass, when
        the pass stays within `prefill_chunk_alone` tokens (rows x the widest row, padding
        included) and they are at least as many as the rows already decoding (whose rows are
        padded to the prompts' width: worth it for a burst, not for one newcomer among many).

        A burst of new requests then costs one pass instead of a prefill each, and its
        streams start (and tend to finish) together."""
        candidates = [self._prefilling] if self._prefilling is not None else []
        candidates += self._waiting
        decoding = len(self._decoding)
        budget, widest, taken = self.settings.prefill_chunk_alone, 1, 0
        for entry in candidates[: self.settings.max_rows - decoding]:
            width = max(widest, entry.generation.prefill_remaining + 1)
            if (decoding + taken + 1) * width > budget:
                break
            taken, widest = taken + 1, width
        if taken == 0 or taken < decoding:
            return False
        for entry in candidates[:taken]:  # a partly prefilled one first: its row is next
            if entry is self._prefilling:
                self._prefilling = None
            else:
                self._waiting.remove(entry)
            self.stats.prefill_tokens += entry.generation.prefill_remaining
            self._decoding.append(entry)
        return True

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
        planned = [(entry, tokens[id(entry)]) for entry in entries]
        rows = self._cut_to_width(planned)
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
        width = max(len(row) for row in rows)
        logits = self.target.forward(
            self._cache,
            [entry.generation.cache_length for entry in entries],
            rows,
            first_row=first_row,
            min_width=self._pass_width(len(rows), width),
            skips=[entry.generation.prefill_remaining for entry in entries],  # prompt tails
        )
        self._count_pass(len(rows), width)
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
            self._finish_row(entry, error)

    def _cut_to_width(self, planned: list[tuple[_Entry, list[int]]]) -> list[list[int]]:
        proposed = [len(tokens) - 1 - e.generation.prefill_remaining for e, tokens in planned]
        acceptance = [entry.generation.speculator.acceptance_estimate() for entry, _ in planned]
        width = choose_width(proposed, acceptance, self.costs)
        return [entry.generation.truncate_drafts(width - 1) for entry, _ in planned]

    def _pass_width(self, rows: int, width: int) -> int:
        if width == 1 or self.costs is None or not self.settings.pad_passes:
            return width
        room = min(self.target.max_context - e.generation.cache_length for e in self._decoding)
        return self.costs.pass_width(rows, width, limit=max(width, room))

    def _count_pass(self, rows: int, width: int) -> None:
        self.stats.passes += 1
        self.stats.rows_verified += rows
        self.stats.by_width[width] = self.stats.by_width.get(width, 0) + 1
        if self.on_pass is not None:
            self.on_pass(rows, width)

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
