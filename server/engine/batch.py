"""Continuous batching: every decoding generation's round verified in one forward pass.

One iteration (Orca-style, iteration-level scheduling):
1. admit: arrivals join the waiting queue, cancelled generations leave (a decoding one's cache
   row goes to the next), and new prompts start decoding or are prefilled a chunk
   (`Intake`);
2. round: every decoding row drafts, verifies in one packed pass and accepts on its own
   logits (`engine.round`, read top to bottom).

The batch keeps the rows' bookkeeping for the round: entries[i] is in cache row i, a row
that leaves has the last one moved into its place, a failed pass is rerun row by row so
that a failure fails only its own request, and prompts and finished answers are kept in the
prefix cache.

A Batch is driven by one thread (`run_until_idle`, or `rounds` for a caller that drives one
generation itself); `add` and `cancel` may be called from any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import structlog

from kenspec.server.engine.costs import Costs
from kenspec.server.engine.draft_choice import DraftChoice
from kenspec.server.engine.events import NO_EVENTS, EngineEvents
from kenspec.server.engine.generation import Generation, Round
from kenspec.server.engine.intake import BatchSettings, BatchStats, Deliver, Entry, Intake
from kenspec.server.engine.pass_logits import Logits
from kenspec.server.engine.prefix_cache import PrefixCache
from kenspec.server.engine.round import RoundTimes, run_round
from kenspec.server.engine.target import TargetModel
from kenspec.server.engine.verify_pass import VerifyPass

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
        self._choice = DraftChoice(costs, target, pad_passes=self.settings.pad_passes)
        self._timer = timer  # times the passes live costs learn from
        self.stats = BatchStats()
        self._events = events
        self._cache = target.new_cache(self.settings.max_rows)
        budget = self.settings.prefix_cache_bytes
        self.prefixes = PrefixCache(budget) if budget > 0 else None
        self._intake = Intake(
            target,
            self._cache,
            self.settings,
            prefixes=self.prefixes,
            stats=self.stats,
            events=events,
        )
        self._decoding: list[Entry] = []  # _decoding[i] is in cache row i

    # -- any thread ---------------------------------------------------------------------

    def add(
        self, generation: Generation, deliver: Deliver, follows: Generation | None = None
    ) -> bool:
        """Queue a generation; deliver gets each Round (on the driving thread) or an error.
        With `follows` (another choice of the same request, added before it), it copies that
        one's prompt keys/values instead of computing them (one prefill, n rows).

        True when the batch was idle: the caller must then start `run_until_idle` on its
        engine thread.
        """
        return self._intake.submit(Entry(generation, deliver), follows)

    def cancel(self, generation: Generation) -> None:
        """Drop a generation at the next iteration (a pass in flight is not interrupted)."""
        self._intake.cancel(generation)

    @property
    def costs(self) -> Costs | None:
        """What passes are priced by (LiveCosts: updated by every timed pass)."""
        return self._choice.costs

    @property
    def active(self) -> int:
        return len(self._decoding) + (self._intake.prefilling is not None)

    @property
    def waiting(self) -> int:
        return self._intake.waiting

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
        if self._intake.stop_if_idle(len(self._decoding)):
            return False
        try:
            self.iterate()
        except Exception as error:  # a bug, not a request's fault: fail everyone, go on
            log.exception("batch_iteration_failed")
            for entry in self._decoding:
                self._intake.forget(entry)
                entry.fail(error)
            self._decoding = []
            self._intake.fail_all(error)
        return True

    def iterate(self) -> None:
        self.stats.iterations += 1
        self._intake.take_arrivals()
        for index in reversed(range(len(self._decoding))):
            if self._decoding[index].cancelled:
                self._remove(index)
        self._intake.drop_cancelled()
        self._intake.admit(self._decoding)
        if self._decoding:
            times = run_round(self, self._choice, self._timer)
            if times is not None:
                self._count_round(times)

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
            "rounds": stats.rounds,
        }

    # -- the round's rows (engine.round.BatchRows) ----------------------------------------------

    @property
    def entries(self) -> list[Entry]:
        return self._decoding

    def fail(self, entry: Entry, error: BaseException) -> None:
        self._remove(self._decoding.index(entry))
        entry.fail(error)

    def relocate(self, row: int, moves: Sequence[tuple[int, int]]) -> None:
        if moves:
            self._cache.relocate(row, moves)

    def forward(self, verify: VerifyPass) -> list[Logits | Exception]:
        """The pass's logits per row. A pass that raises is rerun row by row, so that only the
        row that fails again fails its request; a failed pass commits nothing (it wrote only
        past each row's valid length)."""
        try:
            logits: list[Logits | Exception] = list(self._forward(verify))
        except Exception as error:
            log.exception("verify_pass_failed", rows=len(verify.rows))
            if len(verify.rows) == 1:
                return [error]
            return self._forward_alone(verify)
        self._store_prompts(verify)
        return logits

    def finish(self, finished: list[tuple[Entry, Exception | None]]) -> None:
        for entry, error in finished:
            if error is not None:
                self.fail(entry, error)
                continue
            row = self._decoding.index(entry)
            if self.prefixes is not None:  # a conversation's next turn re-sends them
                generation = entry.generation
                self.prefixes.store(self._cache, row, generation.cached_tokens, generation.tenant)
            self._remove(row)

    # -- passes -------------------------------------------------------------------------

    def _forward_alone(self, verify: VerifyPass) -> list[Logits | Exception]:
        results: list[Logits | Exception] = []
        for index, row in enumerate(verify.rows):
            alone = VerifyPass((row,), first_row=index, width=self._choice.width([row]))
            try:
                results.append(self._forward(alone)[0])
            except Exception as error:
                log.exception("verify_row_failed")
                results.append(error)
        return results

    def _forward(self, verify: VerifyPass) -> list[Logits]:
        timed = self._choice.timed(verify)
        if timed:
            self.target.synchronize()  # CUDA: work queued before (cache moves) is not the pass's
        started = self._timer()
        logits = self.target.forward(self._cache, verify)
        if timed:
            self.target.synchronize()  # CUDA: the pass, not its launch
            self._choice.observe(verify, self._timer() - started)
        self._count_pass(verify)
        return logits

    def _store_prompts(self, verify: VerifyPass) -> None:
        """Keep the prompts whose last tokens were in this pass (all but their pending token)."""
        if self.prefixes is None:
            return
        for row, (entry, passed) in enumerate(zip(self._decoding, verify.rows, strict=True)):
            if passed.prompt_tail:
                generation = entry.generation
                self.prefixes.store(self._cache, row, generation.prompt[:-1], generation.tenant)

    def _count_round(self, times: RoundTimes) -> None:
        """A round's phases into the stats, its own work to the metrics and the live costs."""
        self.stats.rounds += 1
        for phase, seconds in times.phases().items():
            self.stats.add(phase, seconds)
        self._events.observe_round_work(times.overhead, times.drafted)
        self._choice.observe_round(
            times.rows, times.drafted_rows, times.overhead, times.drafted_tokens
        )

    def _count_pass(self, verify: VerifyPass) -> None:
        stats, width = self.stats, max(len(row.tokens) for row in verify.rows)
        stats.passes += 1
        stats.rows_verified += len(verify.rows)
        stats.by_width[width] = stats.by_width.get(width, 0) + 1
        self._events.observe_pass(len(verify.rows), verify.tokens)

    # -- row bookkeeping ----------------------------------------------------------------

    def _remove(self, index: int) -> None:
        """Free decoding row `index`: the last decoding row moves in, the prefilling one follows."""
        last = len(self._decoding) - 1
        moved = self._decoding[last]
        self._cache.move(last, index, moved.generation.cache_length)
        self._intake.forget(self._decoding[index])
        self._decoding[index] = moved
        self._decoding.pop()
        prefilling = self._intake.prefilling
        if prefilling is not None:
            self._cache.move(last + 1, last, prefilling.generation.cache_length)
