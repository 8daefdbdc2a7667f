"""Memory the process freed, given back to the system; the heap it keeps, kept out of the
garbage collector's way.

Loading a model allocates and frees a lot in small pieces (a GGUF file's tensors read and laid
out, a folder's safetensors converted, calibration's passes): glibc keeps freed heap pages
below a live allocation for later use, and a server that never needs them again kept them
resident (about 240 MiB of 1,010 for the default model on the AVX2 benchmark VM). After
loading, `release_freed_memory` asks glibc to give back every free page (`malloc_trim(0)`);
elsewhere (musl, macOS) it does nothing.

A served process holds ~680,000 objects the collector tracks once torch, transformers and the
model are loaded, nearly all of them for its life, and each full collection scanned them all:
on the AVX2 benchmark VM eleven while the default model loaded, 21-342 ms each (2.0 s of a
~10 s start); CPython runs one again once new survivors reach a quarter of them (~170,000), a
pause of that length for every stream.
`freeze_heap` moves every tracked object into the collector's permanent generation
(`gc.freeze`, as long-lived Python servers do after start-up; constant time), so later
collections scan only what was made since. It does not collect first: once the default
model is loaded a full collection finds ~20 unreachable objects (and takes 460 ms), so what
the freeze keeps from the collector is garbage of no account. `thaw_heap` hands the objects
back (a server that stops in a process that goes on, as tests do: its garbage is collected
again).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache
from pathlib import Path
from typing import Any


@cache
def _trim() -> Any | None:
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def resident_mib() -> float | None:
    """This process's resident memory (VmRSS), MiB; None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def release_freed_memory() -> float | None:
    """Give the system back the pages the C heap holds free; the resident MiB that went
    (0 where none did), or None where this C library cannot (or /proc cannot tell)."""
    trim = _trim()
    before = resident_mib()
    if trim is None or before is None:
        return None
    trim(0)
    after = resident_mib()
    return None if after is None else max(0.0, before - after)


def freeze_heap() -> int:
    """Freeze every tracked object (see the module doc); the objects the permanent
    generation holds now."""
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """The frozen objects back to the collector's oldest generation (its next full
    collection scans them again)."""
    gc.unfreeze()
