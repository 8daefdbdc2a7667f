"""Which kernels a target's passes take, and the scratch buffers they reuse.

A `Kernels` value is chosen at start-up (server.runtime: grouped attention by measurement,
batch invariance by `invariant.make_invariant`) and owned by the TargetModel; every pass hands
it to attention through its Packing, so two targets in one process (tests, benchmarks) each
run their own choice. It is frozen: a new choice is a new value (`with_grouped`,
`with_invariance`) that keeps the same scratch buffers.

Batch-invariant mode's rules live here too, as values (`Padding`, `BatchInvariance`, and the
block sizes the kernels pad to); engine.invariant measures them and switches the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

# Batch invariance (as far as MKL's float32 products give it): a product of a multiple of 4
# rows gives each row the same result whatever their number (1 to 3 rows take other kernels,
# and so do the last rows of a count that is not a multiple of 4: 5, 6, 7, 9, ...), and one
# summing over at least 384 keys (MKL on AVX-512 sums blocks of 192 from there on) gives the
# same sums whatever the number of zero-weighted keys after a row's own. So the attention
# kernels pad queries to QUERY_BLOCK rows per product and the values to MIN_KEYS keys: a
# query's output does not depend on how many queries or rows share its pass, nor on their
# lengths (tests/server/engine/test_grouped_attention).
QUERY_BLOCK = 4
# Exact batch invariance (invariant_attention) needs more: the score product gives a key other
# bits in the last, partial block of 16 columns than in a full one, and the softmax's
# vectorised sums change with a short row's length. So keys are padded (their scores -inf) to
# a multiple of KEY_BLOCK, and to at least MIN_KEYS unless the count is one measured to sum
# alike (BatchInvariance.short_keys: MKL sums up to 192 keys in one block, 256 or 320 in two
# halves, and from 384 on in blocks of 192).
KEY_BLOCK = 64
MIN_KEYS = 384


@dataclass(frozen=True, slots=True)
class Padding:
    """Pad a product's rows to at least `minimum` and to a multiple of `multiple`; with a
    `block`, a product of more rows runs `block` rows at a time, the last block padded.

    Example: Padding(4, 4).rows(5) == 8; Padding(2, 1, block=32).rows(33) == 34 (32 rows,
    then 1 padded to 2)."""

    minimum: int = 1
    multiple: int = 1
    block: int = 0  # 0: any number of rows in one product

    def rows(self, rows: int) -> int:
        if self.block and rows > self.block:
            tail = rows % self.block
            return rows - tail + (self._padded(tail) if tail else 0)
        return self._padded(rows)

    def _padded(self, rows: int) -> int:
        return max(self.minimum, -(-rows // self.multiple) * self.multiple)


@dataclass(frozen=True, slots=True)
class BatchInvariance:
    """What batch-invariant mode measured at start-up (engine.invariant); Kernels holding one
    run the mode."""

    padding: Padding  # every linear layer's rows, and whole passes' where the cache has room
    # keys attention's weighted sum adds up in order (invariant.value_block); None: token
    # trees cannot be verified in the mode
    value_block: int | None
    short_keys: tuple[int, ...] = ()  # key counts under MIN_KEYS that sum as MIN_KEYS do

    @property
    def tree_key_block(self) -> int:
        return self.value_block or 1  # unmeasured: a tree's nodes only where slot = position


class _ThreadBuffers(threading.local):
    """One thread's buffers by name (threading.local runs __init__ once in each thread)."""

    def __init__(self) -> None:
        self.by_name: dict[str, list[torch.Tensor]] = {}


