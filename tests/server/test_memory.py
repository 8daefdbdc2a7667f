"""Freed heap pages given back after loading (server.memory)."""

from __future__ import annotations

import platform

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
