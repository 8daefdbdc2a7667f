"""Intake: how new generations get from the inbox into the batch's decoding rows.

(Which calls may start at all, the slots and their bounded queue, is `server.scheduler`'s
admission control.)

- Any thread `submit`s a generation into a locked inbox; the driving thread moves arrivals to
  the waiting queue at the start of each iteration.
- New prompts whose remaining tokens fit the pass's prompt budget together start decoding at
  once: each is prefilled in its first round's pass (`admit`). The budget is
  `prefill_chunk_alone` when they are at least as many as the running streams (a lone
  request, a burst: one pass beats a wait each), else `prefill_chunk`. A pass is packed, so
  the running rows pay only for the prompt tokens, not for padding to them.
- A longer prompt is prefilled a chunk per iteration first, in a pass of its own, in the row
  after the decoding ones, so running streams never stall by more than a chunk.
- A prompt that begins like a stored one (`PrefixCache`) copies those positions instead of
  computing them; it is matched when it can take a row, so prompts stored since it arrived
  count.
- The n choices of one request share one prefill: every choice but the first `follows` it,
  waits until the first has its whole prompt in its cache row, and copies that row's
  positions (if the first is gone by then, it prefills as any prompt does).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from kenspec.server.engine.events import EngineEvents
from kenspec.server.engine.generation import Generation, Round
from kenspec.server.engine.kv_cache import SlotCache
from kenspec.server.engine.prefix_cache import Prefix, PrefixCache
from kenspec.server.engine.target import TargetModel

log = structlog.get_logger("kenspec.batch")

Deliver = Callable[[Round | BaseException], None]


@dataclass(frozen=True, slots=True)
class BatchSettings:
    max_rows: int = 8  # generations verified together; more wait for a row
    prefill_chunk: int = 64  # prompt tokens per iteration while others decode
    prefill_chunk_alone: int = 512  # ... while none decodes, or for a burst (see module doc)
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
    # prefill, and a round's phases (round.RoundTimes): propose, choose, forward, walk, deliver
    seconds: dict[str, float] = field(default_factory=dict)
    rounds: int = 0

    def timed(self, phase: str, started: float) -> float:
        now = time.perf_counter()
        self.add(phase, now - started)
        return now

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass(slots=True)
class Entry:
    """A generation in the batch, and where its rounds go."""

    generation: Generation
    deliver: Deliver
    cancelled: bool = False
    reuse: Prefix | None = None  # a stored prefix whose first `reused` positions it shares
    reused: int = 0
    leader: Entry | None = None  # the entry whose prompt's keys/values it copies (n > 1)
    leader_row: int | None = None  # ... from this decoding row, once it may

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to compute (once the shared prefix is copied in)."""
        return self.generation.prefill_remaining - self.reused

    def fail(self, error: BaseException) -> None:
        self.deliver(error)


def _fitting(entries: Sequence[Entry], budget: int) -> int:
    """How many of entries, in order, have prompt tokens left that fit in budget together."""
    taken = 0
    for entry in entries:
        budget -= entry.to_prefill
        if budget < 0:
            break
        taken += 1
    return taken


