"""Continuous batching: every decoding generation's round verified in one forward pass.

One iteration (Orca-style, iteration-level scheduling):
1. admit: arrivals join the waiting queue, cancelled generations leave (a decoding one's cache
   row goes to the next), and new prompts start decoding or are prefilled a chunk
   (`Intake`);
2. plan: every decoding generation drafts (its own k, breakers, sampling parameters; an open
   breaker means no drafts), and the drafts worth their cost are chosen for the whole pass
   (`costs.choose_drafts`);
3. verify: one packed forward pass scores all rows, each with its own number of tokens
   (`SlotCache`), and each row accepts on its own logits; finished rows are freed.

A Batch is driven by one thread (`run_until_idle`, or `rounds` for a caller that drives one
generation itself); `add` and `cancel` may be called from any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import structlog

from server.engine.costs import Costs, choose_drafts
from server.engine.events import NO_EVENTS, EngineEvents
from server.engine.generation import Generation, Round
from server.engine.intake import BatchSettings, BatchStats, Deliver, Entry, Intake
from server.engine.live_costs import LiveCosts
from server.engine.prefix_cache import PrefixCache
from server.engine.sampling import LogitRows
from server.engine.target import TargetModel

log = structlog.get_logger("kenspec.batch")


class Batch:
    """Rows 0..d-1 of the cache hold decoding generations; row d the one being prefilled."""

    def __init__(
        self,
        target: TargetModel,
        settings: BatchSettings | None = None,
        *,
        costs: Costs | None = None,
        events: EngineEvents = NO_EVENTS,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings or BatchSettings()
        self.target = target
        self.costs = costs
        self._live = costs if isinstance(costs, LiveCosts) else None
        self._timer = timer  # times the passes live costs learn from
        self._explore: int | None = None  # this pass's tokens, when live costs asked for them
        self._logged_costs: dict[str, object] = {}
        self.stats = BatchStats()
        self._events = events
        self._cache = target.new_cache(self.settings.max_rows)
        budget = self.settings.prefix_cache_bytes
        self.prefixes = PrefixCache(budget) if budget > 0 else None
        self._admission = Intake(
            target,
            self._cache,
            self.settings,
            prefixes=self.prefixes,
            stats=self.stats,
            events=events,
        )
        self._decoding: list[Entry] = []  # _decoding[i] is in cache row i

    # -- any thread ---------------------------------------------------------------------

    def add(self, generation: Generation, deliver: Deliver) -> bool:
        """Queue a generation; deliver gets each Round (on the driving thread) or an error.

        True when the batch was idle: the caller must then start `run_until_idle` on its
        engine thread.
        """
        return self._admission.submit(Entry(generation, deliver))

    def cancel(self, generation: Generation) -> None:
        """Drop a generation at the next iteration (a pass in flight is not interrupted)."""
        self._admission.cancel(generation)

    @property
    def active(self) -> int:
        return len(self._decoding) + (self._admission.prefilling is not None)

    @property
    def waiting(self) -> int:
        return self._admission.waiting

    # -- the driving thread -------------------------------------------------------------

    def run_until_idle(self, on_iteration_end: Callable[[], None] | None = None) -> None:
        """Iterate while any generation is queued or decoding; on_iteration_end after each
        iteration (e.g. to hand its rounds to the event loop in one wake-up)."""
        while self._step():
            if on_iteration_end is not None:
                on_iteration_end()
        log.debug("batch_idle", **self._summary())

    def rounds(self, generation: Generation) -> Iterator[Round]:
        """Run `generation` to its end on this thread, yielding its rounds as they come (a
        solo request is a batch of one). The batch must not be driven by another thread."""
        delivered: list[Round | BaseException] = []
        if not self.add(generation, delivered.append):
            self.cancel(generation)
            raise RuntimeError("the batch is already driven by another thread")
        try:
            while True:
                if not delivered and not self._step():
                    raise RuntimeError("the batch went idle before the generation finished")
                while delivered:
                    item = delivered.pop(0)
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finish_reason is not None:
                        return
        finally:
            if not generation.finished:
                self.cancel(generation)
            self.run_until_idle()

    def _step(self) -> bool:
        """One iteration; False (the batch idle again) when there was nothing to do."""
        if self._admission.stop_if_idle(len(self._decoding)):
            return False
        try:
            self.iterate()
        except Exception as error:  # a bug, not a request's fault: fail everyone, go on
            log.exception("batch_iteration_failed")
            for entry in self._decoding:
                self._admission.forget(entry)
                entry.fail(error)
            self._decoding = []
            self._admission.fail_all(error)
        return True

    def iterate(self) -> None:
        self.stats.iterations += 1
        self._admission.take_arrivals()
        for index in reversed(range(len(self._decoding))):
            if self._decoding[index].cancelled:
                self._remove(index)
        self._admission.drop_cancelled()
        self._admission.admit(self._decoding)
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

    def _verify(self) -> None:
        started = time.perf_counter()
        for entry in list(self._decoding):
            try:
                entry.generation.plan()
            except Exception as error:
                log.exception("plan_failed")
                self._finish_row(entry, error)  # rows move: the pass is laid out after this
        if not self._decoding:
            return
        entries = list(self._decoding)  # entries[i] is in cache row i
        rows = self._cut_drafts(entries)
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

    def _verify_alone(self, entries: list[Entry], rows: list[list[int]]) -> None:
        self._explore = None
        done: list[tuple[Entry, LogitRows | Exception]] = []
        for index, (entry, row) in enumerate(zip(entries, rows, strict=True)):
            try:
                done.append((entry, self._forward(index, [entry], [row])[0]))
            except Exception as error:
                log.exception("verify_row_failed")
                done.append((entry, error))
        self._complete(done)

    def _forward(self, first_row: int, entries: list[Entry], rows: list[list[int]]) -> list:
        generations = [entry.generation for entry in entries]
        skips = [generation.prefill_remaining for generation in generations]  # prompt tails
        pass_tokens = max(sum(len(row) for row in rows), self._pass_tokens(generations, rows))
        # Only passes of drafts and pending tokens: prompt chunks are not the shapes priced.
        timed = self._live is not None and first_row == 0 and not any(skips)
        if timed:
            self.target.synchronize()  # CUDA: work queued before (cache moves) is not the pass's
        started = self._timer()
        logits = self.target.forward(
            self._cache,
            [generation.cache_length for generation in generations],
            rows,
            first_row=first_row,
            min_tokens=pass_tokens,
            skips=skips,
            parents=[generation.feed_parents() for generation in generations],  # token trees
        )
        if timed:
            assert self._live is not None
            self.target.synchronize()  # CUDA: the pass, not its launch
            self._live.observe(len(rows), pass_tokens, self._timer() - started)
            self._log_costs()
        self._count_pass(rows)
        return logits

    def _log_costs(self) -> None:
        """Log the live costs (every 64 passes at most) when they moved since the last line."""
        assert self._live is not None
        if self._live.passes % 64 or (
            self._logged_costs and not self._live.moved(self._logged_costs)
        ):
            return
        self._logged_costs = self._live.summary()
        log.info("pass_costs", **self._logged_costs)

    def _complete(self, results: list[tuple[Entry, LogitRows | Exception]]) -> None:
        """Accept each row on its logits (or fail it), deliver, then free finished rows."""
        finished: list[tuple[Entry, Exception | None]] = []
        for entry, logits in results:
            if isinstance(logits, Exception):
                finished.append((entry, logits))
                continue
            try:
                round_ = entry.generation.complete(logits)
                if entry.generation.kv_moves:  # a tree's accepted path, made contiguous
                    self._cache.relocate(self._decoding.index(entry), entry.generation.kv_moves)
            except Exception as error:
                log.exception("complete_failed")
                finished.append((entry, error))
                continue
            entry.deliver(round_)
            if round_.finish_reason is not None:
                finished.append((entry, None))
        for entry, error in finished:
            if error is None and self.prefixes is not None:
                # A conversation's next turn re-sends this prompt and answer.
                row = self._decoding.index(entry)
                generation = entry.generation
                self.prefixes.store(self._cache, row, generation.cached_tokens, generation.tenant)
            self._finish_row(entry, error)

    def _store_prompts(self, entries: list[Entry]) -> None:
        """Keep the prompts whose last tokens were in this pass (all but their pending token);
        called after the pass, before its rows are accepted (so their prompt tails still count
        as remaining)."""
        if self.prefixes is None:
            return
        for row, entry in enumerate(entries):
            if entry.generation.prefill_remaining:
                generation = entry.generation
                self.prefixes.store(self._cache, row, generation.prompt[:-1], generation.tenant)

    def _cut_drafts(self, entries: list[Entry]) -> list[list[int]]:
        """Each row's feed, its drafts cut to those worth their share of the pass (or, when
        live costs ask to measure a stale shape, to that many tokens)."""
        generations = [entry.generation for entry in entries]
        skips = [generation.prefill_remaining for generation in generations]
        gains = [generation.draft_gains() for generation in generations]
        block = self.target.tree_key_block
        if block:  # batch invariance: keys summed in order (attention.invariant_attention)
            gains = [
                g[: n.drafts_in_blocks(block)] for g, n in zip(gains, generations, strict=True)
            ]
        base = len(entries) + sum(skips)
        self._explore = None
        if self._live is not None and not any(skips):
            # A stale shape is reached by verifying fewer drafts, or, in a one-row pass where
            # padding is on, by padding (padding several rows' pass would lay it out wider).
            can_pad = len(entries) == 1 and self.settings.pad_passes
            most = None if can_pad else base + sum(len(g) for g in gains)
            self._explore = self._live.explore(len(entries), most_tokens=most)
        counts = choose_drafts(gains, self.costs, base, tokens=self._explore)
        return [
            generation.truncate_drafts(count)
            for generation, count in zip(generations, counts, strict=True)
        ]

    def _pass_tokens(self, generations: list[Generation], rows: list[list[int]]) -> int:
        """The tokens to pad the pass to (0: none): a stale shape live costs asked for, or a
        one-row pass's width measured cheaper. The padding goes after the last row."""
        room = self.target.max_context - generations[-1].cache_length - len(rows[-1])
        tokens = sum(len(row) for row in rows)
        if self._explore is not None and len(rows) == 1:
            return min(self._explore, tokens + room)
        if len(rows) > 1 or tokens == 1 or self.costs is None or not self.settings.pad_passes:
            return 0
        return self.costs.pass_tokens(tokens, limit=tokens + room)

    def _count_pass(self, rows: list[list[int]]) -> None:
        stats, width = self.stats, max(len(row) for row in rows)
        stats.passes += 1
        stats.rows_verified += len(rows)
        stats.by_width[width] = stats.by_width.get(width, 0) + 1
        self._events.observe_pass(len(rows), sum(len(row) for row in rows))

    def _finish_row(self, entry: Entry, error: BaseException | None) -> None:
        """Take a decoding generation out of the batch (delivering error, if any)."""
        self._remove(self._decoding.index(entry))
        if error is not None:
            entry.fail(error)

    def _remove(self, index: int) -> None:
        """Free decoding row `index`: the last decoding row moves in, the prefilling one follows."""
        last = len(self._decoding) - 1
        moved = self._decoding[last]
        self._cache.move(last, index, moved.generation.cache_length)
        self._admission.forget(self._decoding[index])
        self._decoding[index] = moved
        self._decoding.pop()
        prefilling = self._admission.prefilling
        if prefilling is not None:
            self._cache.move(last + 1, last, prefilling.generation.cache_length)