class ScratchBuffers:
    """float32 buffers the attention kernels reuse from call to call, per thread: new buffers
    each pass would add page faults, and the engine thread and a benchmark's or test's own
    thread must not share one.

    Example: `in_float32(key, value)` gives float32 copies of both in two kept buffers, each
    good until the next call on this thread."""

    def __init__(self) -> None:
        self._threads = _ThreadBuffers()

    def in_float32(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Float32 copies of `tensors`, in buffers this thread reuses: each is good until the
        next call. A buffer grows (at least doubling) to the largest copy asked for and stays."""
        copies = self.views("float32", [tensor.shape for tensor in tensors], tensors[0].device)
        return [copy.copy_(tensor) for copy, tensor in zip(copies, tensors, strict=True)]

    def zeroed(self, *shapes: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
        """float32 tensors of `shapes`, in zeroed buffers this thread reuses (not
        in_float32's): each is good until the next call and holds what earlier calls left."""
        return self.views("zeroed", shapes, device, torch.zeros)

    def views(
        self,
        name: str,
        shapes: Sequence[Sequence[int]],
        device: torch.device,
        make: Callable[..., torch.Tensor] = torch.empty,
    ) -> list[torch.Tensor]:
        """Views of `shapes` into this thread's float32 buffers `name` (one a shape, made by
        `make`), grown (at least doubling) to the largest view asked for, and kept."""
        buffers = self._threads.by_name.setdefault(name, [])
        views = []
        for index, shape in enumerate(shapes):
            size = torch.Size(shape).numel()
            if index == len(buffers):
                buffers.append(make(size, dtype=torch.float32, device=device))
            elif not _reusable(buffers[index], device):
                buffers[index] = make(size, dtype=torch.float32, device=device)
            elif buffers[index].numel() < size:
                grown = max(size, 2 * buffers[index].numel())
                buffers[index] = make(grown, dtype=torch.float32, device=device)
            views.append(buffers[index][:size].view(shape))
        return views


def _reusable(buffer: torch.Tensor, device: torch.device) -> bool:
    """Whether a scratch buffer can be written here: on `device`, and not an inference tensor
    outside inference mode (torch refuses that write)."""
    return buffer.device == device and (
        not buffer.is_inference() or torch.is_inference_mode_enabled()
    )


@dataclass(frozen=True, slots=True)
class Kernels:
    """Which kernel a packed pass's attention takes, and batch-invariant mode's rules.

    Example: Kernels().with_grouped({1: 128, 8: 2048}) sends passes of 1 query per row over
    128 positions or more, and of 2 to 8 over 2,048 or more, to grouped_attention; the others
    to SDPA."""

    # (width, min_length), by width: a pass whose rows carry at most `width` queries (the
    # narrowest such entry) over at least `min_length` positions takes grouped_attention;
    # others, and passes wider than the widest entry (prefill chunks), take SDPA.
    grouped: tuple[tuple[int, int], ...] = ((16, 0),)
    # bf16/fp16 caches in grouped_attention: True, keys and values converted into float32
    # buffers and everything in float32; False, the products in the cache's dtype, in place.
    upcast: bool = True
    # Batch-invariant mode (engine.invariant), None: off. On, every pass takes
    # invariant_attention whatever `grouped` says, and passes are padded to its row rule.
    invariance: BatchInvariance | None = None
    scratch: ScratchBuffers = field(default_factory=ScratchBuffers, compare=False, repr=False)

    @property
    def invariant(self) -> bool:
        return self.invariance is not None

    @property
    def short_keys(self) -> tuple[int, ...]:
        """Key counts under MIN_KEYS invariant_attention may pad to (measured; () when off)."""
        return self.invariance.short_keys if self.invariance is not None else ()

    @property
    def tree_key_block(self) -> int:
        """A token tree's node is verified only where its cache slot and its position lie in
        one block of this many keys (0: anywhere, outside the mode)."""
        return self.invariance.tree_key_block if self.invariance is not None else 0

    @property
    def pass_padding(self) -> Padding | None:
        """The token count a pass is padded to, for its linear layers (None: as it comes)."""
        return self.invariance.padding if self.invariance is not None else None

    def takes_grouped(self, width: int, kv_length: int) -> bool:
        for max_width, min_length in self.grouped:
            if width <= max_width:
                return kv_length >= min_length
        return False

    def with_grouped(self, min_lengths: Mapping[int, int]) -> Kernels:
        """{width: min_length}: passes of at most `width` queries per row (the narrowest such
        entry) over at least `min_length` positions take grouped_attention, the others SDPA.
        {16: 0}: grouped up to 16 queries per row at any length; {}: SDPA always."""
        grouped = tuple(sorted((w, max(0, n)) for w, n in min_lengths.items() if w > 0))
        return replace(self, grouped=grouped)

    def with_invariance(self, invariance: BatchInvariance | None) -> Kernels:
        """This choice in batch-invariant mode (None: out of it)."""
        return replace(self, invariance=invariance)