class Intake:
    """The inbox, the waiting queue and the one prompt being prefilled in chunks."""

    def __init__(
        self,
        target: TargetModel,
        cache: SlotCache,
        settings: BatchSettings,
        *,
        prefixes: PrefixCache | None,
        stats: BatchStats,
        events: EngineEvents,
    ) -> None:
        self._target = target
        self._cache = cache
        self._settings = settings
        self._prefixes = prefixes
        self._stats = stats
        self._events = events
        self._lock = threading.Lock()
        self._inbox: list[Entry] = []
        self._by_generation: dict[int, Entry] = {}  # id(generation) -> entry, for cancel()
        self._running = False
        self._waiting: deque[Entry] = deque()
        self.prefilling: Entry | None = None  # in the row after the decoding ones

    # -- any thread ---------------------------------------------------------------------

    def submit(self, entry: Entry, follows: Generation | None = None) -> bool:
        """Queue an entry (sharing the prefill of `follows`, a generation submitted before it
        with the same prompt); True when the batch was idle (its loop must be started)."""
        with self._lock:
            if follows is not None:
                entry.leader = self._by_generation.get(id(follows))
            self._inbox.append(entry)
            self._by_generation[id(entry.generation)] = entry
            start, self._running = not self._running, True
        return start

    def cancel(self, generation: Generation) -> None:
        with self._lock:
            entry = self._by_generation.get(id(generation))
            if entry is not None:
                entry.cancelled = True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- the driving thread -------------------------------------------------------------

    def stop_if_idle(self, decoding: int) -> bool:
        """With nothing decoding, queued or prefilling: mark the loop stopped, return True."""
        with self._lock:
            if self._inbox or decoding or self.prefilling or self._waiting:
                return False
            self._running = False
            return True

    def take_arrivals(self) -> None:
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    def drop_cancelled(self) -> None:
        if self.prefilling is not None and self.prefilling.cancelled:
            self.forget(self.prefilling)
            self.prefilling = None
        for entry in [e for e in self._waiting if e.cancelled]:
            self._waiting.remove(entry)
            self.forget(entry)

    def forget(self, entry: Entry) -> None:
        with self._lock:
            self._by_generation.pop(id(entry.generation), None)

    def fail_all(self, error: BaseException) -> None:
        """Fail every entry not yet decoding (after a fault in the batch's own code)."""
        for entry in [self.prefilling, *self._waiting]:
            if entry is not None:
                self.forget(entry)
                entry.fail(error)
        self.prefilling = None
        self._waiting.clear()

    def admit(self, decoding: list[Entry]) -> None:
        """Start what fits this iteration's pass (appended to `decoding`), else prefill a chunk."""
        if not self._join(decoding):
            self._prefill_chunk(len(decoding))

    def _join(self, decoding: list[Entry]) -> bool:
        """New prompts that fit the budget together join `decoding`, each to be prefilled in
        its first round's pass; False when the next one does not fit."""
        candidates = [self.prefilling] if self.prefilling is not None else []
        candidates += [entry for entry in self._waiting if not self._follows(entry, decoding)]
        candidates = candidates[: self._settings.max_rows - len(decoding)]
        for entry in candidates:
            if entry is self.prefilling:
                continue
            if entry.leader_row is not None:  # the leader's row holds the whole prompt
                entry.reuse, entry.reused = None, entry.generation.prefill_remaining
            elif self._prefixes is not None:
                prompt = entry.generation.prompt[:-1]
                entry.reuse, entry.reused = self._prefixes.match(prompt, entry.generation.tenant)
            else:
                entry.reuse, entry.reused = None, 0
        taken = _fitting(candidates, self._settings.prefill_chunk_alone)
        if taken < len(decoding):
            taken = _fitting(candidates, self._settings.prefill_chunk)
        for entry in candidates[:taken]:  # a partly prefilled one first: its row is next
            if entry is self.prefilling:
                self.prefilling = None
            else:
                self._waiting.remove(entry)
                self._reuse_prefix(entry, len(decoding))
            self._stats.prefill_tokens += entry.generation.prefill_remaining
            decoding.append(entry)
        return taken > 0

    def _prefill_chunk(self, row: int) -> None:
        """Prefill the next chunk of the prompt in `row` (taking the next waiting one if none)."""
        if self.prefilling is None:
            ready = [entry for entry in self._waiting if not self._follows(entry, [])]
            if not ready or row >= self._settings.max_rows:
                return
            self.prefilling = ready[0]
            self._waiting.remove(ready[0])
            self._reuse_prefix(self.prefilling, row)
        entry = self.prefilling
        generation = entry.generation
        # Chunks keep running streams moving; alone, fewer and larger chunks are faster. The
        # prompt's last `budget` tokens are left to its first round's pass (`_join`).
        budget = self._settings.prefill_chunk if row else self._settings.prefill_chunk_alone
        chunk = min(budget, generation.prefill_remaining - budget)
        if chunk <= 0:  # what the copied prefix left joins the next pass
            return
        start, tokens = generation.next_prefill(chunk)
        started = time.perf_counter()
        try:
            self._target.prefill(self._cache, row, start, tokens)
        except Exception as error:
            log.exception("prefill_failed")
            self.prefilling = None
            self.forget(entry)
            entry.fail(error)
            return
        self._stats.timed("prefill", started)
        generation.prefilled(len(tokens))
        self._stats.prefill_tokens += len(tokens)

    def _follows(self, entry: Entry, decoding: Sequence[Entry]) -> bool:
        """Whether `entry` waits for its leader: True until the leader decodes with its whole
        prompt in its row (then `leader_row` says which), False once it does or is gone."""
        leader, entry.leader_row = entry.leader, None
        if leader is None:
            return False
        row = next((i for i, running in enumerate(decoding) if running is leader), None)
        if row is not None and leader.generation.prefill_remaining == 0:
            entry.leader_row = row
            return False
        with self._lock:
            gone = leader.cancelled or id(leader.generation) not in self._by_generation
        if gone:
            entry.leader = None  # finished, failed or cancelled first: prefill as usual
            return False
        return True

    def _reuse_prefix(self, entry: Entry, row: int) -> None:
        """Copy the stored prefix (or the leader's row) the entry's prompt begins with into
        its new cache row."""
        if entry.leader_row is not None:
            self._cache.move(entry.leader_row, row, entry.reused)
            entry.leader, entry.leader_row = None, None
        elif entry.reuse is None or self._prefixes is None:
            return
        else:
            self._prefixes.copy_into(self._cache, row, entry.reuse, entry.reused)
        entry.generation.prefilled(entry.reused)
        self._stats.reused_tokens += entry.reused
        self._events.observe_reuse(entry.reused)
        entry.reuse, entry.reused = None, 0
