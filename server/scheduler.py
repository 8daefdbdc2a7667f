"""Admission control and the one worker thread that runs every torch call.

Admitted streams join the engine's Batch, which the worker drives while any generation is in
it: every iteration verifies all of them in one forward pass (continuous batching), and each
round is handed back to its stream's asyncio queue, so the event loop stays free for health
checks and I/O. A torch call cannot be interrupted, so a cancelled stream leaves the batch
after at most the pass in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TypeVar

from kenspec.server.engine.batch import Batch
from kenspec.server.engine.generation import Generation, Round

T = TypeVar("T")


class Overloaded(Exception):
    """No slot and no room in the queue: the caller should retry later."""


class Scheduler:
    def __init__(self, *, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.active = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_active)
        self._in_turn = asyncio.Lock()  # one call takes its slots at a time (see acquire)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kenspec-engine")
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = []

    async def acquire(self, count: int = 1) -> AbstractAsyncContextManager[None]:
        """Wait (in the bounded queue) for `count` slots (a request's n choices are n
        streams); the returned context manager holds them. Calls take their slots in the order
        they came, so a request of many choices is not starved by single ones, and two of them
        never each hold part of what they need."""
        if count > self.max_active:
            raise ValueError(f"{count} slots asked of {self.max_active}")
        free = self.max_active - self.active
        if count > free and self.waiting + count > self.max_queue:
            raise Overloaded(
                f"server busy: {self.active} streams generating and {self.waiting} queued "
                f"(limits {self.max_active} and {self.max_queue}); retry after the delay the "
                "response carries (grpc-retry-pushback-ms, Retry-After), or on another replica"
            )
        self.waiting += count
        taken = 0
        try:
            async with self._in_turn:
                for _ in range(count):
                    await self._slots.acquire()
                    taken += 1
        except BaseException:
            for _ in range(taken):
                self._slots.release()
            raise
        finally:
            self.waiting -= count
        self.active += count
        return self._held(count)

    @asynccontextmanager
    async def _held(self, count: int) -> AsyncIterator[None]:
        try:
            yield
        finally:
            self.active -= count
            for _ in range(count):
                self._slots.release()

    async def stream(
        self, batch: Batch, generation: Generation, follows: Generation | None = None
    ) -> AsyncIterator[Round]:
        """Run generation in batch (sharing the prefill of `follows`, see Batch.add), once its
        grammar, if any, is compiled; its rounds as they come. Leaving early cancels it."""
        # A grammar is compiled in a thread of its own (engine.grammar: up to seconds for a
        # hostile one, on neither this loop nor the engine thread); a later choice waits for
        # the first's as well, so that the first joins the batch first (its prefill is shared).
        for waited in (follows, generation):
            if waited is not None and waited.grammar is not None:
                await waited.grammar.prepare()
        loop = asyncio.get_running_loop()
        rounds: asyncio.Queue[Round | BaseException] = asyncio.Queue()
        deliver = lambda item: self._outbox.append((loop, rounds, item))  # noqa: E731
        if batch.add(generation, deliver, follows):
            self.submit(functools.partial(batch.run_until_idle, self._flush))
        try:
            while True:
                item = await rounds.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            batch.cancel(generation)

    def _flush(self) -> None:
        """Hand an iteration's rounds to the event loop in one wake-up, not one per stream
        (on the engine thread, which alone appends to the outbox)."""
        items, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, queue, item in items:
            by_loop.setdefault(loop, []).append((queue, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """Run function on the engine thread, with the caller's context (request-bound logs)."""
        call = functools.partial(contextvars.copy_context().run, function, *args)
        return await asyncio.get_running_loop().run_in_executor(self._worker, call)

    def submit(self, function: Callable[[], object]) -> None:
        """Queue function behind every round already submitted; nobody waits for it."""
        with contextlib.suppress(RuntimeError):  # the worker is already shut down
            self._worker.submit(function)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
