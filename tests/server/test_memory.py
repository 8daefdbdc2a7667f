"""Freed heap pages given back after loading (server.memory)."""

from __future__ import annotations

import gc
import platform
import weakref

from kenspec.server import memory


def test_freed_pages_below_a_live_allocation_are_given_back() -> None:
    """128 MiB of 64 KiB blocks freed below one that stays: glibc keeps those pages resident
    (they are not at the top of the heap) until asked; release_freed_memory gives them back
    and says how much went."""
    if memory._trim() is None:
        assert platform.libc_ver()[0] != "glibc"  # only where there is no malloc_trim
        assert memory.release_freed_memory() is None
        return
    memory.release_freed_memory()  # what earlier tests left
    blocks = [bytearray(b"x" * 65536) for _ in range(2048)]
    survivor = bytearray(b"y" * 65536)  # above them in the heap: no automatic trim
    held = memory.resident_mib()
    del blocks
    after_free = memory.resident_mib()
    assert held is not None and after_free is not None
    assert after_free > held - 32  # freed, still resident
    released = memory.release_freed_memory()
    assert released is not None and released > 64
    assert memory.resident_mib() < after_free - 64  # type: ignore[operator]
    assert survivor[0] == ord("y")


def test_nothing_to_give_back_is_zero_not_an_error() -> None:
    memory.release_freed_memory()
    released = memory.release_freed_memory()
    if memory._trim() is None:  # not glibc: nothing is done, and it says so
        assert released is None
    else:
        assert released is not None and 0 <= released < 16


def test_a_frozen_heap_is_left_out_of_collections_and_new_garbage_still_goes() -> None:
    """freeze_heap: every tracked object into the permanent generation (a full collection no
    longer scans them); a cycle made afterwards is still collected; thaw_heap hands them back."""
    memory.thaw_heap()
    kept = [Node() for _ in range(1000)]
    frozen = memory.freeze_heap()
    try:
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        garbage = Node()
        garbage.me = garbage  # a cycle: only the collector frees it
        gone = weakref.ref(garbage)
        del garbage
        gc.collect()
        assert gone() is None
        assert gc.get_freeze_count() == frozen  # the frozen ones stayed where they were
    finally:
        memory.thaw_heap()
    assert gc.get_freeze_count() == 0


async def test_a_serving_server_keeps_its_heap_frozen_and_a_stopped_one_thaws_it(
    start_server,
) -> None:
    """Once loaded (the `ready` line), the server's objects are frozen; stopped, handed back."""
    memory.thaw_heap()
    server, _ = await start_server()
    assert gc.get_freeze_count() > 0
    await server.stop(0)
    assert gc.get_freeze_count() == 0


class Node:
    """A tracked object that can hold a reference to itself."""

    me: Node | None = None
